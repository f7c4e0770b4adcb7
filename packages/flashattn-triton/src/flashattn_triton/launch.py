"""Launchers: check, allocate, pick tiles and start the Triton kernels for (B, H, N, d) inputs.

These functions run real kernels; compiled graphs call them through the opaque custom ops
in ``ops``, or trace them on fake tensors through ``traced_ops`` (``Options.traced_compile``).
Triton is imported on first use, so importing the package costs nothing and the interpreter
switch ``TRITON_INTERPRET=1`` may be set any time before the first call.

This module is the launchers' entry point: it holds the forward (``forward``, and the
split-KV decode path ``_decode``) and re-exports ``backward`` (``launch_backward``: the
backward schemes) and ``clear_plans`` (``launch_plans``: launch-plan keys and replays,
i.e. the per-call host cost). ``launch_common`` holds what they all share (``out_like``,
kernel arguments, ``_run``: one kernel's launch with its tiles); ``launch_varlen`` the
launchers of packed batches. On small causal grids the forward halves its grid-axis tiles
(``configs.for_small_grid``), as the split backward does.

Features (``features.Features``): grouped-query attention (k/v with fewer heads) and sliding
windows (and, in ``launch_varlen``, packed variable-length batches) switch on the kernels'
GQA / WINDOW / VARLEN flags and always take the split backward (the fused and atomic kernels
lack them; the d = 128 Gluon kernels take grouped-query heads, not windows or packing). A
forward with few queries against many keys (``configs.DECODE_*``) runs the split-KV decode
kernels instead (``_decode``). Each is part of the launch-plan key; a call with none launches
exactly what it did before.

Each launcher module imports the helpers it calls by name: to replace one in a test, patch
it in the module that calls it (``launch._run`` for the forward, ``launch_backward._run``
for the backward, ``launch_varlen._run`` for packed batches), not only here.
"""

from __future__ import annotations

import torch

from . import configs as C
from . import fastlaunch
from ._device import (
    head_group_args,
    interpreting,
    require_runnable,
    sm_count,
    smem_per_sm,
    tma_usable,
)
from ._device import kernels as _kernels
from .features import PLAIN, Features, feature_args, features
from .launch_backward import _backward_scheme, _stats_buffers, backward
from .launch_common import (
    _bhn_strides,
    _check_grid,
    _dot_precision,
    _interpreter_bf16,
    _run,
    _small_grid,
    _strides,
    _unit_last_stride,
    append_kv,
    out_like,
    triton_cdiv,
    workspace_layout,
    workspace_views,
)
from .launch_plans import (
    _PLANS,
    _launch_planned,
    _layout_key,
    call_key,
    clear_plans,
    keyed_cache,
    remember_call,
    replay_call,
)
from .options import get_options

