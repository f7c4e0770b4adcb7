"""``FlashAttention2Triton``: the autograd.Function over the Triton custom ops.

Any leading dims are folded into (B, H) without copies where possible: (B, H, N, d) passes
as is (any strides with a unit last stride, e.g. a transposed (B, N, H, d) buffer), (Z, N, d)
becomes (Z, 1, N, d), more leading dims are reshaped into B.
"""

from __future__ import annotations

import torch

from . import cpp_launch, launch, launch_varlen, ops, traced_ops  # ops register torch.ops.*
from ._checks import check_qkv, check_triton_dtype_and_dim, resolve_scale
from .configs import TRACED_MAX_WORK
from .options import get_options


def _compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    return compiler is not None and compiler.is_compiling()


def _use_traced_ops(causal: bool, q: torch.Tensor, k: torch.Tensor, *more: torch.Tensor) -> bool:
    """Whether a compiled graph calls the traced ops (``traced_ops``) rather than the opaque
    ones: ``Options.traced_compile`` (``auto``: a call of at most ``TRACED_MAX_WORK``, none
    where the opaque ops replay from C++, ``cpp_launch.serves_compiled``), no
    autotuning (the autotuner would time fake tensors), static sizes (outside dynamo: under
    it the traced ops' bodies check, ``traced_ops._concrete``) and CUDA tensors (the
    interpreter's launches read addresses). The bodies, which run only while torch.compile
    compiles, also keep ``auto`` on the opaque ops for graphs replayed from CUDA graphs and
    on GPUs other than the tables' kind (``traced_ops``). ``q``, ``k``: (B, H, Nq, d),
    (B, Hkv, Nk, d)."""
    opts = get_options()
    if opts.traced_compile is False or opts.autotune:
        return False
    if not traced_ops.static_sizes(q, k, *more) or not q.is_cuda:
        return False
    if opts.traced_compile == "auto":
        if cpp_launch.serves_compiled():
            return False
        b, h, n_q, d = q.shape
        work = b * h * n_q * k.shape[2] * d
        return (work // 2 if causal else work) <= TRACED_MAX_WORK
    return True


def _fwd(q4, k4, v4, causal: bool, scale: float, *window: int):
    """The forward launcher: through an op when torch.compile traces (no graph break; see
    ``_use_traced_ops``), called directly in eager mode (skips the op dispatcher's per-call cost).
    ``window``: (left, right), for the windowed calls only."""
    if _compiling():
        op = traced_ops.fwd_traced if _use_traced_ops(causal, q4, k4, v4) else ops.fwd_launch
        return op(q4, k4, v4, causal, scale, *window)
    return launch.forward(q4, k4, v4, causal, scale, *window)


def _bwd(do4, q4, k4, v4, o4, lse, causal: bool, scale: float, *window: int):
    """The backward launcher, dispatched like ``_fwd``."""
    if _compiling():
        traced = _use_traced_ops(causal, q4, k4, v4, do4, o4)
        op = traced_ops.bwd_traced if traced else ops.bwd_launch
        return op(do4, q4, k4, v4, o4, lse, causal, scale, *window)
    return launch.backward(do4, q4, k4, v4, o4, lse, causal, scale, *window)


def as_bhnd(t: torch.Tensor, heads_first: bool = False) -> torch.Tensor:
    """View (..., N, d) as (B, H, N, d); copies only when leading dims cannot be merged.
    A 3-D tensor is (B, N, d) -> (B, 1, N, d), or with ``heads_first`` (H, N, d) ->
    (1, H, N, d) (grouped-query attention on 3-D inputs: dim -3 holds the heads)."""
    if t.dim() == 4:
        return t
    if t.dim() == 3:
        return t.unsqueeze(0) if heads_first else t.unsqueeze(1)
    if t.dim() == 2:
        return t[None, None]  # (1, 1, N, d)
    return t.reshape(-1, *t.shape[-3:])  # (prod(lead[:-1]), H, N, d)


def _lse_as_bhn(lse: torch.Tensor, q4: torch.Tensor) -> torch.Tensor:
    return lse.reshape(q4.shape[:-1])  # (B, H, Nq)


def _forward(ctx, q, k, v, causal: bool, scale: float) -> torch.Tensor:
    """The forward of both Functions below, on checked inputs."""
    o, lse = forward_without_grad(q, k, v, causal, scale)
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.is_causal = causal
    ctx.softmax_scale = scale
    return o


def _forward_any_rank(q, k, v, causal: bool, scale: float, *window: int):
    """``_fwd`` on inputs of any rank >= 2, seen as (B, H, N, d)."""
    gqa = q.shape[:-2] != k.shape[:-2]
    q4, k4, v4 = (as_bhnd(t, gqa) for t in (q, k, v))
    o4, lse4 = _fwd(q4, k4, v4, causal, scale, *window)
    return o4.reshape(q.shape), lse4.reshape(q.shape[:-1])  # (..., Nq, d), (..., Nq)


def forward_without_grad(q, k, v, causal: bool, scale: float, *window: int):
    """(o, lse) of checked inputs, recording nothing for autograd: the Functions' forward, and
    what ``flash_attention`` calls directly when no gradient is wanted (without the Function
    around it: ~6 us less per call on a CPU host; a decode step calls attention per layer)."""
    if q.dim() == 4 and not window:  # (B, H, N, d): no views to make (the common case)
        return _fwd(q, k, v, causal, scale)
    return _forward_any_rank(q, k, v, causal, scale, *window)


def _backward_any_rank(do, q, k, v, o, lse, causal: bool, scale: float, *window: int):
    """``_bwd`` on inputs of any rank >= 2 (see ``_forward_any_rank``)."""
    gqa = q.shape[:-2] != k.shape[:-2]
    q4 = as_bhnd(q, gqa)
    dq4, dk4, dv4 = _bwd(
        as_bhnd(do, gqa), q4, as_bhnd(k, gqa), as_bhnd(v, gqa), as_bhnd(o, gqa),
        _lse_as_bhn(lse, q4), causal, scale, *window,
    )  # fmt: skip
    return dq4.reshape(q.shape), dk4.reshape(k.shape), dv4.reshape(v.shape)


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
        dq, dk, dv = _backward_any_rank(do, q, k, v, o, lse, ctx.is_causal, ctx.softmax_scale)
        return dq, dk, dv, None, None


class CheckedFlashAttention(FlashAttention2Triton):
    """``flash_attention``'s Function: the same, for inputs it has checked already and a
    resolved ``softmax_scale`` (no second round of checks per call)."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal, softmax_scale):
        return _forward(ctx, q, k, v, is_causal, softmax_scale)


class WindowedFlashAttention(torch.autograd.Function):
    """``flash_attention`` with a window or the log-sum-exp:
    ``WindowedFlashAttention.apply(q, k, v, causal, scale, window_left, window_right)`` on
    checked inputs -> (o, lse), lse (..., Nq) float32 and not differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, causal, softmax_scale, window_left, window_right):
        o, lse = _forward_any_rank(q, k, v, causal, softmax_scale, window_left, window_right)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.args = (causal, softmax_scale, window_left, window_right)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = _backward_any_rank(do, q, k, v, o, lse, *ctx.args)
        return dq, dk, dv, None, None, None, None


