"""Launchers of packed variable-length batches (``flash_attention_varlen``): the dense
kernels with VARLEN set, on (1, H, total, d) views of the packed (total, H, d) tensors.

Sequence s is queries cu_q[s]:cu_q[s+1] against keys cu_k[s]:cu_k[s+1]; the grid's first
axis runs over (sequence, head) and its second over the longest sequence's tiles (programs
past their own sequence's end return at once). Tiles are the dense kernels' for the
longest sequences, read by pointers with every bounds check on; the backward is the split
one. Offsets are tensors the replayed launch plans take as inputs (their values may change
from call to call; their number and the longest lengths are part of the key). Repeated
16-bit calls are remembered by call key, as the dense launchers' are (``launch_plans``).
"""

from __future__ import annotations

import torch

from . import configs as C
from ._device import kernels as _kernels
from ._device import require_runnable
from .features import Varlen, feature_args, features
from .launch_backward import _backward_launches, _stats_outputs
from .launch_common import (
    _check_grid,
    _dot_precision,
    _interpreter_bf16,
    _run,
    _strides,
    _unit_last_stride,
    out_like,
    triton_cdiv,
)
from .launch_plans import (
    _launch_planned,
    _layout_key,
    call_key,
    keyed_cache,
    remember_call,
    replay_call,
)

# Repeated calls by call key (``launch_plans.call_key``; the key also says whether
# cu_seqlens_k is cu_seqlens_q, which changes the replay's inputs): the replay, and for the
# backward whether its row statistics are packed (always False here, kept for
# ``_stats_outputs``).
_FWD_CALLS: dict[tuple, tuple] = keyed_cache()
_BWD_CALLS: dict[tuple, tuple] = keyed_cache()


def _remembered(cache: dict, call: tuple | None, tensors: tuple[torch.Tensor, ...]):
    """The remembered replay of ``call`` (None where there is none), and ``call`` itself
    or None where these tensors cannot be replayed (a last stride other than 1: the
    launches read copies)."""
    if call is None:
        return None, None
    remembered = cache.get(call)
    if remembered is None and not all(t.stride(-1) == 1 for t in tensors):
        return None, None
    return remembered, call


def _varlen_inputs(q, k, v, cu_q, cu_k) -> tuple[torch.Tensor, ...]:
    """The buffers of a varlen call: q, k, v and the offsets, cu_seqlens_k left out where it
    is cu_seqlens_q itself (a launch-plan replay needs distinct addresses)."""
    if cu_k.data_ptr() == cu_q.data_ptr():
        return (q, k, v, cu_q)
    return (q, k, v, cu_q, cu_k)