# The names other modules, benchmarks and tests reach through this module: the launchers'
# entry points and a few internals of the modules above.
__all__ = [
    "_PLANS",
    "_backward_scheme",
    "_stats_buffers",
    "backward",
    "clear_plans",
    "forward",
    "interpreting",
    "out_like",
    "tma_usable",
]


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    window_left: int = -1,
    window_right: int = -1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, H, Nq, d), k, v (B, Hkv, Nk, d) -> o (B, H, Nq, d), lse (B, H, Nq) float32.

    Hkv divides H (query head h reads k/v head h // (H // Hkv)); window_left / window_right
    bound the keys each query sees (-1: unbounded; see ``flash_attention``)."""
    call = call_key((q, k, v), causal, softmax_scale, window_left, window_right)
    if call is not None:
        replayed = replay_forward(call, (q, k, v))
        if replayed is not None:
            return replayed
        if not all(t.stride(-1) == 1 for t in (q, k, v)):
            call = None  # the launches read copies: nothing to replay on the caller's tensors
    require_runnable(q)
    if _interpreter_bf16(q):
        o32, lse = forward(
            q.float(), k.float(), v.float(), causal, softmax_scale, window_left, window_right
        )
        o = out_like(q)
        return o.copy_(o32), lse
    o = out_like(q)
    b, h, n_q, d = q.shape
    n_k = k.shape[2]
    lse = torch.empty((b, h, n_q), dtype=torch.float32, device=q.device)
    feat = None
    if window_left != -1 or window_right != -1 or k.shape[1] != h:
        feat = features(h, k.shape[1], causal, window_left, window_right, n_q, n_k)
    if o.numel() == 0:
        return o, lse
    if n_k == 0:  # no key at all: every row is empty
        return o.zero_(), lse.fill_(float("-inf"))
    q, k, v = (_unit_last_stride(t) for t in (q, k, v))
    if n_q <= C.DECODE_MAX_Q and n_k >= C.DECODE_MIN_KEYS:
        group = 1 if feat is None else feat.group
        if group * n_q <= C.DECODE_MAX_ROWS:
            return _decode(q, k, v, o, lse, causal, softmax_scale, feat, call)

    def launch_jit() -> None:
        # Hopper, d = 128, long enough: the Gluon forward (gluon_fwd) when it applies.
        if q.is_cuda and (feat is None or not feat.window):
            kern_causal = causal if feat is None else feat.causal
            if _gluon_fwd(q, k, v, o, lse, kern_causal, softmax_scale):
                return
        kern = _kernels()
        block_d = C.block_d_for(d)
        args = fwd_args(q, k, v, o, lse, causal, softmax_scale, feat, block_d)

        def grid(cfg):
            return (b * h, triton_cdiv(n_q, cfg.block_m))

        _check_grid(triton_cdiv(n_q, 16), "query length", 16)
        n_sms = sm_count(q)
        small = _small_grid(args["CAUSAL"] and feat is None, b * h, n_q, n_sms)
        few = C.few_programs("fwd", b * h, n_q, block_d, n_sms)
        # Grouped-query heads alone keep the plain tiles (d = 128: 1.22x faster forward than
        # the feature tile, configs.FEATURE_DEFAULTS); windows need the feature tile.
        _run(
            "fwd", kern.attn_fwd_kernel, grid, args, n_q, n_k, block_d, q.element_size(),
            small_grid=small, few_programs=few, features=feat is not None and feat.window,
        )  # fmt: skip

    key = _layout_key((q, k, v), "fwd", causal, softmax_scale, feat) if q.is_cuda else None
    _launch_planned(key, (q, k, v), (o, lse), launch_jit)
    remember_call(_CALLS, call, key, ())
    return o, lse


def fwd_args(
    q, k, v, o, lse, causal: bool, softmax_scale: float, feat: Features | None, block_d: int,
    grouped: bool = True,
) -> dict:  # fmt: skip
    """``attn_fwd_kernel``'s arguments for dense (B, H, N, d) tensors, the tiles apart: heads
    launched in L2-sized groups (``grouped``) or in the plain order."""
    b, h, n_q, d = q.shape
    n_k = k.shape[2]
    if grouped:
        order = head_group_args(k, b * h, n_k, block_d)
    else:
        order = {"head_group": b * h, "GROUPED": False}
    return {
        "Q": q, "K": k, "V": v, "Out": o, "LSE": lse,
        **_strides("q", q), **_strides("k", k), **_strides("v", v), **_strides("o", o),
        "n_heads": h, "n_q": n_q, "n_k": n_k, "qk_scale": softmax_scale * _kernels().LOG2E,
        **order, "SEQ_BUCKET": C.seq_bucket(max(n_q, n_k)), "HEAD_DIM": d, "BLOCK_D": block_d,
        "CAUSAL": causal, "DOT_PRECISION": _dot_precision(q.dtype),
        **PLAIN, **feature_args(feat),
    }  # fmt: skip


def replay_forward(
    call: tuple, tensors: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(o, lse) of a remembered forward call (``_CALLS``) replayed on ``tensors`` (q first,
    its inputs in launch order), or None where there is none or it cannot replay."""
    remembered = _CALLS.get(call)
    if remembered is None:
        return None
    replay, scratch = remembered
    q = tensors[0]
    o = torch.empty_like(q)
    lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
    addresses = [t.data_ptr() for t in (*tensors, o, lse)]
    if scratch:  # the decode splits' partial results: one workspace (``workspace_layout``)
        offsets, total = scratch
        workspace = q.new_empty(total, dtype=torch.float32)
        base = workspace.data_ptr()
        addresses += [base + 4 * offset for offset in offsets]
    if replay_call(_CALLS, call, replay, addresses, len(tensors)):
        return o, lse
    return None


def _gluon_fwd(*args) -> bool:
    """``gluon_fwd.try_fwd`` (imported on first CUDA forward: it imports Triton's Gluon)."""
    from . import gluon_fwd

    return gluon_fwd.try_fwd(*args)


# Repeated forward calls by call key (``launch_plans.call_key``): the replay and the layout
# (``workspace_layout``) of the float32 workspace it writes besides o and lse: the decode
# splits' partial results, () where there are none.
# ``launch_kvcache`` keeps its calls here too: their keys hold four to six tensors, these three.
_CALLS: dict[tuple, tuple] = keyed_cache()

# Decode launches by launch-plan key: (tile config, splits, keys per split, first key).
_DECODE_PLANS: dict[tuple, tuple[C.TileConfig, int, int, int]] = keyed_cache()


def _decode_plan(q, k, feat: Features | None) -> tuple[C.TileConfig, int, int, int]:
    """The decode kernels' tile, key splits, keys per split (a multiple of the key tile)
    and first key: the keys any query sees run from row 0's left bound to the last key
    (bottom-right aligned, the last query sees the last key whatever the right bound)."""
    b, h, n_q, d = q.shape
    h_kv, n_k = k.shape[1], k.shape[2]
    block_d = C.block_d_for(d)
    cfg = C.decode_config(h // h_kv * n_q, block_d, q.element_size(), get_options().tile_configs)
    key_lo = 0
    if feat is not None and feat.window:
        key_lo = max(0, n_k - n_q - feat.left) // cfg.block_n * cfg.block_n
    tiles = triton_cdiv(n_k - key_lo, cfg.block_n)
    per_sm = C.decode_programs_per_sm(cfg, block_d, q.element_size(), smem_per_sm(q))
    splits = C.decode_splits(b * h_kv, tiles, sm_count(q) * per_sm)
    keys_per_split = triton_cdiv(tiles, splits) * cfg.block_n
    return cfg, triton_cdiv(n_k - key_lo, keys_per_split), keys_per_split, key_lo


def _decode(
    q, k, v, o, lse, causal: bool, softmax_scale: float, feat: Features | None,
    call: tuple | None = None, seqlens: torch.Tensor | None = None,
    new_kv: tuple[torch.Tensor, torch.Tensor] = (),
):  # fmt: skip
    """The forward by the split-KV decode kernels (few queries, many keys; ``forward``
    checked the shapes): the keys any query sees are split over programs, each (batch, k/v
    head) program takes the queries of all q heads that read that k/v head, and a combine
    kernel merges the splits (one split: the decode kernel writes o and lse itself).
    ``seqlens`` (``launch_kvcache``): each batch element's filled cache rows, read by the
    kernel (KV_LENS), whose splits share each element's visible keys (the plan's split count
    is sized over k's rows, its key range unused). ``new_kv``: new rows
    (k, v) stored into the cache from row seqlens[b] on first (``append_kv``), each element
    then seeing seqlens[b] + their count."""
    b, h, n_q, d = q.shape
    h_kv, n_k = k.shape[1], k.shape[2]
    inputs = (q, k, v) if seqlens is None else (q, k, v, seqlens, *new_kv)
    kind = "decode" if seqlens is None else "kvcache_decode"
    key = _layout_key(inputs, kind, causal, softmax_scale, feat) if q.is_cuda else None
    plan = _DECODE_PLANS.get(key) if key is not None else None
    if plan is None:
        plan = _decode_plan(q, k, feat if seqlens is None else None)
        if key is not None:
            if len(_DECODE_PLANS) >= 4096:
                _DECODE_PLANS.clear()
            _DECODE_PLANS[key] = plan
    cfg, splits, keys_per_split, key_lo = plan
    added = new_kv[0].shape[2] if new_kv else 0
    if splits > 1:
        shapes = ((b, h, splits, n_q, d), (b, h, splits, n_q))
        scratch = workspace_layout(shapes)  # remembered for replays
        o_part, lse_part = workspace_views(shapes, q.device, scratch)  # one allocation
        outputs = (o, lse, o_part, lse_part)
    else:
        o_part = lse_part = None
        scratch = ()
        outputs = (o, lse)

    def launch_jit() -> None:
        kern = _kernels()
        block_d = C.block_d_for(d)
        kern_causal, window = (causal, False) if feat is None else (feat.causal, feat.window)
        if new_kv:
            append_kv(*new_kv, k, v, seqlens)
        fastlaunch.launch(
            kern.attn_fwd_decode_kernel, (b * h_kv, splits),
            q, k, v, o, lse, o_part, lse_part,
            *_bhn_strides(q), *_bhn_strides(k), *_bhn_strides(v), *_bhn_strides(o),
            h_kv, n_q, n_k, softmax_scale * kern.LOG2E, h // h_kv,
            feat.left if window else None, feat.right if window else None,
            key_lo, n_k, keys_per_split,
            HEAD_DIM=d, BLOCK_D=block_d, CAUSAL=kern_causal, WINDOW=window,
            DOT_PRECISION=_dot_precision(q.dtype), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            EVEN_N=seqlens is None and n_k % cfg.block_n == 0, SPLIT=splits > 1,
            **({} if seqlens is None else {"KV_LEN": seqlens, "KV_LENS": True, "KV_ADD": added}),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
        if splits > 1:
            fastlaunch.launch(
                kern.attn_fwd_combine_kernel, (b * h * n_q,),
                o_part, lse_part, o, lse, *_bhn_strides(o), h, n_q, splits,
                HEAD_DIM=d, BLOCK_D=block_d, BLOCK_S=max(2, C.next_pow2(splits)),
            )  # fmt: skip

    _launch_planned(key, inputs, outputs, launch_jit)
    remember_call(_CALLS, call, key, scratch)
    return o, lse
