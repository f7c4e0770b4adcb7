"""The q/k/v split with RoPE on CUDA at real sizes (run by `nox -s gpu_tests`): against a
float64 reference within 2x the error of the plain ops. Inside the model (compiled, loss and
gradients): test_lm_kernels_gpu.py."""

from __future__ import annotations

import pytest
import torch

from lm_core.model import RotaryEmbedding
from lm_core.qkv_rope import split_rotate, split_rotate_reference

pytestmark = pytest.mark.gpu

SHAPES = [  # (B, T, n_q, n_kv, Dh): xl, 2.7B (Dh 80), 8B-like grouped-query heads
    (4, 512, 25, 25, 64),
    (4, 512, 32, 32, 80),
    (1, 2048, 32, 8, 128),
]


def _errors(qkv, cos, sin, n_q, n_kv, grads, backend):
    x = qkv.detach().requires_grad_()
    outs = split_rotate(x, cos, sin, n_q, n_kv, backend=backend)
    (dx,) = torch.autograd.grad(outs, x, grads)
    x64 = qkv.detach().double().requires_grad_()
    ref = split_rotate_reference(x64, cos.double(), sin.double(), n_q, n_kv)
    (d64,) = torch.autograd.grad(ref, x64, [g.double() for g in grads])
    out_err = max((o.double() - r).abs().max().item() for o, r in zip(outs, ref))
    return out_err, (dx.double() - d64).abs().max().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernels_within_twice_the_plain_error(shape, dtype):
    b, t, n_q, n_kv, d = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    rope = RotaryEmbedding(d, t, 10000.0).cuda()
    qkv = torch.randn(b, t, n_q + 2 * n_kv, d, device="cuda", generator=gen).to(dtype)
    # the attention's gradients arrive transposed: (B, heads, T, Dh) memory
    grads = [
        torch.randn(b, h, t, d, device="cuda", generator=gen).to(dtype).transpose(1, 2)
        for h in (n_q, n_kv, n_kv)
    ]
    ours = _errors(qkv, rope.cos, rope.sin, n_q, n_kv, grads, "triton")
    plain = _errors(qkv, rope.cos, rope.sin, n_q, n_kv, grads, "torch")
    floor = torch.finfo(dtype).eps
    for o, p in zip(ours, plain):
        assert o <= 2 * p + floor, (ours, plain)