def forward_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    causal: bool,
    softmax_scale: float,
    window_left: int = -1,
    window_right: int = -1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed sequences: q (1, H, total_q, d), k, v (1, Hkv, total_k, d) (views of
    (total, H, d) tensors), cu_q, cu_k int32 (batch + 1,) offsets, max_q, max_k the longest
    sequences -> o (1, H, total_q, d), lse (1, H, total_q) float32. Sequence s is queries
    cu_q[s]:cu_q[s+1] against keys cu_k[s]:cu_k[s+1] (the values are not checked here)."""
    inputs = _varlen_inputs(q, k, v, cu_q, cu_k)
    flags = (max_q, max_k, causal, softmax_scale, window_left, window_right, len(inputs))
    remembered, call = _remembered(_FWD_CALLS, call_key(inputs, *flags), (q, k, v))
    if remembered is not None:
        o = out_like(q)
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        addresses = [t.data_ptr() for t in (*inputs, o, lse)]
        if replay_call(_FWD_CALLS, call, remembered[0], addresses, len(inputs)):
            return o, lse
    require_runnable(q)
    if _interpreter_bf16(q):
        o32, lse = forward_varlen(
            q.float(), k.float(), v.float(), cu_q, cu_k, max_q, max_k, causal, softmax_scale,
            window_left, window_right,
        )  # fmt: skip
        return out_like(q).copy_(o32), lse
    o = out_like(q)
    _, h, total_q, d = q.shape
    batch = cu_q.shape[0] - 1
    lse = torch.empty((1, h, total_q), dtype=torch.float32, device=q.device)
    feat = features(h, k.shape[1], causal, window_left, window_right, max_q, max_k)
    if o.numel() == 0 or max_q == 0:
        return o, lse
    if k.shape[2] == 0 or max_k == 0:  # no key at all: every row is empty
        return o.zero_(), lse.fill_(float("-inf"))
    q, k, v = (_unit_last_stride(t) for t in (q, k, v))
    inputs = _varlen_inputs(q, k, v, cu_q, cu_k)

    def launch_jit() -> None:
        kern = _kernels()
        block_d = C.block_d_for(d)
        args = {
            "Q": q, "K": k, "V": v, "Out": o, "LSE": lse,
            **_strides("q", q, True), **_strides("k", k, True), **_strides("v", v, True),
            **_strides("o", o, True),
            "n_heads": h, "n_q": total_q, "n_k": k.shape[2],
            "qk_scale": softmax_scale * kern.LOG2E, "head_group": batch * h, "GROUPED": False,
            "SEQ_BUCKET": C.seq_bucket(max(max_q, max_k)), "HEAD_DIM": d, "BLOCK_D": block_d,
            "DOT_PRECISION": _dot_precision(q.dtype), **feature_args(feat, cu_q, cu_k),
        }  # fmt: skip

        def grid(cfg):
            return (batch * h, triton_cdiv(max_q, cfg.block_m))

        _check_grid(triton_cdiv(max_q, 16), "max_seqlen_q", 16)
        _run(
            "fwd", kern.attn_fwd_kernel, grid, args, max_q, max_k, block_d, q.element_size(),
            ragged=True, features=True,
        )  # fmt: skip

    key = None
    if q.is_cuda:
        key = _layout_key(inputs, "varlen_fwd", softmax_scale, feat, max_q, max_k)
    _launch_planned(key, inputs, (o, lse), launch_jit)
    remember_call(_FWD_CALLS, call, key, ())
    return o, lse


def backward_varlen(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    causal: bool,
    softmax_scale: float,
    window_left: int = -1,
    window_right: int = -1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``forward_varlen``: dq, dk, dv shaped like its (1, H, total, d) q, k, v,
    from dO like q, o and lse (1, H, total_q)."""
    inputs = (*_varlen_inputs(q, k, v, cu_q, cu_k), do, o, lse)
    flags = (max_q, max_k, causal, softmax_scale, window_left, window_right, len(inputs))
    remembered, call = _remembered(_BWD_CALLS, call_key(inputs, *flags), (do, q, k, v, o))
    if remembered is not None:
        dq, dk, dv = out_like(q), out_like(k), out_like(v)
        stats = _stats_outputs(lse, q.shape[2], remembered[1])[1]
        addresses = [t.data_ptr() for t in (*inputs, dq, dk, dv, *stats)]
        if replay_call(_BWD_CALLS, call, remembered[0], addresses, len(inputs)):
            return dq, dk, dv
    require_runnable(q)
    if _interpreter_bf16(q):
        grads = backward_varlen(
            do.float(), q.float(), k.float(), v.float(), o.float(), lse, cu_q, cu_k, max_q,
            max_k, causal, softmax_scale, window_left, window_right,
        )  # fmt: skip
        return tuple(out_like(t).copy_(g) for t, g in zip((q, k, v), grads))
    dq, dk, dv = out_like(q), out_like(k), out_like(v)
    _, h, total_q, _ = q.shape
    feat = features(h, k.shape[1], causal, window_left, window_right, max_q, max_k)
    if total_q == 0 or k.shape[2] == 0 or max_q == 0 or max_k == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    do, q, k, v, o = (_unit_last_stride(t) for t in (do, q, k, v, o))
    varlen = Varlen(cu_q, cu_k, cu_q.shape[0] - 1, max_q, max_k)
    inputs = (*_varlen_inputs(q, k, v, cu_q, cu_k), do, o, lse)
    plan = ("split", "dkdv", False, False)
    (lse_c, lse2, delta, stride_rows), stats = _stats_outputs(lse, total_q, False)

    def launch_jit() -> None:
        _backward_launches(
            do, q, k, v, o, lse_c, lse2, delta, stride_rows, dq, dk, dv, dq, causal,
            softmax_scale, plan, None, feat, varlen,
        )  # fmt: skip

    key = None
    if q.is_cuda:
        key = _layout_key(inputs, "varlen_bwd", softmax_scale, feat, max_q, max_k)
    _launch_planned(key, inputs, (dq, dk, dv, *stats), launch_jit)
    remember_call(_BWD_CALLS, call, key, False)
    return dq, dk, dv
