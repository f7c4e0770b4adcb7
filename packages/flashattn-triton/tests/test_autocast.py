"""Attention under autocast: like SDPA, ``flash_attention`` (and the varlen form) takes CUDA
q, k and v in the autocast dtype, so a float32 model trained under bf16 autocast gets the
16-bit kernels rather than the float32 path. CPU inputs are not cast."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from flashattn_testutil import assert_within_bf16

from flashattn_triton import flash_attention, flash_attention_varlen
from flashattn_triton.api import in_autocast_dtype


def test_in_autocast_dtype_casts_floating_tensors_of_the_device():
    q = torch.randn(2, 3)
    ints = torch.arange(4)
    meta = torch.empty(2, 3, device="meta")
    assert all(a is b for a, b in zip(in_autocast_dtype(q, ints, meta, "cpu"), (q, ints, meta)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = in_autocast_dtype(q, ints, meta, "cpu")
        assert out[0].dtype == torch.bfloat16
        assert torch.equal(out[0], q.bfloat16())
        assert out[1] is ints  # integers as given
        assert out[2] is meta  # tensors of other devices as given
        same = in_autocast_dtype(q, q, q, "cuda")  # CUDA autocast is off here
        assert all(t is q for t in same)


def test_cpu_inputs_are_not_cast(monkeypatch):
    """CPU inputs reach the implementation as given under CPU autocast (the PyTorch path's
    own matmuls still follow autocast, as any torch code's do)."""
    import flashattn_triton.api as api

    seen = []
    monkeypatch.setattr(api, "check_qkv", lambda q, k, v, causal: seen.append(q.dtype))
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o = flash_attention(q, k, v, causal=True)
    assert seen == [torch.float32]
    assert o.dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.parametrize("varlen", [False, True])
def test_cuda_autocast_runs_the_16_bit_kernels(varlen):
    """float32 q and k with a bf16 v under bf16 autocast: a bf16 result that matches SDPA
    under the same autocast, and float32 gradients for the float32 inputs."""
    g = torch.Generator(device="cuda").manual_seed(7)
    q, k = (torch.randn(2, 4, 256, 64, device="cuda", generator=g) for _ in range(2))
    v = torch.randn(2, 4, 256, 64, device="cuda", generator=g).bfloat16()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        if varlen:  # the same two sequences, packed
            cu = torch.tensor([0, 256, 512], device="cuda", dtype=torch.int32)
            packed = [t.transpose(1, 2).reshape(512, 4, 64) for t in (q, k, v)]
            o = flash_attention_varlen(*packed, cu, cu, 256, 256, causal=True)
            o = o.reshape(2, 256, 4, 64).transpose(1, 2)
        else:
            o = flash_attention(q, k, v, causal=True)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert o.dtype == ref.dtype == torch.bfloat16
    grads = torch.autograd.grad(o.float().sum(), (q, k, v))
    refs = torch.autograd.grad(ref.float().sum(), (q, k, v))
    assert [a.dtype for a in (o, *grads)] == [r.dtype for r in (ref, *refs)]
    assert_within_bf16((o, *grads), (ref, *refs))


def test_bad_arguments_reach_the_checks_under_autocast():
    """Under autocast a wrong argument still gets the error that names it."""
    q = torch.randn(1, 2, 8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert in_autocast_dtype(q, None, "v", "cpu")[1:] == (None, "v")
