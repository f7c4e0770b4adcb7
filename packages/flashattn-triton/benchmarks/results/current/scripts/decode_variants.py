"""Candidate split-KV decode kernels for flashattn-triton, timed against SDPA and the package.

Standalone experiment (not part of the package; run from packages/flashattn-triton with every
package's src on PYTHONPATH). One query (n_q = 1) against a long K/V
cache, d = 128, forward only; causal with one query = every key visible = no mask.

Variants (``VARIANTS`` below):
  sdpa            torch SDPA, as perf_tools.attention_features' decode row does it
                  (``F.scaled_dot_product_attention(q, k, v, enable_gqa=Hkv != H)``, no mask)
  pkg             flashattn_triton.flash_attention(q, k, v, causal=True) (shipped path)
  pkgk-sxF        the package's own attn_fwd_decode_kernel + attn_fwd_combine_kernel with the
                  shipped plan's splits times F (finer splits), launched from here
  dot-...         own kernel, tl.dot with a padded 16-row tile (the package's scheme, but the
                  main key loop unmasked); MHA and GQA
  nodot-...       own kernel, rows == 1 (MHA): scores tl.sum(k * q, 1), output
                  tl.sum(p[:, None] * v, 0), fp32
  nodot2d-...     as nodot, but the output accumulator is a (BLOCK_N, d) fp32 tile
                  (acc = acc * alpha + p[:, None] * v), reduced over keys once at the end
  *-tma-...       K and V tiles loaded through host-side TMA descriptors (4-D, block
                  [1, 1, BLOCK_N, 128]); skipped where they do not compile / run
  dot-rot-...     dot with each program's key loop started at a staggered tile and wrapped
                  (ROTATE); dot-ef-...: K/V loads with eviction_policy="evict_first"
  ...-sxF         own kernel with the rule's splits times F, partials merged by the package's
                  attn_fwd_combine_kernel
  streamk-...     persistent grid (SMs x programs per SM; 3 or 5 under the interpreter) over all
                  (batch, k/v head) x key tiles as one sequence, program p taking tiles
                  [p T / P, (p+1) T / P) across row-group boundaries; one partial per row-group
                  segment, merged by the script's streamk_combine_kernel ("splits" = max slots)
Own-kernel names: n<BLOCK_N>w<warps>s<stages>. "rule" splits = the package's decode_splits
with the variant's own tile (programs per SM from its shared-memory ring).

GPU:  python benchmarks/results/current/scripts/decode_variants.py OUT.json [--rounds 3] [--only SUBSTR,...]
CPU:  TRITON_INTERPRET=1 python benchmarks/results/current/scripts/decode_variants.py --cpu-check
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


# ------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------


@triton.jit
def _load_kv(
    desc, base, b32, h32, start, n_k, stride_n, offs_n, offs_d,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr,
    USE_TMA: tl.constexpr, EVICT: tl.constexpr,
):  # fmt: skip
    """(BLOCK_N, HEAD_DIM) tile of rows start + offs_n (rows >= n_k read as zeros). EVICT:
    the pointer loads' L2 eviction policy ("" or "evict_first"; TMA loads take none)."""
    if USE_TMA:
        x = desc.load([b32, h32, start, 0]).reshape(BLOCK_N, HEAD_DIM)
    else:
        ptrs = base + start.to(tl.int64) * stride_n + (offs_n[:, None] * stride_n + offs_d[None, :])
        if MASKED:
            x = tl.load(
                ptrs, mask=(start + offs_n)[:, None] < n_k, other=0.0, eviction_policy=EVICT
            )
        else:
            x = tl.load(ptrs, eviction_policy=EVICT)
    return x


