"""Launcher of attention over a KV cache with a key count per batch element
(``flash_attention_kvcache``): the dense kernels with KV_LENS set.

k and v are the cache, (B, Hkv, S, d) with S rows allocated; batch element b attends to its
first ``cache_seqlens[b]`` keys, and its masks align to that count (bottom-right, as the
dense API's). The counts are read by the kernels, never by the host, so a call does not wait
for the GPU and a CUDA graph can capture it with counts that change between replays. Few
queries take the split-KV decode kernels (``launch._decode`` with the counts: the split
count is chosen over the S rows, and each element's splits share its own visible keys, in
the kernel), more take the forward kernel with
every bounds check on. Forward only: a KV cache serves inference. Repeated 16-bit calls are
remembered by call key in ``launch``'s cache, as the dense launchers' are (``launch_plans``).

New keys and values given with the call are stored into the cache by ``append_kv`` (one
small kernel, launched first in the same plan) from row seqlens[b] on; the attention kernels
then read seqlens[b] plus their count (KV_ADD), so the lengths tensor is never written.
"""

from __future__ import annotations

import torch

from . import configs as C
from ._device import kernels as _kernels
from ._device import require_runnable
from .features import features
from .launch import _CALLS, _decode, fwd_args, replay_forward
from .launch_common import (
    _check_grid,
    _interpreter_bf16,
    _run,
    _unit_last_stride,
    append_kv,
    out_like,
    triton_cdiv,
)
from .launch_plans import (
    _launch_planned,
    _layout_key,
    call_key,
    remember_call,
)
from .torch_impl import append_kv_torch


def forward_kvcache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seqlens: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    window_left: int = -1,
    window_right: int = -1,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, H, Nq, d), the cache k, v (B, Hkv, S, d), seqlens int32 (B,) on q's device ->
    o (B, H, Nq, d), lse (B, H, Nq) float32. Batch element b sees keys [0, seqlens[b])
    (clamped to [0, S]); rows that see no key give o = 0, lse = -inf. With k_new, v_new
    (B, Hkv, n_new, d) the cache first takes them at rows seqlens[b] .. + n_new (rows past
    S dropped), in place, and element b sees seqlens[b] + n_new keys."""
    # no new row (None, or none given) is no store: the call key and plan hold no new rows
    new_kv = () if k_new is None or k_new.shape[2] == 0 else (k_new, v_new)
    inputs = (q, k, v, seqlens, *new_kv)
    call = call_key(inputs, causal, softmax_scale, window_left, window_right)
    if call is not None:
        replayed = replay_forward(call, inputs)
        if replayed is not None:
            return replayed
        if not all(t.stride(-1) == 1 for t in inputs if t.dim() > 1) or not seqlens.is_contiguous():
            call = None  # the launches read copies: nothing to replay on the caller's tensors
    require_runnable(q)
    if _interpreter_bf16(q):
        lens = append_kv_torch(*new_kv, k, v, seqlens) if new_kv else seqlens
        o32, lse = forward_kvcache(
            q.float(), k.float(), v.float(), lens, causal, softmax_scale, window_left,
            window_right,
        )  # fmt: skip
        return out_like(q).copy_(o32), lse
    o = out_like(q)
    b, h, n_q, d = q.shape
    n_k = k.shape[2]
    lse = torch.empty((b, h, n_q), dtype=torch.float32, device=q.device)
    feat = features(h, k.shape[1], causal, window_left, window_right, n_q, n_k)
    if o.numel() == 0:  # no query: only the new rows to store
        if new_kv and n_k > 0 and k_new.numel() > 0:
            append_kv(*(_unit_last_stride(t) for t in new_kv), k, v, seqlens.contiguous())
        return o, lse
    if n_k == 0:  # an empty cache: every row is empty
        return o.zero_(), lse.fill_(float("-inf"))
    q, k, v = (_unit_last_stride(t) for t in (q, k, v))
    new_kv = tuple(_unit_last_stride(t) for t in new_kv)
    seqlens = seqlens.contiguous()
    inputs = (q, k, v, seqlens, *new_kv)
    if n_q <= C.DECODE_MAX_Q and n_k >= C.DECODE_MIN_KEYS and feat.group * n_q <= C.DECODE_MAX_ROWS:
        return _decode(q, k, v, o, lse, feat.causal, softmax_scale, feat, call, seqlens, new_kv)
    block_d = C.block_d_for(d)
    added = new_kv[0].shape[2] if new_kv else 0

    def launch_jit() -> None:
        if new_kv:
            append_kv(*new_kv, k, v, seqlens)
        args = fwd_args(q, k, v, o, lse, causal, softmax_scale, feat, block_d, grouped=False)
        # each element's length, read by the kernel, plus the rows just appended
        args.update(CU_K=seqlens, KV_LENS=True, KV_ADD=added)

        def grid(cfg):
            return (b * h, triton_cdiv(n_q, cfg.block_m))

        _check_grid(triton_cdiv(n_q, 16), "query length", 16)
        _run(
            "fwd", _kernels().attn_fwd_kernel, grid, args, n_q, n_k, block_d, q.element_size(),
            ragged=True, features=True,
        )  # fmt: skip

    key = _layout_key(inputs, "kvcache_fwd", softmax_scale, feat) if q.is_cuda else None
    _launch_planned(key, inputs, (o, lse), launch_jit)
    remember_call(_CALLS, call, key, ())
    return o, lse
