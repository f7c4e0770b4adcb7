"""FLOP and byte counts of attention, and the time floor they imply on a given device.

Convention (as FlashAttention's benchmarks): the forward does two matrix products (S = QK^T and
O = PV) of 2*d flops per visible (query, key) pair; the backward does five (S recomputed, dV,
dP, dQ, dK), 2.5x the forward. Kernels that recompute more (e.g. S and dP twice in a split
backward) do more work than this count, which is the useful work a user asks for.
Causal pairs are counted exactly: N(N+1)/2 for Nq == Nk, i.e. N^2/2 up to a 1/N term.
"""

from __future__ import annotations

MODES = ("fwd", "bwd", "fwd_bwd")


def visible_pairs(n_q: int, n_k: int, causal: bool) -> int:
    """Number of (query, key) pairs attended; bottom-right aligned causal mask."""
    if not causal:
        return n_q * n_k
    off = n_k - n_q
    # Row i sees min(n_k, max(0, i + off + 1)) keys.
    total = 0
    first_full = max(0, n_k - off - 1)  # rows from here on see all n_k keys
    lo = max(0, -off)  # rows below see nothing
    hi = min(n_q, first_full)
    if hi > lo:  # rows lo..hi-1 see i + off + 1 keys: an arithmetic series
        total += (hi - lo) * (lo + off + 1 + hi - 1 + off + 1) // 2
    total += max(0, n_q - max(first_full, lo)) * n_k
    return total


def attention_flops(
    batch_heads: int, n_q: int, n_k: int, head_dim: int, causal: bool, mode: str = "fwd_bwd"
) -> float:
    """FLOPs of attention over ``batch_heads`` independent heads (see module docstring)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    fwd = 4.0 * head_dim * visible_pairs(n_q, n_k, causal) * batch_heads
    return {"fwd": fwd, "bwd": 2.5 * fwd, "fwd_bwd": 3.5 * fwd}[mode]


def attention_bytes(
    batch_heads: int, n_q: int, n_k: int, head_dim: int, elem_bytes: int, mode: str = "fwd_bwd"
) -> float:
    """Fewest bytes moved through device memory: each input read once, each output written."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    q_like = n_q * head_dim * elem_bytes  # q, o, dO, dq
    kv_like = n_k * head_dim * elem_bytes  # k, v, dk, dv
    lse = n_q * 4
    fwd = 2 * q_like + 2 * kv_like + lse  # read q, k, v; write o, lse
    bwd = 4 * q_like + 4 * kv_like + 3 * lse  # read q,k,v,o,dO,lse; write dq,dk,dv; D
    per_head = {"fwd": fwd, "bwd": bwd, "fwd_bwd": fwd + bwd}[mode]
    return float(per_head * batch_heads)


def attention_floor_ms(
    batch_heads: int,
    n_q: int,
    n_k: int,
    head_dim: int,
    causal: bool,
    elem_bytes: int,
    peak_tflops: float,
    peak_gbps: float,
    mode: str = "fwd_bwd",
) -> float:
    """Lower bound in ms: max(flops / peak_tflops, bytes / peak_gbps) (roofline floor)."""
    flops = attention_flops(batch_heads, n_q, n_k, head_dim, causal, mode)
    nbytes = attention_bytes(batch_heads, n_q, n_k, head_dim, elem_bytes, mode)
    return max(flops / (peak_tflops * 1e12), nbytes / (peak_gbps * 1e9)) * 1e3


def tflops_per_s(flops: float, ms: float) -> float:
    """Achieved TFLOP/s for ``flops`` done in ``ms`` milliseconds."""
    return flops / (ms * 1e-3) / 1e12
