"""Tensor-parallel functions run inside `ddp_kit.launch.spawn` workers (module level: picklable)."""

from __future__ import annotations

from typing import Any

import torch


def tp_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed batch of the gradient tests: token ids and targets (2, 16)."""
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 256, (2, 17), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def tp_model() -> Any:
    from lm_core import TransformerLM, get_config

    torch.manual_seed(5)
    return TransformerLM(get_config("tiny", context_length=16))


def tp_gradients(rank: int, world: int, configs: list[tuple[bool, bool]]) -> list[dict[str, Any]]:
    """Per (sequence_parallel, fused loss) config: loss and full gradients (single-process
    layout) of one forward/backward of the tiny model under `apply_tensor_parallel` over all
    `world` ranks."""
    return [_tp_gradients(world, sp, fused) for sp, fused in configs]


def _tp_gradients(world: int, sequence_parallel: bool, fused: bool) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    from lm_core import cross_entropy
    from lm_core.parallel import apply_tensor_parallel, from_tp_layout, make_mesh

    torch.set_num_threads(1)
    model = tp_model()
    mesh = make_mesh(world, "cpu")
    apply_tensor_parallel(model, mesh["tp"], sequence_parallel=sequence_parallel)
    try:
        apply_tensor_parallel(model, mesh["tp"])
        twice = None
    except ValueError as exc:
        twice = str(exc)
    x, y = tp_batch()
    loss = model(x, y) if fused else cross_entropy(model(x), y)
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        if isinstance(g, DTensor):
            g = g.full_tensor()  # sums partial (sequence-parallel) gradients too
        grads[name] = g.detach().clone()
    return {"loss": loss.item(), "grads": from_tp_layout(grads, world), "twice": twice}
