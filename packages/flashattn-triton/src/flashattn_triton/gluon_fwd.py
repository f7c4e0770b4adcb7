"""The forward on Hopper written in Gluon: two math warpgroups (three at ``block_m`` 192, the
d = 64 default) sharing the K / V tiles that a loader warp streams in (the rules by head
dim: ``DEFAULTS``).

Triton 3.6 waits for each ``tl.dot`` before its result is used, so inside one warpgroup the
exponentials never run while the tensor cores work; the Triton forward relies on two
programs per SM to fill each other's gaps. At head dim 128 a 128-row program already needs
most of the registers for its output tile, so the overlap has to come from within a program.
This kernel follows FlashAttention-3's schedule:

* One program owns 128 query rows of one (batch, head): two warpgroups of 64 rows each
  (``_consume``, one the default partition, one a worker) share the K / V tiles that a loader
  warp (``_produce``) streams into shared memory by TMA, K and V on barriers of their own.
* Within a warpgroup, key tile n goes: issue S[n] = Q K[n]^T and O += P[n-1] V[n-1]; wait for
  S[n] only; softmax of S[n] while P[n-1] V[n-1] still runs; wait for it.
* Optionally (``PINGPONG``, off by default: measured no faster, the hardware already
  interleaves the two warpgroups), a pair of mbarriers hands the tensor cores back and forth
  between the warpgroups: each issues its two products only in its turn.
* At d = 128 from ``min_keys_persistent`` keys (causal: up to ``max_keys_persistent_causal``),
  ``fwd_persistent_kernel`` runs the same warpgroups on a persistent grid, one program per
  SM looping over the tiles, so that the loader fetches a tile's Q and first K / V while the
  warpgroups finish the previous tile.
* ``TMA_STORE`` (the default): each warpgroup writes o into a shared buffer of its own and
  hands it to a TMA store, instead of storing from the accumulator's registers.

q, k, v, o are (B, H, N, d) with any strides whose last is 1 (TMA reads 4-D tiles; rows past
a head's end read as zeros); lse is (B, H, Nq) float32, natural log.
"""

from __future__ import annotations

import torch

from . import fastlaunch
from ._device import head_group_args, sm_count
from .configs import parse_overrides
from .gluon_dkdv import GL_DTYPES, HAVE_GLUON, LOG2E, _desc, launch_order, run_guarded
from .gluon_dkdv import applies as _applies
from .options import get_options

