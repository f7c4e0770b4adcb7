"""Tile configurations as data: measured defaults, autotune candidates and their pruning.

Each kernel kind has a default table keyed by padded head dim (the defaults were measured on an
H100; the reasons are in the package's DESIGN.md) and a candidate list for ``triton.autotune``.
Both pass through ``fit_config`` / ``prune_configs``, which clamp tiles to the sequence lengths
and drop configs whose shared-memory estimate exceeds the chip's limit.

The user-facing switches (backward scheme, tile overrides, head groups, ...) live in
``options.Options``; the functions here take their values as arguments and read nothing from
the environment. ``OVERRIDES`` is a programmatic per-kind override table for benchmarks.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, replace

# Shared memory per block on Hopper is 227 KB. The estimate below undercounts what Triton
# allocates (seen with triton 3.6, sm_90: x1.2 for 16-bit tiles, up to x1.6 for float32 with
# tf32x3), so it is scaled by these factors before the comparison.
SMEM_LIMIT_BYTES = 222 * 1024
SMEM_FUDGE = {2: 1.25, 4: 1.7}
# What the limit keeps back from a block's opt-in shared memory (227 KB on Hopper -> 222 KB);
# applied to smaller GPUs' opt-in where a traced graph needs tiles that fit before compiling.
SMEM_RESERVE_BYTES = 5 * 1024
MIN_TILE = 32  # shrinking stops here (sequences shorter than a tile still clamp below it)


@dataclass(frozen=True)
class TileConfig:
    """Tile sizes and launch parameters of one kernel.

    block_m / block_n: query / key tile. For the fused backward, block_n is the dK/dV key tile
    (and the dQ query tile), block_m the query step of the dK/dV loop and block_n2 the key
    step of the dQ loop. ``tma``: the tiles streamed through the main loop (K and V in the
    forward and dQ kernels, Q and dO in the dK/dV kernel) are loaded with Hopper TMA tensor
    descriptors instead of pointer arithmetic (CUDA, compute capability >= 9, 16-byte aligned
    strides; ignored elsewhere). ``ws``: ask Triton to warp-specialize the main (unmasked) loop.
    ``reg``: the split backward's kernels keep their fixed tiles (K and V for dK/dV, Q and dO
    for dQ) in registers as the A operand of the products that read them, instead of
    re-reading them from shared memory on every step. None of the three applies to the fused
    backward; ``reg`` does not apply to the forward. ``maxnreg`` (spec ``r128``): cap the
    registers per thread (ptxas ``.maxnreg``), to fit more programs per SM; 0: no cap.
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    block_n2: int = 0
    tma: bool = False
    ws: bool = False
    reg: bool = False
    maxnreg: int = 0

    def kwargs(self) -> dict[str, int]:
        return {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n}

    @classmethod
    def parse(cls, spec: str) -> TileConfig:
        """'m,n,warps,stages[,n2][,tma][,ws][,reg][,rN]' -> TileConfig, e.g. '128,128,4,3,tma'
        or '32,64,4,3,tma,reg,r128' (rN: at most N registers per thread)."""
        parts = [p.strip().lower() for p in spec.split(",") if p.strip()]
        caps = [p for p in parts if p[:1] == "r" and p[1:].isdigit()]
        flags = {p for p in parts if not p.isdigit() and p not in caps}
        nums = [int(p) for p in parts if p.isdigit()]
        if len(nums) not in (4, 5) or not flags <= {"tma", "ws", "reg"} or len(caps) > 1:
            raise ValueError(
                f"tile config {spec!r}: expected m,n,warps,stages[,n2][,tma][,ws][,reg][,rN]"
            )
        maxnreg = int(caps[0][1:]) if caps else 0
        if caps and not 24 <= maxnreg <= 255:
            raise ValueError(f"tile config {spec!r}: register cap {caps[0]} outside r24..r255")
        return cls(*nums, tma="tma" in flags, ws="ws" in flags, reg="reg" in flags, maxnreg=maxnreg)

    def spec(self) -> str:
        """The inverse of ``parse``."""
        nums = [self.block_m, self.block_n, self.num_warps, self.num_stages]
        nums += [self.block_n2] if self.block_n2 else []
        flags = ["tma"] * self.tma + ["ws"] * self.ws + ["reg"] * self.reg
        flags += [f"r{self.maxnreg}"] * bool(self.maxnreg)
        return ",".join([*map(str, nums), *flags])


