"""Activation checkpointing for a built `TransformerLM`, applied from outside the model.

`apply_activation_checkpointing(model, every)` runs the blocks in groups of `every`
consecutive blocks, each group under `torch.utils.checkpoint.checkpoint(use_reentrant=False)`:
only a group's input is kept from the forward, and its blocks run again during the backward to
rebuild their activations. Parameters, state-dict keys and `model.layers` are unchanged (the
model's `run_blocks` is replaced on this instance), blocks are still called as modules (their
hooks fire, in the forward and again in the recomputation), and `torch.compile` traces through
without a graph break. Apply it before `torch.compile` and data-parallel wrappers (the order of
torchtitan's parallelize: activation checkpointing, then compile, then FSDP / DDP).

The last group is never checkpointed: its activations would be rebuilt first thing in the
backward, so storing them costs no more at the peak and saves recomputing it (torch's
`checkpoint_sequential` does the same). Every other block runs twice per step: about a third
more block FLOPs (one extra forward), whatever the group size.

Memory model (activations only, in units of a = one block's input, B*T*D elements of the
residual stream): a block stores A = r*a for its backward, so with L blocks
  no checkpointing:        L * r
  groups of k, G groups:   max(G - 1 + s_last * r, G - 2 + k * r)
(the group inputs kept while the last group's or a recomputed group's activations are alive;
s_last = size of the last group). With r = 1 -- Chen et al.'s setting, where each checkpointed
unit stores about as much as its input -- this is minimized by k ~ sqrt(L), giving
~2*sqrt(L): the classic "sqrt(L)" scheme (`every="sqrt"`). A Transformer block stores far more
than its input: r ~ 9 + 4F/D in one dtype (about 20 for F = 8/3 D: both norms' inputs and
outputs, q, k, v, the attention output and its reshaped copy, the SwiGLU's gate, up, silu(gate)
and product), r ~ 4 + (5 + 4F/D)/2 under bf16 autocast (fp32 residual stream, bf16 rest). The
optimum then moves to k* ~ sqrt(L/r): `every="optimal"` takes the k in 1..L that minimizes
the formula above for the model's r (`block_activation_ratio`). It is 1 or 2 for every preset
(xl, L = 48: k = 1 in fp32 and k = 2 under autocast), where sqrt(L) grouping would store
several times more (k = 7 at L = 48 in fp32: 180 block inputs against 72 for k = 1).
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lm_core.config import ModelConfig
from lm_core.model import TransformerLM, run_chain

__all__ = [
    "activation_memory",
    "apply_activation_checkpointing",
    "block_activation_ratio",
    "checkpoint_group_size",
    "parse_every",
    "resolve_group_size",
]

POLICIES = ("none", "sqrt", "optimal")


def block_activation_ratio(config: ModelConfig, *, autocast: bool = False) -> float:
    """r = (bytes a block stores for its backward) / (bytes of its input), estimated from the
    shapes: 9 + 4F/D in a single dtype, 4 + (5 + 4F/D)/2 with an fp32 residual stream and a
    16-bit compute dtype (bf16/fp16 autocast). Leaves out the `naive` attention backend's
    (B, H, T, T) scores, which add about 2*H*T/D more."""
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config: expected a ModelConfig, got {type(config).__name__}")
    kv = 2 * config.kv_heads * config.head_dim / config.d_model  # k and v (2 with H = Hkv)
    per_compute = 3 + kv + 4 * config.d_ff / config.d_model  # q, k, v, o, o reshaped, SwiGLU
    return 4 + per_compute / 2 if autocast else 4 + per_compute


def activation_memory(num_layers: int, group_size: int, ratio: float) -> float:
    """Peak stored activations in block inputs (see the module docstring): `group_size` 0 means
    no checkpointing (L * r); k >= 1 means groups of k, the last one not checkpointed."""
    if num_layers <= 0:
        raise ValueError(f"num_layers: expected a positive int, got {num_layers}")
    if group_size < 0:
        raise ValueError(f"group_size: expected >= 0, got {group_size}")
    if group_size == 0:
        return num_layers * ratio
    k = min(group_size, num_layers)
    groups = -(-num_layers // k)
    last = num_layers - (groups - 1) * k
    peak = groups - 1 + last * ratio  # end of forward / backward of the last group
    if groups >= 2:
        peak = max(peak, groups - 2 + k * ratio)  # backward of the last checkpointed group
    return peak


def parse_every(spec: str | int) -> str | int:
    """A policy from a CLI string: "none", "sqrt", "optimal", or a positive int K."""
    if isinstance(spec, bool):
        raise TypeError(f"every: expected an int or one of {POLICIES}, got {spec!r}")
    if isinstance(spec, int):
        value = spec
    elif isinstance(spec, str) and spec.strip().lower() in POLICIES:
        return spec.strip().lower()
    elif isinstance(spec, str) and spec.strip().isdigit():
        value = int(spec.strip())
    else:
        raise ValueError(
            f"every: expected one of {POLICIES} or a positive int (blocks per group), got {spec!r}"
        )
    if value <= 0:
        raise ValueError(f"every: blocks per group must be positive, got {value}")
    return value


def resolve_group_size(every: str | int | None, num_layers: int, ratio: float = 1.0) -> int:
    """Blocks per checkpointed group for a policy (0: no checkpointing).

    every: None or "none" -> 0; an int k >= 1 -> min(k, L); "sqrt" -> ceil(sqrt(L));
    "optimal" -> the k minimizing `activation_memory(L, k, ratio)` (the largest such k on a
    tie: fewer blocks recomputed)."""
    if every is None:
        return 0
    every = parse_every(every)
    if every == "none":
        return 0
    if every == "sqrt":
        return math.ceil(math.sqrt(num_layers))
    if every == "optimal":
        if not ratio > 0:
            raise ValueError(f"activation_ratio: expected a positive number, got {ratio!r}")
        costs = {k: activation_memory(num_layers, k, ratio) for k in range(1, num_layers + 1)}
        best = min(costs.values())
        return max(k for k, c in costs.items() if c <= best * (1 + 1e-12))
    return min(every, num_layers)


def _run_group(
    layers: nn.ModuleList, start: int, end: int, x: torch.Tensor, *packing: object
) -> torch.Tensor:
    # packing = (cu_seqlens, max_seqlen) or nothing. The group's last residual add stays in
    # the group (`run_chain`): a group keeps one stream tensor as its input, not two.
    kw = {} if not packing else {"cu_seqlens": packing[0], "max_seqlen": packing[1]}
    return run_chain((layers[i] for i in range(start, end)), x, **kw)


def _run_blocks_checkpointed(
    layers: nn.ModuleList,
    group_size: int,
    x: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
) -> torch.Tensor:
    """(B, T, D) -> (B, T, D): groups of `group_size` blocks, all but the last checkpointed
    (packed documents as in `TransformerLM.run_blocks`)."""
    n = len(layers)
    last_start = ((n - 1) // group_size) * group_size
    packing = () if cu_seqlens is None else (cu_seqlens, max_seqlen)
    for start in range(0, last_start, group_size):
        # The blocks draw no random numbers: no RNG state to save and restore (reading the
        # CUDA RNG state also fails inside a CUDA graph capture on some torch versions).
        x = checkpoint(
            _run_group,
            layers,
            start,
            start + group_size,
            x,
            *packing,
            use_reentrant=False,
            preserve_rng_state=False,
        )
    return _run_group(layers, last_start, n, x, *packing)


def apply_activation_checkpointing(
    model: TransformerLM,
    every: str | int | None = "optimal",
    *,
    activation_ratio: float | None = None,
) -> TransformerLM:
    """Checkpoint `model`'s blocks in groups (in place; returns the model).

    every: an int k (groups of k consecutive blocks; 1 = each block), "sqrt" (groups of
    ceil(sqrt(L)) blocks, Chen et al.'s scheme), "optimal" (the group size that minimizes peak
    stored activations under the memory model of this module), or "none"/None (remove
    checkpointing). Applying again replaces the previous policy.
    activation_ratio: r for "optimal"; default `block_activation_ratio(model.config)` (single
    dtype; pass `block_activation_ratio(config, autocast=True)` for bf16 autocast training).
    """
    if not isinstance(model, TransformerLM):
        raise TypeError(
            f"model: expected a TransformerLM, got {type(model).__name__}; apply activation "
            "checkpointing before torch.compile and data-parallel wrappers"
        )
    ratio = block_activation_ratio(model.config) if activation_ratio is None else activation_ratio
    k = resolve_group_size(every, len(model.layers), ratio)
    model.__dict__.pop("run_blocks", None)  # back to the class's plain loop
    if k > 0:
        model.run_blocks = functools.partial(_run_blocks_checkpointed, model.layers, k)
    return model


def checkpoint_group_size(model: TransformerLM) -> int:
    """Blocks per checkpointed group of `model` (0: not checkpointed)."""
    runner = model.__dict__.get("run_blocks")
    if isinstance(runner, functools.partial) and runner.func is _run_blocks_checkpointed:
        return runner.args[1]
    return 0
