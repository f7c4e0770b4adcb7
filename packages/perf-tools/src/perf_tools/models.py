"""Model configurations and builders for the benchmarks: lm_core presets or custom dims.

lm_core is imported lazily so that `--help` and the tools that do not need a model stay fast.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

# Custom dimension flags -> ModelConfig field.
DIM_FIELDS = ("vocab_size", "d_model", "num_layers", "num_heads", "d_ff", "rope_theta")


def model_sizes() -> dict[str, Any]:
    """lm_core's MODEL_SIZES (name -> ModelConfig)."""
    from lm_core import MODEL_SIZES

    return dict(MODEL_SIZES)


def size_names() -> list[str]:
    """The preset names, smallest first as lm_core lists them."""
    return list(model_sizes())


def resolve_config(
    size: str | None,
    *,
    context_length: int,
    attention: str | None = None,
    overrides: dict[str, Any] | None = None,
) -> Any:
    """A ModelConfig from preset `size` (or 'custom') with the given context and overrides.

    With size None or 'custom', `overrides` must give d_model, num_layers and num_heads;
    d_ff defaults to 4 * d_model and vocab_size to 10,000 (the handout's table).
    """
    from lm_core import ModelConfig

    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    if size in (None, "custom"):
        missing = [k for k in ("d_model", "num_layers", "num_heads") if k not in overrides]
        if missing:
            raise ValueError(
                "size: a custom model needs "
                + ", ".join("--" + m.replace("_", "-") for m in missing)
            )
        overrides.setdefault("d_ff", 4 * overrides["d_model"])
        overrides.setdefault("vocab_size", 10_000)
        base = ModelConfig(context_length=context_length, **overrides)
    else:
        sizes = model_sizes()
        if size not in sizes:
            raise ValueError(f"size: expected one of {', '.join(sizes)} or custom, got {size!r}")
        base = sizes[size]
    d_model = overrides.get("d_model", base.d_model)
    heads = overrides.get("num_heads", base.num_heads)
    if d_model % heads:
        raise ValueError(f"num_heads: d_model={d_model} is not divisible by num_heads={heads}")
    fields = dict(overrides, context_length=context_length)
    if attention is not None:
        fields["attention"] = attention
    return dataclasses.replace(base, **fields)


def build_model(config: Any, device: torch.device | str) -> nn.Module:
    """lm_core.TransformerLM(config), created directly on `device` (no host-side copy); with
    flash-triton attention on a GPU, its C++ launch path readied first (`ready_cpp_launch`)."""
    from lm_core import TransformerLM

    with torch.device(device):
        model = TransformerLM(config)
    if getattr(config, "attention", None) == "flash-triton" and torch.device(device).type == "cuda":
        from perf_tools._compile import ready_cpp_launch

        ready_cpp_launch()  # the timed steps' launcher: ready before the first step
    return model.to(device)


def count_params(model: nn.Module) -> int:
    """Number of parameters (shared tensors counted once)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def count_local_params(model: nn.Module) -> int:
    """Parameter elements this rank holds: a DTensor's local shard (TP, fully_shard), a plain
    tensor (a zero_shard.FSDP shard, a replicated weight) in full."""
    unique = {id(p): p for p in model.parameters()}.values()
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in unique)


def random_batch(
    batch: int, seq: int, vocab: int, device: torch.device | str, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and next-token targets, both (batch, seq) int64 on `device`."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
    x = tokens[:, :-1].contiguous().to(device)  # (B, T)
    y = tokens[:, 1:].contiguous().to(device)  # (B, T)
    return x, y