# Defaults for 16-bit inputs (kind -> padded head dim -> config), measured on an H100.
# Why each one won is in the package's DESIGN.md.
DEFAULTS: dict[str, dict[int, TileConfig]] = {
    "fwd": {
        16: TileConfig(128, 64, 4, 3),
        32: TileConfig(128, 128, 8, 3),
        64: TileConfig(128, 128, 4, 3, tma=True),
        128: TileConfig(128, 64, 4, 2, tma=True),
    },
    # d = 32, 64: capped at 168 registers (no cap: 231 / 185), three programs per SM instead
    # of two; 1.02-1.05x (d = 32) and 1.01-1.05x (d = 64, against 32,64,4,3 at r128) over
    # the whole backward (H100).
    "dkdv": {
        16: TileConfig(32, 128, 4, 3),
        32: TileConfig(64, 128, 4, 3, maxnreg=168),
        64: TileConfig(64, 64, 4, 3, tma=True, maxnreg=168),
        128: TileConfig(64, 64, 4, 2),
    },
    "dq": {
        16: TileConfig(128, 64, 4, 3),
        32: TileConfig(64, 64, 4, 3),
        # 3 stages since D is computed here (one more tile per stage): 1.00-1.03x over 4 on
        # the whole backward
        64: TileConfig(128, 64, 8, 3, tma=True),
        128: TileConfig(128, 32, 8, 3),
    },
    # Used by "auto" on small grids only, so measured there.
    "fused": {
        16: TileConfig(32, 64, 4, 4, block_n2=64),
        32: TileConfig(32, 64, 4, 4, block_n2=64),
        64: TileConfig(32, 128, 8, 4, block_n2=64),
        128: TileConfig(64, 128, 8, 2, block_n2=32),
    },
}
# The split backward's Triton dQ kernel computes D = rowsum(dO * O) itself (instead of a
# preprocessing launch) up to this padded head dim: whole backward 1.00-1.07x at d = 64 on
# CUDA graphs, but 0.89x at (8, 16, 1024, 128), where the extra O tile costs the d = 128
# dQ kernel more than the launch it saves.
FUSED_DELTA_MAX_D = 64

# Rows of the backward's L and D buffers are padded to a multiple of this (L = +inf, D = 0
# in the padding, ``launch_backward._stats_buffers``) so that the dK/dV loop reads them
# without masks, whose per-tile cost made the backward at ragged lengths up to 1.22x slower.
# Query tiles longer than this (no table or candidate has one) keep the masks.
STATS_ROWS = 256
# The TMA dK/dV kernel also brings each query tile's L (in log2 units) and D by TMA, one bulk
# copy from their packed buffer instead of a per-thread asynchronous copy of every value a
# thread uses (1.05x, then 1.03x packed, on the leaderboard-shape backward).
STATS_TMA = True

# The one-pass backward was only swept at d = 64: its own table.
DEFAULTS["atomic"] = {bd: TileConfig(32, 128, 8, 3) for bd in (16, 32, 64)}
DEFAULTS["atomic"][128] = TileConfig(64, 128, 8, 2)

# Small grids. A causal grid with at most SMALL_GRID_PER_SM programs of
# 128 rows per SM runs in about one wave, so its longest program (the last query tile, or the
# first key tile, twice the average work) sets the time. There the forward and the split
# backward halve their grid-axis tile, and "auto" picks the fused backward, whose program t
# does key tile t and query tile t (equal work per program). d = 128's fused kernel is slower
# per tile, so it takes over only below one program per SM. Measured at 16K-64K tokens only:
# shorter sequences (e.g. a model's 512-token training step) keep the table's tiles and split.
SMALL_GRID_ROWS = 128
SMALL_GRID_PER_SM = 2
SMALL_GRID_MIN_SEQ = 16384
FUSED_GRID_PER_SM = {16: 2, 32: 2, 64: 2, 128: 1}
GRID_TILE = {"fwd": "block_m", "dq": "block_m", "dkdv": "block_n"}  # atomic: not measured

