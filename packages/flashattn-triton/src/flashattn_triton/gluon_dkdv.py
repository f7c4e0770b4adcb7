"""dK/dV on Hopper written in Gluon, with explicit asynchronous wgmma and waits.

Used by the split backward for head dim 128 on Hopper GPUs, where it beats the Triton dK/dV
kernel by 1.15-1.21x causal on an H100 (the Triton kernel spills registers there; at d = 64
it only ties); elsewhere the Triton kernel runs. Gluon
(``triton.experimental.gluon``, Triton >= 3.5) is Triton's lower-level layer: layouts,
shared memory, TMA, mbarriers and wgmma are explicit. Each query tile goes:

    issue S^T = K Q^T and dP^T = V dO^T          (two groups in flight)
    wait for S^T only; P^T = exp2(S^T - lse)     (dP^T still running)
    issue dV += P^T dO; wait for dP^T only       (dV still running)
    dS^T = P^T (dP^T - delta); issue dK += dS^T Q
    next tile: issue its S^T, dP^T behind dV, dK; wait for S^T ...

Q and dO tiles stream through a ring of shared-memory stages filled by TMA (by the math warps,
or with WARP_SPEC by one extra loader warp), with ROW_TMA each tile's lse and delta rows too
(else they are loaded from global memory per tile); K and V stay in shared memory. One program owns
BLOCK_N keys of one (batch, head), one warpgroup per 64 keys. The loads go through 4-D
(B, H, N, d) descriptors, so any layout with a unit last stride and 16-byte aligned strides
works (e.g. a model's (B, N, H, d) buffer seen as (B, H, N, d)); rows past a head's end read
as zeros. dK and dV are stored through their own strides.

``Options.gluon`` (``FLASHATTN_TRITON_GLUON=0``) turns it off. If a compile fails (e.g. a
Triton whose Gluon API differs), a warning names the cause and the Triton kernel takes over
for that key.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from . import fastlaunch
from ._device import cuda_major, head_group_args
from .options import get_options

LOG2E = 1.4426950408889634

try:  # Gluon ships with Triton >= 3.5
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_init,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # A @triton.jit helper: Gluon kernels call it like their own (checked with Triton 3.6, 3.9).
    from .kernels import _grouped_program

    HAVE_GLUON = True
    _LOG2E = gl.constexpr(LOG2E)
    from triton.experimental.gluon.language._core import builtin

    # Triton 3.6 names the TMA load async_copy_global_to_shared; later ones async_load.
    _tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
    # ... and the TMA store async_copy_shared_to_global; later ones async_store.
    _tma_store = tma.async_store if hasattr(tma, "async_store") else tma.async_copy_shared_to_global

    @builtin
    def _sync_partition(_semantic=None):
        """A barrier over the threads of the current partition (``gl.thread_barrier`` in
        Triton 3.6, ``gl.barrier`` later)."""
        return _semantic.debug_barrier()
except ImportError:  # older Triton, or none
    HAVE_GLUON = False

GL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
# Measured defaults by head dim (H100): block_m, block_n, stages, maxnreg
# (None: Triton's), warp specialization, and row_tma (lse / delta rows by TMA with Q / dO
# where ``rows_by_tma`` allows: 1.11-1.13x on the whole backward over five d = 128 shapes).
# tma_store: dK and dV stored by TMA through the K / V buffers, as the forward stores o; the
# package's forward + backward 0.91-0.97x of the register stores' at 512 and 1024 keys, equal
# at 2048, results bitwise equal (H100, scripts/dkdv_tma_store_probe.py; raw
# benchmarks/results/current/h100_dkdv_tma_store.json).
# d = 64 is absent: there, with row_tma and 168 registers, the whole backward is
# 0.98-1.03x the Triton kernel's on full grids, not a clear win.
DEFAULTS: dict[int, dict] = {
    128: {
        "block_m": 64,
        "block_n": 64,
        "stages": 2,
        "maxnreg": None,
        "ws": False,
        "row_tma": True,
        "tma_store": True,
    },
}
_FAILED: dict[tuple, str] = {}  # (kernel, d, dtype, causal) -> why its compile failed
_COMPILED: set[tuple] = set()


if HAVE_GLUON:

    @gluon.jit
    def _tile_pair(
        i, lo, a_desc, b_desc, a_smem, b_smem, ready, b, h,
        STAGES: gl.constexpr, BLOCK: gl.constexpr, pred,
    ):  # fmt: skip
        """Start the TMA loads of the i-th streamed tile pair (rows lo + i * BLOCK of one
        (batch, head): Q and dO here, K and V in ``gluon_dq``) into its ring stage."""
        stage = i % STAGES
        bar = ready.index(stage)
        mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=pred)
        row = lo + i * BLOCK
        _tma_load(a_desc, [b, h, row, 0], bar, a_smem.index(stage), pred=pred)
        _tma_load(b_desc, [b, h, row, 0], bar, b_smem.index(stage), pred=pred)

    @gluon.jit
    def _query_tile(
        i, lo, tiles_per_head, b, hk, pid_bh, n_heads, kv_group,
        BLOCK_M: gl.constexpr, GQA: gl.constexpr,
    ):  # fmt: skip
        """(q head, first row, row-statistics index) of a program's i-th query tile. Without
        GQA: tiles lo, lo + BLOCK_M, ... of the program's own head. With GQA the program
        walks the kv_group q heads reading its k/v head hk, each over the same tiles_per_head
        tiles, and adds their contributions into one dK, dV."""
        if GQA:
            j = i // tiles_per_head
            qh = hk * kv_group + j
            return qh, lo + (i - j * tiles_per_head) * BLOCK_M, b * n_heads + qh
        else:
            return hk, lo + i * BLOCK_M, pid_bh

    @gluon.jit
    def _tile_stage(
        i, row, qh, stats_bh, q_desc, do_desc, lse_desc, delta_desc, q_smem, do_smem,
        lse_smem, delta_smem, ready, b, stride_stats, STAGES: gl.constexpr,
        ROW_TMA: gl.constexpr, pred, INTERLEAVED: gl.constexpr = False,
    ):  # fmt: skip
        """Start the TMA loads of the i-th query tile (rows row.. of q head qh) into its ring
        stage: Q and dO (INTERLEAVED: both in q_smem, buffers 2 * stage and 2 * stage + 1,
        as ``gluon_bwd`` lays out its ring), with ROW_TMA also the tile's log-sum-exp and
        delta rows (1-D TMA over the flat (B*H*stride_stats,) float32 arrays, at stats_bh *
        stride_stats + row), all on the stage's barrier."""
        stage = i % STAGES
        bar = ready.index(stage)
        tiles_bytes: gl.constexpr = q_desc.block_type.nbytes + do_desc.block_type.nbytes
        if ROW_TMA:
            rows_bytes: gl.constexpr = lse_desc.block_type.nbytes + delta_desc.block_type.nbytes
            mbarrier.expect(bar, tiles_bytes + rows_bytes, pred=pred)
        else:
            mbarrier.expect(bar, tiles_bytes, pred=pred)
        if INTERLEAVED:
            q_buf = q_smem.index(2 * stage)
            do_buf = q_smem.index(2 * stage + 1)
        else:
            q_buf = q_smem.index(stage)
            do_buf = do_smem.index(stage)
        _tma_load(q_desc, [b, qh, row, 0], bar, q_buf, pred=pred)
        _tma_load(do_desc, [b, qh, row, 0], bar, do_buf, pred=pred)
        if ROW_TMA:
            flat = stats_bh * stride_stats + row
            _tma_load(lse_desc, [flat], bar, lse_smem.index(stage), pred=pred)
            _tma_load(delta_desc, [flat], bar, delta_smem.index(stage), pred=pred)

    @gluon.jit
    def _lse_log2(lse, LSE_LOG2: gl.constexpr):
        """lse in log2 units (+inf for rows that saw no key: P = 0); as is with LSE_LOG2
        (stored so already by the kernel that computed delta)."""
        if LSE_LOG2:
            return lse
        return gl.where(lse == float("-inf"), float("inf"), lse * _LOG2E)

    @gluon.jit
    def _row_stats(lse_base, delta_base, offs_m, n_q, LSE_LOG2: gl.constexpr):
        """log2-domain log-sum-exp (``_lse_log2``) and delta of the query rows offs_m; rows
        past n_q read as +inf / 0."""
        in_rows = offs_m < n_q
        lse = gl.load(lse_base + offs_m, mask=in_rows, other=float("inf"))
        delta = gl.load(delta_base + offs_m, mask=in_rows, other=0.0)
        return _lse_log2(lse, LSE_LOG2), delta

    @gluon.jit
    def _produce(
        q_desc, do_desc, k_desc, v_desc, k_smem, v_smem, q_smem, do_smem, ready, empty,
        kv_ready, b, hk, pid_bh, n_heads, kv_group, start_n, lo, tiles_per_head, n_iters,
        STAGES: gl.constexpr, BLOCK_M: gl.constexpr, GQA: gl.constexpr,
    ):  # fmt: skip
        """Loader warp (warp-specialized variant): K, V once, then every query tile's Q, dO
        as soon as the consumers release its stage."""
        mbarrier.expect(kv_ready, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        _tma_load(k_desc, [b, hk, start_n, 0], kv_ready, k_smem)
        _tma_load(v_desc, [b, hk, start_n, 0], kv_ready, v_smem)
        for i in range(n_iters):
            # A fresh mbarrier counts as having completed the phase before phase 0.
            mbarrier.wait(empty.index(i % STAGES), ((i // STAGES) & 1) ^ 1)
            qh, row, _ = _query_tile(
                i, lo, tiles_per_head, b, hk, pid_bh, n_heads, kv_group, BLOCK_M, GQA
            )
            _tile_stage(
                i, row, qh, pid_bh, q_desc, do_desc, None, None, q_smem, do_smem, None, None,
                ready, b, 0, STAGES, False, True,
            )  # fmt: skip

    @gluon.jit
    def _store_dkdv(
        DK, DV, dk, dv, b, hk, row0, n_k, stride_dkb, stride_dkh, stride_dkn, stride_dvb,
        stride_dvh, stride_dvn, sm_scale, ROWS: gl.constexpr, HEAD_DIM: gl.constexpr,
        ACC_LAYOUT: gl.constexpr,
    ):  # fmt: skip
        """Store dK * sm_scale and dV (float32 ROWS x HEAD_DIM accumulators in ACC_LAYOUT, key
        rows row0.. of (batch b, k/v head hk)) in DK's dtype through their (batch, head, row)
        strides; rows past n_k are not written. Shared by every Gluon dK/dV loop."""
        dtype: gl.constexpr = DK.dtype.element_ty
        out_rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, ACC_LAYOUT))
        out_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, ACC_LAYOUT))
        rows = out_rows.to(gl.int64)[:, None]
        store_mask = (out_rows < n_k)[:, None]
        dk_base = DK + b.to(gl.int64) * stride_dkb + hk.to(gl.int64) * stride_dkh
        dv_base = DV + b.to(gl.int64) * stride_dvb + hk.to(gl.int64) * stride_dvh
        dk_ptrs = dk_base + rows * stride_dkn + out_cols[None, :]
        dv_ptrs = dv_base + rows * stride_dvn + out_cols[None, :]
        gl.store(dk_ptrs, (dk * sm_scale).to(dtype), mask=store_mask)
        gl.store(dv_ptrs, dv.to(dtype), mask=store_mask)

    @gluon.jit
    def _consume(
        q_desc, do_desc, k_smem, v_smem, q_smem, do_smem, ready, empty, kv_ready,
        LSE, DELTA, DK, DV, pid_bh, b, hk, n_heads, kv_group, stride_dk, stride_dv, start_n, lo,
        tiles_per_head, n_iters, n_q, n_k, stride_stats, qk_scale, sm_scale, lse_desc,
        delta_desc, lse_smem, delta_smem, dk_desc, dv_desc,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
        STAGES: gl.constexpr, CAUSAL: gl.constexpr, WARP_SPEC: gl.constexpr,
        ABLATE: gl.constexpr, ROW_TMA: gl.constexpr, LSE_LOG2: gl.constexpr, GQA: gl.constexpr,
        TMA_STORE: gl.constexpr, num_warps: gl.constexpr,
    ):  # fmt: skip
        """The math: accumulate dK, dV over the query tiles (``_query_tile``: n_iters of
        them), then store them. stride_dk, stride_dv: (batch, head, row) strides of DK, DV.
        TMA_STORE: dK and dV leave through the K and V buffers (no product reads them any
        more) by TMA stores; otherwise straight from the accumulators' registers."""
        dtype: gl.constexpr = q_desc.dtype
        # 2-D views of the 4-D (1, 1, rows, d) TMA tiles, for the products.
        k_tile = k_smem.reshape([BLOCK_N, HEAD_DIM])
        v_tile = v_smem.reshape([BLOCK_N, HEAD_DIM])
        # S^T tiles (BLOCK_N keys x BLOCK_M queries) and the dK, dV accumulators
        # (BLOCK_N x HEAD_DIM): one warpgroup per 64 key rows.
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_M, 16]
        )
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 16]
        )
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

        causal_off = n_k - n_q
        offs_n = start_n + gl.arange(0, BLOCK_N, layout=row_layout)
        offs_tm = gl.arange(0, BLOCK_M, layout=col_layout)
        zero_s = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=s_layout)
        dk = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=acc_layout))
        dv = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=acc_layout))
        # A tile needs a mask if a query in it cannot see a key of ours (the diagonal) or if
        # it runs past n_q.
        mask_below = start_n + BLOCK_N - 1 - causal_off
        mbarrier.wait(kv_ready, 0)

        for i in range(n_iters):
            stage = i % STAGES
            _, start_m, stats_bh = _query_tile(
                i, lo, tiles_per_head, b, hk, pid_bh, n_heads, kv_group, BLOCK_M, GQA
            )
            offs_m = start_m + offs_tm
            if not ROW_TMA:
                stats_off = stats_bh.to(gl.int64) * stride_stats
                lse2, delta = _row_stats(LSE + stats_off, DELTA + stats_off, offs_m, n_q, LSE_LOG2)
            mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
            if ROW_TMA:  # arrived with Q and dO; rows past n_q are masked below
                lse2 = _lse_log2(lse_smem.index(stage).load(col_layout), LSE_LOG2)
            q_s = q_smem.index(stage).reshape([BLOCK_M, HEAD_DIM])
            do_s = do_smem.index(stage).reshape([BLOCK_M, HEAD_DIM])
            s_tok = warpgroup_mma(k_tile, q_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            dp_tok = warpgroup_mma(
                v_tile, do_s.permute((1, 0)), zero_s, use_acc=False, is_async=True
            )
            # Waiting for S^T also retires the previous tile's dV, dK: its stage is free.
            s_t = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))
            if WARP_SPEC:
                mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), pred=i > 0)
            else:
                nxt = i + STAGES - 1
                qh_n, row_n, stats_n = _query_tile(
                    nxt, lo, tiles_per_head, b, hk, pid_bh, n_heads, kv_group, BLOCK_M, GQA
                )
                _tile_stage(
                    nxt, row_n, qh_n, stats_n, q_desc, do_desc, lse_desc, delta_desc, q_smem,
                    do_smem, lse_smem, delta_smem, ready, b, stride_stats, STAGES, ROW_TMA,
                    nxt < n_iters,
                )  # fmt: skip
            if ABLATE % 2 == 1:  # timing experiment: no exponentials
                p_t = s_t * qk_scale - lse2[None, :]
            else:
                p_t = gl.exp2(s_t * qk_scale - lse2[None, :])
            needs_mask = start_m + BLOCK_M > n_q
            if CAUSAL:
                needs_mask = needs_mask | (start_m < mask_below)
            if needs_mask:
                keep = (offs_m < n_q)[None, :]
                if CAUSAL:
                    keep = keep & (offs_n[:, None] <= offs_m[None, :] + causal_off)
                p_t = gl.where(keep, p_t, 0.0)
            dv = warpgroup_mma(gl.convert_layout(p_t.to(dtype), a_layout), do_s, dv, is_async=True)
            dp_t = warpgroup_mma_wait(num_outstanding=1, deps=(dp_tok,))
            if ROW_TMA:  # read only now: fewer registers live across the exponentials
                delta = delta_smem.index(stage).load(col_layout)
            if ABLATE >= 2:  # timing experiment: no element-wise dS
                ds_t = dp_t
            else:
                ds_t = p_t * (dp_t - delta[None, :])
            dk = warpgroup_mma(gl.convert_layout(ds_t.to(dtype), a_layout), q_s, dk, is_async=True)

        dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
        if TMA_STORE:  # rows past n_k are clipped by the TMA unit
            k_tile.store((dk * sm_scale).to(dtype))
            v_tile.store(dv.to(dtype))
            fence_async_shared()
            _sync_partition()
            _tma_store(dk_desc, [b, hk, start_n, 0], k_smem)
            _tma_store(dv_desc, [b, hk, start_n, 0], v_smem)
            tma.store_wait(0)  # the buffers must be read before the program ends
        else:
            _store_dkdv(
                DK, DV, dk, dv, b, hk, start_n, n_k, stride_dk[0], stride_dk[1], stride_dk[2],
                stride_dv[0], stride_dv[1], stride_dv[2], sm_scale, BLOCK_N, HEAD_DIM,
                acc_layout,
            )  # fmt: skip

    @gluon.jit
    def dkdv_kernel(
        q_desc, k_desc, v_desc, do_desc, LSE, DELTA, DK, DV,
        stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
        n_heads, n_q, n_k, stride_stats, qk_scale, sm_scale, head_group, lse_desc, delta_desc,
        kv_group, dk_desc, dv_desc, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
        WARP_SPEC: gl.constexpr, ABLATE: gl.constexpr, GROUPED: gl.constexpr,
        ROW_TMA: gl.constexpr, LSE_LOG2: gl.constexpr, GQA: gl.constexpr,
        TMA_STORE: gl.constexpr, num_warps: gl.constexpr,
    ):  # fmt: skip
        """One program: dK, dV of one key tile of one (batch, k/v head); DK, DV addressed
        through their (batch, head, row) strides (unit last stride). n_heads: q heads; with
        GQA, kv_group q heads share each k/v head (the grid's first axis runs over batch x
        k/v heads) and the program sums their contributions.

        LSE holds natural-log row log-sum-exps (in log2 units, ``_lse_log2``, with LSE_LOG2)
        and DELTA rowsum(dO * O), both (B*H, stride_stats) with n_q <= stride_stats rows used.
        WARP_SPEC: one extra warp issues the TMA loads (the math warps never wait for each
        other); otherwise the math warps issue them STAGES - 1 tiles ahead. head_group,
        GROUPED: the launch order (``kernels._grouped_program``)."""
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

        k_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, HEAD_DIM], v_desc.layout)
        q_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_M, HEAD_DIM], q_desc.layout)
        do_smem = gl.allocate_shared_memory(
            dtype, [STAGES, 1, 1, BLOCK_M, HEAD_DIM], do_desc.layout
        )
        if ROW_TMA:  # ROW_TMA: the row statistics ride the Q / dO ring (not with WARP_SPEC)
            gl.static_assert(not WARP_SPEC, "ROW_TMA needs WARP_SPEC off")
            lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], lse_desc.layout)
            delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], delta_desc.layout)
        else:  # placeholders: never read without ROW_TMA
            lse_smem = q_smem
            delta_smem = q_smem
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=1)
        mbarrier.init(kv_ready, count=1)

        # Query tiles [lo, n_q): with a causal mask the rows before the tile's first key
        # (shifted by n_k - n_q, the bottom-right alignment) see none of it.
        if CAUSAL:
            lo = gl.maximum(start_n - (n_k - n_q), 0) // BLOCK_M * BLOCK_M
        else:
            lo = 0
        tiles_per_head = gl.cdiv(n_q - lo, BLOCK_M)
        if GQA:
            n_iters = tiles_per_head * kv_group
        else:
            n_iters = tiles_per_head
        if WARP_SPEC:
            gl.warp_specialize(
                [
                    (
                        _consume,
                        (
                            q_desc, do_desc, k_smem, v_smem, q_smem, do_smem, ready, empty,
                            kv_ready, LSE, DELTA, DK, DV, pid_bh, b, hk, n_heads, kv_group,
                            stride_dk, stride_dv, start_n, lo, tiles_per_head, n_iters, n_q,
                            n_k, stride_stats, qk_scale, sm_scale, lse_desc, delta_desc,
                            lse_smem, delta_smem, dk_desc, dv_desc, BLOCK_M, BLOCK_N, HEAD_DIM,
                            STAGES, CAUSAL, WARP_SPEC, ABLATE, ROW_TMA, LSE_LOG2, GQA,
                            TMA_STORE, num_warps,
                        ),
                    ),
                    (
                        _produce,
                        (
                            q_desc, do_desc, k_desc, v_desc, k_smem, v_smem, q_smem, do_smem,
                            ready, empty, kv_ready, b, hk, pid_bh, n_heads, kv_group, start_n,
                            lo, tiles_per_head, n_iters, STAGES, BLOCK_M, GQA,
                        ),
                    ),
                ],
                [1],
                [24],
            )  # fmt: skip
        else:
            mbarrier.expect(kv_ready, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            _tma_load(k_desc, [b, hk, start_n, 0], kv_ready, k_smem)
            _tma_load(v_desc, [b, hk, start_n, 0], kv_ready, v_smem)
            for i in gl.static_range(STAGES - 1):
                qh, row, stats_bh = _query_tile(
                    i, lo, tiles_per_head, b, hk, pid_bh, n_heads, kv_group, BLOCK_M, GQA
                )
                _tile_stage(
                    i, row, qh, stats_bh, q_desc, do_desc, lse_desc, delta_desc, q_smem,
                    do_smem, lse_smem, delta_smem, ready, b, stride_stats, STAGES, ROW_TMA,
                    i < n_iters,
                )  # fmt: skip
            _consume(
                q_desc, do_desc, k_smem, v_smem, q_smem, do_smem, ready, empty, kv_ready,
                LSE, DELTA, DK, DV, pid_bh, b, hk, n_heads, kv_group, stride_dk, stride_dv,
                start_n, lo, tiles_per_head, n_iters, n_q, n_k, stride_stats, qk_scale,
                sm_scale, lse_desc, delta_desc, lse_smem, delta_smem, dk_desc, dv_desc, BLOCK_M,
                BLOCK_N, HEAD_DIM, STAGES, CAUSAL, WARP_SPEC, ABLATE, ROW_TMA, LSE_LOG2, GQA,
                TMA_STORE, num_warps,
            )  # fmt: skip
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(s))
            mbarrier.invalidate(empty.index(s))
        mbarrier.invalidate(kv_ready)


