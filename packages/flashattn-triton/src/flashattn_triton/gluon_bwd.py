"""One-pass attention backward for head dims 64 and 128 on Hopper, in Gluon: dK, dV and dQ from one
loop over query tiles, dQ summed by TMA reduce-adds.

The split backward (``gluon_dq`` then ``gluon_dkdv``) computes S and dP twice, once per
kernel: seven products where five are counted. Here a program owns 128 keys of one
(batch, k/v head) and runs four partitions (``gl.warp_specialize``):

- two math warpgroups, 64 keys each. Per query tile: S^T = K Q^T and dP^T = V dO^T,
  P^T = exp2(S^T - lse), dV += P^T dO, dS^T = P^T (dP^T - delta), dK += dS^T Q; each
  writes its dS^T half to shared memory, and once both halves are there, computes one column
  half of dQ = dS K over all 128 keys and stages it (float32) for the reducer;
- a loader warp: K and V once, then each query tile's Q, dO and row statistics through a
  two-stage ring, refilled when both math warpgroups have released a stage;
- a reducer warp: adds each staged dQ half into a zeroed float32 (B, H, n_q, d) buffer by a
  TMA reduce-add from shared memory (done in L2), then hands the staging buffer back.

So the math warpgroups never wait for a reduce, and they meet once per tile (the dS^T
exchange). The caller zeroes the buffer and converts it to dq's dtype afterwards. Triton
3.6's Gluon has no wrapper for the reduce-add; ``_reduce_add`` emits the op its builder
provides (later Gluon names it ``tma.async_atomic_add``). The sums in dQ arrive in no fixed
order, so dq may differ in its last bits between runs; ``Options.backward="split"`` and
torch's deterministic mode keep the deterministic split kernels.

Grouped-query heads work as in ``gluon_dkdv``: the program walks the q heads of its k/v
head and sums their dK, dV in registers; each q head's dQ goes to its own rows. Windows and
packed sequences keep the split kernels. Measured against the split backward and the
variants that lost: flashattn-triton DESIGN.md, "One-pass backward".
"""

from __future__ import annotations

import torch

from . import fastlaunch
from ._device import head_group_args, sm_count
from .configs import next_pow2
from .gluon_dkdv import (
    GL_DTYPES,
    HAVE_GLUON,
    LOG2E,
    _desc,
    _flat_desc,
    applies,
    launch_order,
    rows_by_tma,
    run_guarded,
)
from .options import get_options

if HAVE_GLUON:
    from triton._C.libtriton import ir
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language._core import builtin
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_init,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from .gluon_dkdv import _query_tile, _store_dkdv, _sync_partition, _tile_stage, _tma_load
    from .kernels import _grouped_program