# Under torch.compile, ``traced_compile="auto"`` traces calls of at most this much work,
# B * H * Nq * Nk * d (halved when causal), so that inductor launches their kernels (no
# Python of ours per call) and keeps the opaque ops for larger ones. Traced kernels load by
# pointers and never run the Gluon kernels: on an H100 they took 14-44 us more GPU time per
# forward + backward up to this size (1.08-1.24x), and 14-635 us more above it, while in a
# compiled small model (4 x 12 heads x 1024 x 64, causal) our launchers' Python cost
# 150-280 us per forward + backward, and the step with traced calls was faster than with
# the opaque op in 62 of 72 interleaved cells (flashattn-triton benchmarks/MEASUREMENTS.md,
# "Compiled small step, every setting interleaved in one process (H100)"; DESIGN "Compiled
# graphs that launch our kernels").
TRACED_MAX_WORK = 2**32

# Grids of fewer than FEW_WAVES waves of the table's tile take these entries instead: the
# d = 128 forward's 128-row TMA tile is 1.09-1.33x faster from 512 programs up (H100, 132
# SMs, kernel time) but was 0.59x at 128 programs and 0.75x on a one-wave causal grid in an
# eager A/B.
FEW_PROGRAMS: dict[str, dict[int, TileConfig]] = {"fwd": {128: TileConfig(64, 64, 4, 3)}}
FEW_WAVES = 2

# float32 inputs: smaller tiles (twice the bytes per element, and tf32x3 triples the matrix
# work and registers); chosen to compile without spills where possible (compile_offline.py).
_F32_SMALL = {"fwd": (64, 32), "dkdv": (32, 64), "dq": (64, 32), "fused": (32, 64)}
DEFAULTS_FP32: dict[str, dict[int, TileConfig]] = {
    kind: {
        bd: TileConfig(m, n, 8 if bd == 128 else 4, 2, block_n2=32 if kind == "fused" else 0)
        for bd in (16, 32, 64, 128)
    }
    for kind, (m, n) in _F32_SMALL.items()
}
DEFAULTS_FP32["atomic"] = dict(DEFAULTS_FP32["dkdv"])


# 16-bit calls with features (see ``features``) take these entries where present: the plain
# tables' tiles spill registers there (the windowed forward's extra masked key range, the
# Triton dK/dV kernel's loop over the query heads of a group, the register caps of d = 32
# and 64), e.g. up to 760 bytes of stack for the d = 128 dK/dV kernel. Chosen to compile for
# sm_90 without spills in every feature combination (benchmarks/compile_offline.py). The
# forward takes its entry for windows and packed sequences only: with grouped-query heads
# alone the plain tile compiles with at most an 8-byte stack frame (d = 128; none at d = 64;
# compile_offline.py, Triton 3.9) and ran 1.18-1.22x faster at d = 128 (H200).
FEATURE_DEFAULTS: dict[str, dict[int, TileConfig]] = {
    "fwd": {64: TileConfig(128, 64, 8, 3, tma=True), 128: TileConfig(128, 64, 8, 2, tma=True)},
    "dkdv": {
        32: TileConfig(32, 64, 4, 3, tma=True),
        64: TileConfig(32, 64, 4, 3, tma=True),
        128: TileConfig(32, 128, 8, 3, tma=True),
    },
}


# Per-kind overrides, e.g. set by a benchmark sweeping configs: {"fwd": TileConfig(...)};
# keys "fwd", "dkdv", ... apply to 16-bit inputs, "fwd.fp32", ... to float32 inputs.
OVERRIDES: dict[str, TileConfig] = {}


def overrides_key() -> tuple:
    """The current ``OVERRIDES`` as a hashable value (part of the launch-plan cache key, so
    a benchmark that changes them gets new plans)."""
    return tuple(OVERRIDES.items())


