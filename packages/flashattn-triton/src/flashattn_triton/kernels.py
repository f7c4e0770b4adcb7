"""Triton kernels of FlashAttention-2: forward, backward preprocessing, dK/dV and dQ.

Layout: every tensor is addressed as (batch, heads, seq, head_dim) through its batch, head and
sequence strides; the head_dim stride must be 1 (the launchers make it so). The grid's first
axis runs over batch*heads, so consecutive programs take the same tile index of different
heads; the second axis runs over tiles ordered heaviest first for causal masks.

Numerics: scores are kept in log2 units (the softmax scale is multiplied by log2(e) once, and
exp2 replaces exp); accumulators are float32; P and dS are cast to the input dtype before
their matrix products, as FlashAttention-2 does. The saved log-sum-exp L is in natural units.

Causal masking is bottom-right aligned: key j is visible to query i iff j <= i + (Nk - Nq).
Each key loop is split in two ranges: tiles that every row of the query tile sees in full
(no mask computed) and the tiles on the diagonal or at the ragged end (masked). Tiles that no
row sees are never visited.

Sliding windows (WINDOW): key j is visible to query i iff i + left_off <= j <= i + causal_off,
with left_off = Nk - Nq - window_left and causal_off = Nk - Nq + window_right (the launcher
passes CAUSAL with every window; an unbounded side comes as a bound beyond every key). Key
loops then have a masked range at each end and the unmasked tiles between; tiles outside the
window are never visited. Grouped-query attention (GQA): query head h reads k/v head
h // kv_group; the dK/dV kernel runs per k/v head and loops over its group of query heads, so
dK and dV are summed in registers. Packed variable-length batches (VARLEN): the (batch, head)
axis runs over sequences, each program reads its sequence's offsets from CU_Q / CU_K, and
tensors are (1, H, total, d) with the batch strides 0. All three are constexpr flags: off,
the kernels compile to what they were without them. The decode kernels (few queries, long
key cache) split the keys over programs and combine the partial results.

Head dims that are not a power of two (or below 16) are padded to BLOCK_D with masked loads.
Rows past the sequence end are loaded as zeros; in the backward they get L = +inf so their
probabilities are exactly 0. A row that sees no key (only with causal and Nq > Nk) gets o = 0
and L = -inf in the forward, and the backward reads that L as +inf (so P = 0, no NaN).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .configs import STATS_ROWS

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
_LOG2E = tl.constexpr(LOG2E)
_LN2 = tl.constexpr(LN2)
_STATS_ROWS = tl.constexpr(STATS_ROWS)


@triton.jit
def _load_rows(
    base,
    start,
    n_rows,
    stride_row,
    offs_r,
    offs_d,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CHECK_ROWS: tl.constexpr,
):
    """Load a (len(offs_r), BLOCK_D) tile of rows start + offs_r; zeros outside the tensor."""
    ptrs = base + start.to(tl.int64) * stride_row + (offs_r[:, None] * stride_row + offs_d[None, :])
    if CHECK_ROWS:
        mask = (start + offs_r)[:, None] < n_rows
        if HEAD_DIM != BLOCK_D:
            mask = mask & (offs_d[None, :] < HEAD_DIM)
        x = tl.load(ptrs, mask=mask, other=0.0)
    elif HEAD_DIM != BLOCK_D:
        x = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _store_rows(
    base,
    x,
    start,
    n_rows,
    stride_row,
    offs_r,
    offs_d,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CHECK_ROWS: tl.constexpr,
):
    """Store a (len(offs_r), BLOCK_D) tile to rows start + offs_r, skipping padding."""
    ptrs = base + start.to(tl.int64) * stride_row + (offs_r[:, None] * stride_row + offs_d[None, :])
    if CHECK_ROWS:
        mask = (start + offs_r)[:, None] < n_rows
        if HEAD_DIM != BLOCK_D:
            mask = mask & (offs_d[None, :] < HEAD_DIM)
        tl.store(ptrs, x, mask=mask)
    elif HEAD_DIM != BLOCK_D:
        tl.store(ptrs, x, mask=offs_d[None, :] < HEAD_DIM)
    else:
        tl.store(ptrs, x)


@triton.jit
def _load_streamed(
    desc,
    base,
    b32,
    h32,
    start,
    row0,
    n_rows,
    stride_row,
    offs_r,
    offs_d,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CHECK_ROWS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    """A tile of the main loop's streamed operand: through the (B, H, N, d) TMA descriptor
    (out-of-bounds rows and columns read as zeros) or by pointers as ``_load_rows``. row0:
    where row 0 of base is in the descriptor (a packed sequence's first row; else 0)."""
    if USE_TMA:
        x = desc.load([b32, h32, row0 + start, 0]).reshape(BLOCK_R, BLOCK_D)
    else:
        x = _load_rows(
            base, start, n_rows, stride_row, offs_r, offs_d, HEAD_DIM, BLOCK_D, CHECK_ROWS
        )
    return x


@triton.jit
def _f32(x):
    """A float argument as float32: torch.compile passes Python floats to the kernels it
    launches (``traced_ops``) as float64, Triton's own launches as float32 (a no-op there)."""
    return tl.cast(x, tl.float32)


@triton.jit
def _grouped_program(head_group, GROUPED: tl.constexpr):
    """(batch*head index, tile index) of this program on a (B*H, tiles) grid, in an order
    that runs programs of head_group heads at a time: tile-major inside each group (so the
    heavy-first tile order of each kernel holds), group after group. Concurrent programs
    then stream the K / V (or Q / dO) rows of few heads, which stay in L2; head_group >=
    B*H gives the plain order (program_id(0) = head, fastest), as does GROUPED False (the
    launcher's choice when head_group >= B*H: no index arithmetic at all)."""
    if not GROUPED:
        return tl.program_id(0), tl.program_id(1)
    n_bh = tl.num_programs(0)
    n_tiles = tl.num_programs(1)
    lin = tl.program_id(1) * n_bh + tl.program_id(0)
    per_group = head_group * n_tiles
    group = lin // per_group
    first = group * head_group
    width = tl.minimum(n_bh - first, head_group)
    within = lin - group * per_group
    return first + within % width, within // width


@triton.jit
def _in_registers(x, n):
    """x itself, as a value computed in registers (times a runtime 1; n is any count >= 0).

    Triton (3.6, Hopper) feeds a dot's A operand from shared memory when it comes straight
    from a load, so a loop-invariant tile would be re-read there on every step; an
    element-wise result stays in registers (the REG_A option of the backward kernels)."""
    one = tl.where(n >= 0, 1.0, 0.0)
    return (x * one).to(x.dtype)


@triton.jit
def _visible(
    rows, cols, n_k, causal_off, left_off,
    CAUSAL: tl.constexpr, CHECK_COLS: tl.constexpr, WINDOW: tl.constexpr,
):  # fmt: skip
    """(len(rows), len(cols)) mask of visible (query, key) pairs; rows, cols absolute. WINDOW
    adds the window's left bound cols >= rows + left_off."""
    if CAUSAL:
        keep = cols[None, :] <= rows[:, None] + causal_off
        if CHECK_COLS:
            keep = keep & (cols[None, :] < n_k)
    else:
        keep = (cols[None, :] < n_k) & (rows[:, None] >= 0)
    if WINDOW:
        keep = keep & (cols[None, :] >= rows[:, None] + left_off)
    return keep


# --------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------


@triton.jit
def _fwd_key_loop(
    acc,
    l_i,
    m_i,
    q,
    k_base,
    v_base,
    desc_k,
    desc_v,
    b32,
    h32,
    row0,
    stride_kn,
    stride_vn,
    lo,
    hi,
    offs_m,
    offs_n,
    offs_d,
    n_k,
    causal_off,
    qk_scale,
    left_off,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    EVEN_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr,
    WARP_SPEC: tl.constexpr,
    WINDOW: tl.constexpr,
):
    """Online softmax over key tiles [lo, hi); MASKED tiles compute the visibility mask
    (with WINDOW the window's left bound too, see ``_visible``)."""
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPEC):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k = _load_streamed(
            desc_k, k_base, b32, h32, start_n, row0, n_k, stride_kn, offs_n, offs_d,
            HEAD_DIM, BLOCK_D, MASKED and not EVEN_N, BLOCK_N, USE_TMA,
        )  # fmt: skip
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
        if MASKED:
            keep = _visible(
                offs_m, start_n + offs_n, n_k, causal_off, left_off, CAUSAL, not EVEN_N, WINDOW
            )
            qk = tl.where(keep, qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            # A row with no visible key yet keeps m = -inf: subtract 0 there, not -inf.
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(qk - m_sub[:, None])
            alpha = tl.math.exp2(m_i - m_sub)
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            p = tl.math.exp2(qk * qk_scale - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = _load_streamed(
            desc_v, v_base, b32, h32, start_n, row0, n_k, stride_vn, offs_n, offs_d,
            HEAD_DIM, BLOCK_D, MASKED and not EVEN_N, BLOCK_N, USE_TMA,
        )  # fmt: skip
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def attn_fwd_kernel(
    Q,
    K,
    V,
    Out,
    LSE,
    DESC_A,
    DESC_B,
    CU_Q,
    CU_K,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_ob,
    stride_oh,
    stride_on,
    n_heads,
    n_q,
    n_k,
    qk_scale,
    head_group,
    kv_group,
    window_left,
    window_right,
    SEQ_BUCKET,  # autotune key only
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    USE_TMA: tl.constexpr,
    WARP_SPEC: tl.constexpr,
    GROUPED: tl.constexpr,
    GQA: tl.constexpr,
    WINDOW: tl.constexpr,
    VARLEN: tl.constexpr,
    KV_LENS: tl.constexpr = False,
    KV_ADD=None,
):
    """One program: one query tile of one (batch, head). Writes O tile and L (natural log).

    DESC_A, DESC_B: TMA descriptors of K and V (with USE_TMA; else unused). head_group: see
    ``_grouped_program``. GQA: k/v head h // kv_group. WINDOW: window_left / window_right
    bound the keys (module docstring). VARLEN: the first grid axis runs over (sequence, head);
    n_q, n_k are the packed totals and CU_Q, CU_K the sequences' int32 offsets. KV_LENS (a KV
    cache): CU_K holds each batch element's int32 key count, plus KV_ADD (the keys appended
    by ``kv_append_kernel`` just before), clamped to [0, n_k] (n_k: the cache's rows); masks
    align to that count."""
    qk_scale = _f32(qk_scale)
    pid_bh, tile = _grouped_program(head_group, GROUPED)
    # Heaviest (last) query tiles first: with causal masks they have the most key tiles.
    start_m = (tl.num_programs(1) - 1 - tile) * BLOCK_M
    b32 = pid_bh // n_heads
    h32 = pid_bh % n_heads
    b = b32.to(tl.int64)
    h = h32.to(tl.int64)
    if GQA:
        hk32 = h32 // kv_group
    else:
        hk32 = h32
    hk = hk32.to(tl.int64)
    q_base = Q + b * stride_qb + h * stride_qh
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    o_base = Out + b * stride_ob + h * stride_oh
    lse_row = pid_bh.to(tl.int64) * n_q
    tma_b = b32  # K, V tiles by TMA: descriptor coordinates (batch, head, row0 + row)
    row0 = 0
    if VARLEN:  # batch strides are 0: move to the sequence's first rows
        seq_q = tl.load(CU_Q + b32)
        seq_k = tl.load(CU_K + b32)
        tma_b = 0
        row0 = seq_k
        lse_row = h * n_q + seq_q
        n_q = tl.load(CU_Q + b32 + 1) - seq_q
        n_k = tl.load(CU_K + b32 + 1) - seq_k
        if start_m >= n_q:
            return
        q_base += seq_q.to(tl.int64) * stride_qn
        k_base += seq_k.to(tl.int64) * stride_kn
        v_base += seq_k.to(tl.int64) * stride_vn
        o_base += seq_q.to(tl.int64) * stride_on
    if KV_LENS:
        n_k = tl.minimum(tl.maximum(tl.load(CU_K + b32), 0) + KV_ADD, n_k)

    offs_tm = tl.arange(0, BLOCK_M)
    offs_m = start_m + offs_tm
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_rows(q_base, start_m, n_q, stride_qn, offs_tm, offs_d, HEAD_DIM, BLOCK_D, not EVEN_M)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    causal_off = n_k - n_q
    left_off = 0
    if WINDOW:
        left_off = causal_off - window_left
        causal_off = causal_off + window_right
    if CAUSAL:
        # Keys every row of this tile sees: j <= start_m + causal_off.
        full_hi = tl.maximum(start_m + causal_off + 1, 0) // BLOCK_N * BLOCK_N
        full_hi = tl.minimum(full_hi, n_k // BLOCK_N * BLOCK_N)
        hi = tl.maximum(tl.minimum(n_k, start_m + BLOCK_M + causal_off), 0)
    else:
        full_hi = n_k // BLOCK_N * BLOCK_N
        hi = n_k
    full_lo = 0
    if WINDOW:
        # Keys some row sees: j >= start_m + left_off; every row: j >= start_m + BLOCK_M - 1 +
        # left_off. The tiles before the unmasked ones are masked too.
        lo = tl.minimum(tl.maximum(start_m + left_off, 0) // BLOCK_N * BLOCK_N, hi)
        full_lo = tl.cdiv(tl.maximum(start_m + BLOCK_M - 1 + left_off, 0), BLOCK_N) * BLOCK_N
        full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
        full_hi = tl.maximum(full_hi, full_lo)
        acc, l_i, m_i = _fwd_key_loop(
            acc, l_i, m_i, q, k_base, v_base, DESC_A, DESC_B, tma_b, hk32, row0,
            stride_kn, stride_vn,
            lo, full_lo, offs_m, offs_n, offs_d, n_k, causal_off, qk_scale, left_off,
            True, CAUSAL, EVEN_N, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_PRECISION, USE_TMA, False,
            WINDOW,
        )  # fmt: skip
    acc, l_i, m_i = _fwd_key_loop(
        acc, l_i, m_i, q, k_base, v_base, DESC_A, DESC_B, tma_b, hk32, row0,
        stride_kn, stride_vn,
        full_lo, full_hi, offs_m, offs_n, offs_d, n_k, causal_off, qk_scale, left_off,
        False, CAUSAL, EVEN_N, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_PRECISION, USE_TMA, WARP_SPEC,
        False,
    )  # fmt: skip
    if CAUSAL or not EVEN_N:
        acc, l_i, m_i = _fwd_key_loop(
            acc, l_i, m_i, q, k_base, v_base, DESC_A, DESC_B, tma_b, hk32, row0,
            stride_kn, stride_vn,
            full_hi, hi, offs_m, offs_n, offs_d, n_k, causal_off, qk_scale, left_off,
            True, CAUSAL, EVEN_N, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_PRECISION, USE_TMA, False,
            WINDOW,
        )  # fmt: skip

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    acc = acc * (1.0 / l_safe)[:, None]
    _store_rows(
        o_base, acc.to(Out.dtype.element_ty), start_m, n_q, stride_on, offs_tm, offs_d,
        HEAD_DIM, BLOCK_D, not EVEN_M,
    )  # fmt: skip
    lse = (m_i + tl.math.log2(l_i)) * _LN2  # -inf for a row that saw no key
    lse_ptrs = LSE + lse_row + offs_m
    if EVEN_M:
        tl.store(lse_ptrs, lse)
    else:
        tl.store(lse_ptrs, lse, mask=offs_m < n_q)


# --------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------


@triton.jit
def attn_bwd_preprocess_kernel(
    Out,
    DO,
    DELTA,
    LSE,
    LSE2,
    stride_ob,
    stride_oh,
    stride_on,
    stride_dob,
    stride_doh,
    stride_don,
    n_heads,
    n_q,
    stride_stats,
    stride_rows,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """D = rowsum(dO * O) in float32, one (batch, head) row block per program, and L (LSE,
    natural log) in log2 units into LSE2 (see ``_lse_log2``). The (batch, head) rows of LSE
    are stride_stats apart, those of DELTA and LSE2 stride_rows (see ``attn_bwd_dkdv_kernel``)."""
    pid_bh = tl.program_id(0)
    start_m = tl.program_id(1) * BLOCK_M
    b = (pid_bh // n_heads).to(tl.int64)
    h = (pid_bh % n_heads).to(tl.int64)
    offs_tm = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    o = _load_rows(
        Out + b * stride_ob + h * stride_oh, start_m, n_q, stride_on, offs_tm, offs_d,
        HEAD_DIM, BLOCK_D, True,
    )  # fmt: skip
    do = _load_rows(
        DO + b * stride_dob + h * stride_doh, start_m, n_q, stride_don, offs_tm, offs_d,
        HEAD_DIM, BLOCK_D, True,
    )  # fmt: skip
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    offs_m = start_m + offs_tm
    row0 = pid_bh.to(tl.int64) * stride_rows
    tl.store(DELTA + row0 + offs_m, delta, mask=offs_m < n_q)
    lse2 = _load_lse2(LSE + pid_bh.to(tl.int64) * stride_stats, start_m, offs_tm, n_q, True, False)
    tl.store(LSE2 + row0 + offs_m, lse2, mask=offs_m < n_q)


@triton.jit
def _lse_log2(lse):
    """L (natural log) -> L in log2 units, the form the backward's exponentials subtract:
    +inf for a row that saw no key (L = -inf), so that its P = exp2(s - L) is 0, not NaN."""
    return tl.where(lse == float("-inf"), float("inf"), lse * _LOG2E)


@triton.jit
def _load_lse2(lse_base, start_m, offs_tm, n_q, CHECK_ROWS: tl.constexpr, IN_LOG2: tl.constexpr):
    """L of a tile's rows in log2 units (+inf for padding rows and rows that saw no key).
    IN_LOG2: lse_base already holds them so (``_lse_log2``, written by the kernel that
    computed D), which keeps the conversion out of the dK/dV loop."""
    offs_m = start_m + offs_tm
    if CHECK_ROWS:
        lse = tl.load(lse_base + offs_m, mask=offs_m < n_q, other=float("inf"))
    else:
        lse = tl.load(lse_base + offs_m)
    if IN_LOG2:
        return lse
    return _lse_log2(lse)


@triton.jit
def _load_row_stats(
    lse_base, delta_base, start_m, offs_tm, n_q, CHECK_ROWS: tl.constexpr, IN_LOG2: tl.constexpr
):
    """L in log2 units (see ``_load_lse2``) and D for a tile."""
    offs_m = start_m + offs_tm
    if CHECK_ROWS:
        delta = tl.load(delta_base + offs_m, mask=offs_m < n_q, other=0.0)
    else:
        delta = tl.load(delta_base + offs_m)
    return _load_lse2(lse_base, start_m, offs_tm, n_q, CHECK_ROWS, IN_LOG2), delta


@triton.jit
def _dkdv_query_loop(
    dk,
    dv,
    k,
    v,
    q_base,
    do_base,
    desc_q,
    desc_do,
    desc_dq,
    desc_rows,
    b32,
    h32,
    row0,
    pid_bh,
    lse_base,
    delta_base,
    dq_base,
    stride_qn,
    stride_don,
    stride_dqn,
    start_n,
    lo,
    hi,
    offs_n,
    offs_tm,
    offs_d,
    n_q,
    n_k,
    causal_off,
    qk_scale,
    sm_scale,
    left_off,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ATOMIC_DQ: tl.constexpr,
    USE_TMA: tl.constexpr,
    WARP_SPEC: tl.constexpr,
    TMA_DQ: tl.constexpr,
    PADDED_STATS: tl.constexpr,
    LSE_LOG2: tl.constexpr,
    STATS_TMA: tl.constexpr,
    WINDOW: tl.constexpr,
):
    """Accumulate dK, dV of one key tile over query tiles [lo, hi) (transposed scores).
    PADDED_STATS: L and D hold padding rows (+inf, 0) up to a multiple of STATS_ROWS, so
    their loads need no mask (for query tiles that divide it). LSE_LOG2: L is stored in log2
    units already (``_load_lse2``). STATS_TMA: both come through desc_rows, a TMA descriptor
    of the (B*H, 2, rows) buffer that holds L in log2 units and D (``launch._stats_buffers``;
    the rows run to a whole number of query tiles): one bulk copy per tile.

    With ATOMIC_DQ also add this tile's share of dQ to the float32 DQ buffer: by a TMA bulk
    reduction through desc_dq (TMA_DQ; rows past the end are dropped by the hardware) or by
    element-wise atomics. WINDOW: MASKED tiles also apply the window's left bound.
    ``pid_bh`` is the row of L and D (it addresses desc_rows)."""
    for start_m in tl.range(lo, hi, BLOCK_M, warp_specialize=WARP_SPEC):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        q = _load_streamed(
            desc_q, q_base, b32, h32, start_m, row0, n_q, stride_qn, offs_tm, offs_d,
            HEAD_DIM, BLOCK_D, not EVEN_M, BLOCK_M, USE_TMA,
        )  # fmt: skip
        do = _load_streamed(
            desc_do, do_base, b32, h32, start_m, row0, n_q, stride_don, offs_tm, offs_d,
            HEAD_DIM, BLOCK_D, not EVEN_M, BLOCK_M, USE_TMA,
        )  # fmt: skip
        if STATS_TMA:
            rows = desc_rows.load([pid_bh, 0, start_m]).reshape(2, BLOCK_M)
            lse2, delta = tl.split(tl.permute(rows, (1, 0)))
        else:
            check = not EVEN_M and not (PADDED_STATS and BLOCK_M <= _STATS_ROWS)
            lse2, delta = _load_row_stats(
                lse_base, delta_base, start_m, offs_tm, n_q, check, LSE_LOG2
            )
        qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M)
        p_t = tl.math.exp2(qk_t * qk_scale - lse2[None, :])  # eq. 13-14, transposed
        if MASKED:
            keep_t = tl.trans(
                _visible(start_m + offs_tm, offs_n, n_k, causal_off, left_off, CAUSAL, True, WINDOW)
            )
            p_t = tl.where(keep_t, p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)  # eq. 15
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # eq. 16
        ds_t = p_t * (dp_t - delta[None, :])  # eq. 17
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)  # eq. 19 (unscaled)
        if ATOMIC_DQ:
            dq = tl.dot(tl.trans(ds_t.to(k.dtype)), k, input_precision=DOT_PRECISION) * sm_scale
            if TMA_DQ:
                desc_dq.atomic_add([b32, h32, start_m, 0], dq.reshape(1, 1, BLOCK_M, BLOCK_D))
            else:
                rows = (start_m + offs_tm)[:, None].to(tl.int64)
                dq_ptrs = dq_base + rows * stride_dqn + offs_d[None, :]
                if EVEN_M:
                    tl.atomic_add(dq_ptrs, dq, sem="relaxed")
                else:
                    rows_in = (start_m + offs_tm)[:, None] < n_q
                    tl.atomic_add(dq_ptrs, dq, mask=rows_in, sem="relaxed")
    return dk, dv


@triton.jit
def _stats_strides(
    stride_stats, n_q, PADDED_STATS: tl.constexpr, PACKED_STATS: tl.constexpr,
    LSE_LOG2: tl.constexpr,
):  # fmt: skip
    """(batch, head) row strides of the L and D the dK/dV loop reads: L (natural log) rows
    are stride_stats apart; D rows, and L rows in log2 units (LSE_LOG2), twice that when
    PACKED_STATS (``launch._stats_buffers``). Unpadded, stride_stats is n_q itself: using n_q
    keeps one live argument fewer (d = 16: 127 registers instead of 134, 4 programs per SM)."""
    rows = stride_stats if PADDED_STATS else n_q
    stride_delta = 2 * rows if PACKED_STATS else rows
    stride_lse = stride_delta if LSE_LOG2 else rows
    return stride_lse, stride_delta


@triton.jit
def _dkdv_head(
    dk, dv, k, v, Q, DO, LSE, DELTA, DQ, DESC_A, DESC_B, DESC_C, DESC_ROWS,
    b32, h32, stats_bh, seq_q,
    stride_qb, stride_qh, stride_qn,
    stride_dob, stride_doh, stride_don,
    stride_dqb, stride_dqh, stride_dqn,
    n_q, n_k, stride_lse, stride_delta, qk_scale, sm_scale, start_n, window_left, window_right,
    offs_n, offs_tm, offs_d,
    CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, ATOMIC_DQ: tl.constexpr, USE_TMA: tl.constexpr,
    WARP_SPEC: tl.constexpr, TMA_DQ: tl.constexpr, PADDED_STATS: tl.constexpr,
    LSE_LOG2: tl.constexpr, STATS_TMA: tl.constexpr, WINDOW: tl.constexpr, VARLEN: tl.constexpr,
):  # fmt: skip
    """Add to dK, dV of key tile [start_n, start_n + BLOCK_N) what query head h32 of batch b32
    contributes (stats_bh: its row of L and D; VARLEN: its rows start at seq_q)."""
    b = b32.to(tl.int64)
    h = h32.to(tl.int64)
    q_base = Q + b * stride_qb + h * stride_qh
    do_base = DO + b * stride_dob + h * stride_doh
    dq_base = DQ + b * stride_dqb + h * stride_dqh
    lse_base = LSE + stats_bh.to(tl.int64) * stride_lse
    delta_base = DELTA + stats_bh.to(tl.int64) * stride_delta
    tma_b = b32  # Q, dO tiles by TMA: descriptor coordinates (batch, head, row0 + row)
    row0 = 0
    if VARLEN:
        q_base += seq_q.to(tl.int64) * stride_qn
        do_base += seq_q.to(tl.int64) * stride_don
        lse_base += seq_q
        delta_base += seq_q
        tma_b = 0
        row0 = seq_q

    causal_off = n_k - n_q
    left_off = 0
    if WINDOW:
        left_off = causal_off - window_left
        causal_off = causal_off + window_right
    hi = tl.cdiv(n_q, BLOCK_M) * BLOCK_M
    if WINDOW:  # rows i > start_n + BLOCK_N - 1 - left_off see none of this tile
        hi = tl.minimum(hi, tl.cdiv(tl.maximum(start_n + BLOCK_N - left_off, 0), BLOCK_M) * BLOCK_M)
    if CAUSAL:
        # Rows i >= start_n - causal_off see part of this tile; rows
        # i >= start_n + BLOCK_N - 1 - causal_off see all of it.
        lo = tl.maximum(start_n - causal_off, 0) // BLOCK_M * BLOCK_M
        mask_hi = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - causal_off, 0), BLOCK_M) * BLOCK_M
        mask_hi = tl.minimum(tl.maximum(mask_hi, lo), hi)
        lo = tl.minimum(lo, hi)
    else:
        lo = 0
        mask_hi = 0
    if CAUSAL:
        dk, dv = _dkdv_query_loop(
            dk, dv, k, v, q_base, do_base, DESC_A, DESC_B, DESC_C, DESC_ROWS, tma_b, h32,
            row0, stats_bh, lse_base,
            delta_base, dq_base, stride_qn, stride_don, stride_dqn, start_n, lo, mask_hi,
            offs_n, offs_tm, offs_d, n_q, n_k, causal_off, qk_scale, sm_scale, left_off,
            True, CAUSAL, EVEN_M, EVEN_N, HEAD_DIM, BLOCK_D, BLOCK_M, DOT_PRECISION, ATOMIC_DQ,
            USE_TMA, False, TMA_DQ, PADDED_STATS, LSE_LOG2, STATS_TMA, WINDOW,
        )  # fmt: skip
    full_hi = hi
    if WINDOW:  # rows i <= start_n - left_off see all of this tile, later ones part of it
        full_hi = tl.maximum(start_n - left_off + 1, 0) // BLOCK_M * BLOCK_M
        full_hi = tl.minimum(tl.maximum(full_hi, mask_hi), hi)
    # The rest needs no causal mask. Nor a key mask in a ragged last key tile: its padding
    # keys (K, V rows read as zeros) only fill rows of dK, dV that are never stored, and rows
    # of a product do not mix. Only the one-pass dQ (ATOMIC_DQ) sums over keys, so padding
    # keys must be masked there. (It saves the mask work; no measurable time.)
    MASK_KEYS: tl.constexpr = ATOMIC_DQ and not EVEN_N
    dk, dv = _dkdv_query_loop(
        dk, dv, k, v, q_base, do_base, DESC_A, DESC_B, DESC_C, DESC_ROWS, tma_b, h32,
        row0, stats_bh, lse_base,
        delta_base, dq_base, stride_qn, stride_don, stride_dqn, start_n, mask_hi, full_hi,
        offs_n, offs_tm, offs_d, n_q, n_k, causal_off, qk_scale, sm_scale, left_off,
        MASK_KEYS, False, EVEN_M, EVEN_N, HEAD_DIM, BLOCK_D, BLOCK_M, DOT_PRECISION, ATOMIC_DQ,
        USE_TMA, WARP_SPEC and EVEN_N, TMA_DQ, PADDED_STATS, LSE_LOG2, STATS_TMA, False,
    )  # fmt: skip
    if WINDOW:
        dk, dv = _dkdv_query_loop(
            dk, dv, k, v, q_base, do_base, DESC_A, DESC_B, DESC_C, DESC_ROWS, tma_b, h32,
            row0, stats_bh, lse_base,
            delta_base, dq_base, stride_qn, stride_don, stride_dqn, start_n, full_hi, hi,
            offs_n, offs_tm, offs_d, n_q, n_k, causal_off, qk_scale, sm_scale, left_off,
            True, CAUSAL, EVEN_M, EVEN_N, HEAD_DIM, BLOCK_D, BLOCK_M, DOT_PRECISION, ATOMIC_DQ,
            USE_TMA, False, TMA_DQ, PADDED_STATS, LSE_LOG2, STATS_TMA, WINDOW,
        )  # fmt: skip
    return dk, dv


@triton.jit
def _dkdv_tile(
    Q, K, V, DO, LSE, DELTA, DK, DV, DQ, DESC_A, DESC_B, DESC_C, DESC_ROWS,
    b32, h32, pid_bh,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_don,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    stride_dqb, stride_dqh, stride_dqn,
    n_q, n_k, stride_lse, stride_delta, qk_scale, sm_scale, start_n,
    kv_group, seq_q, seq_k, window_left, window_right,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, ATOMIC_DQ: tl.constexpr,
    USE_TMA: tl.constexpr, WARP_SPEC: tl.constexpr, TMA_DQ: tl.constexpr, REG_A: tl.constexpr,
    PADDED_STATS: tl.constexpr, LSE_LOG2: tl.constexpr, STATS_TMA: tl.constexpr,
    GQA: tl.constexpr, WINDOW: tl.constexpr, VARLEN: tl.constexpr,
):  # fmt: skip
    """dK and dV for key tile [start_n, start_n + BLOCK_N) of one (batch, k/v head); DESC_A,
    DESC_B: TMA descriptors of Q and dO (with USE_TMA), DESC_C of the float32 dQ buffer
    (with TMA_DQ). REG_A: K and V feed S^T and dP^T from registers. pid_bh: the row of L and
    D; with GQA the query heads h32 * kv_group + g (rows pid_bh * kv_group + g), g <
    kv_group, add up in dK, dV. VARLEN: k/v rows start at seq_k, q rows at seq_q."""
    b = b32.to(tl.int64)
    h = h32.to(tl.int64)
    offs_tn = tl.arange(0, BLOCK_N)
    offs_n = start_n + offs_tn
    offs_tm = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    if VARLEN:
        k_base += seq_k.to(tl.int64) * stride_kn
        v_base += seq_k.to(tl.int64) * stride_vn
    k = _load_rows(k_base, start_n, n_k, stride_kn, offs_tn, offs_d, HEAD_DIM, BLOCK_D, not EVEN_N)
    v = _load_rows(v_base, start_n, n_k, stride_vn, offs_tn, offs_d, HEAD_DIM, BLOCK_D, not EVEN_N)
    if REG_A:
        k = _in_registers(k, n_k)
        v = _in_registers(v, n_k)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    if GQA:
        for g in range(0, kv_group):
            dk, dv = _dkdv_head(
                dk, dv, k, v, Q, DO, LSE, DELTA, DQ, DESC_A, DESC_B, DESC_C, DESC_ROWS,
                b32, h32 * kv_group + g, pid_bh * kv_group + g, seq_q,
                stride_qb, stride_qh, stride_qn, stride_dob, stride_doh, stride_don,
                stride_dqb, stride_dqh, stride_dqn,
                n_q, n_k, stride_lse, stride_delta, qk_scale, sm_scale, start_n,
                window_left, window_right, offs_n, offs_tm, offs_d,
                CAUSAL, DOT_PRECISION, BLOCK_M, BLOCK_N, EVEN_M, EVEN_N, HEAD_DIM, BLOCK_D,
                ATOMIC_DQ, USE_TMA, WARP_SPEC, TMA_DQ, PADDED_STATS, LSE_LOG2, STATS_TMA,
                WINDOW, VARLEN,
            )  # fmt: skip
    else:
        dk, dv = _dkdv_head(
            dk, dv, k, v, Q, DO, LSE, DELTA, DQ, DESC_A, DESC_B, DESC_C, DESC_ROWS,
            b32, h32, pid_bh, seq_q,
            stride_qb, stride_qh, stride_qn, stride_dob, stride_doh, stride_don,
            stride_dqb, stride_dqh, stride_dqn,
            n_q, n_k, stride_lse, stride_delta, qk_scale, sm_scale, start_n,
            window_left, window_right, offs_n, offs_tm, offs_d,
            CAUSAL, DOT_PRECISION, BLOCK_M, BLOCK_N, EVEN_M, EVEN_N, HEAD_DIM, BLOCK_D,
            ATOMIC_DQ, USE_TMA, WARP_SPEC, TMA_DQ, PADDED_STATS, LSE_LOG2, STATS_TMA,
            WINDOW, VARLEN,
        )  # fmt: skip
    dk = dk * sm_scale
    dk_base = DK + b * stride_dkb + h * stride_dkh
    if VARLEN:
        dk_base += seq_k.to(tl.int64) * stride_dkn
    _store_rows(
        dk_base, dk.to(DK.dtype.element_ty), start_n, n_k,
        stride_dkn, offs_tn, offs_d, HEAD_DIM, BLOCK_D, not EVEN_N,
    )  # fmt: skip
    dv_base = DV + b * stride_dvb + h * stride_dvh
    if VARLEN:
        dv_base += seq_k.to(tl.int64) * stride_dvn
    _store_rows(
        dv_base, dv.to(DV.dtype.element_ty), start_n, n_k,
        stride_dvn, offs_tn, offs_d, HEAD_DIM, BLOCK_D, not EVEN_N,
    )  # fmt: skip


@triton.jit
def _dq_key_loop(
    dq,
    q,
    do,
    lse2,
    delta,
    k_base,
    v_base,
    desc_k,
    desc_v,
    b32,
    h32,
    row0,
    stride_kn,
    stride_vn,
    lo,
    hi,
    offs_m,
    offs_n,
    offs_d,
    n_k,
    causal_off,
    qk_scale,
    left_off,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    EVEN_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr,
    WARP_SPEC: tl.constexpr,
    WINDOW: tl.constexpr,
):
    """Accumulate dQ (unscaled) of one query tile over key tiles [lo, hi) (MASKED and
    WINDOW as in ``_fwd_key_loop``)."""
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPEC):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k = _load_streamed(
            desc_k, k_base, b32, h32, start_n, row0, n_k, stride_kn, offs_n, offs_d,
            HEAD_DIM, BLOCK_D, MASKED and not EVEN_N, BLOCK_N, USE_TMA,
        )  # fmt: skip
        v = _load_streamed(
            desc_v, v_base, b32, h32, start_n, row0, n_k, stride_vn, offs_n, offs_d,
            HEAD_DIM, BLOCK_D, MASKED and not EVEN_N, BLOCK_N, USE_TMA,
        )  # fmt: skip
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
        p = tl.math.exp2(qk * qk_scale - lse2[:, None])
        if MASKED:
            keep = _visible(
                offs_m, start_n + offs_n, n_k, causal_off, left_off, CAUSAL, not EVEN_N, WINDOW
            )
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)  # eq. 18 (unscaled)
    return dq


