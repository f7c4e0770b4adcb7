"""The competitor users pick instead: Hugging Face `LlamaForCausalLM` with SDPA and fused AdamW.

Same math as lm_core's model (pre-norm RMSNorm blocks, RoPE, SwiGLU, untied LM head, no
biases) at the same dims, so its step time is directly comparable. `transformers` is optional:
it is imported lazily and never a dependency of perf-tools.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class MissingBaselineError(RuntimeError):
    """The optional competitor cannot be built here (package missing)."""


class LlamaLogits(nn.Module):
    """Wraps LlamaForCausalLM so that forward(tokens (B, T)) -> logits (B, T, V), like ours."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens, use_cache=False).logits


def available() -> tuple[bool, str]:
    """Whether transformers imports, and a note saying why not."""
    try:
        import transformers  # noqa: F401
    except ImportError as exc:
        return False, f"transformers is not installed ({exc}); `pip install transformers`"
    return True, ""


def llama_config(config: Any, *, use_cache: bool = False) -> Any:
    """A transformers LlamaConfig at `config`'s dims (vocab, d_model, layers, heads, d_ff,
    context), untied, no biases, SDPA attention."""
    ok, note = available()
    if not ok:
        raise MissingBaselineError(note)
    from transformers import LlamaConfig

    hf_config = LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.d_model,
        intermediate_size=config.d_ff,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_heads,
        max_position_embeddings=config.context_length,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        use_cache=use_cache,
    )
    hf_config._attn_implementation = "sdpa"
    return hf_config


def build_hf_llama(config: Any, device: torch.device | str) -> nn.Module:
    """LlamaForCausalLM at `config`'s dims in fp32, wrapped to return logits (training)."""
    hf_config = llama_config(config)
    from transformers import LlamaForCausalLM

    with torch.device(device):
        model = LlamaForCausalLM(hf_config)
    model = model.to(device=device, dtype=torch.float32)
    return LlamaLogits(model)


def build_hf_llama_lm(config: Any, device: torch.device | str, dtype: torch.dtype) -> nn.Module:
    """The bare LlamaForCausalLM at `config`'s dims with its KV cache on, for `generate`."""
    hf_config = llama_config(config, use_cache=True)
    from transformers import LlamaForCausalLM

    with torch.device(device):
        model = LlamaForCausalLM(hf_config)
    return model.to(device=device, dtype=dtype).eval()


def fused_adamw(params: Any, device: torch.device) -> torch.optim.Optimizer:
    """torch.optim.AdamW, fused on CUDA (foreach elsewhere), the handout's hyper-parameters."""
    fused = torch.device(device).type == "cuda"
    return torch.optim.AdamW(
        params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8, fused=fused
    )


def with_sdpa_dropin(step: Any) -> Any:
    """The HF step with torch's SDPA replaced by flashattn_triton's drop-in (HF's attention
    looks the function up per call; a compiled step traces it on its first call). The
    drop-in's eager calls are counted over the steps run (``run.dropin``: the totals and the
    number of steps), so the row can say how many took our kernels."""
    from flashattn_triton import DropinCalls, sdpa_replaced

    totals, steps = DropinCalls(), [0]

    def run() -> Any:
        with sdpa_replaced() as calls:
            out = step()
        totals.ours += calls.ours
        totals.torch += calls.torch
        steps[0] += 1
        return out

    run.dropin = (totals, steps)
    return run


def dropin_calls(step: Any) -> str | None:
    """ "ours/all" drop-in calls per step of a step made by ``with_sdpa_dropin``; None for
    other steps and for compiled ones (their calls are decided when traced, not counted)."""
    totals, steps = getattr(step, "dropin", (None, [0]))
    if totals is None or steps[0] == 0 or totals.ours + totals.torch == 0:
        return None
    return f"{totals.ours / steps[0]:g}/{(totals.ours + totals.torch) / steps[0]:g}"