def _candidates(kind: str) -> list[TileConfig]:
    if kind == "fwd":
        grid = itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4))
        return [TileConfig(m, n, w, s) for m, n, w, s in grid]
    if kind in ("dkdv", "atomic"):
        grid = itertools.product((32, 64, 128), (64, 128), (4, 8), (2, 3, 4))
        return [TileConfig(m, n, w, s) for m, n, w, s in grid]
    if kind == "dq":
        grid = itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4))
        return [TileConfig(m, n, w, s) for m, n, w, s in grid]
    if kind == "fused":
        grid = itertools.product((32, 64), (64, 128), (32, 64), (4, 8), (2, 3))
        return [TileConfig(m, n, w, s, block_n2=n2) for m, n, n2, w, s in grid]
    raise ValueError(f"unknown kernel kind {kind!r}")


CANDIDATES: dict[str, list[TileConfig]] = {
    kind: _candidates(kind) for kind in ("fwd", "dkdv", "dq", "fused", "atomic")
}


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def block_d_for(head_dim: int) -> int:
    """Head dim padded to a power of two, at least 16 (the smallest matrix-unit K)."""
    return max(16, next_pow2(head_dim))


def seq_bucket(n: int) -> int:
    """Autotune key for a sequence length: the next power of two, at least 16."""
    return max(16, next_pow2(n))


def smem_bytes(kind: str, cfg: TileConfig, block_d: int, elem_bytes: int) -> int:
    """Rough shared-memory estimate: resident tiles plus pipelined streamed tiles."""
    m, n, st = cfg.block_m, cfg.block_n, max(cfg.num_stages, 1)
    if kind == "fwd":  # Q resident, K and V streamed
        return (m + st * 2 * n) * block_d * elem_bytes
    if kind in ("dkdv", "atomic"):  # K, V resident, Q and dO streamed
        return (2 * n + st * 2 * m) * block_d * elem_bytes
    if kind == "dq":  # Q, dO resident, K and V streamed
        return (2 * m + st * 2 * n) * block_d * elem_bytes
    if kind == "fused":
        dkdv = (2 * n + st * 2 * m) * block_d * elem_bytes
        dq = (2 * n + st * 2 * cfg.block_n2) * block_d * elem_bytes
        return max(dkdv, dq)
    raise ValueError(f"unknown kernel kind {kind!r}")


def _clamp(cfg: TileConfig, kind: str, n_q: int, n_k: int, elem_bytes: int = 2) -> TileConfig:
    """Shrink tiles that exceed the (power-of-two rounded) sequence lengths.

    float32 tiles stay at least 32 wide: on an H100 with triton 3.6, float32 (tf32x3) kernels
    with a 16-wide dK/dV query step or dQ key step and 8 warps hit illegal memory accesses
    (the package's DESIGN.md); a tile longer than the sequence is only masked work.
    """
    floor = MIN_TILE if elem_bytes >= 4 else 16
    bq, bk = max(seq_bucket(n_q), floor), max(seq_bucket(n_k), floor)
    if kind == "fused":
        # block_n tiles both keys (dK/dV) and queries (dQ); block_m steps over queries.
        return replace(
            cfg,
            block_m=min(cfg.block_m, bq),
            block_n=min(cfg.block_n, bq, bk),
            block_n2=min(cfg.block_n2, bk),
        )
    return replace(cfg, block_m=min(cfg.block_m, bq), block_n=min(cfg.block_n, bk))


def fits(
    kind: str, cfg: TileConfig, block_d: int, elem_bytes: int, smem_limit: int = SMEM_LIMIT_BYTES
) -> bool:
    """Whether the estimate (scaled by SMEM_FUDGE) stays within ``smem_limit`` bytes."""
    need = smem_bytes(kind, cfg, block_d, elem_bytes) * SMEM_FUDGE.get(elem_bytes, 1.25)
    return need <= smem_limit


