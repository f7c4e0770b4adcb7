"""The d = 128 backward kernels with FlashAttention-3's layout: two math warpgroups per
program sharing the tiles a loader warp streams in (``gl.warp_specialize``).

``gluon_dkdv`` and ``gluon_dq`` run one warpgroup per program and issue their own TMA loads,
two programs per SM hiding each other's waits. Here a program owns twice the rows and
splits them between two warpgroups (each running the same per-tile schedule as those
kernels), so each streamed tile is loaded once for both, and a one-warp loader partition
keeps the ring full without the math warps ever waiting on a load they issued:

* dK / dV (``dkdv_kernel``): 2 x 64 keys of one (batch, k/v head); Q, dO and each query
  tile's log-sum-exp / delta rows stream (64 queries a tile); per tile each warpgroup runs
  ``gluon_dkdv._consume``'s schedule on its 64 keys.
* dQ (``dq_kernel``): 2 x 64 query rows of one (batch, head); K and V stream; per key tile:
  issue S = Q K^T and dP = dO V^T, wait for S, P = exp2(S - lse) while dP runs, wait for dP,
  issue dQ += dS K.

A stage of the ring is released (its mbarrier counts two arrivals) once both warpgroups'
products that read it have retired. Inputs and layouts are those of ``gluon_dkdv``; the
row statistics must be readable by TMA (``gluon_dkdv.rows_by_tma``) for dK / dV.
"""

from __future__ import annotations

import torch

from . import fastlaunch
from .gluon_dkdv import HAVE_GLUON, LOG2E, _desc, _flat_desc, launch_order

