"""torch.compile for a TransformerLM block by block: `compile_blocks`.

`torch.compile(model)` turns the whole forward into one graph and the whole backward into one
autograd node, whose parameter gradients all land at its end. Compiling each block on its own
(as torchtitan does) keeps one backward node per block, so the gradients of a block are final
as soon as its backward is done: what an optimizer overlapped with the backward
(`lm_core.optim_overlap.OverlappedOptimizer`) needs. One block graph serves every block (same
code, same shapes), so compiling takes about as long as compiling one block; the embedding,
the final norm and the fused LM head + loss stay eager (a few large kernels each).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lm_core.checkpoint import unwrap_model

__all__ = ["compile_blocks"]


def compile_blocks(model: nn.Module, **kwargs: Any) -> nn.Module:
    """Compile every block of `model.layers` in place (`block.compile(**kwargs)`: modules,
    parameters and state-dict keys unchanged); returns `model`.

    Activation checkpointing (`apply_activation_checkpointing`) may come before or after.
    `kwargs` go to `torch.compile` (e.g. `dynamic=False`, `mode="max-autotune"`)."""
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
    for block in blocks:
        block.compile(**kwargs)
    return model