@triton.jit
def _decode_steps(
    acc, l_i, m_i, q, k_base, v_base, desc_k, desc_v, b32, hk32, stride_kn, stride_vn,
    lo, hi, n_k, qk_scale, offs_n, offs_d,
    MASKED: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    NO_DOT: tl.constexpr, ACC2D: tl.constexpr, USE_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr, EVICT: tl.constexpr,
):  # fmt: skip
    """Online softmax (log2 units) over key tiles [lo, hi). NO_DOT: q is (HEAD_DIM,) fp32,
    already times qk_scale; m_i, l_i scalars; acc (HEAD_DIM,) or, with ACC2D, (BLOCK_N,
    HEAD_DIM). Else q is the (BLOCK_M, HEAD_DIM) input-dtype tile, m_i, l_i (BLOCK_M,)."""
    for start_n in tl.range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k = _load_kv(
            desc_k, k_base, b32, hk32, start_n, n_k, stride_kn, offs_n, offs_d,
            BLOCK_N, HEAD_DIM, MASKED, USE_TMA, EVICT,
        )  # fmt: skip
        if NO_DOT:
            s = tl.sum(k.to(tl.float32) * q[None, :], 1)  # (BLOCK_N,)
            if MASKED:
                s = tl.where(start_n + offs_n < n_k, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 0))
            p = tl.math.exp2(s - m_new)
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 0)
            v = _load_kv(
                desc_v, v_base, b32, hk32, start_n, n_k, stride_vn, offs_n, offs_d,
                BLOCK_N, HEAD_DIM, MASKED, USE_TMA, EVICT,
            )  # fmt: skip
            if ACC2D:
                acc = acc * alpha + p[:, None] * v.to(tl.float32)
            else:
                acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), 0)
        else:
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
            if MASKED:
                qk = tl.where((start_n + offs_n)[None, :] < n_k, qk * qk_scale, float("-inf"))
            else:
                qk = qk * qk_scale
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.math.exp2(qk - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = _load_kv(
                desc_v, v_base, b32, hk32, start_n, n_k, stride_vn, offs_n, offs_d,
                BLOCK_N, HEAD_DIM, MASKED, USE_TMA, EVICT,
            )  # fmt: skip
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _decode_range(
    acc, l_i, m_i, q, k_base, v_base, desc_k, desc_v, b32, hk32, stride_kn, stride_vn,
    lo, hi_full, hi, n_k, qk_scale, offs_n, offs_d, pid,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, NO_DOT: tl.constexpr,
    ACC2D: tl.constexpr, USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
    EVICT: tl.constexpr, EVEN_N: tl.constexpr, ROTATE: tl.constexpr,
):  # fmt: skip
    """Full tiles [lo, hi_full) unmasked, then the ragged tile [hi_full, hi) masked. ROTATE:
    program pid of P (grid axis 0) starts its full tiles at tile pid * tiles // P and wraps
    around (online softmax is order-free), so that concurrent programs do not walk
    addresses that are equal modulo the head stride in lockstep."""
    if ROTATE:
        n_t = (hi_full - lo) // BLOCK_N
        mid = lo + (pid.to(tl.int64) * n_t // tl.num_programs(0)).to(tl.int32) * BLOCK_N
        acc, l_i, m_i = _decode_steps(
            acc, l_i, m_i, q, k_base, v_base, desc_k, desc_v, b32, hk32, stride_kn, stride_vn,
            mid, hi_full, n_k, qk_scale, offs_n, offs_d,
            False, BLOCK_N, HEAD_DIM, NO_DOT, ACC2D, USE_TMA, DOT_PRECISION, EVICT,
        )  # fmt: skip
        acc, l_i, m_i = _decode_steps(
            acc, l_i, m_i, q, k_base, v_base, desc_k, desc_v, b32, hk32, stride_kn, stride_vn,
            lo, mid, n_k, qk_scale, offs_n, offs_d,
            False, BLOCK_N, HEAD_DIM, NO_DOT, ACC2D, USE_TMA, DOT_PRECISION, EVICT,
        )  # fmt: skip
    else:
        acc, l_i, m_i = _decode_steps(
            acc, l_i, m_i, q, k_base, v_base, desc_k, desc_v, b32, hk32, stride_kn, stride_vn,
            lo, hi_full, n_k, qk_scale, offs_n, offs_d,
            False, BLOCK_N, HEAD_DIM, NO_DOT, ACC2D, USE_TMA, DOT_PRECISION, EVICT,
        )  # fmt: skip
    if not EVEN_N:
        acc, l_i, m_i = _decode_steps(
            acc, l_i, m_i, q, k_base, v_base, desc_k, desc_v, b32, hk32, stride_kn, stride_vn,
            hi_full, hi, n_k, qk_scale, offs_n, offs_d,
            True, BLOCK_N, HEAD_DIM, NO_DOT, ACC2D, USE_TMA, DOT_PRECISION, EVICT,
        )  # fmt: skip
    return acc, l_i, m_i


@triton.jit
def decode_kernel(
    Q, K, V, Out, O_PART, LSE_PART, DESC_K, DESC_V,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh,
    n_kv_heads, n_k, qk_scale, keys_per_split,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, NO_DOT: tl.constexpr, ACC2D: tl.constexpr,
    USE_TMA: tl.constexpr, EVEN_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    EVICT: tl.constexpr, ROTATE: tl.constexpr,
):  # fmt: skip
    """One program: k/v head (b, hk) (grid axis 0), key split s (axis 1) of one query per
    q head; the GROUP q heads hk * GROUP + r share the k/v head. One split: o written in
    Out's dtype; several: fp32 normalized partials O_PART (B, H, S, 1, d) and LSE_PART
    (B, H, S, 1) in log2 units (the layout of the package's attn_fwd_combine_kernel).
    keys_per_split is a multiple of BLOCK_N and every split has at least one key."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    n_splits = tl.num_programs(1)
    b32 = pid // n_kv_heads
    hk32 = pid % n_kv_heads
    b = b32.to(tl.int64)
    hk = hk32.to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    lo = split * keys_per_split
    hi = tl.minimum(lo + keys_per_split, n_k)
    if EVEN_N:
        hi_full = hi
    else:
        hi_full = lo + (hi - lo) // BLOCK_N * BLOCK_N

    if NO_DOT:  # GROUP == 1: q head = hk
        q = tl.load(Q + b * stride_qb + hk * stride_qh + offs_d).to(tl.float32) * qk_scale
        m_i = tl.max(tl.full([BLOCK_N], float("-inf"), tl.float32), 0)  # fp32 scalar
        l_i = tl.sum(tl.zeros([BLOCK_N], tl.float32), 0)
        if ACC2D:
            acc = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
        else:
            acc = tl.zeros([HEAD_DIM], tl.float32)
        acc, l_i, m_i = _decode_range(
            acc, l_i, m_i, q, k_base, v_base, DESC_K, DESC_V, b32, hk32, stride_kn, stride_vn,
            lo, hi_full, hi, n_k, qk_scale, offs_n, offs_d, pid,
            BLOCK_N, HEAD_DIM, NO_DOT, ACC2D, USE_TMA, DOT_PRECISION, EVICT, EVEN_N, ROTATE,
        )  # fmt: skip
        if ACC2D:
            o = tl.sum(acc, 0) / l_i
        else:
            o = acc / l_i
        lse2 = m_i + tl.math.log2(l_i)
        if n_splits > 1:
            part = pid.to(tl.int64) * n_splits + split  # (b * H + h) * S + s, H == Hkv
            tl.store(O_PART + part * HEAD_DIM + offs_d, o)
            tl.store(LSE_PART + part, lse2)
        else:
            tl.store(Out + b * stride_ob + hk * stride_oh + offs_d, o.to(Out.dtype.element_ty))
    else:
        offs_r = tl.arange(0, BLOCK_M)
        rows_ok = offs_r < GROUP
        head = hk * GROUP + offs_r  # (BLOCK_M,) int64 q head of each row
        q_ptrs = Q + b * stride_qb + head[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(q_ptrs, mask=rows_ok[:, None], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        acc, l_i, m_i = _decode_range(
            acc, l_i, m_i, q, k_base, v_base, DESC_K, DESC_V, b32, hk32, stride_kn, stride_vn,
            lo, hi_full, hi, n_k, qk_scale, offs_n, offs_d, pid,
            BLOCK_N, HEAD_DIM, NO_DOT, ACC2D, USE_TMA, DOT_PRECISION, EVICT, EVEN_N, ROTATE,
        )  # fmt: skip
        o = acc / l_i[:, None]
        lse2 = m_i + tl.math.log2(l_i)
        if n_splits > 1:
            part = (b * n_kv_heads * GROUP + head) * n_splits + split
            tl.store(O_PART + part[:, None] * HEAD_DIM + offs_d[None, :], o, mask=rows_ok[:, None])
            tl.store(LSE_PART + part, lse2, mask=rows_ok)
        else:
            o_ptrs = Out + b * stride_ob + head[:, None] * stride_oh + offs_d[None, :]
            tl.store(o_ptrs, o.to(Out.dtype.element_ty), mask=rows_ok[:, None])


@triton.jit
def _streamk_owner(t, n_tiles, n_progs):
    """The program whose range [p * T // P, (p + 1) * T // P) holds linear key tile t (int64):
    the largest p with p * T // P <= t."""
    return ((t + 1) * n_progs - 1) // n_tiles


@triton.jit
def streamk_decode_kernel(
    Q, K, V, O_PART, LSE_PART,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    n_kv_heads, n_k, qk_scale, tiles_per_group, n_tiles, n_slots,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Stream-K: a persistent grid of P programs over the n_tiles = (B * Hkv) *
    tiles_per_group key tiles laid end to end (row group g = b * Hkv + hk, its tiles in key
    order). Program p takes tiles [p * T // P, (p + 1) * T // P), which may start and end
    inside row groups and span several; each row-group segment it walks (the GROUP q heads of
    k/v head (b, hk) as the rows of one dot tile, the last tile of each group masked when
    n_k % BLOCK_N != 0) leaves a normalized fp32 partial and its log2 log-sum-exp in slot
    p - (first program of g) of O_PART (B * H, n_slots, HEAD_DIM) / LSE_PART (B * H,
    n_slots), for ``streamk_combine_kernel``. Every segment has at least one key."""
    pid = tl.program_id(0)
    n_progs = tl.num_programs(0)
    t0 = (pid.to(tl.int64) * n_tiles // n_progs).to(tl.int32)
    t1 = ((pid.to(tl.int64) + 1) * n_tiles // n_progs).to(tl.int32)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_M)
    rows_ok = offs_r < GROUP
    for g in range(t0 // tiles_per_group, (t1 - 1) // tiles_per_group + 1):
        g_t0 = g * tiles_per_group  # first linear tile of row group g
        b32 = g // n_kv_heads
        hk32 = g % n_kv_heads
        b = b32.to(tl.int64)
        hk = hk32.to(tl.int64)
        lo = (tl.maximum(t0, g_t0) - g_t0) * BLOCK_N
        hi = (tl.minimum(t1, g_t0 + tiles_per_group) - g_t0) * BLOCK_N
        if EVEN_N:
            hi_full = hi
        else:
            hi = tl.minimum(hi, n_k)
            hi_full = lo + (hi - lo) // BLOCK_N * BLOCK_N
        head = hk * GROUP + offs_r  # (BLOCK_M,) int64 q head of each row
        q_ptrs = Q + b * stride_qb + head[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(q_ptrs, mask=rows_ok[:, None], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        k_base = K + b * stride_kb + hk * stride_kh
        v_base = V + b * stride_vb + hk * stride_vh
        acc, l_i, m_i = _decode_range(
            acc, l_i, m_i, q, k_base, v_base, None, None, b32, hk32, stride_kn, stride_vn,
            lo, hi_full, hi, n_k, qk_scale, offs_n, offs_d, pid,
            BLOCK_N, HEAD_DIM, False, False, False, DOT_PRECISION, "", EVEN_N, False,
        )  # fmt: skip
        o = acc / l_i[:, None]
        lse2 = m_i + tl.math.log2(l_i)
        slot = pid - _streamk_owner(g_t0.to(tl.int64), n_tiles, n_progs)
        part = (b * n_kv_heads * GROUP + head) * n_slots + slot  # (BLOCK_M,)
        tl.store(O_PART + part[:, None] * HEAD_DIM + offs_d[None, :], o, mask=rows_ok[:, None])
        tl.store(LSE_PART + part, lse2, mask=rows_ok)


@triton.jit
def streamk_combine_kernel(
    O_PART, LSE_PART, Out, stride_ob, stride_oh,
    n_heads, tiles_per_group, n_tiles, n_progs, n_slots,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """One program: q head row (b, h) (b * H + h), its stream-K partials merged by their
    log-sum-exps; its row group g = (b * H + h) // GROUP has slots 0 .. owner(last tile) -
    owner(first tile) (the rest of the n_slots slots are never written and masked out)."""
    row = tl.program_id(0).to(tl.int64)
    g_t0 = row // GROUP * tiles_per_group
    first = _streamk_owner(g_t0, n_tiles, n_progs)
    last = _streamk_owner(g_t0 + tiles_per_group - 1, n_tiles, n_progs)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    s_ok = offs_s < last - first + 1
    part = row * n_slots + offs_s
    lse_s = tl.load(LSE_PART + part, mask=s_ok, other=float("-inf"))
    m = tl.max(lse_s, 0)  # finite: slot 0 always holds keys
    w = tl.math.exp2(lse_s - m)
    o_s = tl.load(
        O_PART + part[:, None] * HEAD_DIM + offs_d[None, :], mask=s_ok[:, None], other=0.0
    )
    o = tl.sum(o_s * w[:, None], 0) / tl.sum(w, 0)
    b = row // n_heads
    h = row % n_heads
    tl.store(Out + b * stride_ob + h * stride_oh + offs_d, o.to(Out.dtype.element_ty))


# ------------------------------------------------------------------------------------------
# Variants and launchers
# ------------------------------------------------------------------------------------------


class UnsupportedError(Exception):
    """The variant does not apply to this shape / machine (reported as n/a, not an error)."""


@dataclass(frozen=True)
class Variant:
    name: str
    kind: str  # "sdpa" | "pkg" | "pkgk" | "own" | "streamk"
    bn: int = 64
    warps: int = 4
    stages: int = 3
    no_dot: bool = False
    acc2d: bool = False
    tma: bool = False
    evict_first: bool = False  # K/V pointer loads with eviction_policy="evict_first"
    rotate: bool = False  # staggered start of each program's key loop (ROTATE)
    factor: int = 1  # splits = rule's splits * factor (clamped to the key tiles)
    cpu_programs: int = 3  # stream-K: persistent programs off-GPU (GPU: SMs x per SM)


def _own(prefix: str, bn: int, w: int, s: int, factor: int = 1, **kw) -> Variant:
    name = f"{prefix}-n{bn}w{w}s{s}" + (f"-sx{factor}" if factor > 1 else "")
    return Variant(name, "own", bn, w, s, factor=factor, **kw)


VARIANTS: list[Variant] = [
    Variant("sdpa", "sdpa"),
    Variant("pkg", "pkg"),
    # (b) the shipped kernel, finer splits
    Variant("pkgk-sx2", "pkgk", factor=2),
    Variant("pkgk-sx4", "pkgk", factor=4),
    Variant("pkgk-sx8", "pkgk", factor=8),
    # own kernel, dot with a 16-row tile (control: the shipped scheme, unmasked main loop)
    _own("dot", 64, 4, 3),
    # (a) no-dot, rows == 1
    _own("nodot", 64, 4, 2, no_dot=True),
    _own("nodot", 64, 4, 3, no_dot=True),
    _own("nodot", 64, 4, 4, no_dot=True),
    _own("nodot", 128, 4, 2, no_dot=True),
    _own("nodot", 128, 8, 2, no_dot=True),
    _own("nodot", 128, 8, 3, no_dot=True),
    _own("nodot2d", 64, 4, 3, no_dot=True, acc2d=True),
    _own("nodot2d", 128, 8, 2, no_dot=True, acc2d=True),
    # (a) + (b): no-dot, finer splits (one compiled config; splits are a grid size)
    _own("nodot", 64, 4, 3, 2, no_dot=True),
    _own("nodot", 64, 4, 3, 4, no_dot=True),
    _own("nodot", 64, 4, 3, 8, no_dot=True),
    # (c) TMA
    _own("nodot-tma", 64, 4, 3, no_dot=True, tma=True),
    _own("nodot-tma", 128, 8, 2, no_dot=True, tma=True),
    _own("dot-tma", 64, 4, 3, tma=True),
    # extras on the dot kernel (the scheme that is at SDPA's speed): staggered key order,
    # streaming loads, a smaller key tile (more programs per SM)
    _own("dot-rot", 64, 4, 3, rotate=True),
    _own("dot-ef", 64, 4, 3, evict_first=True),
    _own("dot-rot-ef", 64, 4, 3, 8, rotate=True, evict_first=True),
    _own("dot", 32, 4, 3),
    # stream-K: persistent grid, the (batch, k/v head) x key-tile work cut into equal ranges
    Variant("streamk-n64w4s3", "streamk", 64, 4, 3, cpu_programs=5),
    Variant("streamk-n64w4s2", "streamk", 64, 4, 2, cpu_programs=3),
]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _dims(q, k):
    b, h, n_q, d = q.shape
    h_kv, n_k = k.shape[1], k.shape[2]
    if n_q != 1 or d != 128 or h % h_kv or h // h_kv > 16:
        raise UnsupportedError("n_q = 1, d = 128, group <= 16 only")
    return b, h, h_kv, n_k, d


def _pkg_modules():
    from flashattn_triton import configs, kernels, launch
    from flashattn_triton._device import sm_count, smem_per_sm
    from flashattn_triton.launch_common import _dot_precision

    return configs, kernels, launch, sm_count, smem_per_sm, _dot_precision


def _dot_prec(dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def rule_splits(q, k, bn: int, warps: int, stages: int) -> int:
    """The package's decode_splits for this variant's tile (slots 0 off-GPU: 3 splits)."""
    C, _, _, sm_count, smem_per_sm, _ = _pkg_modules()
    b, _, h_kv, n_k, d = _dims(q, k)
    cfg = C.TileConfig(16, bn, warps, stages)
    per_sm = C.decode_programs_per_sm(cfg, d, q.element_size(), smem_per_sm(q))
    return C.decode_splits(b * h_kv, cdiv(n_k, bn), sm_count(q) * per_sm)


def _split_buffers(q, h: int, splits: int):
    b, d = q.shape[0], q.shape[-1]
    s = max(splits, 1)  # one split: unused 1-split buffers (same kernel, no recompile)
    o_part = torch.empty((b, h, s, 1, d), dtype=torch.float32, device=q.device)
    lse_part = torch.empty((b, h, s, 1), dtype=torch.float32, device=q.device)
    lse = torch.empty((b, h, 1), dtype=torch.float32, device=q.device)
    return o_part, lse_part, lse


def _combine(o_part, lse_part, o, lse, h: int, splits: int) -> None:
    _, kern, _, _, _, _ = _pkg_modules()
    b = o.shape[0]
    kern.attn_fwd_combine_kernel[(b * h,)](
        o_part, lse_part, o, lse, *o.stride()[:3], h, 1, splits,
        HEAD_DIM=o.shape[-1], BLOCK_D=o.shape[-1], BLOCK_S=max(2, next_pow2(splits)),
    )  # fmt: skip


def streamk_plan(var: Variant, q, k) -> tuple[int, int, int, int]:
    """-> (P, T, tiles per row group, S): P persistent programs (SMs x programs per SM of
    the variant's tile ring, as the package's decode slots; var.cpu_programs off-GPU), at
    most T (B * Hkv x key tiles); S = the most programs that touch one row group."""
    C, _, _, sm_count, smem_per_sm, _ = _pkg_modules()
    b, _, h_kv, n_k, d = _dims(q, k)
    tpg = cdiv(n_k, var.bn)
    n_tiles = b * h_kv * tpg
    slots = 0
    if sm_count(q) > 0:
        cfg = C.TileConfig(16, var.bn, var.warps, var.stages)
        per_sm = C.decode_programs_per_sm(cfg, d, q.element_size(), smem_per_sm(q))
        slots = sm_count(q) * per_sm
    progs = max(1, min(n_tiles, slots or var.cpu_programs))

    def owner(t: int) -> int:
        return ((t + 1) * progs - 1) // n_tiles

    n_slots = max(owner((g + 1) * tpg - 1) - owner(g * tpg) + 1 for g in range(b * h_kv))
    return progs, n_tiles, tpg, n_slots


def _tma_ok(t: torch.Tensor) -> bool:
    if t.is_cuda and torch.cuda.get_device_capability(t.device)[0] < 9:
        return False
    e = t.element_size()
    return t.data_ptr() % 16 == 0 and all(s * e % 16 == 0 for s in t.stride()[:-1])


def build(var: Variant, q, k, v):
    """-> (fn, info): fn() runs the variant and returns o (B, H, 1, d) in q's dtype."""
    b, h, h_kv, n_k, d = _dims(q, k)
    group = h // h_kv
    scale = d**-0.5
    if var.kind == "sdpa":
        gqa = h_kv != h

        def fn():
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)

        return fn, {}
    if var.kind == "pkg":
        from flashattn_triton import flash_attention

        def fn():
            return flash_attention(q, k, v, causal=True)

        C, _, launch, _, _, _ = _pkg_modules()
        info = {}
        if n_k >= C.DECODE_MIN_KEYS:
            cfg, splits, kps, _ = launch._decode_plan(q, k, None)
            info = {"splits": splits, "programs": b * h_kv * splits, "tile": cfg.spec()}
        return fn, info
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        raise UnsupportedError("unit last stride only")
    o = torch.empty_like(q)
    if var.kind == "pkgk":
        C, kern, launch, _, _, dot_precision = _pkg_modules()
        cfg, splits0, _, _ = launch._decode_plan(q, k, None)
        tiles = cdiv(n_k, cfg.block_n)
        splits = min(tiles, splits0 * var.factor)
        kps = cdiv(tiles, splits) * cfg.block_n
        s = cdiv(n_k, kps)
        o_part, lse_part, lse = _split_buffers(q, h, s)
        prec = dot_precision(q.dtype)
        qk_scale = scale * kern.LOG2E

        def fn():
            kern.attn_fwd_decode_kernel[(b * h_kv, s)](
                q, k, v, o, lse, o_part, lse_part,
                *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3],
                h_kv, 1, n_k, qk_scale, group, None, None, 0, n_k, kps,
                HEAD_DIM=d, BLOCK_D=d, CAUSAL=True, WINDOW=False, DOT_PRECISION=prec,
                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, EVEN_N=n_k % cfg.block_n == 0,
                SPLIT=s > 1, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            )  # fmt: skip
            if s > 1:
                _combine(o_part, lse_part, o, lse, h, s)
            return o

        info = {"splits": s, "programs": b * h_kv * s, "tile": cfg.spec(), "rule_splits": splits0}
        return fn, info
    if var.kind == "streamk":
        progs, n_tiles, tpg, n_slots = streamk_plan(var, q, k)
        o_part = torch.empty((b * h, n_slots, d), dtype=torch.float32, device=q.device)
        lse_part = torch.empty((b * h, n_slots), dtype=torch.float32, device=q.device)
        block_m = max(16, next_pow2(group))
        qk_scale = scale * LOG2E
        prec = _dot_prec(q.dtype)

        def fn():
            streamk_decode_kernel[(progs,)](
                q, k, v, o_part, lse_part,
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
                v.stride(0), v.stride(1), v.stride(2),
                h_kv, n_k, qk_scale, tpg, n_tiles, n_slots,
                GROUP=group, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=var.bn,
                EVEN_N=n_k % var.bn == 0, DOT_PRECISION=prec,
                num_warps=var.warps, num_stages=var.stages,
            )  # fmt: skip
            streamk_combine_kernel[(b * h,)](
                o_part, lse_part, o, o.stride(0), o.stride(1),
                h, tpg, n_tiles, progs, n_slots,
                GROUP=group, HEAD_DIM=d, BLOCK_S=max(2, next_pow2(n_slots)),
            )  # fmt: skip
            return o

        return fn, {"splits": n_slots, "programs": progs, "tiles": n_tiles}
    # own kernel
    if var.no_dot and group != 1:
        raise UnsupportedError("no-dot: MHA only")
    if var.tma and not (_tma_ok(k) and _tma_ok(v)):
        raise UnsupportedError("TMA: needs sm_90+ and 16-byte aligned strides")
    bn = var.bn
    tiles = cdiv(n_k, bn)
    splits0 = rule_splits(q, k, bn, var.warps, var.stages)
    splits = min(tiles, splits0 * var.factor)
    kps = cdiv(tiles, splits) * bn
    s = cdiv(n_k, kps)
    o_part, lse_part, lse = _split_buffers(q, h, s)
    desc_k = desc_v = None
    if var.tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        desc_k = TensorDescriptor(k, list(k.shape), list(k.stride()), [1, 1, bn, d])
        desc_v = TensorDescriptor(v, list(v.shape), list(v.stride()), [1, 1, bn, d])
    block_m = 1 if var.no_dot else max(16, next_pow2(group))
    qk_scale = scale * LOG2E
    prec = _dot_prec(q.dtype)

    def fn():
        decode_kernel[(b * h_kv, s)](
            q, k, v, o, o_part, lse_part, desc_k, desc_v,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1),
            h_kv, n_k, qk_scale, kps,
            GROUP=group, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=bn, NO_DOT=var.no_dot,
            ACC2D=var.acc2d, USE_TMA=var.tma, EVEN_N=n_k % bn == 0, DOT_PRECISION=prec,
            EVICT="evict_first" if var.evict_first else "", ROTATE=var.rotate,
            num_warps=var.warps, num_stages=var.stages,
        )  # fmt: skip
        if s > 1:
            _combine(o_part, lse_part, o, lse, h, s)
        return o

    return fn, {"splits": s, "programs": b * h_kv * s, "rule_splits": splits0}


# ------------------------------------------------------------------------------------------
# Correctness
# ------------------------------------------------------------------------------------------


def reference(q, k, v) -> torch.Tensor:
    """float64 softmax(q k^T / sqrt(d)) v, one batch element at a time."""
    b, h, _, d = q.shape
    group = h // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    for i in range(b):
        kd, vd = k[i].double(), v[i].double()
        if group > 1:
            kd, vd = kd.repeat_interleave(group, 0), vd.repeat_interleave(group, 0)
        s = torch.matmul(q[i].double(), kd.transpose(-1, -2)) * d**-0.5
        out[i] = torch.matmul(torch.softmax(s, -1), vd)
        del kd, vd, s
    return out


def check(o: torch.Tensor, ref: torch.Tensor, tol: float) -> dict:
    o = o.double()
    err = (o - ref).abs()
    finite = bool(torch.isfinite(o).all())
    max_abs = float(err.max()) if finite else float("inf")
    rel = (
        float(torch.linalg.vector_norm(o - ref) / torch.linalg.vector_norm(ref))
        if finite
        else float("inf")
    )
    ok = finite and max_abs <= tol and rel <= tol
    return {"max_abs_err": max_abs, "rel_l2_err": rel, "ok": ok}


def make_inputs(shape, dtype, device, seed: int, strided: bool = False):
    b, h, h_kv, n_k = shape
    d = 128
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn((b, h, 1, d), generator=gen, device=device, dtype=torch.float32).to(dtype)
    if strided:  # (B, N, H, d) storage viewed as (B, H, N, d)
        k, v = (
            torch.randn((b, n_k, h_kv, d), generator=gen, device=device, dtype=torch.float32)
            .to(dtype)
            .transpose(1, 2)
            for _ in range(2)
        )
    else:
        k, v = (
            torch.randn((b, h_kv, n_k, d), generator=gen, device=device, dtype=torch.float32).to(
                dtype
            )
            for _ in range(2)
        )
    return q, k, v


def shape_name(shape, strided=False) -> str:
    b, h, h_kv, n_k = shape
    heads = f"H{h}" if h == h_kv else f"Hq{h}/Hkv{h_kv}"
    return f"B{b} {heads} Nk{n_k}" + (" strided" if strided else "")


def _short(exc: BaseException) -> str:
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
    text = lines[-1] if lines else ""
    return f"{type(exc).__name__}: {text[:200]}"


def prepare(variants, q, k, v, ref, tol: float, label: str) -> dict:
    """Build and check every variant on one shape. -> {name: entry}; entry["fn"] is set for
    the variants that passed."""
    out = {}
    for var in variants:
        entry: dict = {"variant": var.name}
        t = time.time()
        try:
            fn, info = build(var, q, k, v)
            entry.update(info)
            with torch.no_grad():
                o = fn()
            if o.is_cuda:
                torch.cuda.synchronize()
            if o.shape != q.shape or o.dtype != q.dtype:
                raise RuntimeError(
                    f"output {tuple(o.shape)} {o.dtype}, want {tuple(q.shape)} {q.dtype}"
                )
            entry.update(check(o, ref, tol))
            entry["status"] = "ok" if entry["ok"] else "WRONG"
            if entry["ok"]:
                entry["fn"] = fn
        except UnsupportedError as exc:
            entry["status"] = f"n/a ({exc})"
        except Exception as exc:  # compile failure, launch error: skipped, not a crash
            entry["status"] = f"skipped ({_short(exc)})"
            if os.environ.get("DECODE_VARIANTS_TRACE"):
                traceback.print_exc()
        entry["check_s"] = round(time.time() - t, 2)
        err = entry.get("max_abs_err")
        errs = f"max_abs {err:.2e} rel_l2 {entry['rel_l2_err']:.2e}" if err is not None else ""
        extra = f" splits {entry['splits']}" if "splits" in entry else ""
        log(f"check {label:28s} {var.name:24s} {entry['status']:10.60s} {errs}{extra} "
            f"({entry['check_s']}s)")  # fmt: skip
        out[var.name] = entry
    return out


# ------------------------------------------------------------------------------------------
# Modes
# ------------------------------------------------------------------------------------------


def cpu_check(variants) -> int:
    """Correctness only, fp32, Triton's interpreter, tiny shapes."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("--cpu-check needs TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    cases = [  # (B, Hq, Hkv, Nk), strided
        ((2, 2, 2, 300), False),  # ragged: 300 = 4 * 64 + 44 = 2 * 128 + 44
        ((2, 2, 2, 256), False),  # even
        ((2, 2, 2, 300), True),  # (B, N, H, d) storage
        ((1, 2, 2, 50), False),  # fewer keys than one tile: one split
        ((1, 8, 2, 300), False),  # GQA group 4
        ((1, 16, 1, 200), True),  # GQA group 16, strided
        ((1, 2, 2, 1100), False),  # the package's decode path (>= DECODE_MIN_KEYS)
    ]
    bad = []
    results = {}
    for i, (shape, strided) in enumerate(cases):
        label = shape_name(shape, strided)
        q, k, v = make_inputs(shape, torch.float32, "cpu", seed=i, strided=strided)
        ref = reference(q, k, v)
        res = prepare(variants, q, k, v, ref, 1e-4, label)
        results[label] = res
        bad += [(label, n) for n, e in res.items() if e["status"] == "WRONG"]
        bad += [
            (label, n)
            for n, e in res.items()
            if e["status"].startswith("skipped") and "tma" not in n
        ]
    print("\nCPU check summary (max abs error over the cases; status):", flush=True)
    for var in variants:
        errs = [r[var.name].get("max_abs_err") for r in results.values()]
        errs = [e for e in errs if e is not None]
        stats = sorted({r[var.name]["status"] for r in results.values()})
        worst = f"{max(errs):.2e}" if errs else "-"
        print(f"  {var.name:24s} worst max_abs {worst:>9s}   {'; '.join(stats)}", flush=True)
    if bad:
        print(f"FAILED: {bad}", flush=True)
        return 1
    print("CPU check passed (TMA variants may be skipped under the interpreter)", flush=True)
    return 0


GPU_SHAPES = [(8, 32, 32, 8192), (8, 32, 32, 65536), (1, 32, 32, 131072), (4, 32, 8, 32768)]


def gpu_run(variants, out_path: str, rounds: int, warmup: int, rep: int) -> int:
    from triton.testing import do_bench

    device = torch.device("cuda")
    dtype = torch.bfloat16
    props = torch.cuda.get_device_properties(device)
    meta = {
        "device": props.name, "sms": props.multi_processor_count,
        "torch": torch.__version__, "triton": triton.__version__,
        "python": platform.python_version(), "dtype": "bf16", "d": 128,
        "rounds": rounds, "do_bench": {"warmup_ms": warmup, "rep_ms": rep, "mode": "median"},
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }  # fmt: skip
    log(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, "
        f"triton {triton.__version__}")  # fmt: skip
    shapes = {}
    for i, shape in enumerate(GPU_SHAPES):
        label = shape_name(shape)
        q, k, v = make_inputs(shape, dtype, device, seed=i)
        log(f"inputs {label}: reference (float64)")
        ref = reference(q, k, v)
        entries = prepare(variants, q, k, v, ref, 2e-2, label)
        del ref
        torch.cuda.empty_cache()
        kv_bytes = (k.numel() + v.numel()) * k.element_size()
        shapes[label] = {
            "shape": shape,
            "kv_bytes": kv_bytes,
            "entries": entries,
            "tensors": (q, k, v),
        }
    timed = [
        (label, n) for label, s in shapes.items() for n, e in s["entries"].items() if "fn" in e
    ]
    log(f"timing {len(timed)} (shape, variant) cells x {rounds} rounds")
    with torch.no_grad():
        for r in range(rounds):
            for s in shapes.values():
                names = [n for n, e in s["entries"].items() if "fn" in e]
                shift = r % max(len(names), 1)
                for n in names[shift:] + names[:shift]:  # rotate the order each round
                    e = s["entries"][n]
                    try:
                        ms = float(do_bench(e["fn"], warmup=warmup, rep=rep, return_mode="median"))
                    except Exception as exc:
                        e.setdefault("errors", []).append(_short(exc))
                        ms = float("nan")
                    e.setdefault("ms_rounds", []).append(ms)
            log(f"round {r + 1}/{rounds} done")
    report = {"meta": meta, "shapes": {}}
    for label, s in shapes.items():
        ents = s["entries"]
        for e in ents.values():
            ms = [x for x in e.get("ms_rounds", []) if x == x]
            if ms:
                e["ms_median"] = (
                    sorted(ms)[len(ms) // 2]
                    if len(ms) % 2
                    else 0.5 * (sorted(ms)[len(ms) // 2 - 1] + sorted(ms)[len(ms) // 2])
                )
                e["ms_min"] = min(ms)
                e["tb_s"] = s["kv_bytes"] / (e["ms_median"] * 1e-3) / 1e12
        base = ents.get("sdpa", {}).get("ms_median")
        pkg = ents.get("pkg", {}).get("ms_median")
        print(f"\n== {label}  (K+V {s['kv_bytes'] / 1e9:.3f} GB, bf16, d 128)", flush=True)
        print(f"  {'variant':24s} {'splits':>6s} {'progs':>6s} {'ms med':>9s} {'ms min':>9s} "
              f"{'rounds ms':>28s} {'TB/s':>6s} {'t/sdpa':>7s} {'t/pkg':>7s}  status",
              flush=True)  # fmt: skip
        rows = sorted(ents.values(), key=lambda e: e.get("ms_median", float("inf")))
        for e in rows:
            med = e.get("ms_median")
            if med is None:
                print(f"  {e['variant']:24s} {'':>6s} {'':>6s} {'-':>9s} {'':>9s} {'':>28s} "
                      f"{'':>6s} {'':>7s} {'':>7s}  {e['status']}", flush=True)  # fmt: skip
                continue
            rr = " ".join(f"{x:.4f}" for x in e["ms_rounds"])
            rs = f"{med / base:.4f}" if base else "-"
            rp = f"{med / pkg:.4f}" if pkg else "-"
            print(f"  {e['variant']:24s} {e.get('splits', ''):>6} {e.get('programs', ''):>6} "
                  f"{med:9.4f} {e['ms_min']:9.4f} {rr:>28s} {e['tb_s']:6.2f} {rs:>7s} {rp:>7s}"
                  f"  {e['status']} err {e.get('max_abs_err', float('nan')):.1e}",
                  flush=True)  # fmt: skip
        report["shapes"][label] = {
            "shape_b_hq_hkv_nk": list(s["shape"]), "kv_bytes": s["kv_bytes"],
            "sdpa_ms": base, "pkg_ms": pkg,
            "variants": {n: {kk: vv for kk, vv in e.items() if kk != "fn"} for n, e in ents.items()},
        }  # fmt: skip
    report["variant_defs"] = [asdict(v) for v in variants]
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1, default=str)
    log(f"wrote {out_path}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="?", help="JSON path for the raw numbers (GPU mode)")
    p.add_argument("--cpu-check", action="store_true", help="interpreter correctness check")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up ms")
    p.add_argument("--rep", type=int, default=100, help="do_bench measuring ms")
    p.add_argument("--only", default="", help="comma-separated substrings of variant names "
                   "(sdpa and pkg always kept)")  # fmt: skip
    args = p.parse_args(argv)
    variants = VARIANTS
    if args.only:
        keys = [s for s in args.only.split(",") if s]
        variants = [
            v for v in VARIANTS if v.kind in ("sdpa", "pkg") or any(s in v.name for s in keys)
        ]
    if args.cpu_check:
        return cpu_check(variants)
    if not args.out:
        p.error("give the output JSON path (or --cpu-check)")
    if not torch.cuda.is_available():
        print("no CUDA device: use --cpu-check with TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    return gpu_run(variants, args.out, max(1, args.rounds), args.warmup, args.rep)


if __name__ == "__main__":
    sys.exit(main())
