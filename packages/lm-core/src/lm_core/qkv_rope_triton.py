"""Triton kernels of the attention input split (`lm_core.qkv_rope`): q, k rotated by RoPE
and v, out of the fused projection's (B, T, n, Dh) output, and the inverse in the backward.

One program per token and block of heads. Forward: read the heads' rows, rotate the pairs
(2i, 2i+1) of q and k heads by the token's cos / sin row (float32), store q, k, v into
three contiguous (B, T, heads, Dh) buffers. Backward: read dq, dk, dv through their strides,
rotate dq and dk back (the transpose of the rotation), store one contiguous dqkv. Why not
inductor's kernels: it rotates through `stack` with element-wise index arithmetic and, in
the backward, builds dqkv from two scatter kernels (~38 us per xl layer for ~26 MB each way;
these need ~20).

This module imports triton at the top; `lm_core.qkv_rope` imports it lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lm_core._triton_util import is_interpreted

ELEMENTS = 1024  # heads x head dim per program
WARPS = 2  # 2 warps per 1024 elements: 8.9 / 9.3 us per xl layer against 11.0 / 12.0 at 4 (H200)


@triton.jit
def _rotate(x, cos, sin, INVERSE: tl.constexpr, HEADS: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rotate the pairs of x (HEADS, BLOCK_D) by angles with cos, sin (BLOCK_D / 2,)."""
    x0, x1 = tl.split(tl.reshape(x, (HEADS, BLOCK_D // 2, 2)))
    c = cos[None, :]
    s = sin[None, :]
    if INVERSE:
        r0 = x0 * c + x1 * s
        r1 = x1 * c - x0 * s
    else:
        r0 = x0 * c - x1 * s
        r1 = x0 * s + x1 * c
    return tl.reshape(tl.join(r0, r1), (HEADS, BLOCK_D))


@triton.jit
def _table_rows(COS, SIN, t, head_dim, BLOCK_D: tl.constexpr):
    """Row t of the (T, head_dim / 2) cos and sin tables (1 and 0 past their end)."""
    halves = tl.arange(0, BLOCK_D // 2)
    in_row = halves < head_dim // 2
    cos = tl.load(COS + t * (head_dim // 2) + halves, mask=in_row, other=1.0)
    sin = tl.load(SIN + t * (head_dim // 2) + halves, mask=in_row, other=0.0)
    return cos, sin


# The two kernels repeat their program prologue (token, heads, head dims) rather than share
# it through a helper: a shared load helper in the SwiGLU kernels made torch 2.11 take its
# pointer argument as written (lm-core DESIGN), and no GPU check of a new helper here has
# been run.


@triton.jit
def qkv_rope_fwd_kernel(
    QKV, COS, SIN, Q, K, V, seq, n_q, n_kv, head_dim,
    stride_b, stride_t, stride_h,
    HEADS: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0).to(tl.int64)
    b = tok // seq
    t = tok % seq
    heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    dims = tl.arange(0, BLOCK_D)
    in_d = dims < head_dim
    n = n_q + 2 * n_kv
    mask = (heads < n)[:, None] & in_d[None, :]
    src = QKV + b * stride_b + t * stride_t + heads[:, None] * stride_h + dims[None, :]
    x = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    cos, sin = _table_rows(COS, SIN, t, head_dim, BLOCK_D)
    rot = _rotate(x, cos, sin, False, HEADS, BLOCK_D)
    is_q = heads < n_q
    is_k = (heads >= n_q) & (heads < n_q + n_kv)
    is_v = (heads >= n_q + n_kv) & (heads < n)
    out = tl.where((is_q | is_k)[:, None], rot, x).to(Q.dtype.element_ty)
    col = dims[None, :]
    tl.store(Q + (tok * n_q + heads[:, None]) * head_dim + col, out, mask=is_q[:, None] & mask)
    k_head = heads[:, None] - n_q
    tl.store(K + (tok * n_kv + k_head) * head_dim + col, out, mask=is_k[:, None] & mask)
    v_head = heads[:, None] - n_q - n_kv
    tl.store(V + (tok * n_kv + v_head) * head_dim + col, out, mask=is_v[:, None] & mask)


@triton.jit
def qkv_rope_bwd_kernel(
    DQ, DK, DV, COS, SIN, DQKV, seq, n_q, n_kv, head_dim,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h,
    HEADS: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0).to(tl.int64)
    b = tok // seq
    t = tok % seq
    heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    dims = tl.arange(0, BLOCK_D)
    in_d = (dims < head_dim)[None, :]
    n = n_q + 2 * n_kv
    is_q = (heads < n_q)[:, None]
    is_k = ((heads >= n_q) & (heads < n_q + n_kv))[:, None]
    is_v = ((heads >= n_q + n_kv) & (heads < n))[:, None]
    col = dims[None, :]
    hq = heads[:, None]
    hk = hq - n_q
    hv = hq - n_q - n_kv
    g = tl.load(DQ + b * sq_b + t * sq_t + hq * sq_h + col, mask=is_q & in_d, other=0.0)
    g += tl.load(DK + b * sk_b + t * sk_t + hk * sk_h + col, mask=is_k & in_d, other=0.0)
    g += tl.load(DV + b * sv_b + t * sv_t + hv * sv_h + col, mask=is_v & in_d, other=0.0)
    g = g.to(tl.float32)
    cos, sin = _table_rows(COS, SIN, t, head_dim, BLOCK_D)
    rot = _rotate(g, cos, sin, True, HEADS, BLOCK_D)
    out = tl.where(is_q | is_k, rot, g).to(DQKV.dtype.element_ty)
    tl.store(DQKV + (tok * n + hq) * head_dim + col, out, mask=(heads < n)[:, None] & in_d)


def _tiles(head_dim: int) -> tuple[int, int]:
    block_d = triton.next_power_of_2(head_dim)
    heads = max(1, (64 if INTERPRETED else ELEMENTS) // block_d)
    return heads, block_d


def forward(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_q: int, n_kv: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (B, T, n_q, Dh), k and v (B, T, n_kv, Dh), contiguous, of qkv (B, T, n, Dh) (unit
    last stride); cos, sin: contiguous float32 (>= T, Dh / 2) tables."""
    b, t, n, d = qkv.shape
    q = torch.empty(b, t, n_q, d, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(b, t, n_kv, d, dtype=qkv.dtype, device=qkv.device)
    v = torch.empty_like(k)
    heads, block_d = _tiles(d)
    if b * t:
        qkv_rope_fwd_kernel[(b * t, triton.cdiv(n, heads))](
            qkv, cos, sin, q, k, v, t, n_q, n_kv, d, *qkv.stride()[:3],
            HEADS=heads, BLOCK_D=block_d, num_warps=WARPS,
        )  # fmt: skip
    return q, k, v


def backward(
    dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """dqkv (B, T, n, Dh), contiguous, from the gradients of q, k, v (unit last strides)."""
    b, t, n_q, d = dq.shape
    n_kv = dk.shape[2]
    n = n_q + 2 * n_kv
    dqkv = torch.empty(b, t, n, d, dtype=dq.dtype, device=dq.device)
    heads, block_d = _tiles(d)
    if b * t:
        qkv_rope_bwd_kernel[(b * t, triton.cdiv(n, heads))](
            dq, dk, dv, cos, sin, dqkv, t, n_q, n_kv, d,
            *dq.stride()[:3], *dk.stride()[:3], *dv.stride()[:3],
            HEADS=heads, BLOCK_D=block_d, num_warps=WARPS,
        )  # fmt: skip
    return dqkv


INTERPRETED = is_interpreted(qkv_rope_fwd_kernel)
