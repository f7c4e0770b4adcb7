"""One-pass attention backward for head dims 128 and 64 in Gluon: the package's
warp-specialized kernel (``flashattn_triton.gluon_bwd``, spec ``ws``) beside the simpler
variants it grew from, which lost (flashattn-triton DESIGN.md, "One-pass backward").

The package's d = 128 split backward on Hopper (``gluon_dq``, ``gluon_dkdv``) computes seven
products where five are counted. The one-pass variants add the fifth to the dK/dV loop: per
query tile dQ = dS K for the program's own keys, added into a zeroed float32 (B, H, n_q, d)
buffer by a TMA reduce-add from shared memory (done in L2), then converted to dq's dtype.
The variants here (``bwd_kernel``) do everything in the math warps: each query tile

    issue S^T = K Q^T and dP^T = V dO^T; wait for S^T; refill a ring stage
    P^T = exp2(S^T - lse); issue dV += P^T dO; wait for dP^T
    dS^T = P^T (dP^T - delta); issue dK += dS^T Q; dS^T to shared memory; issue dQ = dS K
    wait for all; dQ * scale to a float32 staging buffer; reduce-add it (asynchronous)

Variant spec ``BLOCK_N[,sep][,late]``: 64 keys per program (one warpgroup, dQ staged in the
Q / dO ring stage it replaces, two programs per SM) or 128 (two warpgroups; ``sep``: two
staging buffers of their own); ``late``: refill the ring stage after dK is issued instead
of after S^T arrives. ``ws[,REGS]``: the package's kernel, where two math warpgroups, a
loader warp and a reducer warp are separate partitions. ``--ablate`` (first spec, not
``ws``) times the ``bwd_kernel`` without the reduce (1) or without staging and reduce (2).
The script makes the row statistics with torch ops, so its one-pass times include that work,
which the package's launcher does in one kernel.

    python benchmarks/onepass_bwd.py offline ws 64 128,sep,late        # any machine
    python benchmarks/onepass_bwd.py check ws 128,sep,late --out $OUT  # Hopper GPU
    python benchmarks/onepass_bwd.py time ws 128,sep,late --out $OUT
    python benchmarks/onepass_bwd.py time 128,sep,late 64 --ablate 1 2 --out $OUT
    python benchmarks/onepass_bwd.py time ws --d 64 --out $OUT
    python benchmarks/onepass_bwd.py time ws --d 64 --head-group-cap 1000000 --out $OUT

``--d 64`` runs the same kernels at head dim 64 (129 KB of shared memory, one program per
SM, no spills), which the package runs on long rows (``gluon_bwd.enough_keys``; DESIGN.md,
"At d = 64").
``--head-group-cap`` sets the launch order's cap (``gluon_bwd.head_group``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

from flashattn_triton.gluon_dkdv import (
    GL_DTYPES,
    HAVE_GLUON,
    LOG2E,
    _desc,
    _flat_desc,
    launch_order,
)

if HAVE_GLUON:
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

    from flashattn_triton.gluon_bwd import _reduce_add, bwd_ws_kernel
    from flashattn_triton.gluon_dkdv import _query_tile, _store_dkdv, _tile_stage, _tma_load
    from flashattn_triton.kernels import _grouped_program

if HAVE_GLUON:

    @builtin
    def _view_as(smem, dtype, shape, layout, _semantic=None):
        """smem seen with another dtype, shape and layout (the method is ``_reinterpret``
        in Triton 3.6, ``reinterpret`` later)."""
        view = getattr(smem, "reinterpret", None) or smem._reinterpret
        return view(dtype, shape, layout, _semantic=_semantic)

    @gluon.jit
    def _refill(
        i, lo, tiles_per_head, b, hk, pid_bh, n_heads, kv_group, q_desc, do_desc, lse_desc,
        delta_desc, qdo_smem, lse_smem, delta_smem, ready, stride_stats, STAGES: gl.constexpr,
        BLOCK_M: gl.constexpr, GQA: gl.constexpr, WAIT_REDUCE: gl.constexpr, pred,
    ):  # fmt: skip
        """Load the i-th query tile into its ring stage (the interleaved Q / dO ring); with
        WAIT_REDUCE first wait until the dQ reduce staged in that stage has read it."""
        if WAIT_REDUCE:
            tma.store_wait(0)
        qh, row, stats_bh = _query_tile(
            i, lo, tiles_per_head, b, hk, pid_bh, n_heads, kv_group, BLOCK_M, GQA
        )
        _tile_stage(
            i, row, qh, stats_bh, q_desc, do_desc, lse_desc, delta_desc, qdo_smem, qdo_smem,
            lse_smem, delta_smem, ready, b, stride_stats, STAGES, True, pred, INTERLEAVED=True,
        )  # fmt: skip

    @gluon.jit
    def bwd_kernel(
        q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, dq_desc, DK, DV,
        stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
        n_heads, n_q, n_k, stride_stats, qk_scale, sm_scale, head_group, kv_group,
        DS_LAYOUT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
        GROUPED: gl.constexpr, GQA: gl.constexpr, SEPARATE: gl.constexpr,
        LATE: gl.constexpr, ABLATE: gl.constexpr, num_warps: gl.constexpr,
    ):  # fmt: skip
        """One program: one key tile of one (batch, k/v head). dK, dV stored through their
        (batch, head, row) strides; dQ * sm_scale added into dq_desc's float32 buffer.
        lse_desc, delta_desc: 1-D views of the (B*H, stride_stats) row statistics, lse in
        log2 units (+inf for rows without keys)."""
        pid_bh, tile = _grouped_program(head_group, GROUPED)
        start_n = tile * BLOCK_N
        dtype: gl.constexpr = q_desc.dtype
        if GQA:
            n_kv_heads = n_heads // kv_group
        else:
            n_kv_heads = n_heads
        b = pid_bh // n_kv_heads
        hk = pid_bh % n_kv_heads

        k_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, HEAD_DIM], v_desc.layout)
        if SEPARATE:  # two float32 dQ staging buffers of their own; 16-bit Q, dO ring
            qdo_smem = gl.allocate_shared_memory(
                dtype, [2 * STAGES, 1, 1, BLOCK_M, HEAD_DIM], q_desc.layout
            )
            stage_smem = gl.allocate_shared_memory(
                gl.float32, [2, 1, 1, BLOCK_M, HEAD_DIM], dq_desc.layout
            )
        else:  # ring stage s: float32 dQ staging, or 16-bit buffers 2s (Q) and 2s + 1 (dO)
            stage_smem = gl.allocate_shared_memory(
                gl.float32, [STAGES, 1, 1, BLOCK_M, HEAD_DIM], dq_desc.layout
            )
            qdo_smem = _view_as(
                stage_smem, dtype, [2 * STAGES, 1, 1, BLOCK_M, HEAD_DIM], q_desc.layout
            )
        lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], lse_desc.layout)
        delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], delta_desc.layout)
        ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M], DS_LAYOUT)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
        mbarrier.init(kv_ready, count=1)

        # Query tiles [lo, n_q): causal rows before the tile's first key (bottom-right
        # aligned) see none of it.
        if CAUSAL:
            lo = gl.maximum(start_n - (n_k - n_q), 0) // BLOCK_M * BLOCK_M
        else:
            lo = 0
        tiles_per_head = gl.cdiv(n_q - lo, BLOCK_M)
        if GQA:
            n_iters = tiles_per_head * kv_group
        else:
            n_iters = tiles_per_head

        mbarrier.expect(kv_ready, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        _tma_load(k_desc, [b, hk, start_n, 0], kv_ready, k_smem)
        _tma_load(v_desc, [b, hk, start_n, 0], kv_ready, v_smem)
        for i in gl.static_range(STAGES - 1):
            _refill(
                i, lo, tiles_per_head, b, hk, pid_bh, n_heads, kv_group, q_desc, do_desc,
                lse_desc, delta_desc, qdo_smem, lse_smem, delta_smem, ready, stride_stats,
                STAGES, BLOCK_M, GQA, False, i < n_iters,
            )  # fmt: skip

        k_tile = k_smem.reshape([BLOCK_N, HEAD_DIM])
        v_tile = v_smem.reshape([BLOCK_N, HEAD_DIM])
        # S^T tiles (BLOCK_N keys x BLOCK_M queries) and dK, dV (BLOCK_N x HEAD_DIM): one
        # warpgroup per 64 keys. dQ (BLOCK_M x HEAD_DIM): the warpgroups split its columns.
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_M, 16]
        )
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 16]
        )
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0],
            warps_per_cta=[4, num_warps // 4],
            instr_shape=[16, HEAD_DIM // (num_warps // 4), 16],
        )
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

        causal_off = n_k - n_q
        offs_n = start_n + gl.arange(0, BLOCK_N, layout=row_layout)
        offs_tm = gl.arange(0, BLOCK_M, layout=col_layout)
        zero_s = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=s_layout)
        zero_dq = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=dq_layout)
        dk = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=acc_layout))
        dv = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=acc_layout))
        # A tile needs a mask if a query in it cannot see one of our keys (the causal
        # diagonal), or if it runs past n_q, or our keys past n_k (their K rows read as
        # zeros, but exp2 of a very negative lse could overflow and reach dQ).
        mask_below = start_n + BLOCK_N - 1 - causal_off
        keys_ragged = start_n + BLOCK_N > n_k
        mbarrier.wait(kv_ready, 0)

        for i in range(n_iters):
            stage = i % STAGES
            qh, start_m, _ = _query_tile(
                i, lo, tiles_per_head, b, hk, pid_bh, n_heads, kv_group, BLOCK_M, GQA
            )
            offs_m = start_m + offs_tm
            mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
            lse2 = lse_smem.index(stage).load(col_layout)
            q_s = qdo_smem.index(2 * stage).reshape([BLOCK_M, HEAD_DIM])
            do_s = qdo_smem.index(2 * stage + 1).reshape([BLOCK_M, HEAD_DIM])
            s_tok = warpgroup_mma(k_tile, q_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            dp_tok = warpgroup_mma(
                v_tile, do_s.permute((1, 0)), zero_s, use_acc=False, is_async=True
            )
            s_t = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))
            # The stage the previous tile used gets the tile STAGES - 1 ahead, once the
            # previous tile's dQ reduce has finished reading it.
            nxt = i + STAGES - 1
            if not LATE:
                _refill(
                    nxt, lo, tiles_per_head, b, hk, pid_bh, n_heads, kv_group, q_desc, do_desc,
                    lse_desc, delta_desc, qdo_smem, lse_smem, delta_smem, ready, stride_stats,
                    STAGES, BLOCK_M, GQA, not SEPARATE, nxt < n_iters,
                )  # fmt: skip
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
            dk = warpgroup_mma(gl.convert_layout(ds_t, a_layout), q_s, dk, is_async=True)
            if LATE:
                _refill(
                    nxt, lo, tiles_per_head, b, hk, pid_bh, n_heads, kv_group, q_desc, do_desc,
                    lse_desc, delta_desc, qdo_smem, lse_smem, delta_smem, ready, stride_stats,
                    STAGES, BLOCK_M, GQA, not SEPARATE, nxt < n_iters,
                )  # fmt: skip
            ds_smem.store(ds_t)
            fence_async_shared()
            dq_tok = warpgroup_mma(
                ds_smem.permute((1, 0)), k_tile, zero_dq, use_acc=False, is_async=True
            )
            # Waiting for dQ, the last group issued, retires dV and dK too.
            dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq_tok,))
            if ABLATE != 2:
                if SEPARATE:  # the reduce that read this buffer two tiles ago is done
                    tma.store_wait(1)
                    dq_stage = stage_smem.index(i % 2)
                else:
                    dq_stage = stage_smem.index(stage)
                dq_stage.reshape([BLOCK_M, HEAD_DIM]).store(dq * sm_scale)
                fence_async_shared()
                if ABLATE != 1:
                    _reduce_add(dq_desc, [b, qh, start_m, 0], dq_stage)

        dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
        tma.store_wait(0)
        _store_dkdv(
            DK, DV, dk, dv, b, hk, start_n, n_k, stride_dkb, stride_dkh, stride_dkn, stride_dvb,
            stride_dvh, stride_dvn, sm_scale, BLOCK_N, HEAD_DIM, acc_layout,
        )  # fmt: skip
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(s))
        mbarrier.invalidate(kv_ready)


def launch_onepass(
    q, k, v, do, lse2, delta, dq_acc, dk, dv, causal: bool, softmax_scale: float, *,
    block_n: int = 64, separate: bool = False, late: bool = False, ws: bool = False,
    math_regs: int = 240, ablate: int = 0, head_group: int = 0,
) -> None:  # fmt: skip
    """dK, dV of (B, H, N, d) 16-bit q, do and (B, Hkv, N, d) k, v (d 64 or 128,
    TMA-readable as ``gluon_dkdv.applies`` requires) into dk, dv, and dQ * softmax_scale
    added into dq_acc,
    a zeroed contiguous float32 (B, H, n_q, d) buffer. lse2 (log2 units, +inf for rows
    without keys) and delta: contiguous (B, H, rows) float32, rows a multiple of 4 >= n_q.
    ``ws``: the warp-specialized kernel (128 keys, ``math_regs`` registers per math thread);
    else ``bwd_kernel`` with ``block_n``, ``separate``, ``late``. ``ablate`` (timing only,
    wrong dQ; not with ``ws``): 1 skips the reduce, 2 the staging store too."""
    b, h, n_q, d = q.shape
    h_kv, n_k = k.shape[1], k.shape[2]
    block_m = 64
    if ws:
        block_n = 128
    group, grouped = launch_order(head_group, b * h_kv)
    block = [1, 1, block_m, d // 2 if ws else d]
    dq_layout = gl.NVMMASharedLayout.get_default_for(block, gl.float32)
    dq_desc = TensorDescriptor(dq_acc, list(dq_acc.shape), list(dq_acc.stride()), block, dq_layout)
    ds_layout = gl.NVMMASharedLayout.get_default_for(
        [block_n, block_m], getattr(gl, GL_DTYPES[q.dtype])
    )
    args = (
        _desc(q, block_m), _desc(k, block_n), _desc(v, block_n), _desc(do, block_m),
        _flat_desc(lse2, block_m), _flat_desc(delta, block_m), dq_desc, dk, dv,
        dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
        h, n_q, n_k, lse2.shape[-1], softmax_scale * LOG2E, softmax_scale, group, h // h_kv,
    )  # fmt: skip
    grid = (b * h_kv, -(-n_k // block_n))
    if ws:
        bwd_ws_kernel[grid](
            *args, DS_LAYOUT=ds_layout, BLOCK_M=block_m, HEAD_DIM=d, STAGES=2, CAUSAL=causal,
            GROUPED=grouped, GQA=h_kv != h, MATH_REGS=math_regs, num_warps=4,
        )  # fmt: skip
        return
    bwd_kernel[grid](
        *args, DS_LAYOUT=ds_layout, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=d, STAGES=2,
        CAUSAL=causal, GROUPED=grouped, GQA=h_kv != h, SEPARATE=separate, LATE=late,
        ABLATE=ablate, num_warps=block_n // 16,
    )  # fmt: skip


def backward_onepass(
    do, q, k, v, o, lse, causal: bool, scale: float, cap: int | None = None, **variant
):
    """dq, dk, dv through ``launch_onepass``: the row statistics (lse in log2 units and
    delta = rowsum(dO * O), rows padded to a multiple of 256), the zeroed float32 dQ buffer
    and its conversion, as a launcher would make them, and the package's launch order
    (``gluon_bwd.head_group``, at most ``cap`` heads where the L2 rule keeps the plain
    order). lse: natural log, (B, H, n_q)."""
    from flashattn_triton.gluon_bwd import head_group

    b, h, n_q, d = q.shape
    rows = -(-n_q // 256) * 256
    lse2 = torch.full((b, h, rows), float("inf"), device=q.device)
    lse2[..., :n_q] = torch.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    delta = torch.zeros((b, h, rows), device=q.device)
    delta[..., :n_q] = (do.float() * o.float()).sum(-1)
    dq_acc = torch.zeros((b, h, n_q, d), dtype=torch.float32, device=q.device)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    group = head_group(q, k, causal, cap)
    launch_onepass(
        q, k, v, do, lse2, delta, dq_acc, dk, dv, causal, scale, head_group=group, **variant
    )
    return dq_acc.to(q.dtype), dk, dv


def parse_spec(spec: str) -> dict:
    """``BLOCK_N[,sep][,late]`` or ``ws[,REGS]`` -> ``launch_onepass`` keyword arguments."""
    parts = spec.split(",")
    if parts[0] == "ws":
        if len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
            raise ValueError(f"{spec!r}: want ws or ws,REGS")
        return {"ws": True} | ({"math_regs": int(parts[1])} if len(parts) == 2 else {})
    flags = set(parts[1:])
    if parts[0] not in ("64", "128") or not flags <= {"sep", "late"}:
        raise ValueError(f"{spec!r}: want BLOCK_N (64 or 128) then optional sep, late, or ws")
    return {"block_n": int(parts[0]), "separate": "sep" in flags, "late": "late" in flags}


def _inputs(b, h, h_kv, n_q, n_k, dtype, layout="bhnd", d=128):
    if layout == "bnhd":  # a model's (B, N, H, d) buffers seen as (B, H, N, d)
        q = torch.randn(b, n_q, h, d, device="cuda", dtype=dtype).transpose(1, 2)
        k, v = (
            torch.randn(b, n_k, h_kv, d, device="cuda", dtype=dtype).transpose(1, 2)
            for _ in range(2)
        )
    else:
        q = torch.randn(b, h, n_q, d, device="cuda", dtype=dtype)
        k, v = (torch.randn(b, h_kv, n_k, d, device="cuda", dtype=dtype) for _ in range(2))
    return q, k, v, torch.randn(b, h, n_q, d, device="cuda", dtype=dtype)


def _split(do, q, k, v, o, lse, causal, scale):
    """The package's backward; the callers hold ``use_options(backward="split")``."""
    from flashattn_triton import launch

    return launch.backward(do, q, k, v, o, lse, causal, scale)


