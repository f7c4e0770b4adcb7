"""Functional API and ``nn.Module``: pick the Triton or the PyTorch implementation."""

from __future__ import annotations

import torch
from torch import nn

from . import cpp_launch, launch_kvcache, ops
from ._checks import (
    MAX_HEAD_DIM,
    TRITON_DTYPES,
    check_kv_append,
    check_kvcache,
    check_offsets,
    check_qkv,
    check_triton_dtype_and_dim,
    check_varlen,
    check_window,
    resolve_scale,
)
from .autograd import (
    CheckedFlashAttention,
    VarlenFlashAttention,
    WindowedFlashAttention,
    forward_without_grad,
)
from .torch_impl import (
    FlashAttention2Torch,
    TorchAttention,
    append_kv_torch,
    kvcache_attention_torch,
    varlen_attention_torch,
)

BACKENDS = ("auto", "triton", "torch")


def resolve_backend(backend: str, q: torch.Tensor) -> str:
    """'auto' -> 'triton' for CUDA tensors of a Triton dtype with head_dim <= 128, else 'torch'."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    if q.is_cuda and q.dtype in TRITON_DTYPES and q.shape[-1] <= MAX_HEAD_DIM:
        return "triton"
    return "torch"


def in_autocast_dtype(q, k, v, device_type: str) -> tuple:
    """q, k, v as attention sees them under autocast: where autocast is on for
    ``device_type``, its floating-point tensors there cast to the autocast dtype, as SDPA's
    inputs are (autocast runs SDPA in lower precision); otherwise unchanged."""
    if not torch.is_autocast_enabled(device_type):
        return q, k, v
    dtype = torch.get_autocast_dtype(device_type)
    if all(getattr(t, "dtype", None) is dtype for t in (q, k, v)):
        return q, k, v  # (the usual case: nothing to cast)
    return tuple(
        t.to(dtype)
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.device.type == device_type
        else t
        for t in (q, k, v)
    )


def _compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    return compiler is not None and compiler.is_compiling()


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    return_lse: bool = False,
    *,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention, softmax(q k^T * scale [+ mask]) v, differentiable.

    q (..., Hq, Nq, d), k and v (..., Hkv, Nk, d) with the same other leading dims (e.g.
    (B, H, N, d)), one dtype and one device -> o (..., Hq, Nq, d) in q's dtype.
    ``softmax_scale`` defaults to 1/sqrt(d).

    - Grouped-query / multi-query attention: Hkv may divide Hq (heads are dim -3); query
      head h reads k/v head h // (Hq // Hkv), as SDPA's ``enable_gqa``. dk, dv come back
      shaped like k, v, summed over each group (no expanded copies).
    - Masks are bottom-right aligned (flash-attn's convention): with ``window_size=(left,
      right)`` key j is visible to query i iff
      i + Nk - Nq - left <= j <= i + Nk - Nq + right, -1 meaning unbounded; ``causal=True``
      sets right = 0 (j <= i + Nk - Nq). Key tiles outside the window are skipped. Rows that
      see no key give 0.
    - ``return_lse=True`` returns (o, lse), lse (..., Hq, Nq) float32 (float64 for float64
      inputs on the torch backend), the natural-log log-sum-exp of each row's scaled scores
      (-inf for rows that see no key). Gradients flow through o only: lse is not
      differentiable.

    backend: 'triton' runs the Triton kernels (CUDA tensors, or CPU tensors under
    TRITON_INTERPRET=1; float16/bfloat16/float32; d <= 128), 'torch' the tiled PyTorch
    implementation (any device and floating dtype), 'auto' chooses 'triton' for CUDA tensors
    that it supports and 'torch' otherwise. Few queries against many keys (decoding from a
    KV cache) split the keys over thread blocks on the Triton backend (no separate API).

    Under CUDA autocast, CUDA q, k and v are taken in the autocast dtype, as SDPA takes them
    (a float32 model's RoPE under bf16 autocast hands attention float32 q and k).
    """
    if type(q) is torch.Tensor and q.is_cuda:
        q, k, v = in_autocast_dtype(q, k, v, "cuda")
    plain = not return_lse and window_size == (-1, -1)
    # A repeated call whose layouts, window and scale the C++ launch path knows
    # (``cpp_launch``): they were checked by the first call, so it skips the checks too.
    cpp = (return_lse is False or return_lse is True) and (causal is True or causal is False)
    cpp = cpp and (softmax_scale is None or type(softmax_scale) is float)
    cpp = cpp and (backend == "auto" or backend == "triton") and not _compiling()
    if cpp and cpp_launch.ACTIVE[0]:
        o = cpp_launch.known_call(q, k, v, causal, window_size, softmax_scale, return_lse)
        if o is not None:
            if o is not False:
                return o  # (o, lse) with return_lse
            cpp = False  # a refused layout: the Python path, without offering it again
    check_qkv(q, k, v, causal)
    if resolve_backend(backend, q) == "triton":
        check_triton_dtype_and_dim(q)
        scale = resolve_scale(softmax_scale, q.shape[-1])
        window = () if plain else _check_window_and_lse(window_size, return_lse)
        if not _builds_graph(q, k, v):  # inference, decoding: no autograd.Function to pay for
            o, lse = forward_without_grad(q, k, v, causal, scale, *window)
            if cpp:
                cpp_launch.after_python_call(q, k, v, causal, scale, *window)
        elif plain:
            o = CheckedFlashAttention.apply(q, k, v, causal, scale)
            if cpp:
                cpp_launch.after_python_call(q, k, v, causal, scale)
            return o
        else:
            o, lse = WindowedFlashAttention.apply(q, k, v, causal, scale, *window)
            if cpp:
                cpp_launch.after_python_call(q, k, v, causal, scale, *window)
        return (o, lse) if return_lse else o
    if plain:
        return FlashAttention2Torch.apply(q, k, v, causal, softmax_scale)
    left, right = _check_window_and_lse(window_size, return_lse)
    scale = resolve_scale(softmax_scale, q.shape[-1])
    o, lse = TorchAttention.apply(q, k, v, causal, scale, left, right)
    return (o, lse) if return_lse else o


