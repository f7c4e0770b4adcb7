"""Hugging Face ``transformers`` models on our kernels: ``attn_implementation="fa-triton"``.

``register()`` adds an attention implementation to transformers' registries (its
``AttentionInterface`` and, for the masks, ``AttentionMaskInterface``): HF's own SDPA
attention (``sdpa_attention_forward``: its grouped-query handling, its choice of
``is_causal``, its output layout) with ``torch.nn.functional.scaled_dot_product_attention``
replaced by our drop-in (``sdpa.scaled_dot_product_attention``) for the call, and SDPA's
masks (none for batches without padding, which is what lets the calls take our kernels).
Calls the drop-in does not take (a padding mask, dropout) run torch's SDPA, so a model gives
the results it gives with ``attn_implementation="sdpa"``. ``transformers`` is imported only
here, and only when called.

    import flashattn_triton.hf_attention as fa_hf

    fa_hf.register()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="fa-triton")
"""

from __future__ import annotations

from typing import Any

import torch

from .sdpa import sdpa_replaced

# (transformers takes every name containing "flash" for one of its flash-attn kernels)
NAME = "fa-triton"


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF's SDPA attention function with our drop-in in place of torch's SDPA for the call
    (the replacement is process-wide while it lasts, which is harmless: the drop-in means
    what torch's SDPA means for every call)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    with sdpa_replaced():
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register(name: str = NAME) -> str:
    """Make ``attn_implementation=name`` (default ``"fa-triton"``) available to
    transformers models; returns the name (not one containing "flash", which transformers
    reserves for flash-attn kernels). Raises ImportError without transformers (or with a
    release too old to have the attention registries)."""
    if not isinstance(name, str) or not name or "flash" in name:
        raise ValueError(
            f"name: expected a non-empty str without 'flash' (transformers takes such names "
            f"for its flash-attn kernels), got {name!r}"
        )
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
