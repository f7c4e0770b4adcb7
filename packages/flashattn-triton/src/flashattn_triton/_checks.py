"""Input validation shared by every entry point: clear errors before any kernel runs.

Each check names the argument and the value expected, so that a wrong call fails in Python
with a readable message instead of inside a kernel launch.
"""

from __future__ import annotations

import itertools
import math

import torch

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 128


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> None:
    """Check ranks, dtypes, devices and shapes of q (..., Nq, d), k and v (..., Nk, d)."""
    if not _plain_qkv(q, k, v, causal):
        _check_qkv_in_detail(q, k, v, causal)


def _plain_qkv(q, k, v, causal) -> bool:
    """The common valid call (one dtype and device; one leading shape, or grouped-query
    heads: k and v alike with a divisor of q's heads, dim -3) in one expression: every call
    pays for the checks, and this costs about half of ``_check_qkv_in_detail`` (4.0 against
    7.3 us, medians of nine interleaved rounds on a 2-core CPU host; per-round ratios
    0.48-0.66). Grouped-query heads took the detailed path until they were added here: 7.16
    against 3.01 us per call, and a decode step's ``check_kvcache`` 8.85 against 3.81 us
    (``benchmarks/check_cost.py``, the same host and method). k and v are compared whole
    (``ks == v.shape``) rather than by slices, each slice of a torch.Size being a new object:
    plain 2.30 -> 1.94 us, grouped 2.99 -> 2.48, ``check_kvcache`` 3.84 -> 3.34 (per-round
    ratios 0.79-0.88). False sends the call to that function, which names what is wrong."""
    try:
        qs, ks, dt = q.shape, k.shape, q.dtype
        return (
            isinstance(causal, bool)
            and isinstance(q, torch.Tensor)
            and isinstance(k, torch.Tensor)
            and isinstance(v, torch.Tensor)
            and ks == v.shape  # k and v alike in every dim: one slice fewer per call
            and k.dtype == dt
            and v.dtype == dt
            and dt.is_floating_point
            and len(qs) == len(ks) >= 2
            and qs[-1] == ks[-1] >= 1
            and (
                qs[:-2] == ks[:-2]
                or (len(qs) >= 3 and qs[:-3] == ks[:-3] and ks[-3] > 0 and qs[-3] % ks[-3] == 0)
            )
            and q.device == k.device == v.device
        )
    except AttributeError:  # not tensors: the detailed checks say which argument
        return False


def _check_qkv_in_detail(q, k, v, causal) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() < 2:
            raise ValueError(
                f"{name} must have shape (..., seq, head_dim) with at least 2 dims, "
                f"got shape {tuple(t.shape)}"
            )
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if not q.dim() == k.dim() == v.dim():
        raise ValueError(
            f"q, k, v must have the same number of dims, got q {q.dim()}, k {k.dim()}, v {v.dim()}"
        )
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(
            f"q, k, v must be on one device, got q {q.device}, k {k.device}, v {v.device}"
        )
    if k.shape[:-2] != q.shape[:-2] or v.shape[:-2] != q.shape[:-2]:
        _check_heads(q, k, v)
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"k and v must have the same sequence length, got k {k.shape[-2]}, v {v.shape[-2]}"
        )
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"k head_dim must equal q head_dim {q.shape[-1]}, got k head_dim {k.shape[-1]}"
        )
    if v.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"v head_dim must equal q head_dim {q.shape[-1]}, got v head_dim {v.shape[-1]}"
        )
    if q.shape[-1] < 1:
        raise ValueError(f"head_dim must be at least 1, got {q.shape[-1]}")


def _check_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Leading dims that differ: only grouped-query attention is allowed, i.e. k and v alike
    with fewer heads (dim -3) than q, a divisor of q's, and the same dims before the heads."""
    lead = "q, k, v must have the same leading (batch, heads) dims"
    if v.shape[:-2] != k.shape[:-2] or q.dim() < 3 or k.shape[:-3] != q.shape[:-3]:
        raise ValueError(
            f"{lead} (k and v may have fewer heads, dim -3, for grouped-query attention), "
            f"got q {tuple(q.shape[:-2])}, k {tuple(k.shape[:-2])}, v {tuple(v.shape[:-2])}"
        )
    h_q, h_kv = q.shape[-3], k.shape[-3]
    if h_kv == 0 or h_q % h_kv != 0:
        raise ValueError(
            f"grouped-query attention needs the q heads to be a multiple of the k/v heads "
            f"(dim -3), got q heads {h_q} and k/v heads {h_kv}"
        )