# Defaults by head dim (used by ``gluon_dkdv.try_dkdv`` and ``gluon_dq.run_default`` in place
# of their one-warpgroup kernels; an empty table turns them off). consumer_regs: registers
# of each math warpgroup (setmaxnreg). dQ runs from min_keys keys.
DKDV_DEFAULTS: dict[int, dict] = {
    128: {"block_m": 64, "block_n": 128, "stages": 2, "consumer_regs": 240},
}
DQ_DEFAULTS: dict[int, dict] = {
    128: {"block_m": 128, "block_n": 64, "stages": 2, "consumer_regs": 240, "min_keys": 2048},
}

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_init,
        warpgroup_mma_wait,
    )

    from .gluon_dkdv import _consume, _query_tile, _row_stats, _tile_stage, _tma_load
    from .kernels import _grouped_program

    @gluon.jit
    def _dkdv_load(
        q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, k_smem, v_smem, q_smem, do_smem,
        lse_smem, delta_smem, kv_ready, ready, empty, b, hk, pid_bh, n_heads, kv_group,
        start_n, lo, tiles_per_head, n_iters, stride_stats,
        STAGES: gl.constexpr, BLOCK_M: gl.constexpr, HALF_N: gl.constexpr, GQA: gl.constexpr,
    ):  # fmt: skip
        """Loader warp: both halves of the key tile's K and V, then every query tile's Q, dO,
        lse and delta rows as soon as both warpgroups have released its stage (a fresh
        barrier counts as released)."""
        mbarrier.expect(kv_ready, 2 * (k_desc.block_type.nbytes + v_desc.block_type.nbytes))
        for w in gl.static_range(2):
            _tma_load(k_desc, [b, hk, start_n + w * HALF_N, 0], kv_ready, k_smem.index(w))
            _tma_load(v_desc, [b, hk, start_n + w * HALF_N, 0], kv_ready, v_smem.index(w))
        for i in range(n_iters):
            mbarrier.wait(empty.index(i % STAGES), ((i // STAGES) & 1) ^ 1)
            qh, row, stats_bh = _query_tile(
                i, lo, tiles_per_head, b, hk, pid_bh, n_heads, kv_group, BLOCK_M, GQA
            )
            _tile_stage(
                i, row, qh, stats_bh, q_desc, do_desc, lse_desc, delta_desc, q_smem, do_smem,
                lse_smem, delta_smem, ready, b, stride_stats, STAGES, True, True,
            )  # fmt: skip

    @gluon.jit
    def _dkdv_math(
        q_desc, do_desc, k_smem, v_smem, q_smem, do_smem, ready, empty, kv_ready, LSE, DELTA,
        DK, DV, pid_bh, b, hk, n_heads, kv_group, stride_dk, stride_dv, start_n, lo,
        tiles_per_head, n_iters, n_q, n_k, stride_stats, qk_scale, sm_scale, lse_desc,
        delta_desc, lse_smem, delta_smem,
        WG: gl.constexpr, BLOCK_M: gl.constexpr, HALF_N: gl.constexpr,
        HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
        LSE_LOG2: gl.constexpr, GQA: gl.constexpr,
    ):  # fmt: skip
        """Warpgroup WG: keys start_n + WG * HALF_N .. + HALF_N, the one-warpgroup kernel's
        loop (``gluon_dkdv._consume``, loads by the loader warp, rows by TMA)."""
        _consume(
            q_desc, do_desc, k_smem.index(WG), v_smem.index(WG), q_smem, do_smem, ready, empty,
            kv_ready, LSE, DELTA, DK, DV, pid_bh, b, hk, n_heads, kv_group, stride_dk,
            stride_dv, start_n + WG * HALF_N, lo, tiles_per_head, n_iters, n_q, n_k,
            stride_stats, qk_scale, sm_scale, lse_desc, delta_desc, lse_smem, delta_smem,
            BLOCK_M, HALF_N, HEAD_DIM, STAGES, CAUSAL, True, 0, True, LSE_LOG2, GQA, 4,
        )  # fmt: skip

    @gluon.jit
    def dkdv_kernel(
        q_desc, k_desc, v_desc, do_desc, LSE, DELTA, DK, DV,
        stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
        n_heads, n_q, n_k, stride_stats, qk_scale, sm_scale, head_group, lse_desc, delta_desc,
        kv_group, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
        STAGES: gl.constexpr, CAUSAL: gl.constexpr, GROUPED: gl.constexpr,
        LSE_LOG2: gl.constexpr, GQA: gl.constexpr, CONSUMER_REGS: gl.constexpr,
        num_warps: gl.constexpr,
    ):  # fmt: skip
        """One program: dK, dV of BLOCK_N keys of one (batch, k/v head), arguments as
        ``gluon_dkdv.dkdv_kernel``'s (row statistics by TMA only)."""
        gl.static_assert(num_warps == 4, "the default partition is one math warpgroup")
        HALF_N: gl.constexpr = BLOCK_N // 2
        pid_bh, tile = _grouped_program(head_group, GROUPED)
        start_n = tile * BLOCK_N
        dtype: gl.constexpr = q_desc.dtype
        if GQA:
            n_kv_heads = n_heads // kv_group
        else:
            n_kv_heads = n_heads
        b = pid_bh // n_kv_heads
        hk = pid_bh % n_kv_heads
        stride_dk = (stride_dkb, stride_dkh, stride_dkn)
        stride_dv = (stride_dvb, stride_dvh, stride_dvn)

        k_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, HALF_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, HALF_N, HEAD_DIM], v_desc.layout)
        q_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_M, HEAD_DIM], q_desc.layout)
        do_smem = gl.allocate_shared_memory(
            dtype, [STAGES, 1, 1, BLOCK_M, HEAD_DIM], do_desc.layout
        )
        lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], lse_desc.layout)
        delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], delta_desc.layout)
        bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
        kv_ready = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=2)  # both warpgroups release a stage
        mbarrier.init(kv_ready, count=1)

        # Query tiles [lo, n_q): rows before the first key (shifted by n_k - n_q, the
        # bottom-right alignment) see none of the program's keys.
        if CAUSAL:
            lo = gl.maximum(start_n - (n_k - n_q), 0) // BLOCK_M * BLOCK_M
        else:
            lo = 0
        tiles_per_head = gl.cdiv(n_q - lo, BLOCK_M)
        if GQA:
            n_iters = tiles_per_head * kv_group
        else:
            n_iters = tiles_per_head
        gl.warp_specialize(
            [
                (
                    _dkdv_math,
                    (
            q_desc, do_desc, k_smem, v_smem, q_smem, do_smem, ready, empty, kv_ready, LSE,
            DELTA, DK, DV, pid_bh, b, hk, n_heads, kv_group, stride_dk, stride_dv, start_n, lo,
            tiles_per_head, n_iters, n_q, n_k, stride_stats, qk_scale, sm_scale, lse_desc,
            delta_desc, lse_smem, delta_smem,
                        0, BLOCK_M, HALF_N, HEAD_DIM, STAGES, CAUSAL, LSE_LOG2, GQA,
                    ),
                ),
                (
                    _dkdv_math,
                    (
            q_desc, do_desc, k_smem, v_smem, q_smem, do_smem, ready, empty, kv_ready, LSE,
            DELTA, DK, DV, pid_bh, b, hk, n_heads, kv_group, stride_dk, stride_dv, start_n, lo,
            tiles_per_head, n_iters, n_q, n_k, stride_stats, qk_scale, sm_scale, lse_desc,
            delta_desc, lse_smem, delta_smem,
                        1, BLOCK_M, HALF_N, HEAD_DIM, STAGES, CAUSAL, LSE_LOG2, GQA,
                    ),
                ),
                (
                    _dkdv_load,
                    (
                        q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, k_smem, v_smem,
                        q_smem, do_smem, lse_smem, delta_smem, kv_ready, ready, empty, b, hk,
                        pid_bh, n_heads, kv_group, start_n, lo, tiles_per_head, n_iters,
                        stride_stats, STAGES, BLOCK_M, HALF_N, GQA,
                    ),
                ),
            ],
            [4, 1],
            [CONSUMER_REGS, 24],
        )  # fmt: skip
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(s))
            mbarrier.invalidate(empty.index(s))
        mbarrier.invalidate(kv_ready)

    @gluon.jit
    def _dq_load(
        q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, qd_ready, ready,
        empty, b, h, hk, start_m, n_tiles,
        STAGES: gl.constexpr, BLOCK_N: gl.constexpr, HALF_M: gl.constexpr,
    ):  # fmt: skip
        """Loader warp: both halves of the query tile's Q and dO, then K and V of each key
        tile as soon as both warpgroups have released its stage."""
        mbarrier.expect(qd_ready, 2 * (q_desc.block_type.nbytes + do_desc.block_type.nbytes))
        for w in gl.static_range(2):
            _tma_load(q_desc, [b, h, start_m + w * HALF_M, 0], qd_ready, q_smem.index(w))
            _tma_load(do_desc, [b, h, start_m + w * HALF_M, 0], qd_ready, do_smem.index(w))
        for j in range(n_tiles):
            stage = j % STAGES
            mbarrier.wait(empty.index(stage), ((j // STAGES) & 1) ^ 1)
            bar = ready.index(stage)
            mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            _tma_load(k_desc, [b, hk, j * BLOCK_N, 0], bar, k_smem.index(stage))
            _tma_load(v_desc, [b, hk, j * BLOCK_N, 0], bar, v_smem.index(stage))

    @gluon.jit
    def _dq_math(
        q_smem, do_smem, k_smem, v_smem, qd_ready, ready, empty, LSE, DELTA, DQ,
        stride_dqb, stride_dqh, stride_dqn, pid_bh, b, h, start_m, n_q, n_k, n_tiles,
        stride_stats, qk_scale, sm_scale,
        WG: gl.constexpr, HALF_M: gl.constexpr, BLOCK_N: gl.constexpr,
        HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
    ):  # fmt: skip
        """Warpgroup WG: dQ of rows start_m + WG * HALF_M .. + HALF_M."""
        dtype: gl.constexpr = k_smem.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
        )
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
        )
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        row0 = start_m + WG * HALF_M
        causal_off = n_k - n_q
        offs_m = row0 + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, s_layout))
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        stats_off = pid_bh.to(gl.int64) * stride_stats
        lse2, delta = _row_stats(LSE + stats_off, DELTA + stats_off, offs_m, n_q, False)
        # Key tiles from this one on hold a key some row of the warpgroup must not see.
        mask_from = row0 + causal_off - BLOCK_N + 1
        zero_s = gl.zeros([HALF_M, BLOCK_N], gl.float32, layout=s_layout)
        dq = warpgroup_mma_init(gl.zeros([HALF_M, HEAD_DIM], gl.float32, layout=acc_layout))
        q_t = q_smem.index(WG).reshape([HALF_M, HEAD_DIM])
        do_t = do_smem.index(WG).reshape([HALF_M, HEAD_DIM])
        mbarrier.wait(qd_ready, 0)

        for j in range(n_tiles):
            stage = j % STAGES
            mbarrier.wait(ready.index(stage), (j // STAGES) & 1)
            k_s = k_smem.index(stage).reshape([BLOCK_N, HEAD_DIM])
            v_s = v_smem.index(stage).reshape([BLOCK_N, HEAD_DIM])
            s_tok = warpgroup_mma(q_t, k_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            dp_tok = warpgroup_mma(do_t, v_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            # Waiting for S also retires the previous tile's dQ product: its stage is free.
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))
            mbarrier.arrive(empty.index((j + STAGES - 1) % STAGES), count=1, pred=j > 0)
            p = gl.exp2(s * qk_scale - lse2[:, None])
            start_n = j * BLOCK_N
            needs_mask = start_n + BLOCK_N > n_k
            if CAUSAL:
                needs_mask = needs_mask | (start_n > mask_from)
            if needs_mask:
                cols = start_n + offs_n
                keep = (cols < n_k)[None, :]
                if CAUSAL:
                    keep = keep & (cols[None, :] <= offs_m[:, None] + causal_off)
                p = gl.where(keep, p, 0.0)
            dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp_tok,))
            ds = p * (dp - delta[:, None])
            dq = warpgroup_mma(gl.convert_layout(ds.to(dtype), a_layout), k_s, dq, is_async=True)

        dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))
        out_rows = row0 + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, acc_layout))
        out_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
        base = DQ + b.to(gl.int64) * stride_dqb + h.to(gl.int64) * stride_dqh
        ptrs = base + out_rows.to(gl.int64)[:, None] * stride_dqn + out_cols[None, :]
        gl.store(ptrs, (dq * sm_scale).to(dtype), mask=(out_rows < n_q)[:, None])

    @gluon.jit
    def dq_kernel(
        q_desc, k_desc, v_desc, do_desc, LSE, DELTA, DQ, stride_dqb, stride_dqh, stride_dqn,
        n_heads, n_q, n_k, stride_stats, qk_scale, sm_scale, head_group, kv_group,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
        STAGES: gl.constexpr, CAUSAL: gl.constexpr, GROUPED: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr,
    ):  # fmt: skip
        """One program: dQ of BLOCK_M query rows of one (batch, head), heaviest first;
        arguments as ``gluon_dq.dq_kernel``'s (q head h reads k/v head h // kv_group)."""
        gl.static_assert(num_warps == 4, "the default partition is one math warpgroup")
        HALF_M: gl.constexpr = BLOCK_M // 2
        pid_bh, tile = _grouped_program(head_group, GROUPED)
        start_m = (gl.num_programs(1) - 1 - tile) * BLOCK_M
        dtype: gl.constexpr = q_desc.dtype
        b = pid_bh // n_heads
        h = pid_bh % n_heads
        hk = h // kv_group
        if CAUSAL:
            hi = gl.maximum(gl.minimum(n_k, start_m + BLOCK_M + n_k - n_q), 0)
        else:
            hi = n_k
        n_tiles = gl.cdiv(hi, BLOCK_N)

        q_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, HALF_M, HEAD_DIM], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, HALF_M, HEAD_DIM], do_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, HEAD_DIM], v_desc.layout)
        bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
        qd_ready = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
        mbarrier.init(qd_ready, count=1)
        for st in gl.static_range(STAGES):
            mbarrier.init(ready.index(st), count=1)
            mbarrier.init(empty.index(st), count=2)
        gl.warp_specialize(
            [
                (
                    _dq_math,
                    (
            q_smem, do_smem, k_smem, v_smem, qd_ready, ready, empty, LSE, DELTA, DQ,
            stride_dqb, stride_dqh, stride_dqn, pid_bh, b, h, start_m, n_q, n_k, n_tiles,
            stride_stats, qk_scale, sm_scale,
                        0, HALF_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL,
                    ),
                ),
                (
                    _dq_math,
                    (
            q_smem, do_smem, k_smem, v_smem, qd_ready, ready, empty, LSE, DELTA, DQ,
            stride_dqb, stride_dqh, stride_dqn, pid_bh, b, h, start_m, n_q, n_k, n_tiles,
            stride_stats, qk_scale, sm_scale,
                        1, HALF_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL,
                    ),
                ),
                (
                    _dq_load,
                    (
                        q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem,
                        qd_ready, ready, empty, b, h, hk, start_m, n_tiles, STAGES, BLOCK_N,
                        HALF_M,
                    ),
                ),
            ],
            [4, 1],
            [CONSUMER_REGS, 24],
        )  # fmt: skip
        mbarrier.invalidate(qd_ready)
        for st in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(st))
            mbarrier.invalidate(empty.index(st))