def _builds_graph(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether autograd records this call (grad mode on and an input requires grad)."""
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


def _check_window_and_lse(window_size: object, return_lse: object) -> tuple[int, int]:
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    return check_window(window_size)


def _checked_offsets(cu: torch.Tensor, name: str, total: int, max_seqlen: int) -> list[int] | None:
    """``check_offsets`` once per tensor version (its result is kept on the tensor; reading
    CUDA offsets waits for the GPU, so a model passing one tensor to every layer pays once);
    None under torch.compile, which cannot read values (offsets are then not checked)."""
    if _compiling():
        return None
    seen = getattr(cu, "_flashattn_offsets", None)
    if seen is not None and seen[0] == (cu._version, total, max_seqlen):
        return seen[1]
    offsets = check_offsets(cu, name, total, max_seqlen)
    cu._flashattn_offsets = ((cu._version, total, max_seqlen), offsets)
    return offsets


def flash_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    return_lse: bool = False,
    *,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over packed sequences of different lengths (flash-attn's varlen API).

    q (total_q, Hq, d), k and v (total_k, Hkv, d) hold the sequences one after another;
    ``cu_seqlens_q`` / ``cu_seqlens_k``: int32 (batch + 1,) cumulative offsets on q's device,
    starting at 0 and ending at total_q / total_k (sequence s is rows cu[s]:cu[s+1]; empty
    sequences are allowed); ``max_seqlen_q`` / ``max_seqlen_k``: the longest sequence (ints).
    No query attends across a sequence boundary. ``causal``, ``softmax_scale``,
    ``window_size``, ``return_lse`` and grouped-query heads as in :func:`flash_attention`,
    per sequence. Returns o (total_q, Hq, d), with ``return_lse`` also lse (Hq, total_q)
    float32.

    The offsets are checked (start 0, never decrease, end at the totals, no sequence longer
    than the given maximum) before any launch, once per tensor (see ``_checked_offsets``;
    for CUDA tensors reading them waits for the GPU); under ``torch.compile`` they cannot be
    read and are not checked. Under CUDA autocast, as :func:`flash_attention`.
    """
    if type(q) is torch.Tensor and q.is_cuda:
        q, k, v = in_autocast_dtype(q, k, v, "cuda")
    check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal)
    left, right = _check_window_and_lse(window_size, return_lse)
    scale = resolve_scale(softmax_scale, q.shape[-1])
    offs_q = _checked_offsets(cu_seqlens_q, "cu_seqlens_q", q.shape[0], max_seqlen_q)
    offs_k = _checked_offsets(cu_seqlens_k, "cu_seqlens_k", k.shape[0], max_seqlen_k)
    if resolve_backend(backend, q) == "triton":
        check_triton_dtype_and_dim(q)
        cu_k = None if cu_seqlens_k is cu_seqlens_q else cu_seqlens_k
        o, lse = VarlenFlashAttention.apply(
            q, k, v, cu_seqlens_q, cu_k, max_seqlen_q, max_seqlen_k, causal, scale, left, right
        )
    else:
        if offs_q is None:
            offs_q, offs_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        o, lse = varlen_attention_torch(q, k, v, offs_q, offs_k, causal, scale, (left, right))
    return (o, lse) if return_lse else o