@triton.jit
def _dq_tile(
    Q, K, V, DO, LSE, DELTA, LSE2, DQ, DESC_A, DESC_B, Out,
    b32, h32, pid_bh,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_don,
    stride_dqb, stride_dqh, stride_dqn,
    stride_ob, stride_oh, stride_on,
    n_q, n_k, stride_stats, stride_rows, qk_scale, sm_scale, start_m,
    hk32, seq_q, seq_k, window_left, window_right,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
    USE_TMA: tl.constexpr, WARP_SPEC: tl.constexpr, REG_A: tl.constexpr,
    FUSE_DELTA: tl.constexpr, WINDOW: tl.constexpr, VARLEN: tl.constexpr,
):  # fmt: skip
    """dQ for query tile [start_m, start_m + BLOCK_M) of one (batch, head); DESC_A, DESC_B:
    TMA descriptors of K and V (with USE_TMA). REG_A: Q and dO feed S and dP from registers.
    FUSE_DELTA: compute the tile's D = rowsum(dO * O) from Out here and store it to DELTA,
    and L in log2 units to LSE2 (for the dK/dV kernel that runs next), instead of loading D.
    pid_bh: the row of L and D; hk32: the k/v head (h32 itself without GQA); VARLEN: q rows
    (and L, D) start at seq_q, k/v rows at seq_k."""
    b = b32.to(tl.int64)
    h = h32.to(tl.int64)
    offs_tm = tl.arange(0, BLOCK_M)
    offs_m = start_m + offs_tm
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_base = Q + b * stride_qb + h * stride_qh
    if VARLEN:
        q_base += seq_q.to(tl.int64) * stride_qn
    q = _load_rows(q_base, start_m, n_q, stride_qn, offs_tm, offs_d, HEAD_DIM, BLOCK_D, not EVEN_M)
    do_base = DO + b * stride_dob + h * stride_doh
    if VARLEN:
        do_base += seq_q.to(tl.int64) * stride_don
    do = _load_rows(
        do_base, start_m, n_q, stride_don, offs_tm, offs_d, HEAD_DIM, BLOCK_D, not EVEN_M
    )
    if FUSE_DELTA:  # as attn_bwd_preprocess_kernel, for this tile's rows
        o_base = Out + b * stride_ob + h * stride_oh
        if VARLEN:
            o_base += seq_q.to(tl.int64) * stride_on
        o = _load_rows(
            o_base, start_m, n_q, stride_on, offs_tm, offs_d, HEAD_DIM, BLOCK_D, not EVEN_M
        )
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        delta_ptrs = DELTA + pid_bh.to(tl.int64) * stride_rows + offs_m
        if VARLEN:
            delta_ptrs += seq_q
        if EVEN_M:
            tl.store(delta_ptrs, delta)
        else:
            tl.store(delta_ptrs, delta, mask=offs_m < n_q)
        lse_base = LSE + pid_bh.to(tl.int64) * stride_stats
        if VARLEN:
            lse_base += seq_q
        lse2 = _load_lse2(lse_base, start_m, offs_tm, n_q, not EVEN_M, False)
        lse2_ptrs = LSE2 + pid_bh.to(tl.int64) * stride_rows + offs_m
        if VARLEN:
            lse2_ptrs += seq_q
        if EVEN_M:
            tl.store(lse2_ptrs, lse2)
        else:
            tl.store(lse2_ptrs, lse2, mask=offs_m < n_q)
    else:
        lse_base = LSE + pid_bh.to(tl.int64) * stride_stats
        delta_base = DELTA + pid_bh.to(tl.int64) * stride_rows
        if VARLEN:
            lse_base += seq_q
            delta_base += seq_q
        lse2, delta = _load_row_stats(
            lse_base, delta_base, start_m, offs_tm, n_q, not EVEN_M, False
        )  # fmt: skip
    if REG_A:
        q = _in_registers(q, n_q)
        do = _in_registers(do, n_q)
    hk = hk32.to(tl.int64)
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    tma_b = b32  # K, V tiles by TMA: descriptor coordinates (batch, head, row0 + row)
    row0 = 0
    if VARLEN:
        k_base += seq_k.to(tl.int64) * stride_kn
        v_base += seq_k.to(tl.int64) * stride_vn
        tma_b = 0
        row0 = seq_k
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    causal_off = n_k - n_q
    left_off = 0
    if WINDOW:
        left_off = causal_off - window_left
        causal_off = causal_off + window_right
    if CAUSAL:
        full_hi = tl.maximum(start_m + causal_off + 1, 0) // BLOCK_N * BLOCK_N
        full_hi = tl.minimum(full_hi, n_k // BLOCK_N * BLOCK_N)
        hi = tl.maximum(tl.minimum(n_k, start_m + BLOCK_M + causal_off), 0)
    else:
        full_hi = n_k // BLOCK_N * BLOCK_N
        hi = n_k
    full_lo = 0
    if WINDOW:  # as in attn_fwd_kernel
        lo = tl.minimum(tl.maximum(start_m + left_off, 0) // BLOCK_N * BLOCK_N, hi)
        full_lo = tl.cdiv(tl.maximum(start_m + BLOCK_M - 1 + left_off, 0), BLOCK_N) * BLOCK_N
        full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
        full_hi = tl.maximum(full_hi, full_lo)
        dq = _dq_key_loop(
            dq, q, do, lse2, delta, k_base, v_base, DESC_A, DESC_B, tma_b, hk32, row0, stride_kn,
            stride_vn, lo, full_lo, offs_m, offs_n, offs_d, n_k, causal_off, qk_scale, left_off,
            True, CAUSAL, EVEN_N, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_PRECISION, USE_TMA, False,
            WINDOW,
        )  # fmt: skip
    dq = _dq_key_loop(
        dq, q, do, lse2, delta, k_base, v_base, DESC_A, DESC_B, tma_b, hk32, row0, stride_kn,
        stride_vn, full_lo, full_hi, offs_m, offs_n, offs_d, n_k, causal_off, qk_scale, left_off,
        False, CAUSAL, EVEN_N, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_PRECISION, USE_TMA, WARP_SPEC,
        False,
    )  # fmt: skip
    if CAUSAL or not EVEN_N:
        dq = _dq_key_loop(
            dq, q, do, lse2, delta, k_base, v_base, DESC_A, DESC_B, tma_b, hk32, row0, stride_kn,
            stride_vn, full_hi, hi, offs_m, offs_n, offs_d, n_k, causal_off, qk_scale, left_off,
            True, CAUSAL, EVEN_N, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_PRECISION, USE_TMA, False,
            WINDOW,
        )  # fmt: skip
    dq = dq * sm_scale
    dq_base = DQ + b * stride_dqb + h * stride_dqh
    if VARLEN:
        dq_base += seq_q.to(tl.int64) * stride_dqn
    _store_rows(
        dq_base, dq.to(DQ.dtype.element_ty), start_m, n_q,
        stride_dqn, offs_tm, offs_d, HEAD_DIM, BLOCK_D, not EVEN_M,
    )  # fmt: skip


@triton.jit
def attn_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, DQ, DESC_A, DESC_B, DESC_C, DESC_ROWS, CU_Q, CU_K,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_don,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    stride_dqb, stride_dqh, stride_dqn,
    n_heads, n_q, n_k, stride_stats, qk_scale, sm_scale, head_group,
    kv_group, window_left, window_right,
    SEQ_BUCKET,  # autotune key only
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr, ATOMIC_DQ: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
    USE_TMA: tl.constexpr, WARP_SPEC: tl.constexpr, TMA_DQ: tl.constexpr,
    REG_A: tl.constexpr, GROUPED: tl.constexpr, PADDED_STATS: tl.constexpr,
    PACKED_STATS: tl.constexpr, LSE_LOG2: tl.constexpr, STATS_TMA: tl.constexpr,
    GQA: tl.constexpr, WINDOW: tl.constexpr, VARLEN: tl.constexpr,
):  # fmt: skip
    """One program: dK, dV of one key tile (first key tiles see the most queries: run first).

    With ATOMIC_DQ it also adds its share of dQ (float32) into DQ atomically (through the
    DESC_C descriptor with TMA_DQ). LSE and DELTA: float32 rows per (batch, head),
    stride_stats apart, twice that with PACKED_STATS for DELTA and, with LSE_LOG2 (L in log2
    units, ``_lse_log2``, as the kernel that wrote D leaves it), for LSE (``_stats_strides``;
    else LSE holds natural logs). The first n_q of each are used; with PADDED_STATS the rest
    hold +inf / 0 up to a whole number of query tiles, so the loop reads them without masks.
    STATS_TMA: the loop reads both through DESC_ROWS (``_dkdv_query_loop``).

    GQA: the grid's first axis runs over (batch, k/v head), n_heads of them per batch, and
    each program sums the kv_group query heads that share its k/v head. WINDOW, VARLEN: as
    in ``attn_fwd_kernel`` (VARLEN: no unmasked reads past a sequence's rows).
    """
    qk_scale = _f32(qk_scale)
    sm_scale = _f32(sm_scale)
    pid_bh, tile = _grouped_program(head_group, GROUPED)
    start_n = tile * BLOCK_N
    stride_lse, stride_delta = _stats_strides(
        stride_stats, n_q, PADDED_STATS, PACKED_STATS, LSE_LOG2
    )
    b32 = pid_bh // n_heads
    h32 = pid_bh % n_heads
    stats_bh = pid_bh
    seq_q = 0
    seq_k = 0
    if VARLEN:
        seq_q = tl.load(CU_Q + b32)
        seq_k = tl.load(CU_K + b32)
        n_q = tl.load(CU_Q + b32 + 1) - seq_q
        n_k = tl.load(CU_K + b32 + 1) - seq_k
        stats_bh = h32  # L and D are (1, H, total) rows
        if start_n >= n_k:
            return
    _dkdv_tile(
        Q, K, V, DO, LSE, DELTA, DK, DV, DQ, DESC_A, DESC_B, DESC_C, DESC_ROWS,
        b32, h32, stats_bh,
        stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_don,
        stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
        stride_dqb, stride_dqh, stride_dqn,
        n_q, n_k, stride_lse, stride_delta, qk_scale, sm_scale, start_n,
        kv_group, seq_q, seq_k, window_left, window_right,
        HEAD_DIM, BLOCK_D, CAUSAL, DOT_PRECISION, BLOCK_M, BLOCK_N, EVEN_M, EVEN_N, ATOMIC_DQ,
        USE_TMA, WARP_SPEC, TMA_DQ, REG_A, PADDED_STATS and not VARLEN, LSE_LOG2, STATS_TMA,
        GQA, WINDOW, VARLEN,
    )  # fmt: skip


@triton.jit
def attn_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, LSE2, DQ, DESC_A, DESC_B, Out, CU_Q, CU_K,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_don,
    stride_dqb, stride_dqh, stride_dqn,
    stride_ob, stride_oh, stride_on,
    n_heads, n_q, n_k, stride_stats, stride_rows, qk_scale, sm_scale, head_group,
    kv_group, window_left, window_right,
    SEQ_BUCKET,  # autotune key only
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
    USE_TMA: tl.constexpr, WARP_SPEC: tl.constexpr, REG_A: tl.constexpr,
    GROUPED: tl.constexpr, FUSE_DELTA: tl.constexpr,
    GQA: tl.constexpr, WINDOW: tl.constexpr, VARLEN: tl.constexpr,
):  # fmt: skip
    """One program: dQ of one query tile (last query tiles are heaviest: run first). With
    FUSE_DELTA it also computes the tile's D = rowsum(dO * O) and stores it, with L in log2
    units (LSE2), for the dK/dV kernel, which then runs after it (no preprocessing launch;
    see ``_dq_tile``). GQA, WINDOW, VARLEN: as in ``attn_fwd_kernel``."""
    qk_scale = _f32(qk_scale)
    sm_scale = _f32(sm_scale)
    pid_bh, tile = _grouped_program(head_group, GROUPED)
    start_m = (tl.num_programs(1) - 1 - tile) * BLOCK_M
    b32 = pid_bh // n_heads
    h32 = pid_bh % n_heads
    if GQA:
        hk32 = h32 // kv_group
    else:
        hk32 = h32
    stats_bh = pid_bh
    seq_q = 0
    seq_k = 0
    if VARLEN:
        seq_q = tl.load(CU_Q + b32)
        seq_k = tl.load(CU_K + b32)
        n_q = tl.load(CU_Q + b32 + 1) - seq_q
        n_k = tl.load(CU_K + b32 + 1) - seq_k
        stats_bh = h32  # L and D are (1, H, total) rows
        if start_m >= n_q:
            return
    _dq_tile(
        Q, K, V, DO, LSE, DELTA, LSE2, DQ, DESC_A, DESC_B, Out,
        b32, h32, stats_bh,
        stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_don,
        stride_dqb, stride_dqh, stride_dqn, stride_ob, stride_oh, stride_on,
        n_q, n_k, stride_stats, stride_rows, qk_scale, sm_scale, start_m,
        hk32, seq_q, seq_k, window_left, window_right,
        HEAD_DIM, BLOCK_D, CAUSAL, DOT_PRECISION, BLOCK_M, BLOCK_N, EVEN_M, EVEN_N,
        USE_TMA, WARP_SPEC, REG_A, FUSE_DELTA, WINDOW, VARLEN,
    )  # fmt: skip


