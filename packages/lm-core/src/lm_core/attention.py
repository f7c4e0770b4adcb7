"""Causal attention backends, chosen by name.

Every backend is a function `attn(q, k, v) -> o` on tensors of shape (B, H, T, head_dim),
causal (query t sees keys 0..t), softmax scale 1/sqrt(head_dim), returning (B, H, T, head_dim)
in the dtype of `v`.

| name           | implementation                                                   |
|----------------|------------------------------------------------------------------|
| "naive"        | scores, masked softmax, weighted sum in plain PyTorch (annotated)|
| "sdpa"         | `torch.nn.functional.scaled_dot_product_attention(is_causal=True)`|
| "flash-torch"  | `flashattn_triton.FlashAttention2Torch` (tiled PyTorch reference)|
| "flash-triton" | `flashattn_triton.flash_attention` (Triton FlashAttention-2)     |

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

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention written out: (B, H, T, d) x3 -> (B, H, T, d).

    Materializes the (B, H, T, T) score matrix; the softmax runs in fp32 (autocast does the same
    for `torch.softmax`), then probabilities are cast to v's dtype for the weighted sum.
    """
    seq_q, seq_k = q.shape[-2], k.shape[-2]
    with annotate("attention/scores"):
        scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
        # True above the diagonal = key after query: masked out. Every row keeps its diagonal,
        # so no row is fully masked and the softmax never sees an all -inf row.
        future = torch.ones(seq_q, seq_k, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    with annotate("attention/softmax"):
        probs = torch.softmax(scores.float(), dim=-1)
    with annotate("attention/weighted_sum"):
        return torch.matmul(probs.to(v.dtype), v)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal `F.scaled_dot_product_attention`: (B, H, T, d) x3 -> (B, H, T, d).

    PyTorch dispatches to a fused kernel (FlashAttention / memory-efficient / cuDNN on CUDA).
    """
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _import_flashattn():  # returns the flashattn_triton module
    try:
        import flashattn_triton
    except ImportError as exc:
        raise ImportError(
            "the flash attention backends need the flashattn-triton package: "
            "`pip install lm-core[flash]` (or `pip install flashattn-triton`)"
        ) from exc
    return flashattn_triton


def _load_flash_torch() -> AttentionFn:
    fa = _import_flashattn()
    function = fa.FlashAttention2Torch

    def flash_torch_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """FlashAttention2Torch on (B*H, T, d) views: (B, H, T, d) x3 -> (B, H, T, d)."""
        b, h, t, d = q.shape
        out = function.apply(
            q.reshape(b * h, t, d),  # (B*H, T, d)
            k.reshape(b * h, k.shape[-2], d),  # (B*H, T, d)
            v.reshape(b * h, v.shape[-2], d),  # (B*H, T, d)
            True,
        )
        return out.reshape(b, h, t, d)  # (B, H, T, d)

    return flash_torch_attention


def _load_flash_triton() -> AttentionFn:
    fa = _import_flashattn()
    flash_attention = fa.flash_attention

    def flash_triton_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """flashattn_triton.flash_attention, causal: (B, H, T, d) x3 -> (B, H, T, d)."""
        return flash_attention(q, k, v, causal=True)

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
