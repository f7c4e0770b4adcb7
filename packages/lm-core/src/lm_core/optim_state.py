"""Optimizer state dicts keyed by parameter name, as torch.distributed.checkpoint's
`get_optimizer_state_dict` lays them out: `{"state": {name: {...}}, "param_groups": [{...,
"params": [name, ...]}]}`. `torch.optim.Optimizer.state_dict()` keys by position instead;
names let checkpoints move between engines (plain, ZeRO, both FSDPs) and world sizes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch


def state_by_name(state_dict: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """`Optimizer.state_dict()` (positions: the i-th parameter of its groups is `names[i]`)
    keyed by name instead."""
    return {
        "state": {names[int(i)]: entry for i, entry in state_dict["state"].items()},
        "param_groups": [
            {**g, "params": [names[int(i)] for i in g["params"]]}
            for g in state_dict["param_groups"]
        ],
    }


def state_by_index(state_dict: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """The inverse of `state_by_name`: ValueError for a name that is not in `names`."""
    index = {name: i for i, name in enumerate(names)}

    def position(name: str) -> int:
        if name not in index:
            raise ValueError(f"optimizer state for {name!r}, which is not a parameter here")
        return index[name]

    return {
        "state": {position(n): entry for n, entry in state_dict["state"].items()},
        "param_groups": [
            {**g, "params": [position(n) for n in g["params"]]} for g in state_dict["param_groups"]
        ],
    }


@torch.no_grad()
def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give an optimizer that has not stepped its state, as torch's `get_state_dict` does
    before a load: one step at learning rate 0 on zero gradients, which changes no parameter
    (AdamW, SGD); gradients present are put back afterwards. Nothing when it has state.
    (zero_shard has the same helper; each package stays importable without the other.)"""
    if optimizer.state:
        return
    grads = [(p, p.grad) for g in optimizer.param_groups for p in g["params"]]
    for p, _ in grads:
        p.grad = torch.zeros_like(p) if p.requires_grad else None
    lrs = [g.get("lr") for g in optimizer.param_groups]
    for g, lr in zip(optimizer.param_groups, lrs):
        if lr is not None:
            g["lr"] = torch.zeros_like(lr) if isinstance(lr, torch.Tensor) else 0.0
    try:
        optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, lrs):
            if lr is not None:
                g["lr"] = lr
        for p, grad in grads:
            p.grad = grad