def _varlen_views(q, k, v):
    """Packed (total, H, d) tensors as (1, H, total, d) views."""
    return tuple(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))


class VarlenFlashAttention(torch.autograd.Function):
    """``flash_attention_varlen`` on checked inputs: ``apply(q, k, v, cu_seqlens_q,
    cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, window_left, window_right)``
    -> (o (total_q, Hq, d), lse (Hq, total_q) float32, not differentiable). cu_seqlens_k
    None: the same as cu_seqlens_q (dynamo traces no Function given one tensor twice)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, left, right):
        cu_k = cu_q if cu_k is None else cu_k
        args = (cu_q, cu_k, max_q, max_k, causal, scale, left, right)
        q4, k4, v4 = _varlen_views(q, k, v)
        if _compiling():
            o4, lse3 = ops.varlen_fwd_launch(q4, k4, v4, *args)
        else:
            o4, lse3 = launch_varlen.forward_varlen(q4, k4, v4, *args)
        o, lse = o4[0].transpose(0, 1), lse3[0]  # (total_q, Hq, d), (Hq, total_q)
        ctx.save_for_backward(q, k, v, o, lse, cu_q, cu_k)
        ctx.args = (max_q, max_k, causal, scale, left, right)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse, cu_q, cu_k = ctx.saved_tensors
        args = (cu_q, cu_k, *ctx.args)
        q4, k4, v4 = _varlen_views(q, k, v)
        do4, o4 = (t.transpose(0, 1).unsqueeze(0) for t in (do, o))
        if _compiling():
            dq4, dk4, dv4 = ops.varlen_bwd_launch(do4, q4, k4, v4, o4, lse[None], *args)
        else:
            dq4, dk4, dv4 = launch_varlen.backward_varlen(do4, q4, k4, v4, o4, lse[None], *args)
        grads = (g[0].transpose(0, 1) for g in (dq4, dk4, dv4))
        return (*grads, *(None,) * 8)