def launch_dkdv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    *,
    block_m: int = 64,
    block_n: int = 128,
    stages: int = 2,
    consumer_regs: int = 240,
    head_group: int = 0,
    lse_log2: bool = True,
) -> None:
    """``gluon_dkdv.launch_dkdv``'s contract with two warpgroups per program (block_n keys,
    64 each) and the row statistics by TMA, which they must allow
    (``gluon_dkdv.rows_by_tma``). Checks only the tiles."""
    if block_n != 128 or block_m != 64:
        raise ValueError(f"block_m, block_n must be 64, 128, got {block_m}, {block_n}")
    b, h, n_q, d = q.shape
    h_kv, n_k = k.shape[1], k.shape[2]
    group, grouped = launch_order(head_group, b * h_kv)
    fastlaunch.launch(
        dkdv_kernel, (b * h_kv, -(-n_k // block_n)),
        _desc(q, block_m), _desc(k, block_n // 2), _desc(v, block_n // 2), _desc(do, block_m),
        lse, delta, dk, dv, dk.stride(0), dk.stride(1), dk.stride(2),
        dv.stride(0), dv.stride(1), dv.stride(2), h, n_q, n_k, lse.shape[-1],
        softmax_scale * LOG2E, softmax_scale, group, _flat_desc(lse, block_m),
        _flat_desc(delta, block_m), h // h_kv,
        BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=d, STAGES=stages, CAUSAL=causal,
        GROUPED=grouped, LSE_LOG2=lse_log2, GQA=h_kv != h, CONSUMER_REGS=consumer_regs,
        num_warps=4,
    )  # fmt: skip


def launch_dq(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    dq: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    *,
    block_m: int = 128,
    block_n: int = 64,
    stages: int = 2,
    consumer_regs: int = 240,
    head_group: int = 0,
) -> None:
    """``gluon_dq.launch_dq``'s contract (lse in natural log) with two warpgroups per program
    (block_m rows, 64 each). Checks only the tiles."""
    if block_m != 128 or block_n not in (64, 128):
        raise ValueError(f"block_m must be 128 and block_n 64 or 128, got {block_m}, {block_n}")
    b, h, n_q, d = q.shape
    n_k = k.shape[2]
    group, grouped = launch_order(head_group, b * h)
    fastlaunch.launch(
        dq_kernel, (b * h, -(-n_q // block_m)),
        _desc(q, block_m // 2), _desc(k, block_n), _desc(v, block_n), _desc(do, block_m // 2),
        lse, delta, dq, dq.stride(0), dq.stride(1), dq.stride(2), h, n_q, n_k, lse.shape[-1],
        softmax_scale * LOG2E, softmax_scale, group, h // k.shape[1],
        BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=d, STAGES=stages, CAUSAL=causal,
        GROUPED=grouped, CONSUMER_REGS=consumer_regs, num_warps=4,
    )  # fmt: skip