def check(specs: list[str], out: Path | None, d: int = 128) -> int:
    """dq, dk, dv of each variant against float64 on awkward shapes (ragged, n_q != n_k,
    grouped-query heads, a (B, N, H, d) layout), the package's split backward as the
    yardstick; returns 1 if any variant is off."""
    from flashattn_triton import launch, use_options
    from flashattn_triton.reference import attention_reference

    shapes = [  # B, H, Hkv, n_q, n_k, causal, layout
        (2, 4, 4, 1024, 1024, True, "bhnd"), (2, 4, 4, 1024, 1024, False, "bhnd"),
        (1, 3, 3, 999, 999, True, "bhnd"), (1, 2, 2, 1000, 1000, False, "bhnd"),
        (1, 2, 2, 384, 640, True, "bhnd"), (1, 2, 2, 640, 384, True, "bhnd"),
        (1, 2, 2, 130, 130, False, "bhnd"), (2, 8, 2, 1024, 1024, True, "bhnd"),
        (1, 8, 1, 777, 777, True, "bhnd"), (1, 8, 8, 333, 1500, False, "bhnd"),
        (2, 4, 4, 1024, 1024, True, "bnhd"), (1, 4, 2, 4096, 4096, True, "bnhd"),
    ]  # fmt: skip
    rows, bad = [], 0
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        for b, h, h_kv, n_q, n_k, causal, layout in shapes:
            q, k, v, do = _inputs(b, h, h_kv, n_q, n_k, dtype, layout, d)
            scale = d**-0.5
            o, lse = launch.forward(q, k, v, causal, scale)
            q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
            rep = h // h_kv
            o64 = attention_reference(
                q64, k64.repeat_interleave(rep, 1), v64.repeat_interleave(rep, 1), causal
            )[0]
            ref = torch.autograd.grad(o64, (q64, k64, v64), do.double())

            def err(x, r):
                return ((x.double() - r).norm() / r.norm()).item()

            with use_options(backward="split"):
                split = _split(do, q, k, v, o, lse, causal, scale)
            yard = [err(x, r) for x, r in zip(split, ref)]
            for spec in specs:
                got = backward_onepass(do, q, k, v, o, lse, causal, scale, **parse_spec(spec))
                errs = [err(x, r) for x, r in zip(got, ref)]
                ok = all(e <= 1.5 * y + 2e-3 for e, y in zip(errs, yard))
                bad += not ok
                rows.append({"spec": spec, "dtype": str(dtype)[6:], "shape": [b, h, h_kv, n_q, n_k],
                             "causal": causal, "layout": layout, "rel_err_dq_dk_dv": errs,
                             "split_rel_err": yard, "ok": ok})  # fmt: skip
                print(f"{spec:12s} {rows[-1]['dtype']:9s} {b},{h},{h_kv},{n_q},{n_k} "
                      f"causal={causal!s:5s} {layout} dq/dk/dv {errs[0]:.2e} {errs[1]:.2e} "
                      f"{errs[2]:.2e} (split {yard[0]:.2e} {yard[1]:.2e} {yard[2]:.2e}) "
                      f"{'ok' if ok else 'WRONG'}", flush=True)  # fmt: skip
    if out:
        (out / "onepass_check.json").write_text(json.dumps(rows, indent=1))
    print(f"{len(rows)} comparisons, {bad} wrong")
    return int(bad > 0)