@triton.jit
def attn_bwd_fused_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, DQ,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_don,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    stride_dqb, stride_dqh, stride_dqn,
    n_heads, n_q, n_k, stride_stats, stride_rows, qk_scale, sm_scale,
    SEQ_BUCKET,  # autotune key only
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr,
    BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr,
    EVEN_M1: tl.constexpr, EVEN_N1: tl.constexpr,
    EVEN_M2: tl.constexpr, EVEN_N2: tl.constexpr, PADDED_STATS: tl.constexpr,
    PACKED_STATS: tl.constexpr,
):  # fmt: skip
    """One program: dK, dV of key tile t and dQ of query tile t (one launch, no atomics).

    With causal masks the key tile's work falls as t grows and the query tile's rises, so
    every program does about the same work.
    """
    qk_scale = _f32(qk_scale)
    sm_scale = _f32(sm_scale)
    pid_bh = tl.program_id(0)
    tile = tl.program_id(1)
    b32 = pid_bh // n_heads
    h32 = pid_bh % n_heads
    if tile * BLOCK_N1 < n_k:
        stride_lse, stride_delta = _stats_strides(
            stride_stats, n_q, PADDED_STATS, PACKED_STATS, False
        )
        _dkdv_tile(
            Q, K, V, DO, LSE, DELTA, DK, DV, DQ, None, None, None, None, b32, h32, pid_bh,
            stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
            stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_don,
            stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
            stride_dqb, stride_dqh, stride_dqn,
            n_q, n_k, stride_lse, stride_delta, qk_scale, sm_scale, tile * BLOCK_N1,
            1, 0, 0, 0, 0,
            HEAD_DIM, BLOCK_D, CAUSAL, DOT_PRECISION, BLOCK_M1, BLOCK_N1, EVEN_M1, EVEN_N1, False,
            False, False, False, False, PADDED_STATS, False, False, False, False, False,
        )  # fmt: skip
    if tile * BLOCK_M2 < n_q:
        _dq_tile(
            Q, K, V, DO, LSE, DELTA, None, DQ, None, None, None, b32, h32, pid_bh,
            stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
            stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_don,
            stride_dqb, stride_dqh, stride_dqn, 0, 0, 0,
            n_q, n_k, stride_stats, stride_rows, qk_scale, sm_scale, tile * BLOCK_M2,
            h32, 0, 0, 0, 0,
            HEAD_DIM, BLOCK_D, CAUSAL, DOT_PRECISION, BLOCK_M2, BLOCK_N2, EVEN_M2, EVEN_N2,
            False, False, False, False, False, False,
        )  # fmt: skip