# Measured defaults by head dim (H200, ``benchmarks/gluon_fwd_ab.py``): tiles, stages,
# ping-pong (off: no faster here, the two warpgroups interleave on their own), programs of
# ``head_group`` heads at a time (the K / V rows of few heads stay in L2: 1.02-1.24x over
# the plain order on seven shapes), and the fewest keys from which it runs (below,
# the Triton forward's two programs per SM win: a 128-row program here fills a whole SM, and
# its start, the first loads, is not hidden behind another program's work).
# Query rows per math warpgroup (a program has block_m // WG_ROWS of them).
WG_ROWS = 64
# d = 64: three math warpgroups of 64 rows (192-row programs, 160 registers each, as
# FlashAttention-3), on grids of at least ``min_waves`` = 8 waves of programs (one per SM)
# from 2048 keys. What decides is the grid, not the length: 1 x 16 x 16384 (10.4 waves)
# non-causal 2.30 against 2.52 ms for the Triton forward (cuDNN 2.39), causal 1.19 against
# 1.26; non-causal 4 x 32 x 4096 (21 waves) 1.25 against 1.40 and 8 x 16 x 2048 (10.7) 0.34
# against 0.35; but on grids of 2.6-2.7 waves (1 x 32 x 2048, 1 x 16 x 4096, 1 x 8 x 8192)
# it was 0.5-20% slower, where the Triton forward's tiles run two programs per SM (H200,
# forward alone; raw benchmarks/results/current/h200_d64_fwd_parts_three_warpgroups.json and
# h200_d64_fwd_tiles.json). Below 2048 keys: not measured.
# d = 128: the persistent grid (``fwd_persistent_kernel``, one program per SM) from
# ``min_keys_persistent`` = 512 keys, where its overlap of one tile's start with the previous
# tile's end pays: non-causal at every length (forward GPU time 0.89-0.98x that of the
# forward before it over the sweep's six batch-1 shapes, 512 to 16384 keys; H100, raw
# benchmarks/results/current/h100_gluon_fwd_persistent_d128.json), causal up to
# ``max_keys_persistent_causal`` = 2048 keys with o stored by TMA and the tiles handed out in
# the serpentine order (``serpentine``): 0.93-0.95x the per-tile kernel there, 1.04-1.09x
# beyond, where causal tiles' uneven work ends the static shares unevenly
# (h100_gluon_fwd_causal_persistent.json). ``tma_store``: o through shared memory by TMA,
# 4-13% off the forward at 512-2048 keys on either grid (h100_gluon_fwd_tma_store_d128.json),
# 0.5% at d = 64 on 16 x 16384 (h100_gluon_fwd_tma_store_d64.json). d = 64 on grids under
# ``min_waves`` waves: non-causal from 2048 keys the persistent grid with two math
# warpgroups (``persistent_tiles``) and o by TMA store, 0.96-0.97x the Triton forward at
# 2048-8192 keys (H100, h100_gluon_fwd_persistent_d64_tma.json; without the TMA store it did
# not beat the Triton forward, h100_gluon_fwd_persistent_d64.json); causal: the Triton
# forward (the persistent grid took 1.13x its time at 2048 keys). Below 512 keys at d = 128:
# not measured.
DEFAULTS: dict[int, dict] = {
    128: {
        "block_m": 128, "block_n": 128, "stages": 2, "pingpong": False, "head_group": 4,
        "tma_store": True, "serpentine": True,
        "min_keys": 2048, "min_keys_persistent": 512, "max_keys_persistent_causal": 2048,
    },
    64: {
        "block_m": 192, "block_n": 128, "stages": 2, "pingpong": False, "head_group": 4,
        "consumer_regs": 160, "tma_store": True, "min_keys": 2048, "min_waves": 8,
        "min_keys_persistent": 2048, "max_keys_persistent_causal": 0,
        "persistent_tiles": {"block_m": 128, "consumer_regs": 240},
    },
}  # fmt: skip
# Keys of DEFAULTS that choose where the kernel runs, not how it is launched.
RULES = ("min_keys", "min_keys_persistent", "max_keys_persistent_causal", "min_waves")
# Tiles that replace the per-tile ones on the persistent grid (where a head dim has them).
PERSISTENT_TILES = "persistent_tiles"

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from .gluon_dkdv import _sync_partition, _tma_load, _tma_store
    from .kernels import _grouped_program

    @gluon.jit
    def _load_tile(
        q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, k_empty, v_ready,
        v_empty, b, h, hk, start_m, n_tiles, count, STAGES: gl.constexpr,
        BLOCK_N: gl.constexpr, WG_M: gl.constexpr, NUM_WG: gl.constexpr,
    ):  # fmt: skip
        """One tile's loads: each math warpgroup's rows of the Q tile (q head h), then K and
        V (k/v head hk) of each key tile as soon as every warpgroup has released its stage (a
        fresh barrier counts as released). ``count``: key tiles loaded before these (the
        stages and phases run on across a persistent program's tiles)."""
        mbarrier.expect(q_ready, NUM_WG * q_desc.block_type.nbytes)
        for w in gl.static_range(NUM_WG):
            _tma_load(q_desc, [b, h, start_m + w * WG_M, 0], q_ready, q_smem.index(w))
        for i in range(n_tiles):
            c = count + i
            stage = c % STAGES
            phase = ((c // STAGES) & 1) ^ 1
            row = i * BLOCK_N
            mbarrier.wait(k_empty.index(stage), phase)
            mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
            _tma_load(k_desc, [b, hk, row, 0], k_ready.index(stage), k_smem.index(stage))
            mbarrier.wait(v_empty.index(stage), phase)
            mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
            _tma_load(v_desc, [b, hk, row, 0], v_ready.index(stage), v_smem.index(stage))

    @gluon.jit
    def _produce(
        q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, k_empty, v_ready,
        v_empty, b, h, hk, start_m, n_tiles, STAGES: gl.constexpr, BLOCK_N: gl.constexpr,
        WG_M: gl.constexpr, NUM_WG: gl.constexpr,
    ):  # fmt: skip
        """Loader warp: the program's one tile (``_load_tile``)."""
        _load_tile(
            q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, k_empty, v_ready,
            v_empty, b, h, hk, start_m, n_tiles, 0, STAGES, BLOCK_N, WG_M, NUM_WG,
        )  # fmt: skip

    @gluon.jit
    def _scores_to_p(
        s, m_i, l_i, start_n, offs_m, offs_n, n_k, causal_off, qk_scale, needs_mask,
        CAUSAL: gl.constexpr,
    ):  # fmt: skip
        """Online softmax of one raw score tile (log2 units): P, the factor that rescales the
        running output, the new row max and row sum. Masked tiles set invisible scores to
        -inf; a row that has seen no key keeps m = -inf and P = 0."""
        if needs_mask:
            cols = start_n + offs_n
            keep = (cols < n_k)[None, :]
            if CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None] + causal_off)
            s = gl.where(keep, s * qk_scale, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, 1))
            m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
            p = gl.exp2(s - m_sub[:, None])
            alpha = gl.exp2(m_i - m_sub)
        else:
            m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
            p = gl.exp2(s * qk_scale - m_new[:, None])
            alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, 1)
        return p, alpha, m_new, l_i

    @gluon.jit
    def _turn_wait(turn, k, WG: gl.constexpr, PINGPONG: gl.constexpr):
        """Block until it is warpgroup WG's k-th turn on the tensor cores (WG 0 goes first:
        parity 1 of a fresh barrier has completed)."""
        if PINGPONG:
            if WG == 0:
                mbarrier.wait(turn.index(0), (k & 1) ^ 1)
            else:
                mbarrier.wait(turn.index(1), k & 1)

    @gluon.jit
    def _turn_pass(turn, WG: gl.constexpr, PINGPONG: gl.constexpr):
        """Hand the tensor cores to the other warpgroup."""
        if PINGPONG:
            mbarrier.arrive(turn.index(1 - WG), count=1)

    @gluon.jit
    def _attend_rows(
        q_tile, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, turn, q_empty,
        Out, LSE, o_desc, o_smem, stride_ob, stride_oh, stride_om, b, h, n_heads, row0, n_q,
        n_k, n_tiles, count, causal_off, qk_scale,
        WG: gl.constexpr, WG_M: gl.constexpr, BLOCK_N: gl.constexpr,
        HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
        PINGPONG: gl.constexpr, RELEASE_Q: gl.constexpr, TMA_STORE: gl.constexpr,
    ):  # fmt: skip
        """One math warpgroup's WG_M query rows from row0 over n_tiles key tiles: o and lse
        written. ``count``: how many key tiles the loader streamed before these (stages and
        barrier phases run on across a persistent program's tiles). RELEASE_Q: arrive on
        q_empty once the last score product has read the Q tile. TMA_STORE: o leaves through
        the warpgroup's own ``o_smem`` (1, 1, WG_M, HEAD_DIM) by a TMA store, which the
        caller waits for (``tma.store_wait``) before the program ends; otherwise straight
        from the accumulator's registers."""
        dtype: gl.constexpr = k_smem.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
        )
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
        )
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
        offs_m = row0 + gl.arange(0, WG_M, layout=row_layout)
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        m_i = gl.full([WG_M], float("-inf"), gl.float32, layout=row_layout)
        l_i = gl.zeros([WG_M], gl.float32, layout=row_layout)
        zero_s = gl.zeros([WG_M, BLOCK_N], gl.float32, layout=s_layout)
        acc = gl.zeros([WG_M, HEAD_DIM], gl.float32, layout=o_layout)
        # Key tiles from this one on contain a key that some row of the warpgroup must not
        # see (the causal diagonal): they compute the mask.
        mask_from = row0 + causal_off - BLOCK_N + 1

        # Tile 0: its scores alone.
        _turn_wait(turn, 0, WG, PINGPONG)
        first = count % STAGES
        mbarrier.wait(k_ready.index(first), (count // STAGES) & 1)
        k_tile = k_smem.index(first).reshape([BLOCK_N, HEAD_DIM])
        s_tok = warpgroup_mma(q_tile, k_tile.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        _turn_pass(turn, WG, PINGPONG)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
        mbarrier.arrive(k_empty.index(first), count=1)
        needs_mask = n_k < BLOCK_N
        if CAUSAL:
            needs_mask = needs_mask | (mask_from < 0)
        p, alpha, m_i, l_i = _scores_to_p(
            s, m_i, l_i, 0, offs_m, offs_n, n_k, causal_off, qk_scale, needs_mask, CAUSAL
        )
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        for n in range(1, n_tiles):
            c = count + n
            stage = c % STAGES
            prev = (c - 1) % STAGES
            _turn_wait(turn, n, WG, PINGPONG)
            mbarrier.wait(k_ready.index(stage), (c // STAGES) & 1)
            k_tile = k_smem.index(stage).reshape([BLOCK_N, HEAD_DIM])
            s_tok = warpgroup_mma(
                q_tile, k_tile.permute((1, 0)), zero_s, use_acc=False, is_async=True
            )
            acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
            mbarrier.wait(v_ready.index(prev), ((c - 1) // STAGES) & 1)
            v_tile = v_smem.index(prev).reshape([BLOCK_N, HEAD_DIM])
            acc = warpgroup_mma(p_op, v_tile, acc, is_async=True)
            _turn_pass(turn, WG, PINGPONG)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))
            mbarrier.arrive(k_empty.index(stage), count=1)
            start_n = n * BLOCK_N
            needs_mask = start_n + BLOCK_N > n_k
            if CAUSAL:
                needs_mask = needs_mask | (start_n > mask_from)
            p, alpha, m_i, l_i = _scores_to_p(
                s, m_i, l_i, start_n, offs_m, offs_n, n_k, causal_off, qk_scale, needs_mask,
                CAUSAL,
            )  # fmt: skip
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(v_empty.index(prev), count=1)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
        if RELEASE_Q:  # every score product has completed: the loader may refill Q
            mbarrier.arrive(q_empty, count=1)
        # The last tile's P V.
        last = count + n_tiles - 1
        _turn_wait(turn, n_tiles, WG, PINGPONG)
        acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
        mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
        v_tile = v_smem.index(last % STAGES).reshape([BLOCK_N, HEAD_DIM])
        acc = warpgroup_mma(p_op, v_tile, acc, is_async=True)
        _turn_pass(turn, WG, PINGPONG)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(v_empty.index(last % STAGES), count=1)

        l_safe = gl.where(l_i == 0.0, 1.0, l_i)
        o = acc * gl.convert_layout(1.0 / l_safe, o_rows)[:, None]
        if TMA_STORE:
            # The buffer's previous tile has left (only the issuing thread's wait counts,
            # hence the barrier); rows past the head's end are clipped by the TMA unit.
            tma.store_wait(0)
            _sync_partition()
            o_smem.reshape([WG_M, HEAD_DIM]).store(o.to(dtype))
            fence_async_shared()
            _sync_partition()
            _tma_store(o_desc, [b, h, row0, 0], o_smem)
        else:
            out_rows = row0 + gl.arange(0, WG_M, layout=o_rows)
            out_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
            base = b.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh
            offs = base + out_rows.to(gl.int64)[:, None] * stride_om + out_cols[None, :]
            gl.store(Out + offs, o.to(dtype), mask=(out_rows < n_q)[:, None])
        lse = (m_i + gl.log2(l_i)) * 0.6931471805599453  # -inf for a row that saw no key
        lse_base = (b * n_heads + h).to(gl.int64) * n_q
        gl.store(LSE + lse_base + offs_m, lse, mask=offs_m < n_q)

    @gluon.jit
    def _consume(
        q_smem, k_smem, v_smem, q_ready, k_ready, k_empty, v_ready, v_empty, turn,
        Out, LSE, o_desc, o_smem, stride_ob, stride_oh, stride_om, b, h, n_heads, start_m,
        n_q, n_k, n_tiles, causal_off, qk_scale,
        WG: gl.constexpr, WG_M: gl.constexpr, BLOCK_N: gl.constexpr,
        HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
        PINGPONG: gl.constexpr, TMA_STORE: gl.constexpr,
    ):  # fmt: skip
        """One math warpgroup: rows start_m + WG * WG_M .. + WG_M of the program's tile."""
        q_tile = q_smem.index(WG).reshape([WG_M, HEAD_DIM])
        mbarrier.wait(q_ready, 0)
        _attend_rows(
            q_tile, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, turn, q_ready,
            Out, LSE, o_desc, o_smem.index(WG), stride_ob, stride_oh, stride_om, b, h,
            n_heads, start_m + WG * WG_M, n_q, n_k, n_tiles, 0, causal_off, qk_scale,
            WG, WG_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, PINGPONG, False, TMA_STORE,
        )  # fmt: skip
        if TMA_STORE:
            tma.store_wait(0)

    @gluon.jit
    def fwd_kernel(
        q_desc, k_desc, v_desc, o_desc, Out, LSE, stride_ob, stride_oh, stride_om, n_heads, n_q,
        n_k, qk_scale, kv_group, head_group,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
        STAGES: gl.constexpr, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, GROUPED: gl.constexpr, TMA_STORE: gl.constexpr,
        num_warps: gl.constexpr,
    ):  # fmt: skip
        """One program: BLOCK_M query rows of one (batch, head), 64 per math warpgroup (two,
        or three at BLOCK_M = 192); heaviest tiles first, with GROUPED head_group heads at a
        time (``kernels._grouped_program``)."""
        gl.static_assert(num_warps == 4, "the default partition is one math warpgroup")
        gl.static_assert(BLOCK_M == 128 or BLOCK_M == 192, "two or three math warpgroups")
        WG_M: gl.constexpr = 64
        NUM_WG: gl.constexpr = BLOCK_M // WG_M
        gl.static_assert(NUM_WG == 2 or not PINGPONG, "ping-pong pairs two warpgroups")
        pid_bh, tile = _grouped_program(head_group, GROUPED)
        b = pid_bh // n_heads
        h = pid_bh % n_heads
        hk = h // kv_group  # grouped-query heads: the k/v head this q head reads
        start_m = (gl.num_programs(1) - 1 - tile) * BLOCK_M
        dtype: gl.constexpr = q_desc.dtype
        causal_off = n_k - n_q
        if CAUSAL:
            hi = gl.maximum(gl.minimum(n_k, start_m + BLOCK_M + causal_off), 0)
        else:
            hi = n_k
        # At least one tile: a tile where no row sees a key comes out fully masked (o = 0).
        n_tiles = gl.maximum(gl.cdiv(hi, BLOCK_N), 1)

        q_smem = gl.allocate_shared_memory(dtype, [NUM_WG, 1, 1, WG_M, HEAD_DIM], q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, HEAD_DIM], v_desc.layout)
        if TMA_STORE:  # each math warpgroup's o on its way out
            o_smem = gl.allocate_shared_memory(dtype, [NUM_WG, 1, 1, WG_M, HEAD_DIM], o_desc.layout)
        else:
            o_smem = q_smem  # not used: o leaves from registers
        bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
        q_ready = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
        mbarrier.init(q_ready, count=1)
        for st in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(st), count=1)
            mbarrier.init(v_ready.index(st), count=1)
            mbarrier.init(k_empty.index(st), count=NUM_WG)  # every warpgroup releases a stage
            mbarrier.init(v_empty.index(st), count=NUM_WG)
        mbarrier.init(turn.index(0), count=1)
        mbarrier.init(turn.index(1), count=1)

        # The partitions: the math warpgroups (the first is the default partition), then the
        # loader warp; written out per warpgroup count (a partition list is a literal, and an
        # argument tuple built once and extended per warpgroup loses its constexprs).
        if NUM_WG == 2:
            gl.warp_specialize(
                [
                (
                    _consume,
                    (
                        q_smem, k_smem, v_smem, q_ready, k_ready, k_empty, v_ready, v_empty,
                        turn, Out, LSE, o_desc, o_smem, stride_ob, stride_oh, stride_om, b,
                        h, n_heads, start_m, n_q, n_k, n_tiles, causal_off, qk_scale, 0, WG_M,
                        BLOCK_N, HEAD_DIM, STAGES, CAUSAL, PINGPONG, TMA_STORE,
                    ),
                ),
                (
                    _consume,
                    (
                        q_smem, k_smem, v_smem, q_ready, k_ready, k_empty, v_ready, v_empty,
                        turn, Out, LSE, o_desc, o_smem, stride_ob, stride_oh, stride_om, b,
                        h, n_heads, start_m, n_q, n_k, n_tiles, causal_off, qk_scale, 1, WG_M,
                        BLOCK_N, HEAD_DIM, STAGES, CAUSAL, PINGPONG, TMA_STORE,
                    ),
                ),
                (
                    _produce,
                    (
                        q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready,
                        k_empty, v_ready, v_empty, b, h, hk, start_m, n_tiles, STAGES, BLOCK_N,
                        WG_M, NUM_WG,
                    ),
                ),
                ],
                [4, 1],
                [CONSUMER_REGS, 24],
            )  # fmt: skip
        else:
            gl.warp_specialize(
                [
                (
                    _consume,
                    (
                        q_smem, k_smem, v_smem, q_ready, k_ready, k_empty, v_ready, v_empty,
                        turn, Out, LSE, o_desc, o_smem, stride_ob, stride_oh, stride_om, b,
                        h, n_heads, start_m, n_q, n_k, n_tiles, causal_off, qk_scale, 0, WG_M,
                        BLOCK_N, HEAD_DIM, STAGES, CAUSAL, PINGPONG, TMA_STORE,
                    ),
                ),
                (
                    _consume,
                    (
                        q_smem, k_smem, v_smem, q_ready, k_ready, k_empty, v_ready, v_empty,
                        turn, Out, LSE, o_desc, o_smem, stride_ob, stride_oh, stride_om, b,
                        h, n_heads, start_m, n_q, n_k, n_tiles, causal_off, qk_scale, 1, WG_M,
                        BLOCK_N, HEAD_DIM, STAGES, CAUSAL, PINGPONG, TMA_STORE,
                    ),
                ),
                (
                    _consume,
                    (
                        q_smem, k_smem, v_smem, q_ready, k_ready, k_empty, v_ready, v_empty,
                        turn, Out, LSE, o_desc, o_smem, stride_ob, stride_oh, stride_om, b,
                        h, n_heads, start_m, n_q, n_k, n_tiles, causal_off, qk_scale, 2, WG_M,
                        BLOCK_N, HEAD_DIM, STAGES, CAUSAL, PINGPONG, TMA_STORE,
                    ),
                ),
                (
                    _produce,
                    (
                        q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready,
                        k_empty, v_ready, v_empty, b, h, hk, start_m, n_tiles, STAGES, BLOCK_N,
                        WG_M, NUM_WG,
                    ),
                ),
                ],
                [4, 4, 1],
                [CONSUMER_REGS, CONSUMER_REGS, 24],
            )  # fmt: skip
        mbarrier.invalidate(q_ready)
        for st in gl.static_range(STAGES):
            mbarrier.invalidate(k_ready.index(st))
            mbarrier.invalidate(v_ready.index(st))
            mbarrier.invalidate(k_empty.index(st))
            mbarrier.invalidate(v_empty.index(st))
        mbarrier.invalidate(turn.index(0))
        mbarrier.invalidate(turn.index(1))

    @gluon.jit
    def _tile_coords(
        t, n_m, total, n_heads, kv_group, n_q, n_k,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
        SERPENTINE: gl.constexpr,
    ):  # fmt: skip
        """Tile t of a persistent grid: (batch, q head, k/v head, first query row, key
        tiles). Non-causal: the n_m query tiles of one head in a row (their K / V rows stay
        in L2); causal: every head's heaviest tile first, then the next heaviest, so that the
        programs' shares of work even out. SERPENTINE (causal): every other full round of
        tiles goes to the programs in reverse, so that the program that took a round's
        heaviest tile takes the next round's lightest."""
        if CAUSAL and SERPENTINE:
            grid = gl.num_programs(0)
            rnd = t // grid
            if (rnd % 2 == 1) & ((rnd + 1) * grid <= total):
                t = rnd * grid + (grid - 1 - (t - rnd * grid))
        if CAUSAL:
            n_bh = total // n_m
            pid_bh = t % n_bh
            start_m = (n_m - 1 - t // n_bh) * BLOCK_M
            hi = gl.maximum(gl.minimum(n_k, start_m + BLOCK_M + n_k - n_q), 0)
        else:
            pid_bh = t // n_m
            start_m = (n_m - 1 - t % n_m) * BLOCK_M
            hi = n_k
        h = pid_bh % n_heads
        return pid_bh // n_heads, h, h // kv_group, start_m, gl.maximum(gl.cdiv(hi, BLOCK_N), 1)

    @gluon.jit
    def _produce_tiles(
        q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty,
        v_ready, v_empty, n_heads, kv_group, n_q, n_k, n_m, total,
        STAGES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        WG_M: gl.constexpr, NUM_WG: gl.constexpr, CAUSAL: gl.constexpr,
        SERPENTINE: gl.constexpr,
    ):  # fmt: skip
        """Loader warp of a persistent program: for each of its tiles, the Q rows once the
        math warpgroups have released the previous ones, then K and V of each key tile into
        the stages, whose count runs on across tiles."""
        count = gl.program_id(0) * 0
        j = gl.program_id(0) * 0
        for t in range(gl.program_id(0), total, gl.num_programs(0)):
            b, h, hk, start_m, n_tiles = _tile_coords(
                t, n_m, total, n_heads, kv_group, n_q, n_k, BLOCK_M, BLOCK_N, CAUSAL, SERPENTINE
            )
            mbarrier.wait(q_empty, (j & 1) ^ 1)
            _load_tile(
                q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, k_empty,
                v_ready, v_empty, b, h, hk, start_m, n_tiles, count, STAGES, BLOCK_N, WG_M,
                NUM_WG,
            )  # fmt: skip
            count += n_tiles
            j += 1

    @gluon.jit
    def _consume_tiles(
        q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty,
        Out, LSE, o_desc, o_smem, stride_ob, stride_oh, stride_om, n_heads, kv_group, n_q,
        n_k, n_m, total, qk_scale,
        WG: gl.constexpr, WG_M: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
        TMA_STORE: gl.constexpr, SERPENTINE: gl.constexpr,
    ):  # fmt: skip
        """One math warpgroup of a persistent program: its rows of each of the program's
        tiles in turn."""
        q_tile = q_smem.index(WG).reshape([WG_M, HEAD_DIM])
        count = gl.program_id(0) * 0
        j = gl.program_id(0) * 0
        for t in range(gl.program_id(0), total, gl.num_programs(0)):
            b, h, _, start_m, n_tiles = _tile_coords(
                t, n_m, total, n_heads, kv_group, n_q, n_k, BLOCK_M, BLOCK_N, CAUSAL, SERPENTINE
            )
            mbarrier.wait(q_ready, j & 1)
            # (no ping-pong here: q_empty also fills the unused turn-barrier slot)
            _attend_rows(
                q_tile, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, q_empty, q_empty,
                Out, LSE, o_desc, o_smem.index(WG), stride_ob, stride_oh, stride_om, b, h,
                n_heads, start_m + WG * WG_M, n_q, n_k, n_tiles, count, n_k - n_q, qk_scale,
                WG, WG_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, False, True, TMA_STORE,
            )  # fmt: skip
            count += n_tiles
            j += 1
        if TMA_STORE:
            tma.store_wait(0)

    @gluon.jit
    def fwd_persistent_kernel(
        q_desc, k_desc, v_desc, o_desc, Out, LSE, stride_ob, stride_oh, stride_om, n_heads, n_q,
        n_k, qk_scale, kv_group, n_m, total,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
        STAGES: gl.constexpr, CAUSAL: gl.constexpr, CONSUMER_REGS: gl.constexpr,
        TMA_STORE: gl.constexpr, SERPENTINE: gl.constexpr, num_warps: gl.constexpr,
    ):  # fmt: skip
        """``fwd_kernel`` on a persistent grid: each program takes tiles pid, pid + grid, ...
        of the ``total`` (B * H * n_m) tiles, so the loader fetches a tile's Q and first
        K / V while the math warpgroups still finish the previous tile (its last P V and the
        stores), which a fresh program of a short row cannot overlap."""
        gl.static_assert(num_warps == 4, "the default partition is one math warpgroup")
        gl.static_assert(BLOCK_M == 128 or BLOCK_M == 192, "two or three math warpgroups")
        WG_M: gl.constexpr = 64
        NUM_WG: gl.constexpr = BLOCK_M // WG_M
        dtype: gl.constexpr = q_desc.dtype
        q_smem = gl.allocate_shared_memory(dtype, [NUM_WG, 1, 1, WG_M, HEAD_DIM], q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, HEAD_DIM], v_desc.layout)
        if TMA_STORE:  # each math warpgroup's o on its way out
            o_smem = gl.allocate_shared_memory(dtype, [NUM_WG, 1, 1, WG_M, HEAD_DIM], o_desc.layout)
        else:
            o_smem = q_smem  # not used: o leaves from registers
        bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
        q_ready = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
        q_empty = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
        mbarrier.init(q_ready, count=1)
        mbarrier.init(q_empty, count=NUM_WG)
        for st in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(st), count=1)
            mbarrier.init(v_ready.index(st), count=1)
            mbarrier.init(k_empty.index(st), count=NUM_WG)
            mbarrier.init(v_empty.index(st), count=NUM_WG)

        # The partitions, written out per warpgroup count as in ``fwd_kernel``.
        if NUM_WG == 2:
            gl.warp_specialize(
                [
                (
                    _consume_tiles,
                    (
                        q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                        v_empty, Out, LSE, o_desc, o_smem, stride_ob, stride_oh, stride_om,
                        n_heads, kv_group, n_q, n_k, n_m, total, qk_scale, 0, WG_M, BLOCK_M,
                        BLOCK_N, HEAD_DIM, STAGES, CAUSAL, TMA_STORE, SERPENTINE,
                    ),
                ),
                (
                    _consume_tiles,
                    (
                        q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                        v_empty, Out, LSE, o_desc, o_smem, stride_ob, stride_oh, stride_om,
                        n_heads, kv_group, n_q, n_k, n_m, total, qk_scale, 1, WG_M, BLOCK_M,
                        BLOCK_N, HEAD_DIM, STAGES, CAUSAL, TMA_STORE, SERPENTINE,
                    ),
                ),
                (
                    _produce_tiles,
                    (
                        q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty,
                        k_ready, k_empty, v_ready, v_empty, n_heads, kv_group, n_q, n_k, n_m,
                        total, STAGES, BLOCK_M, BLOCK_N, WG_M, NUM_WG, CAUSAL, SERPENTINE,
                    ),
                ),
                ],
                [4, 1],
                [CONSUMER_REGS, 24],
            )  # fmt: skip
        else:
            gl.warp_specialize(
                [
                (
                    _consume_tiles,
                    (
                        q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                        v_empty, Out, LSE, o_desc, o_smem, stride_ob, stride_oh, stride_om,
                        n_heads, kv_group, n_q, n_k, n_m, total, qk_scale, 0, WG_M, BLOCK_M,
                        BLOCK_N, HEAD_DIM, STAGES, CAUSAL, TMA_STORE, SERPENTINE,
                    ),
                ),
                (
                    _consume_tiles,
                    (
                        q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                        v_empty, Out, LSE, o_desc, o_smem, stride_ob, stride_oh, stride_om,
                        n_heads, kv_group, n_q, n_k, n_m, total, qk_scale, 1, WG_M, BLOCK_M,
                        BLOCK_N, HEAD_DIM, STAGES, CAUSAL, TMA_STORE, SERPENTINE,
                    ),
                ),
                (
                    _consume_tiles,
                    (
                        q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                        v_empty, Out, LSE, o_desc, o_smem, stride_ob, stride_oh, stride_om,
                        n_heads, kv_group, n_q, n_k, n_m, total, qk_scale, 2, WG_M, BLOCK_M,
                        BLOCK_N, HEAD_DIM, STAGES, CAUSAL, TMA_STORE, SERPENTINE,
                    ),
                ),
                (
                    _produce_tiles,
                    (
                        q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty,
                        k_ready, k_empty, v_ready, v_empty, n_heads, kv_group, n_q, n_k, n_m,
                        total, STAGES, BLOCK_M, BLOCK_N, WG_M, NUM_WG, CAUSAL, SERPENTINE,
                    ),
                ),
                ],
                [4, 4, 1],
                [CONSUMER_REGS, CONSUMER_REGS, 24],
            )  # fmt: skip
        mbarrier.invalidate(q_ready)
        mbarrier.invalidate(q_empty)
        for st in gl.static_range(STAGES):
            mbarrier.invalidate(k_ready.index(st))
            mbarrier.invalidate(v_ready.index(st))
            mbarrier.invalidate(k_empty.index(st))
            mbarrier.invalidate(v_empty.index(st))


def launch_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    *,
    block_m: int = 128,
    block_n: int = 128,
    stages: int = 2,
    pingpong: bool = False,
    consumer_regs: int = 240,
    head_group: int = 0,
    persistent: int = 0,
    tma_store: bool = False,
    serpentine: bool = False,
) -> None:
    """Write o (B, H, Nq, d) and lse (B, H, Nq) float32 (natural log) of 16-bit q
    (B, H, Nq, d), k, v (B, Hkv, Nk, d), Hkv dividing H (grouped-query heads), in the layouts
    ``applies`` accepts. Checks nothing: ``try_fwd`` is the gated entry point; this one is for
    benchmarks that pick their own tiles. ``block_m`` 192: three math warpgroups (as
    FlashAttention-3 at d = 64; ``consumer_regs`` 160 fits them without spills).
    ``head_group``: programs of that many heads at a time (``kernels._grouped_program``); 0:
    the plain order. ``persistent``: that many programs (at most one per tile) loop over the
    tiles (``fwd_persistent_kernel``; no ping-pong, heads in the plain order); 0: one program
    per tile. ``tma_store``: o leaves through shared memory by TMA stores (o's layout must be
    TMA-readable, as ``applies`` checks) instead of from the registers. ``serpentine``
    (persistent, causal): every other round of tiles is handed to the programs in reverse
    (``_tile_coords``)."""
    if not HAVE_GLUON:
        raise RuntimeError("gluon_fwd needs triton.experimental.gluon (Triton >= 3.5)")
    if q.dtype not in GL_DTYPES:
        raise ValueError(f"q must be float16 or bfloat16, got {q.dtype}")
    if block_m not in (128, 192):
        raise ValueError(
            f"block_m must be 128 or 192 (two or three warpgroups of 64 rows), got {block_m}"
        )
    if block_n not in (64, 128):
        raise ValueError(f"block_n must be 64 or 128, got {block_n}")
    if isinstance(persistent, bool) or not isinstance(persistent, int) or persistent < 0:
        raise ValueError(f"persistent must be a count of programs >= 0, got {persistent!r}")
    for name, flag in (("tma_store", tma_store), ("serpentine", serpentine)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be True or False, got {flag!r}")
    b, h, n_q, d = q.shape
    n_k = k.shape[2]
    n_m = -(-n_q // block_m)
    q_desc = _desc(q, WG_ROWS)
    o_desc = _desc(o, WG_ROWS) if tma_store else q_desc  # q_desc: a placeholder, not read
    if persistent:
        if pingpong:
            raise ValueError("pingpong needs one program per tile (persistent=0)")
        fastlaunch.launch(
            fwd_persistent_kernel, (min(persistent, b * h * n_m),),
            q_desc, _desc(k, block_n), _desc(v, block_n), o_desc, o, lse,
            o.stride(0), o.stride(1), o.stride(2), h, n_q, n_k, softmax_scale * LOG2E,
            h // k.shape[1], n_m, b * h * n_m,
            BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=d, STAGES=stages, CAUSAL=causal,
            CONSUMER_REGS=consumer_regs, TMA_STORE=tma_store, SERPENTINE=serpentine,
            num_warps=4,
        )  # fmt: skip
        return
    group, grouped = launch_order(head_group, b * h)
    fastlaunch.launch(
        fwd_kernel, (b * h, -(-n_q // block_m)),
        q_desc, _desc(k, block_n), _desc(v, block_n), o_desc, o, lse,
        o.stride(0), o.stride(1), o.stride(2), h, n_q, n_k, softmax_scale * LOG2E,
        h // k.shape[1], group,
        BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=d, STAGES=stages, CAUSAL=causal,
        PINGPONG=pingpong, CONSUMER_REGS=consumer_regs, GROUPED=grouped, TMA_STORE=tma_store,
        num_warps=4,
    )  # fmt: skip


def try_fwd(q, k, v, o, lse, causal: bool, softmax_scale: float) -> bool:
    """Run the Gluon forward where it applies: the Gluon kernels apply
    (``gluon_dkdv.applies``: Hopper, 16-bit, TMA-readable layouts), the head dim has
    ``DEFAULTS`` and at least its ``min_keys`` keys (and, where it has ``min_waves``, a grid
    of that many waves of one program per SM), or its ``min_keys_persistent`` (then on the
    persistent grid, with its ``persistent_tiles`` if any, and, where the head dim has
    ``min_waves``, only on grids that the per-tile rule leaves; causal: up to
    ``max_keys_persistent_causal`` keys, and only where the
    heads' K / V rows fit the L2 rule that would otherwise launch heads in groups,
    ``configs.head_group``), and no forward tiles are asked for
    (``Options.tile_configs`` with a ``fwd`` entry, or ``autotune``). False if the caller
    should run the Triton forward (also after a failed first compile,
    ``gluon_dkdv.run_guarded``)."""
    d = q.shape[-1]
    cfg = DEFAULTS.get(d)
    if cfg is None:
        return False
    n_k = k.shape[2]
    persistent = n_k >= cfg.get("min_keys_persistent", float("inf")) and (
        not causal or n_k <= cfg.get("max_keys_persistent_causal", 0)
    )
    if not persistent and n_k < cfg["min_keys"]:
        return False
    if not _applies(q, k, v, o, defaults=DEFAULTS):
        return False
    opts = get_options()
    if opts.autotune or "fwd" in parse_overrides(opts.tile_configs):
        return False  # the caller asked for the Triton forward's tiles: it gets them
    b, h, n_q = q.shape[:3]
    if persistent and causal and head_group_args(k, b * h, n_k, d)["head_group"] < b * h:
        # Causal tiles go heaviest first across every head, so the concurrent programs read
        # every head's K / V; where those overflow L2 (or the option groups heads), the
        # per-tile grid (or the Triton forward) launches heads in groups instead.
        persistent = False
        if n_k < cfg["min_keys"]:
            return False
    min_waves = cfg.get("min_waves")
    if min_waves:  # programs (one per SM at a time) against waves of the GPU's SMs
        many_waves = b * h * -(-n_q // cfg["block_m"]) >= min_waves * sm_count(q)
        if many_waves and n_k >= cfg["min_keys"]:
            persistent = False  # a grid of many waves: one program per tile
        elif not persistent:
            return False
    tiles = {name: value for name, value in cfg.items() if name not in RULES}
    persistent_tiles = tiles.pop(PERSISTENT_TILES, {})
    if persistent:  # one program per SM, looping over the tiles in its own order
        tiles.update(persistent_tiles, persistent=sm_count(q))
        tiles.pop("head_group", None)
    else:
        tiles.pop("serpentine", None)
        if opts.head_group != "auto":  # "off" or a number of heads, as for every kernel
            tiles["head_group"] = head_group_args(k, b * h, n_k, d)["head_group"]
    return run_guarded(
        "forward",
        (d, q.dtype, causal, k.shape[1] != h, persistent),
        lambda: launch_fwd(q, k, v, o, lse, causal, softmax_scale, **tiles),
    )
