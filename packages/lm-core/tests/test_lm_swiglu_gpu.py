"""The SwiGLU kernels on CUDA at the xl model's size (run by `nox -s gpu_tests`): against a
float64 reference within 2x the error of the plain bf16 / fp16 / fp32 expression; "auto"
runs them on CUDA. Inside the model (compiled, loss and gradients): test_lm_kernels_gpu.py."""

from __future__ import annotations

import pytest
import torch

from lm_core import swiglu as swiglu_module
from lm_core.swiglu import swiglu, swiglu_reference

pytestmark = pytest.mark.gpu

ROWS, F = 2048, 6400  # xl: batch 4 x 512 tokens, d_ff 6400


def _errors(h, dy, backend):
    """max |y - y64|, max |dh - dh64| of one backend against float64."""
    h64 = h.detach().double().requires_grad_()
    y64 = swiglu_reference(h64)
    (dh64,) = torch.autograd.grad(y64, h64, dy.double())
    hb = h.detach().requires_grad_()
    y = swiglu(hb, backend=backend)
    (dh,) = torch.autograd.grad(y, hb, dy)
    return (y.double() - y64).abs().max().item(), (dh.double() - dh64).abs().max().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernels_within_twice_the_plain_error(dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    h = (torch.randn(ROWS, 2 * F, device="cuda", generator=gen) * 2).to(dtype)
    dy = torch.randn(ROWS, F, device="cuda", generator=gen).to(dtype)
    ours = _errors(h, dy, "triton")
    plain = _errors(h, dy, "torch")
    floor = torch.finfo(dtype).eps
    for o, p in zip(ours, plain):
        assert o <= 2 * p + floor, (ours, plain)


def test_auto_uses_the_kernels_on_cuda():
    h = torch.randn(4, 2 * 96, device="cuda")
    assert swiglu_module._triton_runs("cuda")
    torch.testing.assert_close(swiglu(h), swiglu(h, backend="triton"), rtol=0, atol=0)