def check_window(window_size: object) -> tuple[int, int]:
    """``window_size`` as (left, right) ints, each -1 (unbounded) or >= 0."""
    ok = isinstance(window_size, (tuple, list)) and len(window_size) == 2
    if ok:
        ok = all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)
    if not ok:
        raise TypeError(
            f"window_size must be a pair of ints (left, right), -1 meaning unbounded, "
            f"got {window_size!r}"
        )
    left, right = window_size
    if left < -1 or right < -1:
        raise ValueError(
            f"window_size values must be -1 (unbounded) or >= 0, got window_size={window_size!r}"
        )
    return int(left), int(right)


def resolve_window(causal: bool, left: int, right: int, n_q: int, n_k: int) -> tuple[int, int]:
    """The effective (left, right) window for Nq queries and Nk keys, -1 where unbounded:
    ``causal`` sets right = 0 (flash-attn's rule), and bounds wide enough to cover every
    key (left >= Nk - 1, right >= Nq - 1) count as unbounded."""
    if causal:
        right = 0
    if left >= n_k - 1:
        left = -1
    if right >= n_q - 1:
        right = -1
    return left, right


def resolve_scale(softmax_scale: float | None, head_dim: int) -> float:
    """Return the softmax scale: 1/sqrt(head_dim) when None, else a checked positive float."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(
            f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}"
        )
    scale = float(softmax_scale)
    if not (math.isfinite(scale) and scale > 0.0):
        raise ValueError(f"softmax_scale must be a finite positive float, got {softmax_scale}")
    return scale


def check_triton_dtype_and_dim(q: torch.Tensor) -> None:
    """The Triton kernels take fp16/bf16/fp32 and head_dim <= 128."""
    if q.dtype not in TRITON_DTYPES:
        raise TypeError(
            f"the Triton backend takes q, k, v in float16, bfloat16 or float32, got {q.dtype}; "
            "use backend='torch' for other floating dtypes"
        )
    if q.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(
            f"the Triton backend supports head_dim 1..{MAX_HEAD_DIM}, got head_dim {q.shape[-1]}; "
            "use backend='torch' for larger heads"
        )


def check_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
) -> None:
    """Check packed q (total_q, Hq, d), k and v (total_k, Hkv, d) and the offsets' metadata
    (int32 (batch + 1,) tensors on q's device, non-negative int maxima). Reads no values."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(
                f"{name} must have shape (total_tokens, heads, head_dim) for "
                f"flash_attention_varlen, got shape {tuple(t.shape)}"
            )
    # The checks of the dense API, on (heads, total, d) views: dtypes, devices, head dims,
    # k/v heads dividing q heads.
    check_qkv(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), causal)
    batch = None
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
        if cu.dtype != torch.int32:
            raise TypeError(f"{name} must be an int32 tensor (flash-attn's), got {cu.dtype}")
        if cu.dim() != 1 or cu.shape[0] < 2:
            raise ValueError(
                f"{name} must be a 1-D tensor of batch + 1 >= 2 offsets, got shape "
                f"{tuple(cu.shape)}"
            )
        if cu.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {cu.device}")
        if batch is not None and cu.shape[0] != batch:
            raise ValueError(
                f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got "
                f"{batch} and {cu.shape[0]}"
            )
        batch = cu.shape[0]
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")


def check_offsets(cu: torch.Tensor, name: str, total: int, max_seqlen: int) -> list[int]:
    """The offsets as a list, checked: start at 0, never decrease, end at ``total``, no
    sequence longer than ``max_seqlen``. Reads the values (for CUDA tensors a device-to-host
    copy, which waits for the GPU), so the launchers check each tensor once per version."""
    offsets = cu.tolist()
    if offsets[0] != 0:
        raise ValueError(f"{name} must start at 0, got {offsets[0]}")
    lengths = [b - a for a, b in itertools.pairwise(offsets)]
    bad = next((i for i, n in enumerate(lengths) if n < 0), None)
    if bad is not None:
        raise ValueError(
            f"{name} must be non-decreasing (cumulative sequence lengths), got "
            f"{offsets[bad]} then {offsets[bad + 1]} at positions {bad}, {bad + 1}"
        )
    if offsets[-1] != total:
        raise ValueError(
            f"{name} must end at the number of packed tokens {total}, got {offsets[-1]}"
        )
    longest = max(lengths)
    if longest > max_seqlen:
        max_name = "max_seqlen_q" if name.endswith("_q") else "max_seqlen_k"
        raise ValueError(
            f"{max_name}={max_seqlen} is less than the longest sequence in {name}, {longest}"
        )
    return offsets