def shrink(kind: str, cfg: TileConfig) -> TileConfig | None:
    """A smaller config (fewer stages, then smaller tiles) or None when nothing is left."""
    if cfg.num_stages > 2:
        return replace(cfg, num_stages=cfg.num_stages - 1)
    if kind in ("dkdv", "atomic", "fused") and cfg.block_m > MIN_TILE:
        return replace(cfg, block_m=cfg.block_m // 2)
    if cfg.block_n > MIN_TILE:
        return replace(cfg, block_n=cfg.block_n // 2)
    if cfg.block_m > MIN_TILE:
        return replace(cfg, block_m=cfg.block_m // 2)
    if kind == "fused" and cfg.block_n2 > MIN_TILE:
        return replace(cfg, block_n2=cfg.block_n2 // 2)
    return None


@functools.lru_cache(maxsize=4096)
def fit_config(
    kind: str,
    cfg: TileConfig,
    n_q: int,
    n_k: int,
    block_d: int,
    elem_bytes: int,
    smem_limit: int = SMEM_LIMIT_BYTES,
) -> TileConfig:
    """Clamp to the sequence lengths, then lower stages and tiles until shared memory fits
    (``smem_limit`` bytes by ``fits``). Cached (a pure function of hashable arguments, asked
    on every launch)."""
    cfg = _clamp(cfg, kind, n_q, n_k, elem_bytes)
    while not fits(kind, cfg, block_d, elem_bytes, smem_limit):
        smaller = shrink(kind, cfg)
        if smaller is None:
            break
        cfg = smaller
    return cfg


@functools.lru_cache(maxsize=16)
def parse_overrides(spec: str) -> dict[str, TileConfig]:
    """Parse "kind=m,n,warps,stages[,n2];..." into {kind: TileConfig}; a kind with the
    suffix ".fp32" (e.g. "fwd.fp32") applies to float32 inputs, a plain kind to 16-bit ones."""
    out: dict[str, TileConfig] = {}
    for item in filter(None, (x.strip() for x in spec.split(";"))):
        kind, _, vals = item.partition("=")
        kind = kind.strip()
        if kind.removesuffix(".fp32") not in (*DEFAULTS, "decode"):
            raise ValueError(f"tile_configs: unknown kind {kind!r} in {item!r}")
        try:
            out[kind] = TileConfig.parse(vals)
        except ValueError as e:
            raise ValueError(f"tile_configs: {e} (in {item!r})") from None
    return out


def _table_key(block_d: int) -> int:
    """The head-dim key of the tables (16, 32, 64 or 128) for a padded head dim."""
    return min(max(block_d, 16), 128)


def small_grid(bh: int, n: int, n_sms: int, per_sm: int = SMALL_GRID_PER_SM) -> bool:
    """Whether bh (batch x heads) sequences of n tokens make a small grid: at most per_sm
    programs of SMALL_GRID_ROWS rows per SM, for n >= SMALL_GRID_MIN_SEQ (the measured
    domain). False when the SM count is unknown (n_sms 0, e.g. under the interpreter)."""
    if n_sms <= 0 or n < SMALL_GRID_MIN_SEQ:
        return False
    return bh * -(-n // SMALL_GRID_ROWS) <= per_sm * n_sms


def few_programs(kind: str, bh: int, n: int, block_d: int, n_sms: int) -> bool:
    """Whether the 16-bit table tile of ``kind`` gives bh * ceil(n / tile) programs, fewer
    than FEW_WAVES per SM, for a kind with a FEW_PROGRAMS entry. False when the SM count is
    unknown (n_sms 0)."""
    key = _table_key(block_d)
    if n_sms <= 0 or key not in FEW_PROGRAMS.get(kind, {}):
        return False
    tile = getattr(DEFAULTS[kind][key], GRID_TILE[kind])
    return bh * -(-n // tile) < FEW_WAVES * n_sms


def for_small_grid(kind: str, cfg: TileConfig) -> TileConfig:
    """Half the grid-axis tile (at 4 warps, pointer loads) where it is 128 or more: twice the
    programs, so a one-wave causal grid spreads its work over the SMs (measured faster for
    every head dim where the tile was 128; 64-wide tiles stay, halving them lost; the halved
    d = 64 forward ran slower with TMA loads)."""
    field = GRID_TILE.get(kind)
    if field is None or getattr(cfg, field) < 128:
        return cfg
    return replace(cfg, **{field: getattr(cfg, field) // 2}, num_warps=4, tma=False)


def default_config(
    kind: str,
    n_q: int,
    n_k: int,
    block_d: int,
    elem_bytes: int,
    small_grid: bool = False,
    few_programs: bool = False,
    tile_configs: str = "",
    features: bool = False,
    smem_limit: int = SMEM_LIMIT_BYTES,
) -> TileConfig:
    """The config used without autotuning: an override (``OVERRIDES``, then the
    ``tile_configs`` spec of ``Options``), else for a call with ``features`` its
    FEATURE_DEFAULTS entry, else the measured table (its FEW_PROGRAMS entry for a grid of
    few programs, see ``few_programs``; adapted to a small grid, see ``for_small_grid``),
    fitted to the sequence lengths and ``smem_limit`` bytes of shared memory."""
    table, key = (DEFAULTS_FP32, kind + ".fp32") if elem_bytes >= 4 else (DEFAULTS, kind)
    cfg = OVERRIDES.get(key) or parse_overrides(tile_configs).get(key)
    if cfg is None and features and elem_bytes < 4:
        cfg = FEATURE_DEFAULTS.get(kind, {}).get(_table_key(block_d))
    if cfg is None:
        cfg = table[kind][_table_key(block_d)]
        if few_programs and elem_bytes < 4:
            cfg = FEW_PROGRAMS.get(kind, {}).get(_table_key(block_d), cfg)
        if small_grid:
            cfg = for_small_grid(kind, cfg)
    return fit_config(kind, cfg, n_q, n_k, block_d, elem_bytes, smem_limit)


def prune_configs(
    kind: str, configs: list[TileConfig], n_q: int, n_k: int, block_d: int, elem_bytes: int
) -> list[TileConfig]:
    """Autotune pruning: fit every candidate, drop duplicates, keep those that fit."""
    out: list[TileConfig] = []
    for cfg in configs:
        c = _clamp(cfg, kind, n_q, n_k, elem_bytes)
        if fits(kind, c, block_d, elem_bytes) and c not in out:
            out.append(c)
    return out or [default_config(kind, n_q, n_k, block_d, elem_bytes)]


def resolve_backward_scheme(
    scheme: str, causal: bool, bh: int, n_k: int, block_d: int, elem_bytes: int, n_sms: int
) -> str:
    """The scheme to run: ``scheme`` (``Options.backward``), or for ``auto`` the fused
    backward where a causal 16-bit grid is small enough (``small_grid`` with
    FUSED_GRID_PER_SM per SM), else split. float32 stays on split: the fused kernel was not
    measured there."""
    if scheme != "auto":
        return scheme
    limit = FUSED_GRID_PER_SM[_table_key(block_d)]
    if causal and elem_bytes == 2 and small_grid(bh, n_k, n_sms, limit):
        return "fused"
    return "split"


# Launch order by head groups (kernels._grouped_program): where the rows each kernel streams
# through its loop (K, V for the forward and dQ; Q, dO for dK/dV), summed over all heads,
# exceed HEAD_GROUP_MIN_L2_MULTIPLE times the L2 cache, programs run a few heads at a time,
# as many as fit in HEAD_GROUP_L2_SHARE of it. Measured on an H100 (50 MB L2): at 512 MB
# streamed 1.07-1.30x backward and 1.06-1.37x forward; at 128 MB mixed (d = 64: 1.03-1.06x
# backward; d = 128 with 3-head groups: 0.95-0.96x); at 64 MB (the leaderboard shape)
# 0.96-0.98x backward. Hence grouping from four times L2 up only.
HEAD_GROUP_L2_SHARE = 0.5
HEAD_GROUP_MIN_L2_MULTIPLE = 4


def head_group(
    n_bh: int, streamed_bytes_per_head: int, l2_bytes: int, setting: str | int = "auto"
) -> int:
    """How many heads' programs run at a time (``n_bh``: the plain order, head fastest).

    ``setting`` (``Options.head_group``): ``auto`` (see HEAD_GROUP_MIN_L2_MULTIPLE; off where
    the L2 size is unknown, e.g. Triton's interpreter), ``off``, or a number of heads."""
    n_bh = max(n_bh, 1)
    if setting == "off":
        return n_bh
    if isinstance(setting, int):
        return min(setting, n_bh)
    if l2_bytes <= 0 or n_bh * streamed_bytes_per_head <= HEAD_GROUP_MIN_L2_MULTIPLE * l2_bytes:
        return n_bh
    fit = int(l2_bytes * HEAD_GROUP_L2_SHARE) // max(streamed_bytes_per_head, 1)
    return max(1, min(n_bh, fit))


# Decode: a forward with at most DECODE_MAX_Q queries (times the q heads per k/v head: at
# most DECODE_MAX_ROWS rows, one tile) against DECODE_MIN_KEYS keys or more runs the split-KV
# kernels (``kernels.attn_fwd_decode_kernel``): one program per (batch, k/v head, key split),
# then a combine kernel. The splits fill whole waves of programs (``decode_splits``): on an
# H200 that took long rows from 1-13% behind SDPA to within 0.6% of it (flashattn-triton
# DESIGN "Decode"). The query and key thresholds are first guesses (flash-attn's are alike).
DECODE_MAX_Q = 16
DECODE_MIN_KEYS = 1024
DECODE_MAX_ROWS = 128
DECODE_MAX_PROGRAMS_PER_SM = 4
# A split count is taken once its waves are this full (flash-attn's rule, stricter).
DECODE_WAVE_EFFICIENCY = 0.95
DECODE_MAX_SPLITS = 128
# Key tile, warps, stages by padded head dim (block_m: the rows, set per call); float32 keys
# tiles of 32.
DECODE_TILES: dict[int, TileConfig] = {
    16: TileConfig(16, 128, 4, 3),
    32: TileConfig(16, 128, 4, 3),
    64: TileConfig(16, 64, 4, 3),
    128: TileConfig(16, 64, 4, 3),
}


def decode_config(rows: int, block_d: int, elem_bytes: int, tile_configs: str = "") -> TileConfig:
    """The decode kernel's tile: ``rows`` (queries x q heads per k/v head) padded to a power
    of two >= 16; keys, warps and stages from an override (``OVERRIDES`` or the
    ``tile_configs`` option, kind "decode" / "decode.fp32"; its block_m is ignored), else
    DECODE_TILES (key tiles of 32 for float32)."""
    key = "decode.fp32" if elem_bytes >= 4 else "decode"
    cfg = OVERRIDES.get(key) or parse_overrides(tile_configs).get(key)
    if cfg is None:
        cfg = DECODE_TILES[_table_key(block_d)]
        if elem_bytes >= 4:
            cfg = replace(cfg, block_n=32)
    return replace(cfg, block_m=max(16, next_pow2(rows)))


def decode_programs_per_sm(cfg: TileConfig, block_d: int, elem_bytes: int, smem: int) -> int:
    """Decode programs of tile ``cfg`` that one SM with ``smem`` bytes of shared memory holds
    at once: each keeps ``num_stages`` K and V tiles in flight (at least 1, at most
    DECODE_MAX_PROGRAMS_PER_SM)."""
    ring = cfg.num_stages * 2 * cfg.block_n * block_d * elem_bytes
    return max(1, min(DECODE_MAX_PROGRAMS_PER_SM, smem // ring))


def decode_splits(bh_kv: int, key_tiles: int, slots: int) -> int:
    """Key splits of the decode kernel for bh_kv (batch x k/v heads) programs per split,
    key_tiles tiles to share and ``slots`` programs the GPU runs at once (SMs x
    ``decode_programs_per_sm``; 0 where unknown, e.g. Triton's interpreter: 3 splits).

    A memory-bound kernel finishes when its last wave does, so the count is the smallest
    whose waves are at least DECODE_WAVE_EFFICIENCY full (e.g. 32 splits of 8 (batch, head)
    programs on 264 slots: 256 programs, one wave); one split where bh_kv alone nearly fills a
    wave. At most one tile per split and DECODE_MAX_SPLITS."""
    top = max(1, min(key_tiles, DECODE_MAX_SPLITS))
    if slots <= 0:
        return min(3, top)
    if bh_kv >= 0.8 * slots:
        return 1

    def fullness(s: int) -> float:
        waves = bh_kv * s / slots
        return waves / -(-waves // 1)

    best = max(fullness(s) for s in range(1, top + 1))
    return next(s for s in range(1, top + 1) if fullness(s) >= DECODE_WAVE_EFFICIENCY * best)
