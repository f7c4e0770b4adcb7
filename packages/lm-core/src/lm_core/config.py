"""Model configuration: the `ModelConfig` dataclass and the named presets of the course handout.

The field names (`vocab_size`, `context_length`, `d_model`, `num_layers`, `num_heads`, `d_ff`,
`rope_theta`) are the course's; `attention` picks the attention backend by name
(see `lm_core.attention`). Presets follow Table 1 of the CS336 assignment 2 handout with a
vocabulary of 10,000 and `context_length` 1024 (the largest context the handout's experiments
use; RoPE tables are sized by it, weights are not), plus a `tiny` preset for tests and the
`8B` model (vocabulary 151,936, context 32,768: the course's 8B training-step race).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

# Backend names known to `lm_core.attention`; kept here so that validating a config imports
# nothing heavy. `lm_core.attention` checks that its registry matches this tuple.
ATTENTION_BACKENDS: tuple[str, ...] = ("naive", "sdpa", "flash-torch", "flash-triton")
# How linear layers multiply in float32 (see `lm_core.matmul`).
MATMUL_BACKENDS: tuple[str, ...] = ("default", "tf32x3")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and options of a `TransformerLM`.

    vocab_size: number of token ids; inputs must lie in [0, vocab_size).
    context_length: longest sequence the model accepts (sizes the RoPE tables).
    d_model: residual stream width; must be divisible by num_heads, d_model/num_heads even.
    num_layers: number of pre-norm Transformer blocks.
    num_heads: attention heads per block (head dim = d_model // num_heads).
    d_ff: hidden width of the SwiGLU feed-forward.
    rope_theta: RoPE base frequency Theta.
    attention: backend name, one of "naive", "sdpa", "flash-torch", "flash-triton".
    matmul: how linear layers multiply float32 inputs: "default" (torch's matmul) or
        "tf32x3" (float32-accurate products on TF32 tensor cores; see `lm_core.matmul`).
    num_kv_heads: key/value heads (grouped-query attention; 1: multi-query); must divide
        num_heads. None: num_heads (multi-head attention, the course model).
    sliding_window: each token attends to itself and the `sliding_window` tokens before it
        (flash-attn's window_size=(sliding_window, 0)); None: every earlier token (causal).
    """

    vocab_size: int
    context_length: int
    d_model: int
    num_layers: int
    num_heads: int
    d_ff: int
    rope_theta: float = 10000.0
    attention: str = "sdpa"
    matmul: str = "default"
    num_kv_heads: int | None = None
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context_length", "d_model", "num_layers", "num_heads", "d_ff"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"ModelConfig.{name}: expected an int, got {value!r}")
            if value <= 0:
                raise ValueError(f"ModelConfig.{name}: expected a positive int, got {value}")
        if not isinstance(self.rope_theta, int | float) or not self.rope_theta > 0:
            raise ValueError(
                f"ModelConfig.rope_theta: expected a positive number, got {self.rope_theta!r}"
            )
        if self.d_model % self.num_heads != 0:
            raise ValueError(
                f"ModelConfig.d_model={self.d_model} must be divisible by "
                f"num_heads={self.num_heads}"
            )
        if (self.d_model // self.num_heads) % 2 != 0:
            raise ValueError(
                f"ModelConfig: head dim d_model/num_heads = {self.d_model // self.num_heads} "
                "must be even for RoPE (it rotates pairs of features)"
            )
        if self.attention not in ATTENTION_BACKENDS:
            raise ValueError(
                f"ModelConfig.attention: unknown backend {self.attention!r}; "
                f"expected one of {list(ATTENTION_BACKENDS)}"
            )
        for name in ("num_kv_heads", "sliding_window"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"ModelConfig.{name}: expected an int or None, got {value!r}")
            if value <= 0:
                raise ValueError(
                    f"ModelConfig.{name}: expected a positive int or None, got {value}"
                )
        if self.num_kv_heads is not None and self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"ModelConfig.num_kv_heads={self.num_kv_heads} must divide "
                f"num_heads={self.num_heads} (each k/v head serves num_heads // num_kv_heads "
                "query heads)"
            )
        if self.matmul not in MATMUL_BACKENDS:
            raise ValueError(
                f"ModelConfig.matmul: unknown backend {self.matmul!r}; "
                f"expected one of {list(MATMUL_BACKENDS)}"
            )

    @property
    def head_dim(self) -> int:
        """Features per attention head, d_model // num_heads."""
        return self.d_model // self.num_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads: num_kv_heads, or num_heads where it is None."""
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    def to_dict(self) -> dict[str, Any]:
        """A plain dict of the fields (what checkpoints store)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Rebuild a config from `to_dict()` output; unknown keys are an error naming them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"ModelConfig.from_dict: unknown fields {unknown}")
        return cls(**data)


def _preset(d_model: int, d_ff: int, num_layers: int, num_heads: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=10_000,
        context_length=1024,
        d_model=d_model,
        num_layers=num_layers,
        num_heads=num_heads,
        d_ff=d_ff,
        rope_theta=10000.0,
    )


# Table 1 of the handout (vocab 10,000), plus "tiny" for tests and quick CPU runs, and "8B".
MODEL_SIZES: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        vocab_size=256, context_length=64, d_model=64, num_layers=2, num_heads=4, d_ff=128
    ),
    "small": _preset(768, 3072, 12, 12),
    "medium": _preset(1024, 4096, 24, 16),
    "large": _preset(1280, 5120, 36, 20),
    "xl": _preset(1600, 6400, 48, 25),
    "2.7B": _preset(2560, 10240, 32, 32),
    # The 8B model (the course's FSDP race: batch 2, context 32,768 on two GPUs); head
    # dim 128, RoPE base as the other presets. Too large to train on one GPU: shard it.
    "8B": ModelConfig(
        vocab_size=151_936,
        context_length=32_768,
        d_model=4096,
        num_layers=34,
        num_heads=32,
        d_ff=11_008,
    ),
}


def get_config(name: str, **overrides: Any) -> ModelConfig:
    """The preset `name` of `MODEL_SIZES` with fields replaced by `overrides`.

    Example: `get_config("xl", context_length=512, attention="naive")`.
    Raises ValueError listing the valid names for an unknown size, and naming an unknown field.
    """
    if name not in MODEL_SIZES:
        raise ValueError(f"unknown model size {name!r}; expected one of {list(MODEL_SIZES)}")
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(
            f"get_config: unknown ModelConfig fields {unknown}; known: {sorted(known)}"
        )
    return dataclasses.replace(MODEL_SIZES[name], **overrides)