HEAD_DIMS = (64, 128)
# Fewer keys keep the split kernels. Forward + backward through the package on an H200,
# replayed launches, ms against the split kernels: 1 x 64 heads x 1024 causal 0.34-0.44
# against 0.22-0.26 (lost), 1 x 32 x 2048 causal 0.32 against 0.33, 1 x 16 x 4096 causal
# 0.52 against 0.55, 1 x 32 x 2048 non-causal 0.51 against 0.57, and faster on every longer
# shape measured. As GPU time on an H100 (CUDA-graph replays) it still loses at 512 and 1024
# keys: 1 x 128 x 512 non-causal 0.214 against 0.196 ms, 1 x 64 x 1024 0.309 against 0.301
# (DESIGN, "One-pass backward").
MIN_KEYS = 2048
# At head dim 64 a program does half of d = 128's math per query tile while its row loads,
# dS exchange and dQ reduce-adds per tile stay, so it needs longer key ranges to beat the
# split kernels: MIN_KEYS times D64_KEY_FACTOR[causal, the grid has D64_MANY_WAVES waves of
# 128-key programs]. GPU time of forward + backward on an H200, ms, split against one-pass:
# non-causal 1 x 32 x 2048 (four waves) 0.313 against 0.317, 1 x 16 x 4096 0.610 against
# 0.577, 8 x 16 x 2048 1.392 against 1.249; causal 1 x 16 x 4096 (four waves) 0.308 against
# 0.320, 8 x 16 x 2048 0.754 against 0.761, 1 x 8 x 8192 0.579 against 0.570, 4 x 32 x 4096
# 2.766 against 2.555; 4-19% faster on the longer shapes (DESIGN, "At d = 64").
D64_KEY_FACTOR = {(False, False): 2, (False, True): 1, (True, False): 4, (True, True): 2}
D64_MANY_WAVES = 8
# Registers per thread (setmaxnreg) of the worker math warpgroup; the 1-warp workers get 24 and
# the default partition's math warpgroup the rest (256 in the sm_90 compile).
MATH_REGS = 240
# Where the L2 rule the other kernels follow (``configs.head_group``) keeps the plain order,
# head fastest (under four times L2 of streamed rows), this kernel runs MAX_HEAD_GROUP k/v
# heads' programs at a time instead (``Options.head_group="auto"`` only): every program of
# a head reads that head's Q / dO tiles and adds into its dQ rows, so concurrent programs
# should share heads. Causal grids of fewer than CAUSAL_MIN_WAVES waves keep the plain
# order, which starts every head's heaviest key tiles first (groups start later groups'
# heavy tiles late). Where the L2 rule groups heads already, its group stays: two heads
# were not shown better there (4 x 32 x 4096 causal, 15 heads by the rule, moved by 5%
# between identical settings). GPU time of forward + backward on an H200, ms, plain order
# against two heads: 8 x 16 x 2048 causal 1.53 against 1.19, non-causal 2.61 against 1.95;
# 1 x 16 x 16384 non-causal 14.23 against 13.40; 1 x 32 x 2048 causal (four waves) 0.314
# against 0.338 (DESIGN, "One-pass backward").
MAX_HEAD_GROUP = 2
CAUSAL_MIN_WAVES = 8
# Grouped-query heads: where the L2 rule groups k/v heads, its group is rounded up to a power
# of two (GQA_POW2_GROUPS), so that groups tile the heads and still fit the L2 cache (at most
# 2 * HEAD_GROUP_L2_SHARE of it). fwd+bwd on an H100, 32 q / 8 kv heads, d = 128, causal,
# 4 x 4096: the rule's 3 heads 4.202 ms, rounded to 4 heads 4.091, SDPA 4.198 (DESIGN,
# "One-pass backward", "Grouped-query heads").
GQA_POW2_GROUPS = True


