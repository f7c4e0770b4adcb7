"""torch.compile for a TransformerLM block by block: `compile_blocks`.

`torch.compile(model)` turns the whole forward into one graph and the whole backward into one
autograd node, whose parameter gradients all land at its end. Compiling each block on its own
(as torchtitan does) keeps one backward node per block, so the gradients of a block are final
as soon as its backward is done: what an optimizer overlapped with the backward
(`lm_core.optim_overlap.OverlappedOptimizer`) needs. One block graph serves every block (same
code, same shapes), so compiling takes about as long as compiling one block; the embedding,
the final norm and the fused LM head + loss stay eager (a few large kernels each).

`compile_block_forwards` compiles each block's `forward` method instead of the module call:
the module's hooks then run eagerly around the compiled graph. That is what a wrapper that
gathers and frees weights in module hooks (`zero_shard.FSDP`) needs: compiled in place, the
hooks' collectives would be traced; compiled as a wrapper module (`torch.compile(block)`),
the parameters would be renamed `_orig_mod.*` and checkpoints would no longer match.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lm_core.checkpoint import unwrap_model

__all__ = ["compile_block_forwards", "compile_blocks"]


def compile_blocks(model: nn.Module, **kwargs: Any) -> nn.Module:
    """Compile every block of `model.layers` in place (`block.compile(**kwargs)`: modules,
    parameters and state-dict keys unchanged); returns `model`.

    Activation checkpointing (`apply_activation_checkpointing`) may come before or after.
    `kwargs` go to `torch.compile` (e.g. `dynamic=False`, `mode="max-autotune"`)."""
    for block in _blocks(model):
        block.compile(**kwargs)
    return model


def compile_block_forwards(model: nn.Module, **kwargs: Any) -> nn.Module:
    """Compile every block's `forward` method in place (`block.forward =
    torch.compile(block.forward, **kwargs)`); returns `model`. Module hooks (forward pre- and
    post-hooks, e.g. `zero_shard.FSDP`'s gathers) run eagerly around the compiled graph;
    modules, parameters and state-dict keys are unchanged. Compile before wrapping."""
    import torch

    for block in _blocks(model):
        block.forward = torch.compile(block.forward, **kwargs)
    return model


def _blocks(model: nn.Module) -> nn.ModuleList:
    """`model.layers`, checked: the model itself (not a wrapper) with a ModuleList of blocks."""
    inner = unwrap_model(model)
    if inner is not model:
        raise TypeError(
            f"model: expected the model itself, got a {type(model).__name__} wrapper; compile "
            "the blocks before wrapping (and not together with torch.compile(model))"
        )
    blocks = getattr(model, "layers", None)
    if not isinstance(blocks, nn.ModuleList):
        raise TypeError(
            f"model: expected a model with a `layers` ModuleList of blocks (a TransformerLM), "
            f"got {type(model).__name__}"
        )
    return blocks
