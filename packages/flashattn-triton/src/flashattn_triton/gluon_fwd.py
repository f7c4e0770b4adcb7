"""The forward on Hopper written in Gluon: the next tile's scores are computed while this
tile's softmax runs (FlashAttention-3's intra-warpgroup overlap).

Triton 3.6 waits for each ``tl.dot`` before using its result, so a CTA's products and its
exponentials run one after the other (benchmarks/NOTES.md, run 19). Here each key tile j goes:

    issue S[j+1] = Q K[j+1]^T
    softmax of S[j] -> P[j]       (S[j+1] and O += P[j-1] V[j-1] run on the tensor cores)
    wait for O's update; O = O * alpha; issue O += P[j] V[j]; wait for S[j+1]

K and V tiles stream through a ring of shared-memory stages filled by TMA (STAGES >= 3: tiles
j and j+1 are in use while j+2 loads). One program owns BLOCK_M query rows of one
(batch, head), one warpgroup per 64 rows. Inputs are seen as 2-D (rows, d) arrays, so q, k,
v and o must be contiguous (B, H, N, d); a tile running past its head's last key reads the
next head's rows, which the mask removes from P.
"""

from __future__ import annotations

import torch

from .gluon_dkdv import GL_DTYPES, HAVE_GLUON, LOG2E, _desc

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_init,
        warpgroup_mma_wait,
    )

    from .gluon_dkdv import _tma_load

    @gluon.jit
    def _kv_tile(
        i, k_desc, v_desc, k_smem, v_smem, ready, row_k0,
        STAGES: gl.constexpr, BLOCK_N: gl.constexpr, pred,
    ):  # fmt: skip
        """Start the TMA loads of the i-th key tile (K and V) into its ring stage."""
        stage = i % STAGES
        bar = ready.index(stage)
        mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes, pred=pred)
        row = row_k0 + i * BLOCK_N
        _tma_load(k_desc, [row, 0], bar, k_smem.index(stage), pred=pred)
        _tma_load(v_desc, [row, 0], bar, v_smem.index(stage), pred=pred)

    @gluon.jit
    def _softmax(
        s, m_i, l_i, start_n, offs_m, offs_n, n_k, causal_off, qk_scale, needs_mask,
        CAUSAL: gl.constexpr,
    ):  # fmt: skip
        """Online-softmax step on a raw score tile: P (log2 domain), the rescale factor of
        the running sums, the new row max and row sum. Masked tiles (the diagonal, the ragged
        end) set invisible scores to -inf; a row with no visible key yet keeps m = -inf."""
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
    def _fwd_consume(
        k_desc, v_desc, q_smem, k_smem, v_smem, ready, empty, q_ready, Out, LSE,
        pid_bh, start_m, row_q0, row_k0, n_q, n_k, n_tiles, causal_off, mask_from, qk_scale,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
        STAGES: gl.constexpr, CAUSAL: gl.constexpr, WARP_SPEC: gl.constexpr,
        num_warps: gl.constexpr,
    ):  # fmt: skip
        """The math warps: online softmax over the key tiles, then O and L."""
        dtype: gl.constexpr = k_desc.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16]
        )
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 16]
        )
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        offs_m = start_m + gl.arange(0, BLOCK_M, layout=row_layout)
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_layout)
        l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_layout)
        zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
        acc = warpgroup_mma_init(gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout))

        mbarrier.wait(q_ready, 0)
        mbarrier.wait(ready.index(0), 0)
        s_tok = warpgroup_mma(
            q_smem, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True
        )
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
        # Loop invariant: s = S[j] in registers, O += P[j-1] V[j-1] possibly still running.
        for j in range(n_tiles - 1):
            stage = j % STAGES
            nxt = (j + 1) % STAGES
            mbarrier.wait(ready.index(nxt), ((j + 1) // STAGES) & 1)
            s_next = warpgroup_mma(
                q_smem, k_smem.index(nxt).permute((1, 0)), zero_s, use_acc=False, is_async=True
            )
            start_n = j * BLOCK_N
            needs_mask = start_n + BLOCK_N > n_k
            if CAUSAL:
                needs_mask = needs_mask | (start_n > mask_from)
            p, alpha, m_i, l_i = _softmax(
                s, m_i, l_i, start_n, offs_m, offs_n, n_k, causal_off, qk_scale, needs_mask,
                CAUSAL,
            )  # fmt: skip
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            # O's update with tile j-1 is done (S[j+1] may still run): tile j-1's stage is
            # free for tile j + STAGES - 1.
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            if WARP_SPEC:
                mbarrier.arrive(empty.index((j + STAGES - 1) % STAGES), pred=j > 0)
            else:
                _kv_tile(
                    j + STAGES - 1, k_desc, v_desc, k_smem, v_smem, ready, row_k0, STAGES,
                    BLOCK_N, j + STAGES - 1 < n_tiles,
                )  # fmt: skip
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            acc = warpgroup_mma(p_op, v_smem.index(stage), acc, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s_next,))
        # The last tile.
        j = n_tiles - 1
        start_n = j * BLOCK_N
        needs_mask = start_n + BLOCK_N > n_k
        if CAUSAL:
            needs_mask = needs_mask | (start_n > mask_from)
        p, alpha, m_i, l_i = _softmax(
            s, m_i, l_i, start_n, offs_m, offs_n, n_k, causal_off, qk_scale, needs_mask, CAUSAL
        )
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        acc = warpgroup_mma(p_op, v_smem.index(j % STAGES), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))

        l_safe = gl.where(l_i == 0.0, 1.0, l_i)
        o = acc * gl.convert_layout(1.0 / l_safe, gl.SliceLayout(1, o_layout))[:, None]
        out_rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
        out_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        offs = (row_q0 + out_rows).to(gl.int64)[:, None] * HEAD_DIM + out_cols[None, :]
        gl.store(Out + offs, o.to(dtype), mask=(out_rows < n_q)[:, None])
        lse = (m_i + gl.log2(l_i)) * 0.6931471805599453  # -inf for a row that saw no key
        gl.store(LSE + pid_bh.to(gl.int64) * n_q + offs_m, lse, mask=offs_m < n_q)

    @gluon.jit
    def _fwd_produce(
        q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, ready, empty, q_ready,
        row_q0, start_m, row_k0, n_tiles, STAGES: gl.constexpr, BLOCK_N: gl.constexpr,
    ):  # fmt: skip
        """Loader warp (WARP_SPEC): Q once, then each key tile as soon as its stage is free."""
        mbarrier.expect(q_ready, q_desc.block_type.nbytes)
        _tma_load(q_desc, [row_q0 + start_m, 0], q_ready, q_smem)
        for i in range(n_tiles):
            # A fresh mbarrier counts as having completed the phase before phase 0.
            mbarrier.wait(empty.index(i % STAGES), ((i // STAGES) & 1) ^ 1)
            _kv_tile(i, k_desc, v_desc, k_smem, v_smem, ready, row_k0, STAGES, BLOCK_N, True)

    @gluon.jit
    def fwd_kernel(
        q_desc, k_desc, v_desc, Out, LSE, n_q, n_k, qk_scale,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
        STAGES: gl.constexpr, CAUSAL: gl.constexpr, WARP_SPEC: gl.constexpr,
        num_warps: gl.constexpr,
    ):  # fmt: skip
        """One program: O rows (of Out: (B*H*n_q, HEAD_DIM)) and L (natural log, (B*H, n_q))
        of one query tile; heaviest (last) query tiles first."""
        pid_bh = gl.program_id(0)
        start_m = (gl.num_programs(1) - 1 - gl.program_id(1)) * BLOCK_M
        dtype: gl.constexpr = q_desc.dtype
        row_q0 = pid_bh * n_q
        row_k0 = pid_bh * n_k
        causal_off = n_k - n_q
        if CAUSAL:
            hi = gl.maximum(gl.minimum(n_k, start_m + BLOCK_M + causal_off), 0)
        else:
            hi = n_k
        # At least one tile: a tile where no row sees a key comes out fully masked (o = 0).
        n_tiles = gl.maximum(gl.cdiv(hi, BLOCK_N), 1)
        # A tile starting after this key reaches past the first row's last visible key.
        mask_from = start_m + causal_off - BLOCK_N + 1

        q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for st in gl.static_range(STAGES):
            mbarrier.init(ready.index(st), count=1)
            mbarrier.init(empty.index(st), count=1)
        mbarrier.init(q_ready, count=1)

        if WARP_SPEC:
            gl.warp_specialize(
                [
                    (
                        _fwd_consume,
                        (
                            k_desc, v_desc, q_smem, k_smem, v_smem, ready, empty, q_ready, Out,
                            LSE, pid_bh, start_m, row_q0, row_k0, n_q, n_k, n_tiles, causal_off,
                            mask_from, qk_scale, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL,
                            WARP_SPEC, num_warps,
                        ),
                    ),
                    (
                        _fwd_produce,
                        (
                            q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, ready, empty,
                            q_ready, row_q0, start_m, row_k0, n_tiles, STAGES, BLOCK_N,
                        ),
                    ),
                ],
                [1],
                [24],
            )  # fmt: skip
        else:
            mbarrier.expect(q_ready, q_desc.block_type.nbytes)
            _tma_load(q_desc, [row_q0 + start_m, 0], q_ready, q_smem)
            for i in gl.static_range(STAGES - 1):
                _kv_tile(
                    i, k_desc, v_desc, k_smem, v_smem, ready, row_k0, STAGES, BLOCK_N,
                    i < n_tiles,
                )  # fmt: skip
            _fwd_consume(
                k_desc, v_desc, q_smem, k_smem, v_smem, ready, empty, q_ready, Out, LSE,
                pid_bh, start_m, row_q0, row_k0, n_q, n_k, n_tiles, causal_off, mask_from,
                qk_scale, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, WARP_SPEC, num_warps,
            )  # fmt: skip
        for st in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(st))
            mbarrier.invalidate(empty.index(st))
        mbarrier.invalidate(q_ready)


def launch_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    *,
    block_m: int,
    block_n: int,
    stages: int,
    maxnreg: int | None = None,
    num_warps: int | None = None,
    ws: bool = False,
) -> None:
    """Write o and lse (natural log, (B, H, n_q) float32) of contiguous (B, H, N, d) 16-bit
    q, k, v. Checks nothing (benchmarks pick their own tiles)."""
    b, h, n_q, d = q.shape
    n_k = k.shape[2]
    if stages < 3:
        raise ValueError(f"stages must be >= 3 (tiles j, j+1 in use while j+2 loads), got {stages}")
    fwd_kernel[(b * h, -(-n_q // block_m))](
        _desc(q, block_m), _desc(k, block_n), _desc(v, block_n), o, lse, n_q, n_k,
        softmax_scale * LOG2E,
        BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=d, STAGES=stages, CAUSAL=causal,
        WARP_SPEC=ws, num_warps=num_warps or block_m // 16, **({"maxnreg": maxnreg} if maxnreg else {}),
    )  # fmt: skip