# --------------------------------------------------------------------------------------------
# Decode: few queries against a long key cache, keys split over programs (split-KV)
# --------------------------------------------------------------------------------------------


@triton.jit
def attn_fwd_decode_kernel(
    Q, K, V, Out, LSE, O_PART, LSE_PART,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on,
    n_kv_heads, n_q, n_k, qk_scale, kv_group, window_left, window_right,
    key_lo, key_hi, keys_per_split,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr, SPLIT: tl.constexpr,
    KV_LEN=None, KV_LENS: tl.constexpr = False, KV_ADD=None,
):  # fmt: skip
    """One program: every query (n_q of them) of the kv_group query heads that share k/v head
    (b, hk), as the rows of one tile (row r: head hk * kv_group + r // n_q, query r % n_q),
    against keys [key_lo + s * keys_per_split, ...) below key_hi (s: the split, the grid's
    second axis; key_lo and keys_per_split are multiples of BLOCK_N). K and V are read once
    for the whole group. With SPLIT the split's normalized output and log-sum-exp (log2
    units; -inf where the split has no visible key) go to O_PART (B, H, S, n_q, HEAD_DIM)
    and LSE_PART (B, H, S, n_q) float32 for ``attn_fwd_combine_kernel``; else (one split)
    O and L are written directly. KV_LENS (a KV cache): KV_LEN holds each batch element's
    int32 key count, plus KV_ADD (keys appended just before), clamped to [0, n_k]; the
    splits then share that element's keys, from its window start (WINDOW) to that count,
    in whole tiles (key_lo, key_hi and keys_per_split unused)."""
    qk_scale = _f32(qk_scale)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b32 = pid // n_kv_heads
    hk32 = pid % n_kv_heads
    b = b32.to(tl.int64)
    offs_r = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    rows_ok = offs_r < kv_group * n_q
    head = hk32 * kv_group + offs_r // n_q  # (BLOCK_M,) query head of each row
    pos = offs_r % n_q  # (BLOCK_M,) query position of each row
    row_off = b * stride_qb + head.to(tl.int64) * stride_qh + pos.to(tl.int64) * stride_qn
    d_ok = offs_d[None, :] < HEAD_DIM
    q = tl.load(Q + row_off[:, None] + offs_d[None, :], mask=rows_ok[:, None] & d_ok, other=0.0)
    k_base = K + b * stride_kb + hk32.to(tl.int64) * stride_kh
    v_base = V + b * stride_vb + hk32.to(tl.int64) * stride_vh
    if KV_LENS:
        n_k = tl.minimum(tl.maximum(tl.load(KV_LEN + b32), 0) + KV_ADD, n_k)

    causal_off = n_k - n_q
    left_off = 0
    if WINDOW:
        left_off = causal_off - window_left
        causal_off = causal_off + window_right
    if KV_LENS:
        # The splits share this sequence's visible keys (from the first query's window start
        # to its length), not the cache's allocation: a short sequence keeps every split busy.
        first = 0
        if WINDOW:
            first = tl.maximum(left_off, 0) // BLOCK_N * BLOCK_N
        tiles = tl.cdiv(n_k - first, BLOCK_N)
        per_split = tl.cdiv(tiles, tl.num_programs(1)) * BLOCK_N
        lo = first + split * per_split
        hi = tl.minimum(lo + per_split, n_k)
    else:
        lo = key_lo + split * keys_per_split
        hi = tl.minimum(lo + keys_per_split, key_hi)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    acc, l_i, m_i = _fwd_key_loop(
        acc, l_i, m_i, q, k_base, v_base, None, None, b32, hk32, 0, stride_kn, stride_vn,
        lo, hi, pos, offs_n, offs_d, n_k, causal_off, qk_scale, left_off,
        True, CAUSAL, EVEN_N, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_PRECISION, False, False, WINDOW,
    )  # fmt: skip
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc * (1.0 / l_safe)[:, None]
    lse2 = m_i + tl.math.log2(l_i)  # -inf for a row that saw no key of this split
    stat = (b * n_kv_heads * kv_group + head.to(tl.int64)) * n_q + pos  # (B, H, n_q) index
    if SPLIT:
        part = (stat - pos) * tl.num_programs(1) + split * n_q + pos  # (B, H, S, n_q) index
        o_ptrs = O_PART + part[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(o_ptrs, o, mask=rows_ok[:, None] & d_ok)
        tl.store(LSE_PART + part, lse2, mask=rows_ok)
    else:
        out_off = b * stride_ob + head.to(tl.int64) * stride_oh + pos.to(tl.int64) * stride_on
        o_ptrs = Out + out_off[:, None] + offs_d[None, :]
        tl.store(o_ptrs, o.to(Out.dtype.element_ty), mask=rows_ok[:, None] & d_ok)
        tl.store(LSE + stat, lse2 * _LN2, mask=rows_ok)


@triton.jit
def attn_fwd_combine_kernel(
    O_PART, LSE_PART, Out, LSE,
    stride_ob, stride_oh, stride_on,
    n_heads, n_q, n_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """One program: one query row (b, h, i) of the decode kernel's splits, combined by their
    log-sum-exps: O = sum_s w_s O_s / sum_s w_s, w_s = 2^(lse_s - max), L = max + log2(sum
    w_s) in natural units (a row that saw no key: O = 0, L = -inf)."""
    row = tl.program_id(0).to(tl.int64)  # (b * n_heads + h) * n_q + i
    bh = row // n_q
    i = row % n_q
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < n_splits
    part = (bh * n_splits + offs_s) * n_q + i  # (BLOCK_S,)
    lse_s = tl.load(LSE_PART + part, mask=s_ok, other=float("-inf"))
    m = tl.max(lse_s, 0)
    m_sub = tl.where(m == float("-inf"), 0.0, m)
    w = tl.math.exp2(lse_s - m_sub)  # 0 for splits without keys
    total = tl.sum(w, 0)
    mask = s_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    o_s = tl.load(O_PART + part[:, None] * HEAD_DIM + offs_d[None, :], mask=mask, other=0.0)
    o = tl.sum(o_s * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    b = bh // n_heads
    h = bh % n_heads
    out = Out + b * stride_ob + h * stride_oh + i * stride_on + offs_d
    tl.store(out, o.to(Out.dtype.element_ty), mask=offs_d < HEAD_DIM)
    tl.store(LSE + row, (m_sub + tl.math.log2(total)) * _LN2)


@triton.jit
def kv_append_kernel(
    K_NEW, V_NEW, K_CACHE, V_CACHE, KV_LEN,
    stride_knb, stride_knh, stride_knn,
    stride_vnb, stride_vnh, stride_vnn,
    stride_kcb, stride_kch, stride_kcn,
    stride_vcb, stride_vch, stride_vcn,
    n_kv_heads, n_new, n_cache,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """One program: BLOCK_N new rows of one (batch, k/v head) of K_NEW and V_NEW (B, Hkv,
    n_new, d) stored into the caches (B, Hkv, n_cache, d) from row KV_LEN[b] (the batch
    element's int32 key count, clamped to [0, n_cache]) on; rows that would land at or past
    n_cache are dropped. The attention kernels launched next read KV_LEN + n_new."""
    pid = tl.program_id(0)
    b32 = pid // n_kv_heads
    b = b32.to(tl.int64)
    hk = (pid % n_kv_heads).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    start = tl.minimum(tl.maximum(tl.load(KV_LEN + b32), 0), n_cache)
    dest = (start + offs_n).to(tl.int64)
    read = (offs_n[:, None] < n_new) & (offs_d[None, :] < HEAD_DIM)
    write = read & (dest[:, None] < n_cache)
    src = offs_n.to(tl.int64)[:, None]
    k = tl.load(K_NEW + b * stride_knb + hk * stride_knh + src * stride_knn + offs_d[None, :],
                mask=read)  # fmt: skip
    k_dst = K_CACHE + b * stride_kcb + hk * stride_kch + dest[:, None] * stride_kcn
    tl.store(k_dst + offs_d[None, :], k, mask=write)
    v = tl.load(V_NEW + b * stride_vnb + hk * stride_vnh + src * stride_vnn + offs_d[None, :],
                mask=read)  # fmt: skip
    v_dst = V_CACHE + b * stride_vcb + hk * stride_vch + dest[:, None] * stride_vcn
    tl.store(v_dst + offs_d[None, :], v, mask=write)
