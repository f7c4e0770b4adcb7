"""What every launcher shares: output buffers, kernel arguments and ``_run``, the launch of
one kernel with its tiles.

``_run`` starts a Triton kernel with the default (fitted) tile config of ``configs``,
retrying smaller configs where the device lacks the shared memory a config needs, or
through ``triton.autotune`` when ``Options.autotune`` is on; ``_stream_args`` adds a
config's TMA descriptors and loop flags. The forward (``launch``), the backward
(``launch_backward``) and the packed launchers (``launch_varlen``) import these helpers by
name: a call looks each up as one module global, with no module attribute on top (the
launchers' host cost is counted in microseconds, see ``launch_plans``).
"""

from __future__ import annotations

import functools

import torch

from . import configs as C
from . import fastlaunch
from ._device import interpreting, smem_limit, tma_usable
from ._device import kernels as _kernels
from .options import get_options

MAX_GRID_Y = 65535


def out_like(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An uninitialized tensor shaped like t with a unit last stride (keeps t's layout when
    t is dense with a unit last stride, e.g. a (B, N, H, d) buffer seen as (B, H, N, d)).
    The fake (meta) implementations use the same rule so strides match under compile."""
    if t.stride(-1) == 1:
        return torch.empty_like(t, dtype=dtype)
    return torch.empty(t.shape, dtype=dtype or t.dtype, device=t.device)


# Buffers in one float32 workspace start at multiples of this many elements (128 bytes).
WORKSPACE_ALIGN = 32


@functools.lru_cache(maxsize=1024)
def workspace_layout(shapes: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], int]:
    """Element offsets of float32 buffers of ``shapes`` placed one after another in one
    workspace, each from a 128-byte boundary, and the workspace's length: a split decode
    call's two scratch buffers take one allocation (allocations were a quarter of a decode
    call's launcher time on an H200 host). The outputs stay allocations of their own, so that
    nothing a caller keeps holds the scratch."""
    offsets, total = [], 0
    for shape in shapes:
        offsets.append(total)
        numel = 1
        for n in shape:
            numel *= n
        total += -(-numel // WORKSPACE_ALIGN) * WORKSPACE_ALIGN
    return tuple(offsets), max(total, 1)


def workspace_views(
    shapes: tuple[tuple[int, ...], ...],
    device: torch.device,
    layout: tuple[tuple[int, ...], int] | None = None,
) -> tuple[torch.Tensor, ...]:
    """Contiguous float32 tensors of ``shapes`` in one allocation at ``layout``
    (``workspace_layout(shapes)``, worked out here unless the caller has it). While traced
    for torch.compile, one allocation each: a compiled graph turns a kernel's writes into
    views of one buffer into copies of the views scattered back into it."""
    if fastlaunch.tracing():
        return tuple(torch.empty(shape, dtype=torch.float32, device=device) for shape in shapes)
    offsets, total = workspace_layout(shapes) if layout is None else layout
    ws = torch.empty(total, dtype=torch.float32, device=device)
    return tuple(
        ws.as_strided(shape, _contiguous_strides(shape), offset)
        for shape, offset in zip(shapes, offsets)
    )


@functools.lru_cache(maxsize=1024)
def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


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
    A launch traced for torch.compile is compiled later, by inductor, where no retry is
    possible: its tiles are fitted to the device's shared memory (``smem_limit``) first.
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

    limit = C.SMEM_LIMIT_BYTES
    if fastlaunch.tracing():
        limit = smem_limit(next(t for t in args.values() if isinstance(t, torch.Tensor)))
    first = C.default_config(
        kind,
        n_q,
        n_k,
        block_d,
        elem,
        small_grid,
        few_programs,
        opts.tile_configs,
        features,
        limit,
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


def append_kv(
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seqlens: torch.Tensor,
) -> None:
    """Store k_new, v_new (B, Hkv, n_new, d) into the caches (B, Hkv, S, d) from row
    seqlens[b] on (``kv_append_kernel``: one launch for both; rows past S are dropped). The
    new rows must have a unit last stride; the caches' last stride is 1 (checked)."""
    b, h_kv, n_new, d = k_new.shape
    block_d = C.block_d_for(d)
    block_n = min(64, max(16, C.next_pow2(n_new)))
    fastlaunch.launch(
        _kernels().kv_append_kernel, (b * h_kv, triton_cdiv(n_new, block_n)),
        k_new, v_new, k_cache, v_cache, seqlens,
        *_bhn_strides(k_new), *_bhn_strides(v_new), *_bhn_strides(k_cache),
        *_bhn_strides(v_cache), h_kv, n_new, k_cache.shape[2],
        HEAD_DIM=d, BLOCK_D=block_d, BLOCK_N=block_n, num_warps=4 if block_d >= 128 else 2,
    )  # fmt: skip


def _interpreter_bf16(t: torch.Tensor) -> bool:
    """Triton's interpreter multiplies bfloat16 matrices wrongly (seen with triton 3.6 and
    3.9): there, run bfloat16 inputs through the float32 kernels and round the results."""
    return t.dtype == torch.bfloat16 and t.device.type == "cpu" and interpreting()


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