def time_specs(
    specs: list[str], ablate: list[int], out: Path | None, d: int = 128, cap: int | None = None
) -> int:
    """Backward alone (ms, do_bench median): the package's split kernels, then each variant
    (with ``ablate`` parts left out, first spec only; launch order as ``backward_onepass``
    with ``cap``), then split again; one process."""
    import triton

    from flashattn_triton import launch, use_options

    shapes = [(1, 16, 16, 16384, True), (1, 32, 32, 32768, True), (1, 16, 16, 16384, False),
              (4, 32, 32, 4096, True), (1, 32, 8, 16384, True)]  # fmt: skip
    rows = []
    for b, h, h_kv, n, causal in shapes:
        q, k, v, do = _inputs(b, h, h_kv, n, n, torch.bfloat16, d=d)
        scale = d**-0.5
        o, lse = launch.forward(q, k, v, causal, scale)

        def bench(fn):
            return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")

        row = {"shape": [b, h, h_kv, n, d], "causal": causal}
        with use_options(backward="split"):
            row["split"] = bench(lambda: _split(do, q, k, v, o, lse, causal, scale))  # noqa: B023
        for spec in specs:
            for ab in [0, *ablate] if spec == specs[0] else [0]:
                kw = parse_spec(spec) | {"ablate": ab, "cap": cap}
                label = spec + (f" ablate={ab}" if ab else "")
                row[label] = bench(
                    lambda kw=kw: backward_onepass(do, q, k, v, o, lse, causal, scale, **kw)  # noqa: B023
                )  # fmt: skip
        with use_options(backward="split"):
            row["split again"] = bench(lambda: _split(do, q, k, v, o, lse, causal, scale))  # noqa: B023
        rows.append(row)
        print(" | ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                         for k, v in row.items()), flush=True)  # fmt: skip
    if out:
        (out / "onepass_time.json").write_text(json.dumps(rows, indent=1))
    return 0


def offline(specs: list[str], d: int = 128) -> int:
    """Compile each variant for sm_90 with no GPU; print registers, spills, shared memory."""
    sys.path.insert(0, str(Path(__file__).parent))
    from compile_offline import _resource_usage, use_hopper_driver

    use_hopper_driver()
    b, h, n = 1, 16, 16384
    q = torch.empty(b, h, n, d, dtype=torch.bfloat16, device="meta")
    lse = torch.empty(b, h, n, dtype=torch.float32, device="meta")
    acc = torch.empty(b, h, n, d, dtype=torch.float32, device="meta")
    for spec in specs:
        o = parse_spec(spec)
        ws = o.get("ws", False)
        bn = 128 if ws else o["block_n"]
        ds_layout = gl.NVMMASharedLayout.get_default_for([bn, 64], gl.bfloat16)
        block = [1, 1, 64, d // 2 if ws else d]
        dq_desc = TensorDescriptor(
            acc, list(acc.shape), list(acc.stride()), block,
            gl.NVMMASharedLayout.get_default_for(block, gl.float32),
        )  # fmt: skip
        args = (
            _desc(q, 64), _desc(q, bn), _desc(q, bn), _desc(q, 64), _flat_desc(lse, 64),
            _flat_desc(lse, 64), dq_desc, q, q, *q.stride()[:3], *q.stride()[:3], h, n, n, n,
            0.18, 0.125, 2, 1,
        )  # fmt: skip
        if ws:
            c = bwd_ws_kernel.warmup(
                *args, DS_LAYOUT=ds_layout, BLOCK_M=64, HEAD_DIM=d, STAGES=2, CAUSAL=True,
                GROUPED=True, GQA=False, MATH_REGS=o.get("math_regs", 240), num_warps=4,
                grid=(1,),
            )  # fmt: skip
        else:
            c = bwd_kernel.warmup(
                *args, DS_LAYOUT=ds_layout, BLOCK_M=64, BLOCK_N=bn, HEAD_DIM=d, STAGES=2,
                CAUSAL=True, GROUPED=True, GQA=False, SEPARATE=o["separate"], LATE=o["late"],
                ABLATE=0, num_warps=bn // 16, grid=(1,),
            )  # fmt: skip
        ptx = c.asm["ptx"]
        split = sorted(set(re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)))
        print(
            f"{spec:14s} {_resource_usage(c.asm['cubin'])} smem {c.metadata.shared // 1024}K "
            f"setmaxnreg {split or '-'}"
        )
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("offline", "check", "time"))
    ap.add_argument("specs", nargs="+", help="BLOCK_N[,sep][,late]")
    ap.add_argument("--ablate", type=int, nargs="*", default=[], choices=(1, 2))
    ap.add_argument("--out", type=Path, default=None, help="folder for the JSON results")
    ap.add_argument("--d", type=int, default=128, choices=(64, 128), help="head dim")
    ap.add_argument(
        "--head-group-cap",
        type=int,
        default=None,
        help="time: at most this many heads' programs at a time where the L2 rule keeps the "
        "plain order (default: the package's gluon_bwd.MAX_HEAD_GROUP; e.g. 1000000: the "
        "L2 rule alone, as before that cap)",
    )
    a = ap.parse_args(argv)
    if a.head_group_cap is not None and a.head_group_cap < 1:
        ap.error(f"--head-group-cap: expected at least 1 head, got {a.head_group_cap}")
    if not HAVE_GLUON:
        ap.error("this Triton has no Gluon (triton.experimental.gluon); Triton >= 3.5 does")
    for spec in a.specs:
        try:
            parse_spec(spec)
        except ValueError as e:
            ap.error(str(e))
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
    if a.mode == "offline":
        return offline(a.specs, a.d)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        ap.error(f"'{a.mode}' needs a Hopper GPU (sm_90); 'offline' runs anywhere")
    if a.mode == "check":
        return check(a.specs, a.out, a.d)
    return time_specs(a.specs, a.ablate, a.out, a.d, a.head_group_cap)


if __name__ == "__main__":
    sys.exit(main())
