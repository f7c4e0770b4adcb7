"""The RMSNorm kernels on CUDA at model sizes (run by `nox -s gpu_tests`): output, sum and
all gradients against a float64 reference within 2x the error of the plain ops, in the
model's dtype mixes; "auto" runs them on CUDA. Inside the model (compiled, loss and
gradients): test_lm_kernels_gpu.py."""

from __future__ import annotations

import pytest
import torch

from lm_core import rmsnorm as rmsnorm_module
from lm_core.rmsnorm import rms_norm, rms_norm_reference

pytestmark = pytest.mark.gpu

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def _errors(x, r, w, out_dtype, dy, ds, backend):
    """max error of y, s, dx, dr, dw against float64 (the norm of the sum as stored)."""
    leaves = [t.detach().requires_grad_() for t in (x, w, r)]
    s, y = rms_norm(leaves[0], leaves[1], residual=leaves[2], out_dtype=out_dtype, backend=backend)
    dx, dw, dr = torch.autograd.grad((y, s), leaves, (dy.to(y.dtype), ds.to(s.dtype)))
    s64 = s.detach().double().requires_grad_()
    w64 = w.double().requires_grad_()
    y64 = rms_norm_reference(s64, w64, 1e-5)
    d_s, dw64 = torch.autograd.grad(y64, (s64, w64), dy.double())
    ds64 = d_s + ds.double()
    pairs = [(y, y64), (s, x.double() + r.double()), (dx, ds64), (dr, ds64), (dw, dw64)]
    return [(t.double() - f).abs().max().item() for t, f in pairs]


@pytest.mark.parametrize(
    ("rows", "d", "x_dtype", "r_dtype", "out_dtype"),
    [
        (2048, 1600, F32, BF16, BF16),  # xl under bf16 autocast: fp32 stream, bf16 branch
        (2048, 1600, F32, F32, F32),  # fp32 training
        (1024, 4096, F32, BF16, BF16),  # 8B's width
        (999, 2560, BF16, BF16, BF16),  # all bf16, ragged rows
        (512, 1600, F16, F16, F16),
    ],
)
def test_kernels_within_twice_the_plain_error(rows, d, x_dtype, r_dtype, out_dtype):
    gen = torch.Generator(device="cuda").manual_seed(d)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)

    x, r = (randn(rows, d) * 2).to(x_dtype), randn(rows, d).to(r_dtype)
    w = torch.rand(d, device="cuda", generator=gen) + 0.5
    dy, ds = randn(rows, d), randn(rows, d)
    ours = _errors(x, r, w, out_dtype, dy, ds, "triton")
    plain = _errors(x, r, w, out_dtype, dy, ds, "torch")
    for name, o, p in zip(("y", "s", "dx", "dr", "dw"), ours, plain):
        floor = 4 * torch.finfo(out_dtype if name == "y" else F32).eps
        assert o <= 2 * p + floor, (name, ours, plain)


def test_auto_uses_the_kernels_on_cuda():
    x, w = torch.randn(4, 96, device="cuda"), torch.rand(96, device="cuda")
    assert rmsnorm_module._triton_runs("cuda")
    torch.testing.assert_close(rms_norm(x, w), rms_norm(x, w, backend="triton"), rtol=0, atol=0)
