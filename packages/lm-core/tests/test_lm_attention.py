"""Attention backends against a float64 reference; the backend registry."""

from __future__ import annotations

import math

import pytest
import torch

from lm_core import get_attention
from lm_core.attention import naive_attention


def _reference(q, k, v):
    """Causal attention in float64, written independently of the backends."""
    q, k, v = q.double(), k.double(), v.double()
    t = q.shape[-2]
    s = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(q.shape[-1])
    allowed = torch.arange(t)[:, None] >= torch.arange(t)[None, :]
    return torch.einsum("bhij,bhjd->bhid", s.masked_fill(~allowed, -math.inf).softmax(-1), v)


@pytest.mark.parametrize("seq", [1, 17, 64])
def test_backend_matches_reference_forward_and_backward(backend, seq):
    torch.manual_seed(seq)
    fn = get_attention(backend)
    q, k, v = (torch.randn(2, 3, seq, 16, requires_grad=True) for _ in range(3))
    out = fn(q, k, v)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = _reference(q64, k64, v64)
    # fp32 kernels vs a float64 reference: errors of a few fp32 ulps of O(1) values.
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), g.double())
    for ours, theirs in zip(grads, ref_grads):
        torch.testing.assert_close(ours.double(), theirs, rtol=1e-4, atol=1e-4)


def test_backends_accept_transposed_views(backend):
    """The model passes (B, H, T, d) views of a (B, T, H, d) tensor; results must not change."""
    torch.manual_seed(0)
    base = torch.randn(2, 10, 3, 3, 16)  # (B, T, 3, H, d)
    q, k, v = (base[:, :, i].transpose(1, 2) for i in range(3))  # (B, H, T, d) views
    out = get_attention(backend)(q, k, v)
    contiguous = naive_attention(q.contiguous(), k.contiguous(), v.contiguous())
    torch.testing.assert_close(out, contiguous, rtol=1e-5, atol=1e-5)


def test_naive_bf16_has_no_nan():
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 9, 8, dtype=torch.bfloat16) * 50 for _ in range(3))
    out = naive_attention(q, k, v)
    assert out.dtype == torch.bfloat16
    assert torch.isfinite(out).all()


def test_unknown_backend_lists_names():
    with pytest.raises(ValueError, match=r"unknown attention backend 'flash3'.*sdpa"):
        get_attention("flash3")


def test_flash_backends_without_package_say_what_to_install(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "flashattn_triton":
            raise ImportError("No module named 'flashattn_triton'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    for name in ("flash-torch", "flash-triton"):
        with pytest.raises(ImportError, match=r"pip install lm-core\[flash\]"):
            get_attention(name)
