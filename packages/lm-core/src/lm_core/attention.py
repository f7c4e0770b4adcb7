"""Causal attention backends, chosen by name.

Every backend is a function `attn(q, k, v, window=None, cu_seqlens=None, max_seqlen=None)
-> o`: q of shape (B, H, T, head_dim), k and v (B, Hkv, T, head_dim) with Hkv dividing H
(grouped-query attention: query head h reads k/v head h // (H // Hkv)), causal (query t sees
keys 0..t), softmax scale 1/sqrt(head_dim), returning (B, H, T, head_dim) in the dtype of
`v`. `window`: query t sees only keys t - window..t. `cu_seqlens`: int32 (S + 1,) offsets of
S packed documents in the B*T tokens flattened row after row (every row start among them);
a query sees only keys of its own document. `max_seqlen`: the longest document (default T).

| name           | implementation                                                   |
|----------------|------------------------------------------------------------------|
| "naive"        | scores, masked softmax, weighted sum in plain PyTorch (annotated)|
| "sdpa"         | `torch.nn.functional.scaled_dot_product_attention`: is_causal    |
|                | (enable_gqa for fewer k/v heads), a boolean mask for windows and |
|                | documents                                                        |
| "flash-torch"  | `flashattn_triton` on its PyTorch backend (tiled reference)      |
| "flash-triton" | `flashattn_triton.flash_attention` / `flash_attention_varlen`    |
|                | (Triton FlashAttention-2: windows skip tiles, no masks built)    |

A backend may carry a `kv_cache(q, k_cache, v_cache, starts, k, v, window=None)` attribute:
the decode step of `lm_core.generation` over a whole preallocated cache whose first `starts`
rows are filled, storing the step's keys and values k, v there first ("flash-triton":
`flash_attention_kvcache`, one call); without it the step writes the cache and runs SDPA
over all of it under a mask.

The flash backends import `flashattn_triton` lazily, when a model is built with them; without
it installed they raise ImportError saying `pip install lm-core[flash]`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from lm_core.annotate import annotate
from lm_core.config import ATTENTION_BACKENDS

AttentionFn = Callable[..., torch.Tensor]

# SDPA's grouped-query flag (torch >= 2.5); older torch gets k and v expanded.
_SDPA_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


def _expand_kv(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """(B, Hkv, T, d) -> (B, H, T, d): each k/v head repeated for its group of query heads."""
    group = q.shape[1] // kv.shape[1]
    return kv if group == 1 else kv.repeat_interleave(group, dim=1)


def document_ids(cu_seqlens: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
    """(B, T) int index of the packed document each token belongs to (no host sync)."""
    positions = torch.arange(batch * seq, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens[1:], positions, right=True).view(batch, seq)


def attention_mask(
    batch: int,
    seq: int,
    device: torch.device,
    window: int | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean (B or 1, 1, T, T) mask, True where query i may attend to key j: j <= i, within
    `window` keys (i - j <= window) and in the same packed document."""
    rows = torch.arange(seq, device=device)[:, None]
    cols = torch.arange(seq, device=device)[None, :]
    keep = cols <= rows
    if window is not None:
        keep = keep & (rows - cols <= window)
    keep = keep[None, None]  # (1, 1, T, T)
    if cu_seqlens is not None:
        doc = document_ids(cu_seqlens, batch, seq)  # (B, T)
        keep = keep & (doc[:, None, :, None] == doc[:, None, None, :])  # (B, 1, T, T)
    return keep


def naive_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int | None = None,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
) -> torch.Tensor:
    """Causal attention written out: (B, H, T, d), k/v (B, Hkv, T, d) -> (B, H, T, d).

    Materializes the (B, H, T, T) score matrix; the softmax runs in fp32 (autocast does the same
    for `torch.softmax`), then probabilities are cast to v's dtype for the weighted sum.
    """
    seq_q, seq_k = q.shape[-2], k.shape[-2]
    k, v = _expand_kv(q, k), _expand_kv(q, v)
    with annotate("attention/scores"):
        scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
        # Every row keeps its diagonal (window, documents and causality all allow it), so no
        # row is fully masked and the softmax never sees an all -inf row.
        if window is None and cu_seqlens is None:
            # True above the diagonal = key after query: masked out.
            future = torch.ones(seq_q, seq_k, dtype=torch.bool, device=q.device).triu(1)
            scores = scores.masked_fill(future, float("-inf"))
        else:
            keep = attention_mask(q.shape[0], seq_q, q.device, window, cu_seqlens)
            scores = scores.masked_fill(~keep, float("-inf"))
    with annotate("attention/softmax"):
        probs = torch.softmax(scores.float(), dim=-1)
    with annotate("attention/weighted_sum"):
        return torch.matmul(probs.to(v.dtype), v)


def sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int | None = None,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
) -> torch.Tensor:
    """Causal `F.scaled_dot_product_attention`: (B, H, T, d), k/v (B, Hkv, T, d) -> (B, H, T, d).

    PyTorch dispatches to a fused kernel (FlashAttention / memory-efficient / cuDNN on CUDA).
    Windows and packed documents go in as a boolean (B, 1, T, T) mask (k, v expanded to q's
    heads), which SDPA's flash kernel does not take: they run the memory-efficient kernel.
    """
    if window is None and cu_seqlens is None:
        if k.shape[1] == q.shape[1]:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if _SDPA_GQA:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return F.scaled_dot_product_attention(q, _expand_kv(q, k), _expand_kv(q, v), is_causal=True)
    mask = attention_mask(q.shape[0], q.shape[2], q.device, window, cu_seqlens)
    return F.scaled_dot_product_attention(q, _expand_kv(q, k), _expand_kv(q, v), attn_mask=mask)


def _import_flashattn():  # returns the flashattn_triton module
    try:
        import flashattn_triton
    except ImportError as exc:
        raise ImportError(
            "the flash attention backends need the flashattn-triton package: "
            "`pip install lm-core[flash]` (or `pip install flashattn-triton`)"
        ) from exc
    return flashattn_triton


def _flash_packed(fa, backend: str, q, k, v, window, cu_seqlens, max_seqlen) -> torch.Tensor:
    """`flash_attention_varlen` on the B*T tokens of (B, H, T, d) views: (B, H, T, d)."""
    b, h, t, d = q.shape
    packed = [x.transpose(1, 2).reshape(b * t, x.shape[1], d) for x in (q, k, v)]  # (B*T, H, d)
    max_seqlen = t if max_seqlen is None else max_seqlen
    window_size = (-1, -1) if window is None else (window, 0)
    out = fa.flash_attention_varlen(
        *packed, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, True,
        window_size=window_size, backend=backend,
    )  # fmt: skip
    return out.reshape(b, t, h, d).transpose(1, 2)  # (B, H, T, d)


def _load_flash_torch() -> AttentionFn:
    fa = _import_flashattn()
    function = fa.FlashAttention2Torch

    def flash_torch_attention(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        window: int | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
    ) -> torch.Tensor:
        """FlashAttention2Torch on (B*H, T, d) views: (B, H, T, d), k/v (B, Hkv, T, d) ->
        (B, H, T, d); windows and documents through flashattn_triton's torch backend."""
        if cu_seqlens is not None:
            return _flash_packed(fa, "torch", q, k, v, window, cu_seqlens, max_seqlen)
        if window is not None:
            return fa.flash_attention(q, k, v, True, window_size=(window, 0), backend="torch")
        b, h, t, d = q.shape
        h_kv = k.shape[1]
        out = function.apply(
            q.reshape(b * h, t, d),  # (B*H, T, d)
            k.reshape(b * h_kv, k.shape[-2], d),  # (B*Hkv, T, d): grouped along dim -3
            v.reshape(b * h_kv, v.shape[-2], d),  # (B*Hkv, T, d)
            True,
        )
        return out.reshape(b, h, t, d)  # (B, H, T, d)

    return flash_torch_attention


def _load_flash_triton() -> AttentionFn:
    fa = _import_flashattn()
    flash_attention = fa.flash_attention

    def flash_triton_attention(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        window: int | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
    ) -> torch.Tensor:
        """flashattn_triton.flash_attention, causal: (B, H, T, d), k/v (B, Hkv, T, d) ->
        (B, H, T, d); packed documents through flash_attention_varlen."""
        if cu_seqlens is not None:
            return _flash_packed(fa, "auto", q, k, v, window, cu_seqlens, max_seqlen)
        if window is not None:
            return flash_attention(q, k, v, causal=True, window_size=(window, 0))
        return flash_attention(q, k, v, causal=True)

    def flash_triton_kv_cache(q, k_cache, v_cache, starts, k, v, window=None) -> torch.Tensor:
        """A decode step over the whole cache (B, Hkv, S, d) of which the first `starts`
        (int32 (B,), on the device) rows are filled: `flash_attention_kvcache` stores the
        step's k, v (B, Hkv, T, d) at rows starts[b].. and attends, causal, over the
        starts[b] + T filled rows. Only they are read, and no k/v head is repeated."""
        window_size = (-1, -1) if window is None else (window, 0)
        return fa.flash_attention_kvcache(
            q, k_cache, v_cache, starts, True, window_size=window_size, k=k, v=v
        )

    flash_triton_attention.kv_cache = flash_triton_kv_cache
    return flash_triton_attention


# name -> loader; loaders run when a model is built, so a missing optional package fails early.
_LOADERS: dict[str, Callable[[], AttentionFn]] = {
    "naive": lambda: naive_attention,
    "sdpa": lambda: sdpa_attention,
    "flash-torch": _load_flash_torch,
    "flash-triton": _load_flash_triton,
}
assert tuple(_LOADERS) == ATTENTION_BACKENDS, "keep config.ATTENTION_BACKENDS in sync"


def get_attention(name: str) -> AttentionFn:
    """The attention function called `name` (see the module table).

    Raises ValueError for an unknown name (listing the known ones) and ImportError, saying what
    to install, when the backend's optional package is missing.
    """
    if name not in _LOADERS:
        raise ValueError(f"unknown attention backend {name!r}; expected one of {list(_LOADERS)}")
    return _LOADERS[name]()


def available_backends() -> list[str]:
    """Names of the backends that can be loaded in this environment."""
    names = []
    for name in _LOADERS:
        try:
            get_attention(name)
        except ImportError:
            continue
        names.append(name)
    return names
