"""Sharded state dicts of an FSDP-wrapped module and its optimizer, for
torch.distributed.checkpoint (DCP): `FSDP.sharded_state_dict()`,
`FSDP.sharded_optimizer_state_dict()` and their `load_*` counterparts.

Layout (torch's `get_state_dict` layout, so checkpoints interchange with torch's FSDP and
with plain models): the model state is keyed as the unwrapped module's `state_dict()`; every
sharded parameter is a `FlatShard` in the parameter's own shape (this rank's elements only),
every replicated parameter and buffer a plain tensor (each rank lists it; DCP writes it
once). The optimizer state is `{"state": {name: {state name: value}}, "param_groups":
[{..., "params": [name, ...]}]}` by parameter name; state tensors shaped like a shard are
`FlatShard`s in the parameter's shape, others (AdamW's step) are kept as they are. Values in
the fp32 master dtype of the shards. Nothing here communicates: each rank describes its own
shards, so every rank writes its own part of a checkpoint in parallel.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from zero_shard.flat_shard import FlatShard
from zero_shard.shard import ShardedParam


def flat_shard(sp: ShardedParam, data: torch.Tensor, rank: int, world: int) -> FlatShard:
    """This rank's real (unpadded) elements of `data` (shard-shaped, `(chunk,)`) as a
    `FlatShard` of the parameter's shape."""
    start = min(rank * sp.chunk, sp.numel)
    stop = min(start + sp.chunk, sp.numel)
    return FlatShard(data.reshape(-1)[: stop - start], sp.shape, start)


def local_rows(
    value: Any, sp: ShardedParam, rank: int, world: int, what: str
) -> torch.Tensor | None:
    """This rank's `(chunk,)` row (zero padding) of `value`: a `FlatShard` of this rank's
    elements or a full tensor of the parameter's shape; None for anything else."""
    if isinstance(value, FlatShard):
        start = min(rank * sp.chunk, sp.numel)
        n = min(start + sp.chunk, sp.numel) - start
        if tuple(value.shape) != sp.shape or value.start != start or value.local.numel() != n:
            raise ValueError(
                f"{what}: a FlatShard of elements [{value.start}, "
                f"{value.start + value.local.numel()}) of shape {tuple(value.shape)}, but this "
                f"rank holds [{start}, {start + n}) of shape {sp.shape}"
            )
        row = value.local.new_zeros(sp.chunk)
        row[:n] = value.local
        return row
    if isinstance(value, torch.Tensor) and tuple(value.shape) == sp.shape:
        return sp.rows(value.detach(), world)[rank].clone()
    return None


def model_sharded_state(
    module: nn.Module, by_key: dict[str, ShardedParam], rank: int, world: int
) -> dict[str, Any]:
    """`module.state_dict()`'s keys: `FlatShard`s of the sharded parameters' shards (views:
    a load into them changes the shards), the other entries as `state_dict()` has them."""
    out: dict[str, Any] = {}
    for key, value in module.state_dict().items():
        sp = by_key.get(key)
        out[key] = value if sp is None else flat_shard(sp, sp.shard.detach(), rank, world)
    return out


@torch.no_grad()
def load_model_sharded_state(
    module: nn.Module,
    by_key: dict[str, ShardedParam],
    state_dict: Mapping[str, Any],
    rank: int,
    world: int,
) -> None:
    """Local: load a state dict of `model_sharded_state`'s keys whose sharded entries are
    this rank's `FlatShard`s or full tensors (padding is zeroed)."""
    expected = module.state_dict().keys()
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"state_dict: keys differ from the module's: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    rows = {}
    for key, sp in by_key.items():  # check everything before changing anything
        row = local_rows(state_dict[key], sp, rank, world, f"state_dict[{key!r}]")
        if row is None:
            value = state_dict[key]
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value)
            raise ValueError(f"state_dict: {key!r} is {shape}, expected shape {sp.shape}")
        rows[key] = row
    for key, sp in by_key.items():
        sp.shard.copy_(rows[key])
    rest = {k: v for k, v in state_dict.items() if k not in by_key}
    module.load_state_dict(rest, strict=False)


def param_names(module: nn.Module) -> dict[int, str]:
    """id(parameter) -> its first qualified name (after wrapping: shards and replicated)."""
    names: dict[int, str] = {}
    for name, p in module.named_parameters():
        names.setdefault(id(p), name)
    return names