def enabled() -> bool:
    """``Options.gluon`` (``FLASHATTN_TRITON_GLUON=0`` in the environment turns it off), and
    not while a compiled graph is traced (``fastlaunch.traced``): Gluon's TMA descriptors
    need real addresses, and torch.compile launches Triton kernels only."""
    return get_options().gluon and not fastlaunch.tracing()


def applies(*tensors: torch.Tensor, defaults: dict[int, dict] | None = None) -> bool:
    """True where a Gluon kernel runs by default: Gluon importable, switched on, a Hopper GPU,
    16-bit inputs with a head dim in ``defaults`` (this module's ``DEFAULTS`` unless given),
    and every tensor (q, k, v, dO, then the outputs) 4-D with a unit last stride; q, k, v, dO
    (read by TMA) also 16-byte aligned with 16-byte multiple strides; k's heads divide q's
    (grouped-query attention). Off under the CPU interpreter (CUDA tensors only)."""
    q = tensors[0]
    if not (HAVE_GLUON and enabled() and q.is_cuda and q.dtype in GL_DTYPES):
        return False
    if q.dim() != 4 or tensors[1].dim() != 4 or tensors[1].shape[0] != q.shape[0]:
        return False
    if tensors[1].shape[1] < 1 or q.shape[1] % tensors[1].shape[1]:
        return False
    table = DEFAULTS if defaults is None else defaults
    if q.shape[-1] not in table or cuda_major(q.get_device()) != 9:
        return False
    if any(t.dim() != 4 or t.stride(-1) != 1 for t in tensors):
        return False
    return all(_tma_ok(t) for t in tensors[:4])


