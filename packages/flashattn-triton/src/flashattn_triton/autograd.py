"""``FlashAttention2Triton``: the autograd.Function over the Triton custom ops.

Any leading dims are folded into (B, H) without copies where possible: (B, H, N, d) passes
as is (any strides with a unit last stride, e.g. a transposed (B, N, H, d) buffer), (Z, N, d)
becomes (Z, 1, N, d), more leading dims are reshaped into B.
"""

from __future__ import annotations

import torch

from . import launch, ops  # ops registers torch.ops.flashattn_triton.*
from ._checks import check_qkv, check_triton_dtype_and_dim, resolve_scale


def _compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    return compiler is not None and compiler.is_compiling()


def _fwd(q4, k4, v4, causal: bool, scale: float):
    """The forward launcher: through the custom op when torch.compile traces (no graph break),
    called directly in eager mode (skips the op dispatcher's per-call cost)."""
    if _compiling():
        return ops.attention_fwd(q4, k4, v4, causal, scale)
    return launch.forward(q4, k4, v4, causal, scale)


def _bwd(do4, q4, k4, v4, o4, lse, causal: bool, scale: float):
    """The backward launcher, dispatched like ``_fwd``."""
    if _compiling():
        return ops.attention_bwd(do4, q4, k4, v4, o4, lse, causal, scale)
    return launch.backward(do4, q4, k4, v4, o4, lse, causal, scale)


def as_bhnd(t: torch.Tensor) -> torch.Tensor:
    """View (..., N, d) as (B, H, N, d); copies only when leading dims cannot be merged."""
    if t.dim() == 4:
        return t
    if t.dim() == 3:
        return t.unsqueeze(1)  # (Z, 1, N, d)
    if t.dim() == 2:
        return t[None, None]  # (1, 1, N, d)
    return t.reshape(-1, *t.shape[-3:])  # (prod(lead[:-1]), H, N, d)


def _lse_as_bhn(lse: torch.Tensor, q4: torch.Tensor) -> torch.Tensor:
    return lse.reshape(q4.shape[:-1])  # (B, H, Nq)


def _forward(ctx, q, k, v, causal: bool, scale: float) -> torch.Tensor:
    """The forward of both Functions below, on checked inputs."""
    if q.dim() == 4:  # (B, H, N, d): no views to make (the common case, kept lean)
        o, lse = _fwd(q, k, v, causal, scale)
    else:
        o4, lse4 = _fwd(as_bhnd(q), as_bhnd(k), as_bhnd(v), causal, scale)
        o = o4.reshape(q.shape)  # (..., Nq, d)
        lse = lse4.reshape(q.shape[:-1])  # (..., Nq)
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.is_causal = causal
    ctx.softmax_scale = scale
    return o


class FlashAttention2Triton(torch.autograd.Function):
    """FlashAttention-2 in Triton: ``FlashAttention2Triton.apply(q, k, v, is_causal=False)``.

    q (..., Nq, d), k and v (..., Nk, d), float16/bfloat16/float32, d <= 128 -> o (..., Nq, d).
    Saves q, k, v, o and the log-sum-exp L (..., Nq) float32 (e.g. (batch, seq) for 3-D
    inputs) for the backward; never P. An optional fifth argument ``softmax_scale`` defaults to
    1/sqrt(d). Causal masks are bottom-right aligned when Nq != Nk (see ``reference``).
    """

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False, softmax_scale=None):
        check_qkv(q, k, v, is_causal)
        check_triton_dtype_and_dim(q)
        return _forward(ctx, q, k, v, is_causal, resolve_scale(softmax_scale, q.shape[-1]))

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        if q.dim() == 4:
            dq, dk, dv = _bwd(do, q, k, v, o, lse, ctx.is_causal, ctx.softmax_scale)
            return dq, dk, dv, None, None
        q4 = as_bhnd(q)
        dq4, dk4, dv4 = _bwd(
            as_bhnd(do), q4, as_bhnd(k), as_bhnd(v), as_bhnd(o), _lse_as_bhn(lse, q4),
            ctx.is_causal, ctx.softmax_scale,
        )  # fmt: skip
        return dq4.reshape(q.shape), dk4.reshape(k.shape), dv4.reshape(v.shape), None, None


class CheckedFlashAttention(FlashAttention2Triton):
    """``flash_attention``'s Function: the same, for inputs it has checked already and a
    resolved ``softmax_scale`` (no second round of checks per call)."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal, softmax_scale):
        return _forward(ctx, q, k, v, is_causal, softmax_scale)
