"""Launchers: check, allocate, pick tiles and start the Triton kernels for (B, H, N, d) inputs.

These functions run real kernels and are not traced by torch.compile (the custom ops in
``ops`` wrap them). Triton is imported on first use, so importing the package costs nothing
and the interpreter switch ``TRITON_INTERPRET=1`` may be set any time before the first call.

Host cost: the first call for a given input layout (shapes, strides, dtype, flags, options,
pointer alignment) picks tiles and launches through Triton's JIT; later calls with that
layout replay the recorded launches with the compiled kernels (``fastlaunch``), so per call
only the outputs are allocated and the new addresses filled in.

Backward schemes (``Options.backward``): ``split`` = a dQ kernel looping over key tiles
(for d <= 64 it also computes D = rowsum(dO * O) for its rows), then a dK/dV kernel looping
over query tiles (no atomics, P recomputed twice; on Hopper, for d = 128 and TMA-readable
layouts, the dK/dV kernel is the Gluon one of ``gluon_dkdv``, and on small grids or with
2048 keys or more the dQ kernel that of ``gluon_dq``);
``fused`` = the same two loops in one launch, program t doing key tile t and query tile t;
``atomic`` = one dK/dV kernel that also adds dQ into a float32 buffer with atomics; ``auto``
(default) = fused for causal 16-bit inputs on small grids (about one wave of programs, e.g.
batch 1 with few heads and long sequences), split otherwise. On small causal grids the forward
and split kernels also halve their grid-axis tiles (``configs.for_small_grid``).

Features (``features.Features``): grouped-query attention (k/v with fewer heads) and sliding
windows (and, in ``launch_varlen``, packed variable-length batches) switch on the kernels'
GQA / WINDOW / VARLEN flags and always take the split backward with the Triton kernels (the
Gluon, fused and atomic ones lack them). A forward with few queries against many keys
(``configs.DECODE_*``) runs the split-KV decode kernels instead (``_decode``). Each is part
of the launch-plan key; a call with none launches exactly what it did before.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from . import _device as _D
from . import configs as C
from . import fastlaunch
from .features import PLAIN, Features, Varlen, feature_args, features
from .options import get_options, on_change

MAX_GRID_Y = 65535


_kernels = _D.kernels
interpreting = _D.interpreting
require_runnable = _D.require_runnable
sm_count = _D.sm_count
cuda_major = _D.cuda_major
head_group_args = _D.head_group_args
tma_usable = _D.tma_usable

# Launch plans by input layout (see ``fastlaunch``), dropped whenever the options change.
_PLANS = fastlaunch.PlanCache()
_GENERATION = [0]


def clear_plans() -> None:
    """Forget every launch plan (after changing ``configs`` tables in place; option changes
    through ``set_options`` and ``configs.OVERRIDES`` are noticed without it)."""
    _GENERATION[0] += 1
    _PLANS.clear()
    _BWD_SCHEMES.clear()
    _DECODE_PLANS.clear()


on_change(clear_plans)


def out_like(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An uninitialized tensor shaped like t with a unit last stride (keeps t's layout when
    t is dense with a unit last stride, e.g. a (B, N, H, d) buffer seen as (B, H, N, d)).
    The fake (meta) implementations use the same rule so strides match under compile."""
    if t.stride(-1) == 1:
        return torch.empty_like(t, dtype=dtype)
    return torch.empty(t.shape, dtype=dtype or t.dtype, device=t.device)


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _bhn_strides(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride()[:3]


def _strides(prefix: str, t: torch.Tensor, varlen: bool = False) -> dict[str, int]:
    """{"stride_<prefix>b", "stride_<prefix>h", "stride_<prefix>n"}: t's (B, H, N) strides as
    kernel arguments (the batch stride 0 for a packed (1, H, total, d) tensor: the kernels
    then address a sequence by its offset alone)."""
    sb, sh, sn = t.stride()[:3]
    return {
        f"stride_{prefix}b": 0 if varlen else sb,
        f"stride_{prefix}h": sh,
        f"stride_{prefix}n": sn,
    }


def _device_guard(t: torch.Tensor):
    """Make t's GPU current for the launch (a no-op where it already is, or off-GPU)."""
    index = t.get_device()
    if index < 0 or index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(index)


def _layout_key(inputs: tuple[torch.Tensor, ...], *flags) -> tuple | None:
    """The launch-plan key of a call on CUDA ``inputs``: their shapes, strides and 16-byte
    alignment (Triton specializes on it), dtype, device, the options and ``flags``; None
    where launches must go through Triton's dispatch (``Options.fast_launch`` off,
    autotuning, a device other than the current one)."""
    opts = get_options()
    if not opts.fast_launch or opts.autotune:
        return None
    q = inputs[0]
    index = q.get_device()
    if index < 0 or index != torch._C._cuda_getDevice():
        return None
    align = 0
    for i, t in enumerate(inputs):
        if t.data_ptr() & 15:
            align |= 1 << i
    prec = opts.resolved_fp32_precision() if q.dtype == torch.float32 else None
    layout = tuple((t.shape, t.stride()) for t in inputs)
    return (layout, q.dtype, index, align, prec, _GENERATION[0], C.overrides_key(), *flags)


def _launch_planned(
    key: tuple | None,
    inputs: tuple[torch.Tensor, ...],
    outputs: tuple[torch.Tensor, ...],
    launch_jit,
) -> None:
    """Run ``launch_jit`` (this call's launches through Triton's dispatch), or replay the
    launches recorded for ``key`` with these buffers (``fastlaunch.PlanCache``). Buffers
    that alias each other or outputs off 16-byte alignment take the dispatch path (a
    replay maps arguments to buffers by address)."""
    if inputs[0].is_cuda:
        _D.ensure_context()
    if key is not None:
        addresses = [t.data_ptr() for t in inputs + outputs]
        aligned = not any(a & 15 for a in addresses[len(inputs) :])
        if aligned and len(set(addresses)) == len(addresses):
            stream = torch._C._cuda_getCurrentRawStream(inputs[0].get_device())
            _PLANS.run(key, addresses, stream, launch_jit)
            return
    with _device_guard(inputs[0]):
        launch_jit()


def _small_grid(causal: bool, bh: int, n: int, n_sms: int) -> bool:
    """A causal grid of about one wave (see configs.small_grid)."""
    return causal and C.small_grid(bh, n, n_sms)


def _dot_precision(dtype: torch.dtype) -> str:
    return get_options().resolved_fp32_precision() if dtype == torch.float32 else "tf32"


def _check_grid(n_tiles: int, what: str, block: int) -> None:
    if n_tiles > MAX_GRID_Y:
        raise ValueError(
            f"{what} of {n_tiles * block} needs {n_tiles} tiles of {block}, more than the "
            f"launch grid allows ({MAX_GRID_Y}); split the sequence"
        )


def _triton_config(kind: str, cfg: C.TileConfig):
    import triton

    if kind == "fused":
        kw = {"BLOCK_M1": cfg.block_m, "BLOCK_N1": cfg.block_n, "BLOCK_M2": cfg.block_n}
        kw["BLOCK_N2"] = cfg.block_n2
    else:
        kw = cfg.kwargs()
    return triton.Config(kw, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _meta(
    kind: str, cfg: C.TileConfig, n_q: int, n_k: int, ragged: bool = False
) -> dict[str, int | bool]:
    """Tile constexprs plus the EVEN_* flags that switch off row/column bounds checks
    (never with ``ragged``: packed sequences of any lengths)."""
    if kind == "fused":
        return {
            "BLOCK_M1": cfg.block_m,
            "BLOCK_N1": cfg.block_n,
            "BLOCK_M2": cfg.block_n,
            "BLOCK_N2": cfg.block_n2,
            "EVEN_M1": n_q % cfg.block_m == 0,
            "EVEN_N1": n_k % cfg.block_n == 0,
            "EVEN_M2": n_q % cfg.block_n == 0,
            "EVEN_N2": n_k % cfg.block_n2 == 0,
        }
    return {
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n,
        "EVEN_M": not ragged and n_q % cfg.block_m == 0,
        "EVEN_N": not ragged and n_k % cfg.block_n == 0,
    }


# The operand pair each kind streams through its main loop, and which tile length it uses.
_STREAMED = {
    "fwd": ("K", "V", "block_n"),
    "dq": ("K", "V", "block_n"),
    "dkdv": ("Q", "DO", "block_m"),
    "atomic": ("Q", "DO", "block_m"),
}


def _descriptor(t: torch.Tensor, rows: int, block_d: int):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, block_d])