def _tma_ok(t: torch.Tensor) -> bool:
    elem = t.element_size()
    return t.data_ptr() % 16 == 0 and all(s * elem % 16 == 0 for s in t.stride()[:-1])


def _desc(t: torch.Tensor, block_rows: int) -> TensorDescriptor:
    """A TMA descriptor over the (B, H, N, d) tensor t (its own strides) for (1, 1,
    block_rows, d) tiles."""
    block = [1, 1, block_rows, t.shape[-1]]
    layout = gl.NVMMASharedLayout.get_default_for(block, getattr(gl, GL_DTYPES[t.dtype]))
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)


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
    block_m: int,
    block_n: int,
    stages: int,
    maxnreg: int | None = None,
    ws: bool = False,
    ablate: int = 0,
    head_group: int = 0,
    row_tma: bool = False,
    lse_log2: bool = False,
    tma_store: bool = False,
) -> None:
    """Write dK, dV of (B, H, N, d) 16-bit q, do and (B, Hkv, N, d) k, v (layouts as in
    ``applies``; Hkv divides H: grouped-query heads, dk and dv summed over each group) into dk,
    dv; lse (natural log, or with ``lse_log2`` in log2 units, +inf for rows without keys)
    and delta: contiguous (B, H, rows) float32 with rows >= n_q (the launcher pads them,
    ``configs.STATS_ROWS``; rows past n_q are masked). Checks nothing:
    ``try_dkdv`` (via ``applies``) is the gated entry point; this one is for benchmarks that
    pick their own tiles. ``ablate`` is for timing experiments only (wrong results): 1 drops
    the exponentials, 2 the element-wise dS, 3 both. ``head_group``: programs of that many
    heads at a time (``kernels._grouped_program``); 0: the plain order. ``row_tma``: each
    query tile's lse / delta rows arrive by TMA with its Q / dO (contiguous lse, delta) where
    ``rows_by_tma`` allows it; elsewhere they are loaded per tile. ``tma_store``: dk and dv
    leave through shared memory by TMA stores (their layouts TMA-writable, as ``applies``
    checks)."""
    b, h, n_q, d = q.shape
    h_kv, n_k = k.shape[1], k.shape[2]
    group, grouped = launch_order(head_group, b * h_kv)
    row_tma = row_tma and rows_by_tma(lse, delta)
    rows = (_flat_desc(lse, block_m), _flat_desc(delta, block_m)) if row_tma else (None, None)
    k_desc = _desc(k, block_n)
    # dk and dv share k's block and dtype, so the K / V buffers' layout; unread without it
    outs = (_desc(dk, block_n), _desc(dv, block_n)) if tma_store else (k_desc, k_desc)
    fastlaunch.launch(
        dkdv_kernel, (b * h_kv, -(-n_k // block_n)),
        _desc(q, block_m), k_desc, _desc(v, block_n), _desc(do, block_m),
        lse, delta, dk, dv, dk.stride(0), dk.stride(1), dk.stride(2),
        dv.stride(0), dv.stride(1), dv.stride(2), h, n_q, n_k, lse.shape[-1],
        softmax_scale * LOG2E, softmax_scale, group, *rows, h // h_kv, *outs,
        BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=d, STAGES=stages, CAUSAL=causal,
        WARP_SPEC=ws, ABLATE=ablate, GROUPED=grouped, ROW_TMA=row_tma, LSE_LOG2=lse_log2,
        GQA=h_kv != h, TMA_STORE=tma_store, num_warps=block_n // 16,
        **({"maxnreg": maxnreg} if maxnreg else {}),
    )  # fmt: skip


def rows_by_tma(lse: torch.Tensor, delta: torch.Tensor) -> bool:
    """Whether the (B, H, rows) float32 row statistics can be read by 1-D TMA tiles starting
    at b*h*rows + row: contiguous, 16-byte aligned, and rows a multiple of 4 (a TMA box must
    start on a 16-byte boundary; unaligned starts fault with an illegal instruction). The launcher's
    statistics have rows = n_q where n_q is a multiple of configs.STATS_ROWS, else are padded
    to one, so only direct callers with other lengths miss it."""
    return (
        all(
            t.is_contiguous() and t.dtype == torch.float32 and t.data_ptr() % 16 == 0
            for t in (lse, delta)
        )
        and lse.shape[-1] % 4 == 0
    )


def _flat_desc(t: torch.Tensor, block: int) -> TensorDescriptor:
    """A 1-D TMA descriptor over a contiguous float32 tensor seen flat, for (block,) tiles."""
    flat = t.view(-1)
    layout = gl.NVMMASharedLayout.get_default_for([block], gl.float32)
    return TensorDescriptor(flat, [flat.numel()], [1], [block], layout)


def launch_order(head_group: int, bh: int) -> tuple[int, bool]:
    """The (head_group, GROUPED) kernel arguments of both Gluon launchers: programs of
    head_group heads at a time where 0 < head_group < bh, else the plain order."""
    grouped = 0 < head_group < bh
    return (head_group if grouped else bh), grouped


def run_guarded(kernel: str, key: tuple, launch: Callable[[], None]) -> bool:
    """Call ``launch``; False if the caller should run the Triton kernel instead. A failing
    first compile per (kernel, key) is reported once and that key falls back from then on;
    once a key has compiled, errors propagate."""
    key = (kernel, *key)
    if key in _FAILED:
        return False
    try:
        launch()
    except Exception as e:  # compile-time failures only: once compiled, errors propagate
        if key in _COMPILED:
            raise
        _FAILED[key] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        warnings.warn(
            f"flashattn_triton: the Gluon {kernel} kernel failed to compile for {key[1:]} "
            f"({_FAILED[key]}); using the Triton kernel (FLASHATTN_TRITON_GLUON=0 silences "
            "this)",
            RuntimeWarning,
            stacklevel=4,
        )
        return False
    _COMPILED.add(key)
    return True


def try_dkdv(
    q, k, v, do, lse, delta, dk, dv, causal: bool, softmax_scale: float, lse_log2: bool = False
) -> bool:
    """Run the default Gluon dK/dV if it applies (see ``applies``); False if the caller
    should run the Triton kernel instead (see ``run_guarded``). ``lse_log2``: see
    ``launch_dkdv``."""
    if not applies(q, k, v, do, dk, dv):
        return False
    b, h, n_q, d = q.shape
    h_kv = k.shape[1]
    group = head_group_args(q, b * h_kv, n_q * (h // h_kv), d)["head_group"]
    return run_guarded(
        "dK/dV",
        (d, q.dtype, causal, h_kv != h),
        lambda: launch_dkdv(
            q, k, v, do, lse, delta, dk, dv, causal, softmax_scale, **DEFAULTS[d],
            head_group=group, lse_log2=lse_log2,
        ),
    )  # fmt: skip
