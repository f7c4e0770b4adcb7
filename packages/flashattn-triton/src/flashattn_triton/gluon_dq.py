"""dQ on Hopper written in Gluon, the split backward's second kernel (companion of
``gluon_dkdv``). Each key tile goes:

    issue S = Q K^T and dP = dO V^T              (two groups in flight)
    wait for S only; P = exp2(S - lse)            (dP still running)
    wait for dP; dS = P (dP - delta); issue dQ += dS K

Used by the split backward where ``gluon_dkdv.applies`` holds with this module's DEFAULTS
(Hopper, 16-bit, d = 128, TMA-readable layouts; ``Options.gluon`` turns both Gluon
kernels off) and the grid is small (``small_grid``) or the keys are many (``MIN_KEYS``).
Q and dO stay in shared memory; K and
V stream through a ring of TMA stages, loaded by the math warps STAGES - 1 tiles ahead. One
program owns BLOCK_M query rows of one (batch, head), one warpgroup per 64 rows; loads go
through the same 4-D descriptors as ``gluon_dkdv``.
"""

from __future__ import annotations

import torch

from . import fastlaunch
from ._device import head_group_args, sm_count
from .gluon_dkdv import HAVE_GLUON, LOG2E, _desc, applies, launch_order, run_guarded

# Measured defaults by head dim (H100); at d = 64 it is slower.
DEFAULTS: dict[int, dict] = {128: {"block_m": 64, "block_n": 64, "stages": 2, "maxnreg": None}}
# The whole backward with this kernel (H100) was
# 1.24-1.25x faster on grids under MAX_WAVES waves of 128-row programs; with at least
# MIN_KEYS keys 1.01-1.06x in the plain launch order and 1.05-1.08x head-grouped (lm-core's
# 8B shape, 2 x 32 heads x 32K tokens: 1.07x; in the plain order the largest grids had lost
# 0.76-0.91x, which the head groups now prevent); at 512 keys it lost (0.97x).
MAX_WAVES = 2
MIN_KEYS = 2048

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_init,
        warpgroup_mma_wait,
    )

    from .gluon_dkdv import _grouped_program, _row_stats, _tile_pair, _tma_load

    @gluon.jit
    def dq_kernel(
        q_desc, k_desc, v_desc, do_desc, LSE, DELTA, DQ, stride_dqb, stride_dqh, stride_dqn,
        n_heads, n_q, n_k, stride_stats, qk_scale, sm_scale, head_group, kv_group,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
        STAGES: gl.constexpr, CAUSAL: gl.constexpr, GROUPED: gl.constexpr,
        GQA: gl.constexpr, num_warps: gl.constexpr,
    ):  # fmt: skip
        """One program: dQ of one query tile (the last, heaviest, first); head_group,
        GROUPED: the launch order (``kernels._grouped_program``); LSE, DELTA rows are
        stride_stats apart. GQA: q head h reads k/v head h // kv_group."""
        pid_bh, tile = _grouped_program(head_group, GROUPED)
        start_m = (gl.num_programs(1) - 1 - tile) * BLOCK_M
        dtype: gl.constexpr = q_desc.dtype
        b = pid_bh // n_heads
        h = pid_bh % n_heads
        if GQA:
            hk = h // kv_group
        else:
            hk = h
        causal_off = n_k - n_q
        if CAUSAL:
            hi = gl.maximum(gl.minimum(n_k, start_m + BLOCK_M + causal_off), 0)
        else:
            hi = n_k
        n_tiles = gl.cdiv(hi, BLOCK_N)
        # A key tile starting after this key reaches past the first row's last visible key.
        mask_from = start_m + causal_off - BLOCK_N + 1

        q_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_M, HEAD_DIM], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_M, HEAD_DIM], do_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, HEAD_DIM], v_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        qd_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for st in gl.static_range(STAGES):
            mbarrier.init(ready.index(st), count=1)
        mbarrier.init(qd_ready, count=1)
        mbarrier.expect(qd_ready, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        _tma_load(q_desc, [b, h, start_m, 0], qd_ready, q_smem)
        _tma_load(do_desc, [b, h, start_m, 0], qd_ready, do_smem)
        for i in gl.static_range(STAGES - 1):
            _tile_pair(
                i, 0, k_desc, v_desc, k_smem, v_smem, ready, b, hk, STAGES, BLOCK_N, i < n_tiles
            )

        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16]
        )
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 16]
        )
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        offs_m = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        lse2, delta = _row_stats(
            LSE + pid_bh.to(gl.int64) * stride_stats,
            DELTA + pid_bh.to(gl.int64) * stride_stats,
            offs_m,
            n_q,
            False,
        )
        zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
        dq = warpgroup_mma_init(gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=acc_layout))
        q_t = q_smem.reshape([BLOCK_M, HEAD_DIM])
        do_t = do_smem.reshape([BLOCK_M, HEAD_DIM])
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
            nxt = j + STAGES - 1
            _tile_pair(
                nxt, 0, k_desc, v_desc, k_smem, v_smem, ready, b, hk, STAGES, BLOCK_N,
                nxt < n_tiles,
            )  # fmt: skip
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
        out_rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
        out_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
        base = DQ + b.to(gl.int64) * stride_dqb + h.to(gl.int64) * stride_dqh
        ptrs = base + out_rows.to(gl.int64)[:, None] * stride_dqn + out_cols[None, :]
        gl.store(ptrs, (dq * sm_scale).to(dtype), mask=(out_rows < n_q)[:, None])
        for st in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(st))
        mbarrier.invalidate(qd_ready)


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
    block_m: int,
    block_n: int,
    stages: int,
    maxnreg: int | None = None,
    head_group: int = 0,
) -> None:
    """Write dQ of (B, H, N, d) 16-bit q, do and (B, Hkv, N, d) k, v (layouts as in
    ``gluon_dkdv.applies``; q head h reads k/v head h // (H // Hkv)) into dq; lse (natural
    log) and delta: contiguous (B, H, >= n_q) float32 (rows past n_q unread). Checks
    nothing. ``head_group``: programs of that many heads at a time; 0: the plain order."""
    b, h, n_q, d = q.shape
    n_k = k.shape[2]
    group, grouped = launch_order(head_group, b * h)
    fastlaunch.launch(
        dq_kernel, (b * h, -(-n_q // block_m)),
        _desc(q, block_m), _desc(k, block_n), _desc(v, block_n), _desc(do, block_m),
        lse, delta, dq, dq.stride(0), dq.stride(1), dq.stride(2), h, n_q, n_k, lse.shape[-1],
        softmax_scale * LOG2E, softmax_scale, group, h // k.shape[1],
        BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=d, STAGES=stages, CAUSAL=causal,
        GROUPED=grouped, GQA=k.shape[1] != h, num_warps=block_m // 16,
        **({"maxnreg": maxnreg} if maxnreg else {}),
    )  # fmt: skip


def would_run(q, k, v, do, dq) -> bool:
    """Whether ``try_dq`` tries the Gluon kernel: it applies (``gluon_dkdv.applies`` with
    this module's DEFAULTS) and the grid has MIN_KEYS keys or is small."""
    if not applies(q, k, v, do, dq, defaults=DEFAULTS):
        return False
    return k.shape[2] >= MIN_KEYS or small_grid(q)


def try_dq(q, k, v, do, lse, delta, dq, causal: bool, softmax_scale: float) -> bool:
    """Run the default Gluon dQ if ``would_run``; False if the caller should run the Triton
    kernel instead (see ``gluon_dkdv.run_guarded``). delta must hold D already."""
    if not would_run(q, k, v, do, dq):
        return False
    return run_default(q, k, v, do, lse, delta, dq, causal, softmax_scale)


def run_default(q, k, v, do, lse, delta, dq, causal: bool, softmax_scale: float) -> bool:
    """``try_dq`` for a caller that has checked ``would_run`` itself (the split backward,
    which must compute D first)."""
    b, h, _, d = q.shape
    group = head_group_args(k, b * h, k.shape[2], d)["head_group"]
    return run_guarded(
        "dQ",
        (d, q.dtype, causal, k.shape[1] != h),
        lambda: launch_dq(
            q, k, v, do, lse, delta, dq, causal, softmax_scale, **DEFAULTS[d], head_group=group
        ),
    )


def small_grid(q: torch.Tensor) -> bool:
    """Whether q's (B, H, N, d) grid has fewer than MAX_WAVES programs of 128 rows per SM
    (the measured domain where this kernel wins; False off-GPU)."""
    b, h, n_q, _ = q.shape
    return b * h * -(-n_q // 128) < MAX_WAVES * sm_count(q)
