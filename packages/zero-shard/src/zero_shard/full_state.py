"""Full (unsharded) state dicts of an FSDP-wrapped module: `FSDP.gather_full_params()` and
`FSDP.load_full_params()`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zero_shard.shard import Collectives, ShardedParam


@torch.no_grad()
def gather_full_state(
    module: nn.Module,
    by_key: dict[str, ShardedParam],
    comm: Collectives,
    device: torch.device | str | None,
) -> dict[str, Any]:
    """Collective: `module.state_dict()`'s keys, shapes and dtypes with the sharded
    parameters all-gathered one at a time (tied: one tensor under both keys), as copies,
    each moved to `device` (if given) as soon as it is complete."""
    out: dict[str, Any] = {}
    done: dict[int, torch.Tensor] = {}
    for key, value in module.state_dict().items():
        sp = by_key.get(key)
        if sp is None:
            full = value.detach().clone()
        elif id(sp) in done:
            full = done[id(sp)]
        else:
            shard = sp.shard.detach()
            recv = torch.empty(comm.world * sp.chunk, dtype=shard.dtype, device=shard.device)
            comm.all_gather(recv, shard, f"parameter {key!r}").wait()
            full = recv[: sp.numel].view(sp.shape).to(sp.dtype)  # (N chunk,) -> shape
        if device is not None:
            full = full.to(device)
        if sp is not None:
            done[id(sp)] = full
        out[key] = full
    return out


@torch.no_grad()
def load_full_state(
    module: nn.Module,
    by_key: dict[str, ShardedParam],
    state_dict: dict[str, torch.Tensor],
    rank: int,
    world: int,
) -> None:
    """Local: load a full state dict; this rank keeps its rows of the sharded parameters."""
    expected = module.state_dict().keys()
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"state_dict: keys differ from the module's: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    for key, sp in by_key.items():
        value = state_dict[key]
        if tuple(value.shape) != sp.shape:
            raise ValueError(
                f"state_dict: {key!r} has shape {tuple(value.shape)}, expected {sp.shape}"
            )
        value = value.to(device=sp.shard.device, dtype=sp.shard.dtype)
        sp.shard.copy_(sp.rows(value, world)[rank])
    rest = {k: v for k, v in state_dict.items() if k not in by_key}
    module.load_state_dict(rest, strict=False)