if HAVE_GLUON:

    @builtin
    def _reduce_add(tensor_desc, coord, src, _semantic=None):
        """global[box at coord] += shared memory ``src``, by TMA (completion as for a TMA
        store: ``tma.store_wait``)."""
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(
            ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle
        )

    @gluon.jit
    def _ws_load(
        q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, k_smem, v_smem, qdo_smem,
        lse_smem, delta_smem, ready, empty, kv_ready, b, hk, pid_bh, n_heads, kv_group,
        start_n, lo, tiles_per_head, n_iters, stride_stats, STAGES: gl.constexpr,
        BLOCK_M: gl.constexpr, GQA: gl.constexpr,
    ):  # fmt: skip
        """Loader warp: K and V once, then each query tile's Q, dO and row statistics as
        soon as both math warpgroups have released its ring stage."""
        mbarrier.expect(kv_ready, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        _tma_load(k_desc, [b, hk, start_n, 0], kv_ready, k_smem)
        _tma_load(v_desc, [b, hk, start_n, 0], kv_ready, v_smem)
        for i in range(n_iters):
            # A fresh mbarrier counts as having completed the phase before phase 0.
            mbarrier.wait(empty.index(i % STAGES), ((i // STAGES) & 1) ^ 1)
            qh, row, stats_bh = _query_tile(
                i, lo, tiles_per_head, b, hk, pid_bh, n_heads, kv_group, BLOCK_M, GQA
            )
            _tile_stage(
                i, row, qh, stats_bh, q_desc, do_desc, lse_desc, delta_desc, qdo_smem, qdo_smem,
                lse_smem, delta_smem, ready, b, stride_stats, STAGES, True, True, INTERLEAVED=True,
            )  # fmt: skip

    @gluon.jit
    def _ws_reduce(
        dq_desc, stage_smem, dq_ready, dq_free, b, hk, pid_bh, n_heads, kv_group, lo,
        tiles_per_head, n_iters, BLOCK_M: gl.constexpr, HALF_D: gl.constexpr,
        GQA: gl.constexpr,
    ):  # fmt: skip
        """Reducer warp: add each query tile's two staged dQ halves into the float32 buffer,
        then hand the staging buffers back once the TMA has read them."""
        for i in range(n_iters):
            qh, row, _ = _query_tile(
                i, lo, tiles_per_head, b, hk, pid_bh, n_heads, kv_group, BLOCK_M, GQA
            )
            buf = i % 2
            for wg in gl.static_range(2):
                mbarrier.wait(dq_ready.index(2 * wg + buf), (i // 2) & 1)
                _reduce_add(dq_desc, [b, qh, row, wg * HALF_D], stage_smem.index(2 * wg + buf))
            tma.store_wait(0)
            for wg in gl.static_range(2):
                mbarrier.arrive(dq_free.index(2 * wg + buf), count=1)

    @gluon.jit
    def _ws_math(
        k_smem, v_smem, qdo_smem, lse_smem, delta_smem, ds_smem, stage_smem, ready, empty,
        kv_ready, ds_ready, dq_ready, dq_free, DK, DV, stride_dkb, stride_dkh, stride_dkn,
        stride_dvb, stride_dvh, stride_dvn, b, hk, pid_bh, n_heads, kv_group, start_n, lo,
        tiles_per_head, n_iters, n_q, n_k, qk_scale, sm_scale, WG: gl.constexpr,
        BLOCK_M: gl.constexpr, HALF_N: gl.constexpr, HEAD_DIM: gl.constexpr,
        STAGES: gl.constexpr, CAUSAL: gl.constexpr, GQA: gl.constexpr,
    ):  # fmt: skip
        """Math warpgroup WG: keys start_n + WG * HALF_N .. + HALF_N. Per query tile: S^T,
        dP^T, dV, dK for its keys; its dS^T half into shared memory; once the other
        warpgroup's half is there too, dQ's column half WG over all the program's keys,
        staged for the reducer warp."""
        dtype: gl.constexpr = k_smem.dtype
        HALF_D: gl.constexpr = HEAD_DIM // 2
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16]
        )
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
        )
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF_D, 16]
        )
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        k_all = k_smem.reshape([2 * HALF_N, HEAD_DIM])
        k_half = k_all.slice(WG * HALF_N, HALF_N, dim=0)
        v_half = v_smem.reshape([2 * HALF_N, HEAD_DIM]).slice(WG * HALF_N, HALF_N, dim=0)
        k_cols = k_all.slice(WG * HALF_D, HALF_D, dim=1)
        key0 = start_n + WG * HALF_N
        causal_off = n_k - n_q
        offs_n = key0 + gl.arange(0, HALF_N, layout=row_layout)
        offs_tm = gl.arange(0, BLOCK_M, layout=col_layout)
        zero_s = gl.zeros([HALF_N, BLOCK_M], gl.float32, layout=s_layout)
        zero_dq = gl.zeros([BLOCK_M, HALF_D], gl.float32, layout=dq_layout)
        dk = warpgroup_mma_init(gl.zeros([HALF_N, HEAD_DIM], gl.float32, layout=acc_layout))
        dv = warpgroup_mma_init(gl.zeros([HALF_N, HEAD_DIM], gl.float32, layout=acc_layout))
        mask_below = key0 + HALF_N - 1 - causal_off
        keys_ragged = key0 + HALF_N > n_k
        mbarrier.wait(kv_ready, 0)
        for i in range(n_iters):
            stage = i % STAGES
            _, start_m, _ = _query_tile(
                i, lo, tiles_per_head, b, hk, pid_bh, n_heads, kv_group, BLOCK_M, GQA
            )
            offs_m = start_m + offs_tm
            mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
            lse2 = lse_smem.index(stage).load(col_layout)
            q_s = qdo_smem.index(2 * stage).reshape([BLOCK_M, HEAD_DIM])
            do_s = qdo_smem.index(2 * stage + 1).reshape([BLOCK_M, HEAD_DIM])
            s_tok = warpgroup_mma(k_half, q_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            dp_tok = warpgroup_mma(
                v_half, do_s.permute((1, 0)), zero_s, use_acc=False, is_async=True
            )
            # Waiting for S^T retires the previous tile's products: its stage is free.
            s_t = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))
            mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), count=1, pred=i > 0)
            p_t = gl.exp2(s_t * qk_scale - lse2[None, :])
            needs_mask = (start_m + BLOCK_M > n_q) | keys_ragged
            if CAUSAL:
                needs_mask = needs_mask | (start_m < mask_below)
            if needs_mask:
                keep = (offs_m < n_q)[None, :] & (offs_n < n_k)[:, None]
                if CAUSAL:
                    keep = keep & (offs_n[:, None] <= offs_m[None, :] + causal_off)
                p_t = gl.where(keep, p_t, 0.0)
            dv = warpgroup_mma(gl.convert_layout(p_t.to(dtype), a_layout), do_s, dv, is_async=True)
            dp_t = warpgroup_mma_wait(num_outstanding=1, deps=(dp_tok,))
            delta = delta_smem.index(stage).load(col_layout)
            ds_t = (p_t * (dp_t - delta[None, :])).to(dtype)
            dsb = i % 2
            ds_smem.index(dsb).slice(WG * HALF_N, HALF_N, dim=0).store(ds_t)
            fence_async_shared()
            _sync_partition()
            mbarrier.arrive(ds_ready.index(dsb), count=1)
            dk = warpgroup_mma(gl.convert_layout(ds_t, a_layout), q_s, dk, is_async=True)
            mbarrier.wait(ds_ready.index(dsb), (i // 2) & 1)
            dq_tok = warpgroup_mma(
                ds_smem.index(dsb).permute((1, 0)), k_cols, zero_dq, use_acc=False,
                is_async=True,
            )  # fmt: skip
            # Waiting for dQ, the last group issued, retires dV and dK too.
            dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq_tok,))
            # The buffer this tile stages into was read by the reducer two tiles ago.
            mbarrier.wait(dq_free.index(2 * WG + dsb), ((i // 2) & 1) ^ 1)
            stage_smem.index(2 * WG + dsb).reshape([BLOCK_M, HALF_D]).store(dq * sm_scale)
            fence_async_shared()
            _sync_partition()
            mbarrier.arrive(dq_ready.index(2 * WG + dsb), count=1)

        dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
        _store_dkdv(
            DK, DV, dk, dv, b, hk, key0, n_k, stride_dkb, stride_dkh, stride_dkn, stride_dvb,
            stride_dvh, stride_dvn, sm_scale, HALF_N, HEAD_DIM, acc_layout,
        )  # fmt: skip

    @gluon.jit
    def bwd_ws_kernel(
        q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, dq_desc, DK, DV,
        stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
        n_heads, n_q, n_k, stride_stats, qk_scale, sm_scale, head_group, kv_group,
        DS_LAYOUT: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr,
        STAGES: gl.constexpr, CAUSAL: gl.constexpr, GROUPED: gl.constexpr,
        GQA: gl.constexpr, MATH_REGS: gl.constexpr, num_warps: gl.constexpr,
    ):  # fmt: skip
        """The warp-specialized variant: one program per 128 keys of one (batch, k/v head);
        two math warpgroups (64 keys each), a loader warp and a reducer warp. dq_desc: (1, 1,
        BLOCK_M, HEAD_DIM / 2) float32 boxes; the other arguments as for ``bwd_kernel``."""
        HALF_N: gl.constexpr = 64
        HALF_D: gl.constexpr = HEAD_DIM // 2
        pid_bh, tile = _grouped_program(head_group, GROUPED)
        start_n = tile * (2 * HALF_N)
        dtype: gl.constexpr = q_desc.dtype
        if GQA:
            n_kv_heads = n_heads // kv_group
        else:
            n_kv_heads = n_heads
        b = pid_bh // n_kv_heads
        hk = pid_bh % n_kv_heads
        k_smem = gl.allocate_shared_memory(dtype, [1, 1, 2 * HALF_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [1, 1, 2 * HALF_N, HEAD_DIM], v_desc.layout)
        qdo_smem = gl.allocate_shared_memory(
            dtype, [2 * STAGES, 1, 1, BLOCK_M, HEAD_DIM], q_desc.layout
        )
        lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], lse_desc.layout)
        delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], delta_desc.layout)
        ds_smem = gl.allocate_shared_memory(dtype, [2, 2 * HALF_N, BLOCK_M], DS_LAYOUT)
        # dQ staging: buffer 2 * warpgroup + (tile % 2), a (1, 1, BLOCK_M, HALF_D) box each.
        stage_smem = gl.allocate_shared_memory(
            gl.float32, [4, 1, 1, BLOCK_M, HALF_D], dq_desc.layout
        )
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        dq_ready = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
        dq_free = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=2)  # both math warpgroups release a stage
        mbarrier.init(kv_ready, count=1)
        for s in gl.static_range(2):
            mbarrier.init(ds_ready.index(s), count=2)
        for s in gl.static_range(4):
            mbarrier.init(dq_ready.index(s), count=1)
            mbarrier.init(dq_free.index(s), count=1)

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
                    _ws_math,
                    (
                        k_smem, v_smem, qdo_smem, lse_smem, delta_smem, ds_smem, stage_smem,
                        ready, empty, kv_ready, ds_ready, dq_ready, dq_free, DK, DV,
                        stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                        b, hk, pid_bh, n_heads, kv_group, start_n, lo, tiles_per_head,
                        n_iters, n_q, n_k, qk_scale, sm_scale, 0, BLOCK_M, HALF_N, HEAD_DIM,
                        STAGES, CAUSAL, GQA,
                    ),
                ),
                (
                    _ws_math,
                    (
                        k_smem, v_smem, qdo_smem, lse_smem, delta_smem, ds_smem, stage_smem,
                        ready, empty, kv_ready, ds_ready, dq_ready, dq_free, DK, DV,
                        stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                        b, hk, pid_bh, n_heads, kv_group, start_n, lo, tiles_per_head,
                        n_iters, n_q, n_k, qk_scale, sm_scale, 1, BLOCK_M, HALF_N, HEAD_DIM,
                        STAGES, CAUSAL, GQA,
                    ),
                ),
                (
                    _ws_load,
                    (
                        q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, k_smem, v_smem,
                        qdo_smem, lse_smem, delta_smem, ready, empty, kv_ready, b, hk, pid_bh,
                        n_heads, kv_group, start_n, lo, tiles_per_head, n_iters, stride_stats,
                        STAGES, BLOCK_M, GQA,
                    ),
                ),
                (
                    _ws_reduce,
                    (
                        dq_desc, stage_smem, dq_ready, dq_free, b, hk, pid_bh, n_heads,
                        kv_group, lo, tiles_per_head, n_iters, BLOCK_M, HALF_D, GQA,
                    ),
                ),
            ],
            [4, 1, 1],
            [MATH_REGS, 24, 24],
        )  # fmt: skip