def flash_attention_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor | int,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    return_lse: bool = False,
    *,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of new queries over a KV cache whose filled length differs per sequence
    (flash-attn's ``flash_attn_with_kvcache``, rotary embeddings, paged caches and
    ``cache_batch_idx`` apart).

    q (B, Hq, Nq, d); k_cache, v_cache (B, Hkv, S, d) with S rows allocated (Hkv divides Hq,
    grouped-query heads as in :func:`flash_attention`; any strides with a unit last stride,
    e.g. a (B, S, Hkv, d) buffer transposed); ``cache_seqlens``: how many keys of each
    sequence are filled, an int32 (B,) tensor on q's device or one int for all. Sequence b
    attends to its keys [0, cache_seqlens[b]), and ``causal`` / ``window_size`` align to that
    length as :func:`flash_attention` aligns to Nk: the queries are the last Nq positions
    (query i sees key j <= i + cache_seqlens[b] - Nq). Returns o (B, Hq, Nq, d), with
    ``return_lse`` also lse (B, Hq, Nq) float32.

    ``k``, ``v`` (B, Hkv, n_new, d), the new tokens' keys and values, are stored into the
    caches in place at rows cache_seqlens[b] .. cache_seqlens[b] + n_new - 1 (by the same call:
    one small kernel before the attention), and sequence b then attends to its first
    cache_seqlens[b] + n_new keys. ``cache_seqlens`` itself is not changed: advance it
    yourself. Rows that would land past S are dropped (an int ``cache_seqlens`` is checked to
    leave room; a tensor's values are not read on the host). Without ``k`` and ``v``, write
    the new keys and values into the cache first and count them in ``cache_seqlens``.

    The lengths are read on the device only, so a call never waits for the GPU and a CUDA
    graph replays it with lengths that change between replays (S, not the lengths, sets the
    shapes); values outside [0, S] count as the nearest bound. Few queries (decoding) split
    the keys over thread blocks, as :func:`flash_attention` does. Forward only: inputs that
    require grad under grad mode are refused.
    """
    check_kvcache(q, k_cache, v_cache, cache_seqlens, causal)
    check_kv_append(k, v, k_cache, v_cache, cache_seqlens)
    left, right = _check_window_and_lse(window_size, return_lse)
    scale = resolve_scale(softmax_scale, q.shape[-1])
    tensors = (q, k_cache, v_cache) if k is None else (q, k_cache, v_cache, k, v)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise RuntimeError(
            "flash_attention_kvcache computes no gradients (a KV cache serves inference): "
            "call it under torch.no_grad() or torch.inference_mode(), or detach q, k_cache, "
            "v_cache, k and v"
        )
    if not isinstance(cache_seqlens, torch.Tensor):
        cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32, device=q.device)
    if resolve_backend(backend, q) == "triton":
        check_triton_dtype_and_dim(q)
        args = (q, k_cache, v_cache, cache_seqlens, causal, scale, left, right)
        if k is not None and _compiling():
            o, lse = ops.kvcache_append_fwd_launch(*args[:4], k, v, *args[4:])
        elif _compiling():
            o, lse = ops.kvcache_fwd_launch(*args)
        else:
            o, lse = launch_kvcache.forward_kvcache(*args, k, v)
    else:
        if k is not None:
            cache_seqlens = append_kv_torch(k, v, k_cache, v_cache, cache_seqlens)
        o, lse = kvcache_attention_torch(
            q, k_cache, v_cache, cache_seqlens, causal, scale, (left, right)
        )
    return (o, lse) if return_lse else o


class FlashAttention(nn.Module):
    """``nn.Module`` form of :func:`flash_attention`: ``FlashAttention(causal=True)(q, k, v)``."""

    def __init__(
        self,
        causal: bool = False,
        softmax_scale: float | None = None,
        backend: str = "auto",
        window_size: tuple[int, int] = (-1, -1),
    ) -> None:
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.backend = backend
        self.window_size = tuple(check_window(window_size))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return flash_attention(
            q, k, v, self.causal, self.softmax_scale, self.window_size, backend=self.backend
        )

    def extra_repr(self) -> str:
        return (
            f"causal={self.causal}, softmax_scale={self.softmax_scale}, "
            f"window_size={self.window_size}, backend={self.backend!r}"
        )