def optimizer_sharded_state(
    optimizer: torch.optim.Optimizer,
    names: dict[int, str],
    sharded: dict[int, ShardedParam],
    rank: int,
    world: int,
) -> dict[str, Any]:
    """The optimizer's state by parameter name; shard-shaped state tensors of sharded
    parameters (`sharded`: id(shard) -> ShardedParam) as `FlatShard`s (views of the state)."""
    init_optimizer_state(optimizer)
    sd = optimizer.state_dict()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    unknown = [i for i, p in enumerate(params) if id(p) not in names]
    if unknown:
        raise ValueError(
            f"optimizer: parameter {unknown[0]} of its groups is not a parameter of this FSDP "
            "module (build the optimizer over fsdp.parameters())"
        )
    state: dict[str, Any] = {}
    for index, entry in sd["state"].items():
        p = params[index]
        sp = sharded.get(id(p))
        state[names[id(p)]] = {
            k: flat_shard(sp, v, rank, world)
            if sp is not None and isinstance(v, torch.Tensor) and v.shape == p.shape
            else v
            for k, v in entry.items()
        }
    groups = [
        {**g, "params": [names[id(params[i])] for i in g["params"]]} for g in sd["param_groups"]
    ]
    return {"state": state, "param_groups": groups}


def check_by_name(state_dict: Any, source: str) -> None:
    """Raise ValueError unless `state_dict` is an optimizer state keyed by parameter name,
    {'state': {name: {...}}, 'param_groups': [...]}, as `source` returns it."""
    if not (
        isinstance(state_dict, Mapping)
        and isinstance(state_dict.get("state"), Mapping)
        and isinstance(state_dict.get("param_groups"), list | tuple)
    ):
        raise ValueError(
            "state_dict: expected {'state': {name: {...}}, 'param_groups': [...]} by parameter "
            f"name ({source})"
        )


def load_optimizer_sharded_state(
    optimizer: torch.optim.Optimizer,
    state_dict: Mapping[str, Any],
    names: dict[int, str],
    sharded: dict[int, ShardedParam],
    rank: int,
    world: int,
) -> None:
    """Local: load what `optimizer_sharded_state` returned (in this or another layout: its
    `FlatShard`s or full-shape tensors) into `optimizer`."""
    check_by_name(state_dict, "FSDP.sharded_optimizer_state_dict()")
    params = [p for g in optimizer.param_groups for p in g["params"]]
    index = {names[id(p)]: i for i, p in enumerate(params) if id(p) in names}
    unknown = sorted(set(state_dict["state"]) - set(index))
    if unknown:
        raise ValueError(f"state_dict: state for {unknown[:5]}, not parameters of the optimizer")
    local: dict[int, dict[str, Any]] = {}
    for name, entry in state_dict["state"].items():
        i = index[name]
        sp = sharded.get(id(params[i]))
        local[i] = {}
        for k, v in entry.items():
            row = None if sp is None else local_rows(v, sp, rank, world, f"{name}.{k}")
            local[i][k] = row if row is not None else v
    groups = []
    for g, saved in enumerate(state_dict["param_groups"]):
        missing = [n for n in saved.get("params", []) if n not in index]
        if missing:
            raise ValueError(f"state_dict: param_groups[{g}] lists {missing[:3]}, not ours")
        groups.append({**saved, "params": [index[n] for n in saved["params"]]})
    optimizer.load_state_dict({"state": local, "param_groups": groups})


@contextmanager
def zero_lr_and_grads(param_groups: list[dict[str, Any]]) -> Iterator[None]:
    """Inside: every parameter of `param_groups` has a zero gradient and every group a zero
    learning rate, so one optimizer step creates the state and changes no parameter (AdamW,
    SGD); on exit the learning rates and the gradients present before come back."""
    grads = [(p, p.grad) for g in param_groups for p in g["params"]]
    for p, _ in grads:
        p.grad = torch.zeros_like(p) if p.requires_grad else None
    lrs = [g.get("lr") for g in param_groups]
    for g, lr in zip(param_groups, lrs):
        if lr is not None:
            g["lr"] = torch.zeros_like(lr) if isinstance(lr, torch.Tensor) else 0.0
    try:
        yield
    finally:
        for g, lr in zip(param_groups, lrs):
            if lr is not None:
                g["lr"] = lr
        for p, grad in grads:
            p.grad = grad


@torch.no_grad()
def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give an optimizer that has not stepped yet its state (as torch's `get_state_dict`
    does before a load): one step inside `zero_lr_and_grads`. Skipped when it has state.
    For a plain optimizer this is local; `ShardedOptimizer` has its own (a collective)."""
    if optimizer.state:
        return
    with zero_lr_and_grads(optimizer.param_groups):
        optimizer.step()
