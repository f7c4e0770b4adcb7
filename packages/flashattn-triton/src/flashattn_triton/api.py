"""Functional API and ``nn.Module``: pick the Triton or the PyTorch implementation."""

from __future__ import annotations

import torch
from torch import nn

from ._checks import (
    MAX_HEAD_DIM,
    TRITON_DTYPES,
    check_qkv,
    check_triton_dtype_and_dim,
    resolve_scale,
)
from .autograd import CheckedFlashAttention
from .torch_impl import FlashAttention2Torch

BACKENDS = ("auto", "triton", "torch")


def resolve_backend(backend: str, q: torch.Tensor) -> str:
    """'auto' -> 'triton' for CUDA tensors of a Triton dtype with head_dim <= 128, else 'torch'."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    if q.is_cuda and q.dtype in TRITON_DTYPES and q.shape[-1] <= MAX_HEAD_DIM:
        return "triton"
    return "torch"


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    softmax_scale: float | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Scaled dot-product attention, softmax(q k^T * scale [+ causal mask]) v, differentiable.

    q (..., Nq, d), k and v (..., Nk, d) with the same leading dims (e.g. (B, H, N, d)), one
    dtype and one device -> o (..., Nq, d) in q's dtype. ``softmax_scale`` defaults to
    1/sqrt(d). Causal masks are bottom-right aligned: key j is visible to query i iff
    j <= i + (Nk - Nq); rows that see no key give 0.

    backend: 'triton' runs the Triton kernels (CUDA tensors, or CPU tensors under
    TRITON_INTERPRET=1; float16/bfloat16/float32; d <= 128), 'torch' the tiled PyTorch
    implementation (any device and floating dtype), 'auto' chooses 'triton' for CUDA tensors
    that it supports and 'torch' otherwise.
    """
    check_qkv(q, k, v, causal)
    if resolve_backend(backend, q) == "triton":
        check_triton_dtype_and_dim(q)
        scale = resolve_scale(softmax_scale, q.shape[-1])
        return CheckedFlashAttention.apply(q, k, v, causal, scale)
    return FlashAttention2Torch.apply(q, k, v, causal, softmax_scale)


class FlashAttention(nn.Module):
    """``nn.Module`` form of :func:`flash_attention`: ``FlashAttention(causal=True)(q, k, v)``."""

    def __init__(
        self, causal: bool = False, softmax_scale: float | None = None, backend: str = "auto"
    ) -> None:
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.backend = backend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return flash_attention(q, k, v, self.causal, self.softmax_scale, backend=self.backend)

    def extra_repr(self) -> str:
        return f"causal={self.causal}, softmax_scale={self.softmax_scale}, backend={self.backend!r}"