def check_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor | int,
    causal: bool,
) -> None:
    """Check q (B, Hq, Nq, d), the caches (B, Hkv, S, d) and ``cache_seqlens``: an int in
    [0, S], or an int32 (B,) tensor on q's device (its values are not read: no host sync)."""
    if (
        type(cache_seqlens) is torch.Tensor
        and _plain_qkv(q, k_cache, v_cache, causal)
        and len(q.shape) == 4
        and cache_seqlens.dtype == torch.int32
        and cache_seqlens.shape == (q.shape[0],)
        and cache_seqlens.device == q.device
    ):
        return  # the common valid call, in one expression (each decode step pays for it)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must have shape (batch, heads, seq, head_dim) for "
                f"flash_attention_kvcache, got shape {tuple(t.shape)}"
            )
    check_qkv(q, k_cache, v_cache, causal)
    batch, n_k = q.shape[0], k_cache.shape[2]
    if isinstance(cache_seqlens, torch.Tensor):
        if cache_seqlens.dtype != torch.int32:
            raise TypeError(
                f"cache_seqlens must be an int32 tensor (flash-attn's), got {cache_seqlens.dtype}"
            )
        if cache_seqlens.shape != (batch,):
            raise ValueError(
                f"cache_seqlens must have shape (batch,) = ({batch},), got "
                f"{tuple(cache_seqlens.shape)}"
            )
        if cache_seqlens.device != q.device:
            raise ValueError(
                f"cache_seqlens must be on q's device {q.device}, got {cache_seqlens.device}"
            )
        return
    if isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, int):
        raise TypeError(
            f"cache_seqlens must be an int or an int32 tensor of shape (batch,), got "
            f"{type(cache_seqlens).__name__}"
        )
    if not 0 <= cache_seqlens <= n_k:
        raise ValueError(
            f"cache_seqlens must lie in [0, {n_k}] (the cache's length), got {cache_seqlens}"
        )


def check_kv_append(
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor | int,
) -> None:
    """Check the new rows ``k``, ``v`` (B, Hkv, n_new, d) that ``flash_attention_kvcache``
    stores into the caches (checked already): both or neither, the caches' batch, heads,
    head dims, dtype and device, one count of new rows; caches written in place need a unit
    last stride; an int ``cache_seqlens`` leaves room for the new rows."""
    if k is None and v is None:
        return
    try:  # the common valid call, in one expression (each decode step pays for it)
        ks, vs, kc, vc = k.shape, v.shape, k_cache.shape, v_cache.shape
        if (
            type(cache_seqlens) is torch.Tensor
            and len(ks) == len(vs) == 4
            and ks[:2] == kc[:2] == vs[:2] == vc[:2]
            and ks[2] == vs[2]
            and ks[3] == kc[3]
            and vs[3] == vc[3]
            and k.dtype == k_cache.dtype
            and v.dtype == v_cache.dtype
            and k.device == k_cache.device == v.device == v_cache.device
            and k_cache.stride(-1) == 1
            and v_cache.stride(-1) == 1
        ):
            return
    except AttributeError:  # not tensors: the checks below say which argument
        pass
    if k is None or v is None:
        raise ValueError("k and v (the new rows to store) must be given together")
    for name, new, cache, cache_name in (
        ("k", k, k_cache, "k_cache"),
        ("v", v, v_cache, "v_cache"),
    ):
        if not isinstance(new, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(new).__name__}")
        if new.dim() != 4:
            raise ValueError(
                f"{name} must have shape (batch, kv_heads, new_seq, head_dim), got shape "
                f"{tuple(new.shape)}"
            )
        want = (cache.shape[0], cache.shape[1], cache.shape[3])
        if (new.shape[0], new.shape[1], new.shape[3]) != want:
            raise ValueError(
                f"{name} must match {cache_name} in batch, heads and head_dim {want}, got shape "
                f"{tuple(new.shape)}"
            )
        if new.dtype != cache.dtype:
            raise TypeError(f"{name} must have {cache_name}'s dtype {cache.dtype}, got {new.dtype}")
        if new.device != cache.device:
            raise ValueError(
                f"{name} must be on {cache_name}'s device {cache.device}, got {new.device}"
            )
        if cache.stride(-1) != 1:
            raise ValueError(
                f"{cache_name} must have a unit last stride to take new rows in place, got "
                f"strides {cache.stride()}"
            )
    if k.shape[2] != v.shape[2]:
        raise ValueError(
            f"k and v must hold the same number of new rows, got {k.shape[2]} and {v.shape[2]}"
        )
    if isinstance(cache_seqlens, int) and cache_seqlens + k.shape[2] > k_cache.shape[2]:
        raise ValueError(
            f"cache_seqlens + new rows = {cache_seqlens} + {k.shape[2]} exceeds the cache's "
            f"length {k_cache.shape[2]}"
        )