def launch_onepass(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    lse2: torch.Tensor,
    delta: torch.Tensor,
    dq_acc: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    *,
    head_group: int = 0,
    math_regs: int = MATH_REGS,
) -> None:
    """dK, dV of (B, H, N, d) 16-bit q, do and (B, Hkv, N, d) k, v (d in HEAD_DIMS; as
    ``gluon_dkdv.applies`` requires) into dk, dv, and dQ * softmax_scale added into dq_acc,
    a zeroed contiguous float32 (B, H, n_q, d) buffer. lse2 (log2 units, +inf for rows
    without keys) and delta: contiguous (B, H, rows) float32 that ``rows_by_tma`` accepts.
    Checks nothing (``try_onepass`` is the gated entry)."""
    b, h, n_q, d = q.shape
    h_kv, n_k = k.shape[1], k.shape[2]
    block_m, block_n = 64, 128
    group, grouped = launch_order(head_group, b * h_kv)
    box = [1, 1, block_m, d // 2]  # each math warpgroup's half of a dQ tile
    dq_desc = TensorDescriptor(
        dq_acc, list(dq_acc.shape), list(dq_acc.stride()), box,
        gl.NVMMASharedLayout.get_default_for(box, gl.float32),
    )  # fmt: skip
    ds_layout = gl.NVMMASharedLayout.get_default_for(
        [block_n, block_m], getattr(gl, GL_DTYPES[q.dtype])
    )
    fastlaunch.launch(
        bwd_ws_kernel, (b * h_kv, -(-n_k // block_n)),
        _desc(q, block_m), _desc(k, block_n), _desc(v, block_n), _desc(do, block_m),
        _flat_desc(lse2, block_m), _flat_desc(delta, block_m), dq_desc, dk, dv,
        dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
        h, n_q, n_k, lse2.shape[-1], softmax_scale * LOG2E, softmax_scale, group, h // h_kv,
        DS_LAYOUT=ds_layout, BLOCK_M=block_m, HEAD_DIM=d, STAGES=2, CAUSAL=causal,
        GROUPED=grouped, GQA=h_kv != h, MATH_REGS=math_regs, num_warps=4,
    )  # fmt: skip


def _has_waves(q: torch.Tensor, k: torch.Tensor, waves: int) -> bool:
    """Whether the grid's (batch x k/v head x 128-key tile) programs fill ``waves`` waves of
    one program per SM."""
    return k.shape[0] * k.shape[1] * -(-k.shape[2] // 128) >= waves * sm_count(q)


def enough_keys(q: torch.Tensor, k: torch.Tensor, causal: bool) -> bool:
    """At least MIN_KEYS keys, and at head dim 64 MIN_KEYS times D64_KEY_FACTOR."""
    n_k = k.shape[2]
    if n_k < MIN_KEYS:
        return False
    if q.shape[3] != 64:
        return True
    many_waves = _has_waves(q, k, D64_MANY_WAVES)
    return n_k >= MIN_KEYS * D64_KEY_FACTOR[bool(causal), many_waves]


def would_run(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, causal: bool
) -> bool:
    """Whether the launcher takes this kernel: ``enough_keys``, ``Options.gluon``, a Hopper
    GPU and TMA-readable 16-bit inputs with a head dim in HEAD_DIMS
    (``gluon_dkdv.applies``)."""
    table = {d: {} for d in HEAD_DIMS}
    return applies(q, k, v, do, defaults=table) and enough_keys(q, k, causal)


def head_group(q: torch.Tensor, k: torch.Tensor, causal: bool, cap: int | None = None) -> int:
    """Heads whose programs run at a time (``launch_onepass``'s ``head_group``): the L2 rule's
    (``_device.head_group_args``, which reads ``Options.head_group``), and under "auto" at
    most ``cap`` (default MAX_HEAD_GROUP) where that rule keeps the plain order, unless the
    grid is causal with fewer than CAUSAL_MIN_WAVES waves of 128-key programs; with
    grouped-query heads the rule's own groups are rounded up to a power of two
    (GQA_POW2_GROUPS)."""
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
        raise ValueError(f"cap: expected a positive int (heads at a time), got {cap!r}")
    b, h, n_q, d = q.shape
    h_kv = k.shape[1]
    group = head_group_args(q, b * h_kv, n_q * (h // h_kv), d)["head_group"]
    plain = group >= b * h_kv  # the L2 rule found too few streamed rows to group heads
    many_waves = _has_waves(q, k, CAUSAL_MIN_WAVES)
    auto = get_options().head_group == "auto"
    if plain and auto and (many_waves or not causal):
        group = min(group, MAX_HEAD_GROUP if cap is None else cap)
    elif auto and not plain and h_kv != h and GQA_POW2_GROUPS:
        group = min(next_pow2(group), b * h_kv)
    return group


def try_onepass(
    q, k, v, do, lse2, delta, dq_acc, dk, dv, causal: bool, softmax_scale: float
) -> bool:
    """Write dk, dv and add dQ * softmax_scale into dq_acc (a zeroed contiguous float32
    (B, H, n_q, d) buffer; the caller converts it into dq) by the one-pass kernel where it
    applies (``would_run``, outputs with a unit last stride, row statistics ``rows_by_tma``
    accepts); False if the caller should run the split kernels instead (a failing first
    compile warns once per key, see ``gluon_dkdv.run_guarded``). delta must hold D already.
    The launch goes through ``fastlaunch``, so a launch plan replays it."""
    table = {d: {} for d in HEAD_DIMS}
    if not (would_run(q, k, v, do, causal) and applies(q, k, v, do, dk, dv, defaults=table)):
        return False
    if not rows_by_tma(lse2, delta):
        return False
    h, d, h_kv = q.shape[1], q.shape[3], k.shape[1]
    group = head_group(q, k, causal)
    return run_guarded(
        "one-pass backward",
        (d, q.dtype, causal, h_kv != h),
        lambda: launch_onepass(
            q, k, v, do, lse2, delta, dq_acc, dk, dv, causal, softmax_scale, head_group=group
        ),
    )