def _packed_rows(lse2: torch.Tensor, delta: torch.Tensor) -> torch.Tensor | None:
    """The (B*H, 2, R) float32 buffer behind the views lse2 = [:, 0], delta = [:, 1] of a
    packed ``_stats_buffers``, or None if they are not laid out so."""
    rows = lse2.shape[-1]
    if lse2.stride(-2) != 2 * rows or delta.data_ptr() != lse2.data_ptr() + 4 * rows:
        return None
    return lse2.as_strided((lse2.numel() // rows, 2, rows), (2 * rows, rows, 1))


def _rows_descriptor(rows: torch.Tensor, block: int):
    """TMA descriptor of a (B*H, 2, R) row-statistics buffer: [1, 2, block] boxes, one query
    tile's L (log2 units) and D in one copy."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(rows, list(rows.shape), list(rows.stride()), [1, 2, block])


def _stream_args(kind: str, cfg: C.TileConfig | None, args: dict, block_d: int) -> dict:
    """DESC_*/USE_TMA/WARP_SPEC/TMA_DQ/REG_A for one launch (nothing for the fused kernel).

    For the atomic backward, ``tma`` also routes the dQ additions through TMA bulk reductions
    into the float32 buffer. ``cfg`` None: every flag off (the autotuned path)."""
    if kind not in _STREAMED:
        return {}
    name_a, name_b, rows = _STREAMED[kind]
    a, b = args[name_a], args[name_b]
    out = {"DESC_A": None, "DESC_B": None, "USE_TMA": False, "WARP_SPEC": bool(cfg and cfg.ws)}
    if kind != "fwd":
        out["REG_A"] = bool(cfg and cfg.reg)
    if kind in ("dkdv", "atomic"):
        out.update(DESC_C=None, TMA_DQ=False, DESC_ROWS=None, STATS_TMA=False)
    if cfg is None or not cfg.tma:
        return out
    if kind == "atomic":
        dq = args["DQ"]  # Triton's interpreter has no TMA reductions (triton 3.9)
        if dq.device.type == "cuda" and tma_usable(dq):
            out.update(DESC_C=_descriptor(dq, cfg.block_m, block_d), TMA_DQ=True)
    if tma_usable(a) and tma_usable(b):
        block = getattr(cfg, rows)
        out.update(DESC_A=_descriptor(a, block, block_d), DESC_B=_descriptor(b, block, block_d))
        out["USE_TMA"] = True
        # The row statistics by TMA too: L in log2 units and D from one packed buffer, rows
        # in whole query tiles.
        if kind in ("dkdv", "atomic") and args.get("PACKED_STATS") and C.STATS_TMA:
            rows = _packed_rows(args["LSE"], args["DELTA"])
            if rows is not None and rows.shape[-1] % block == 0 and rows.data_ptr() % 16 == 0:
                out.update(DESC_ROWS=_rows_descriptor(rows, block), STATS_TMA=True)
    return out


def _to_tile_config(kind: str, meta: dict) -> C.TileConfig:
    if kind == "fused":
        return C.TileConfig(meta["BLOCK_M1"], meta["BLOCK_N1"], 4, 2, meta["BLOCK_N2"])
    return C.TileConfig(meta["BLOCK_M"], meta["BLOCK_N"], 4, 2)


@functools.cache
def _autotuned(kind: str):
    """triton.autotune over the kind's candidates, keyed on (sequence bucket, d, dtype,
    causal), pruned by sequence length and shared memory, EVEN_* flags from heuristics."""
    import triton

    k = _kernels()
    kernel = {
        "fwd": k.attn_fwd_kernel,
        "dkdv": k.attn_bwd_dkdv_kernel,
        "atomic": k.attn_bwd_dkdv_kernel,
        "dq": k.attn_bwd_dq_kernel,
        "fused": k.attn_bwd_fused_kernel,
    }[kind]
    if kind == "fused":
        heur = {
            "EVEN_M1": lambda a: a["n_q"] % a["BLOCK_M1"] == 0,
            "EVEN_N1": lambda a: a["n_k"] % a["BLOCK_N1"] == 0,
            "EVEN_M2": lambda a: a["n_q"] % a["BLOCK_M2"] == 0,
            "EVEN_N2": lambda a: a["n_k"] % a["BLOCK_N2"] == 0,
        }
    else:
        heur = {
            "EVEN_M": lambda a: a["n_q"] % a["BLOCK_M"] == 0,
            "EVEN_N": lambda a: a["n_k"] % a["BLOCK_N"] == 0,
        }
    by_key = {_triton_config(kind, c): c for c in C.CANDIDATES[kind]}

    def prune(configs, named_args, **kwargs):
        n_q, n_k = named_args["n_q"], named_args["n_k"]
        elem = named_args["Q"].element_size()
        tiles = [by_key.get(c) or _to_tile_config(kind, c.kwargs) for c in configs]
        kept = C.prune_configs(kind, tiles, n_q, n_k, kwargs["BLOCK_D"], elem)
        return [_triton_config(kind, c) for c in kept]

    return triton.autotune(
        configs=list(by_key),
        key=["SEQ_BUCKET", "HEAD_DIM", "CAUSAL"],
        prune_configs_by={"early_config_prune": prune},
        reset_to_zero=["DQ"] if kind == "atomic" else None,
    )(triton.heuristics(heur)(kernel))


# Configs that had to shrink at launch (shared memory beyond the device's), reused next time.
_SHRUNK: dict[tuple, C.TileConfig] = {}


def _run(
    kind, kernel, grid, args: dict, n_q: int, n_k: int, block_d: int, elem: int, *,
    small_grid: bool = False, few_programs: bool = False, ragged: bool = False,
    features: bool = False,
) -> None:  # fmt: skip
    """Launch with the default (fitted) config, or through the autotuner when enabled.

    If the device has less shared memory than a config needs, Triton refuses the launch
    (OutOfResources, before anything runs); retry with smaller configs instead of failing.
    ``ragged``: packed variable-length sequences (n_q, n_k: the longest), every bounds
    check on, never autotuned (its heuristics see the packed lengths). ``features``: tiles
    from ``configs.FEATURE_DEFAULTS`` where it has them.
    """
    opts = get_options()
    if opts.autotune and not interpreting() and not ragged:

        def tuned_grid(meta):
            return grid(_to_tile_config(kind, meta))

        _autotuned(kind)[tuned_grid](**args, **_stream_args(kind, None, args, block_d))
        return
    from triton.runtime.errors import OutOfResources

    first = C.default_config(
        kind, n_q, n_k, block_d, elem, small_grid, few_programs, opts.tile_configs, features
    )
    key = (kind, first, block_d, elem, args.get("DOT_PRECISION"), args.get("CAUSAL"), features)
    cfg = _SHRUNK.get(key, first)
    while True:
        try:
            fastlaunch.launch(
                kernel,
                grid(cfg),
                **args,
                **_meta(kind, cfg, n_q, n_k, ragged),
                **_stream_args(kind, cfg, args, block_d),
                num_warps=cfg.num_warps,
                num_stages=cfg.num_stages,
                **({"maxnreg": cfg.maxnreg} if cfg.maxnreg and not interpreting() else {}),
            )
            break
        except OutOfResources:
            smaller = C.shrink(kind, cfg)
            if smaller is None:
                raise
            cfg = smaller
    if cfg != first:
        _SHRUNK[key] = cfg


def _interpreter_bf16(t: torch.Tensor) -> bool:
    """Triton's interpreter multiplies bfloat16 matrices wrongly (seen with triton 3.6 and
    3.9): there, run bfloat16 inputs through the float32 kernels and round the results."""
    return t.dtype == torch.bfloat16 and t.device.type == "cpu" and interpreting()


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
            return _decode(q, k, v, o, lse, causal, softmax_scale, feat)

    def launch_jit() -> None:
        kern = _kernels()
        block_d = C.block_d_for(d)
        args = {
            "Q": q, "K": k, "V": v, "Out": o, "LSE": lse,
            **_strides("q", q), **_strides("k", k), **_strides("v", v), **_strides("o", o),
            "n_heads": h, "n_q": n_q, "n_k": n_k, "qk_scale": softmax_scale * kern.LOG2E,
            **head_group_args(k, b * h, n_k, block_d),
            "SEQ_BUCKET": C.seq_bucket(max(n_q, n_k)), "HEAD_DIM": d, "BLOCK_D": block_d,
            "CAUSAL": causal, "DOT_PRECISION": _dot_precision(q.dtype),
            **PLAIN, **feature_args(feat),
        }  # fmt: skip

        def grid(cfg):
            return (b * h, triton_cdiv(n_q, cfg.block_m))

        _check_grid(triton_cdiv(n_q, 16), "query length", 16)
        n_sms = sm_count(q)
        small = _small_grid(args["CAUSAL"] and feat is None, b * h, n_q, n_sms)
        few = C.few_programs("fwd", b * h, n_q, block_d, n_sms)
        _run(
            "fwd", kern.attn_fwd_kernel, grid, args, n_q, n_k, block_d, q.element_size(),
            small_grid=small, few_programs=few, features=feat is not None,
        )  # fmt: skip

    key = _layout_key((q, k, v), "fwd", causal, softmax_scale, feat) if q.is_cuda else None
    _launch_planned(key, (q, k, v), (o, lse), launch_jit)
    return o, lse


# Decode launches by launch-plan key: (tile config, splits, keys per split, first key).
_DECODE_PLANS: dict[tuple, tuple[C.TileConfig, int, int, int]] = {}


def _decode_plan(q, k, feat: Features | None) -> tuple[C.TileConfig, int, int, int]:
    """The decode kernels' tile, key splits, keys per split (a multiple of the key tile)
    and first key: the keys any query sees run from row 0's left bound to the last key
    (bottom-right aligned, the last query sees the last key whatever the right bound)."""
    b, h, n_q, d = q.shape
    h_kv, n_k = k.shape[1], k.shape[2]
    cfg = C.decode_config(
        h // h_kv * n_q, C.block_d_for(d), q.element_size(), get_options().tile_configs
    )
    key_lo = 0
    if feat is not None and feat.window:
        key_lo = max(0, n_k - n_q - feat.left) // cfg.block_n * cfg.block_n
    tiles = triton_cdiv(n_k - key_lo, cfg.block_n)
    splits = C.decode_splits(b * h_kv, tiles, sm_count(q))
    keys_per_split = triton_cdiv(tiles, splits) * cfg.block_n
    return cfg, triton_cdiv(n_k - key_lo, keys_per_split), keys_per_split, key_lo


def _decode(q, k, v, o, lse, causal: bool, softmax_scale: float, feat: Features | None):
    """The forward by the split-KV decode kernels (few queries, many keys; ``forward``
    checked the shapes): the keys any query sees are split over programs, each (batch, k/v
    head) program takes the queries of all q heads that read that k/v head, and a combine
    kernel merges the splits (one split: the decode kernel writes o and lse itself)."""
    b, h, n_q, d = q.shape
    h_kv, n_k = k.shape[1], k.shape[2]
    key = _layout_key((q, k, v), "decode", causal, softmax_scale, feat) if q.is_cuda else None
    plan = _DECODE_PLANS.get(key) if key is not None else None
    if plan is None:
        plan = _decode_plan(q, k, feat)
        if key is not None:
            if len(_DECODE_PLANS) >= 4096:
                _DECODE_PLANS.clear()
            _DECODE_PLANS[key] = plan
    cfg, splits, keys_per_split, key_lo = plan
    if splits > 1:
        o_part = torch.empty((b, h, splits, n_q, d), dtype=torch.float32, device=q.device)
        lse_part = torch.empty((b, h, splits, n_q), dtype=torch.float32, device=q.device)
        outputs = (o, lse, o_part, lse_part)
    else:
        o_part = lse_part = None
        outputs = (o, lse)

    def launch_jit() -> None:
        kern = _kernels()
        block_d = C.block_d_for(d)
        kern_causal, window = (causal, False) if feat is None else (feat.causal, feat.window)
        fastlaunch.launch(
            kern.attn_fwd_decode_kernel, (b * h_kv, splits),
            q, k, v, o, lse, o_part, lse_part,
            *_bhn_strides(q), *_bhn_strides(k), *_bhn_strides(v), *_bhn_strides(o),
            h_kv, n_q, n_k, softmax_scale * kern.LOG2E, h // h_kv,
            feat.left if window else None, feat.right if window else None,
            key_lo, n_k, keys_per_split,
            HEAD_DIM=d, BLOCK_D=block_d, CAUSAL=kern_causal, WINDOW=window,
            DOT_PRECISION=_dot_precision(q.dtype), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            EVEN_N=n_k % cfg.block_n == 0, SPLIT=splits > 1,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
        if splits > 1:
            fastlaunch.launch(
                kern.attn_fwd_combine_kernel, (b * h * n_q,),
                o_part, lse_part, o, lse, *_bhn_strides(o), h, n_q, splits,
                HEAD_DIM=d, BLOCK_D=block_d, BLOCK_S=max(2, C.next_pow2(splits)),
            )  # fmt: skip

    _launch_planned(key, (q, k, v), outputs, launch_jit)
    return o, lse


def _gluon_dkdv(*args, **kwargs) -> bool:
    """``gluon_dkdv.try_dkdv`` (imported on first CUDA backward: it imports Triton's Gluon)."""
    from . import gluon_dkdv

    return gluon_dkdv.try_dkdv(*args, **kwargs)


def _gluon_dq():
    """The ``gluon_dq`` module (imported on first CUDA backward, like ``_gluon_dkdv``)."""
    from . import gluon_dq

    return gluon_dq


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _gluon_reads_stats(q: torch.Tensor) -> bool:
    """Whether a Gluon kernel may read this backward's row statistics (CUDA, a head dim in a
    Gluon DEFAULTS table): they then stay in separate contiguous buffers, as its row TMA
    needs."""
    if not q.is_cuda:
        return False
    from . import gluon_dkdv, gluon_dq

    return q.shape[-1] in gluon_dkdv.DEFAULTS or q.shape[-1] in gluon_dq.DEFAULTS


def _stats_by_tma(
    q: torch.Tensor,
    kind: str | None,
    n_q: int,
    n_k: int,
    block_d: int,
    elem: int,
    small: bool,
    features: bool = False,
) -> bool:
    """Whether the Triton dK/dV kernel (``kind`` 'dkdv' or 'atomic') will bring L and D by
    TMA, so that ``_stats_buffers`` packs them: configs.STATS_TMA, its default config asks
    for TMA and q allows it, and no Gluon kernel may read them. (Packed rows read by pointers
    cost registers instead: d = 32, 72 B of stack against 56.)"""
    opts = get_options()
    if kind is None or not C.STATS_TMA or opts.autotune or _gluon_reads_stats(q):
        return False
    cfg = C.default_config(
        kind, n_q, n_k, block_d, elem, small, tile_configs=opts.tile_configs, features=features
    )
    return cfg.tma and tma_usable(q)


def _stats_buffers(
    lse: torch.Tensor, n_q: int, packed: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The backward's (B, H, rows) float32 row statistics: L (natural log), buffers for L in
    log2 units and for D (written by the kernel that computes D), and the row stride of the
    last two. L is lse itself (made contiguous) where n_q is a multiple of
    configs.STATS_ROWS, else a copy padded to one (L = +inf, D = 0 in the padding).

    ``packed``: the last two are the [..., 0, :] and [..., 1, :] views of one (B, H, 2, rows)
    buffer (stride 2 * rows), so that the dK/dV kernel brings a query tile's L and D by one
    TMA copy; else two contiguous buffers (stride rows)."""
    lse = lse.contiguous()
    rows = triton_cdiv(n_q, C.STATS_ROWS) * C.STATS_ROWS
    if rows == n_q:  # the common case, kept to one allocation
        if packed:
            lse2, delta = lse.new_empty((*lse.shape[:-1], 2, rows)).unbind(-2)
            return lse, lse2, delta, 2 * rows
        lse2, delta = lse.new_empty((2, *lse.shape)).unbind(0)
        return lse, lse2, delta, rows
    padded = lse.new_full((*lse.shape[:-1], rows), float("inf"))
    padded[..., :n_q] = lse
    lse = padded
    if not packed:
        return lse, torch.full_like(lse, float("inf")), lse.new_zeros(lse.shape), rows
    both = lse.new_empty((*lse.shape[:-1], 2, rows))
    lse2, delta = both.unbind(-2)
    lse2[..., n_q:] = float("inf")
    delta[..., n_q:] = 0.0
    return lse, lse2, delta, 2 * rows


def backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    window_left: int = -1,
    window_right: int = -1,
    only: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients dq, dk, dv (shaped like q, k, v) from dO (B, H, Nq, d) and the saved o, lse
    (k, v with fewer heads and the window as in ``forward``).

    ``only`` (benchmarks): run just that kernel kind ('dkdv', 'dq', 'fused', 'atomic') to
    time it alone; the other outputs are then left unwritten.
    """
    require_runnable(q)
    if _interpreter_bf16(q):
        grads = backward(
            do.float(), q.float(), k.float(), v.float(), o.float(), lse, causal, softmax_scale,
            window_left, window_right,
        )  # fmt: skip
        return tuple(out_like(t).copy_(g) for t, g in zip((q, k, v), grads))
    dq, dk, dv = out_like(q), out_like(k), out_like(v)
    b, h, n_q, d = q.shape
    n_k = k.shape[2]
    feat = None
    if window_left != -1 or window_right != -1 or k.shape[1] != h:
        feat = features(h, k.shape[1], causal, window_left, window_right, n_q, n_k)
    if b * h == 0 or n_q == 0 or n_k == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    # A non-contiguous dO (e.g. the stride-0 ones of o.sum().backward()) is copied once:
    # the kernels need unit-stride rows to vectorize their loads.
    do, q, k, v, o = (_unit_last_stride(t) for t in (do, q, k, v, o))
    inputs = (q, k, v, do, o, lse)
    key = None
    if q.is_cuda and only is None:
        key = _layout_key(inputs, "bwd", causal, softmax_scale, feat)
    plan = _BWD_SCHEMES.get(key) if key is not None else None
    if plan is None:
        plan = _backward_scheme(q, k, causal, feat)
        if key is not None:
            if len(_BWD_SCHEMES) >= 4096:
                _BWD_SCHEMES.clear()
            _BWD_SCHEMES[key] = plan
    scheme, _, _, packed = plan
    lse_c, lse2, delta, stride_rows = _stats_buffers(lse, n_q, packed)
    if scheme == "atomic":
        dq_acc = torch.zeros((b, h, n_q, C.block_d_for(d)), dtype=torch.float32, device=q.device)

    def launch_jit() -> None:
        _backward_launches(
            do, q, k, v, o, lse_c, lse2, delta, stride_rows, dq, dk, dv,
            dq_acc if scheme == "atomic" else dq, causal, softmax_scale, plan, only, feat,
        )  # fmt: skip

    if scheme == "atomic":  # accumulates into dq_acc: never replayed
        key = None
    outputs = (dq, dk, dv, lse2, delta) + ((lse_c,) if lse_c is not lse else ())
    _launch_planned(key, inputs, outputs, launch_jit)
    if scheme == "atomic":
        dq.copy_(dq_acc[..., :d])
    return dq, dk, dv


# Backward scheme choices by launch-plan key, dropped with the plans.
_BWD_SCHEMES: dict[tuple, tuple[str, str | None, bool, bool]] = {}


def _backward_scheme(
    q: torch.Tensor, k: torch.Tensor, causal: bool, feat: Features | None = None
) -> tuple[str, str | None, bool, bool]:
    """(scheme, the Triton dK/dV kernel kind or None, small dK/dV grid, packed statistics).
    Calls with features (``Features``) take the split backward on full-size tiles."""
    b, h, n_q, d = q.shape
    n_k = k.shape[2]
    block_d, elem = C.block_d_for(d), q.element_size()
    _check_grid(triton_cdiv(max(n_q, n_k), 16), "sequence length", 16)
    if feat is not None:
        packed = _stats_by_tma(q, "dkdv", n_q, n_k, block_d, elem, False, features=True)
        return "split", "dkdv", False, packed
    n_sms = sm_count(q)
    setting = get_options().backward
    scheme = C.resolve_backward_scheme(setting, causal, b * h, n_k, block_d, elem, n_sms)
    kind = {"split": "dkdv", "atomic": "atomic"}.get(scheme)  # the dK/dV kernel's, if Triton's
    small_dkdv = _small_grid(causal, b * h, n_k, n_sms)
    packed = _stats_by_tma(q, kind, n_q, n_k, block_d, elem, small_dkdv)
    return scheme, kind, small_dkdv, packed


def _backward_launches(
    do, q, k, v, o, lse, lse2, delta, stride_rows, dq, dk, dv, dq_target,
    causal: bool, softmax_scale: float, plan: tuple, only: str | None,
    feat: Features | None = None, varlen: Varlen | None = None,
) -> None:  # fmt: skip
    """The backward's kernels through Triton's dispatch (``backward`` allocated every
    buffer; ``dq_target``: dq, or the float32 accumulator of the atomic scheme). ``feat``,
    ``varlen``: the Triton dQ and dK/dV kernels with those features (split scheme only)."""
    scheme, kind, small_dkdv, packed = plan
    b, h, n_q, d = q.shape
    h_kv, n_k = k.shape[1], k.shape[2]
    kern = _kernels()
    block_d = C.block_d_for(d)
    elem = q.element_size()
    n_sms = sm_count(q)
    plain = feat is None and varlen is None
    # Grid rows and tile-fitting lengths: per (batch, head) and the lengths, or for packed
    # sequences per (sequence, head) and the longest ones.
    bh, bh_kv, len_q, len_k = b * h, b * h_kv, n_q, n_k
    if varlen is not None:
        bh, bh_kv, len_q, len_k = varlen.batch * h, varlen.batch * h_kv, varlen.max_q, varlen.max_k
    ragged = varlen is not None
    extra = {} if plain else feature_args(feat, *(varlen[:2] if ragged else ()))

    def preprocess() -> None:  # D = rowsum(dO * O), and L in log2 units
        pre_block = 64
        fastlaunch.launch(
            kern.attn_bwd_preprocess_kernel, (b * h, triton_cdiv(n_q, pre_block)),
            o, do, delta, lse, lse2, *_bhn_strides(o), *_bhn_strides(do), h, n_q,
            lse.shape[-1], stride_rows, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=pre_block,
        )  # fmt: skip

    # The split backward runs its dQ kernel first; up to C.FUSED_DELTA_MAX_D the Triton
    # one computes D (and L in log2 units) itself: one launch fewer. Elsewhere both come
    # from preprocess(). The Triton dK/dV kernel reads L in log2 units (lse2).
    dq_first = scheme == "split" and only in (None, "dq")
    fuse_delta = dq_first and block_d <= C.FUSED_DELTA_MAX_D
    if not fuse_delta and only is None:
        preprocess()
    elif not fuse_delta:  # one kernel timed alone: D's values do not matter, L's do
        delta.zero_()
        lse2.copy_(lse * kern.LOG2E).masked_fill_(lse == float("-inf"), float("inf"))
    common = {
        "Q": q, "K": k, "V": v, "DO": do, "LSE": lse, "DELTA": delta,
        **_strides("q", q, ragged), **_strides("k", k, ragged), **_strides("v", v, ragged),
        **_strides("do", do, ragged),
        "n_heads": h, "n_q": n_q, "n_k": n_k, "stride_stats": lse.shape[-1],
        "qk_scale": softmax_scale * kern.LOG2E, "sm_scale": softmax_scale,
        "SEQ_BUCKET": C.seq_bucket(max(len_q, len_k)), "HEAD_DIM": d, "BLOCK_D": block_d,
        "CAUSAL": causal, "DOT_PRECISION": _dot_precision(q.dtype),
    }  # fmt: skip
    dkdv_out = {
        "DK": dk, "DV": dv, "DQ": dq_target,
        **_strides("dk", dk, ragged), **_strides("dv", dv, ragged),
        **_strides("dq", dq_target, ragged),
        "PADDED_STATS": lse.shape[-1] != n_q, "PACKED_STATS": packed,
    }  # fmt: skip
    if scheme == "fused":

        def grid_fused(cfg):
            n_tiles = max(triton_cdiv(n_k, cfg.block_n), triton_cdiv(n_q, cfg.block_n))
            return (b * h, n_tiles)

        _run(
            "fused", kern.attn_bwd_fused_kernel, grid_fused,
            {**common, **dkdv_out, "stride_rows": stride_rows},
            n_q, n_k, block_d, elem,
        )  # fmt: skip
        return

    if dq_first:
        # Hopper, d = 128: the Gluon kernel (gluon_dq) does dQ when it applies.
        gluon_dq_ran = False
        if plain and q.is_cuda and _gluon_dq().would_run(q, k, v, do, dq):
            if fuse_delta:
                preprocess()  # the Gluon kernel reads D
            gluon_dq_ran = _gluon_dq().run_default(
                q, k, v, do, lse, delta, dq, causal, softmax_scale
            )
        if not gluon_dq_ran:  # (after a failed Gluon compile it recomputes D: the same)

            def grid_queries(cfg):
                return (bh, triton_cdiv(len_q, cfg.block_m))

            dq_args = {
                **common, "LSE2": lse2, "stride_rows": stride_rows, "DQ": dq,
                **_strides("dq", dq, ragged), "Out": o, **_strides("o", o, ragged),
                "FUSE_DELTA": fuse_delta, **PLAIN, **extra,
            }  # fmt: skip
            if ragged:
                dq_args.update(head_group=bh, GROUPED=False)
            else:
                dq_args.update(head_group_args(k, bh, n_k, block_d))
            _run(
                "dq", kern.attn_bwd_dq_kernel, grid_queries, dq_args, len_q, len_k, block_d,
                elem, small_grid=plain and _small_grid(causal, bh, n_q, n_sms), ragged=ragged,
                features=not plain,
            )  # fmt: skip

    def grid_keys(cfg):
        return (bh_kv, triton_cdiv(len_k, cfg.block_n))

    # Hopper, d = 128: the Gluon kernel (gluon_dkdv) does dK, dV when it applies.
    gluon_ran = (
        plain
        and kind == "dkdv"
        and only in (None, kind)
        and q.is_cuda
        and _gluon_dkdv(q, k, v, do, lse2, delta, dk, dv, causal, softmax_scale, lse_log2=True)
    )
    if only in (None, kind) and not gluon_ran:
        dkdv_args = {
            **common, **dkdv_out, "LSE": lse2, "LSE_LOG2": True,
            "ATOMIC_DQ": scheme == "atomic", "n_heads": h_kv, **PLAIN, **extra,
        }  # fmt: skip
        if ragged:
            dkdv_args.update(head_group=bh_kv, GROUPED=False)
        else:
            dkdv_args.update(head_group_args(q, bh_kv, n_q * (h // h_kv), block_d))
        _run(
            kind, kern.attn_bwd_dkdv_kernel, grid_keys, dkdv_args, len_q, len_k, block_d,
            elem, small_grid=small_dkdv, ragged=ragged, features=not plain,
        )  # fmt: skip
