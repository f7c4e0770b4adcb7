"""`FSDP`'s state-dict methods: full state dicts (gathered: `gather_full_params()`,
`load_full_params()`) and each rank's shards for torch.distributed.checkpoint
(`sharded_state_dict()`, `sharded_optimizer_state_dict()` and their loads; see
`sharded_state`). A mixin of `FSDP`, kept apart from the gather / reduce-scatter engine."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zero_shard.full_state import gather_full_state, load_full_state
from zero_shard.shard import Collectives, ShardedParam
from zero_shard.sharded_state import (
    load_model_sharded_state,
    load_optimizer_sharded_state,
    model_sharded_state,
    optimizer_sharded_state,
    param_names,
)


class StateDicts:
    """State-dict methods over `FSDP`'s attributes (declared here for the reader)."""

    module: nn.Module
    rank: int
    world_size: int
    _by_key: dict[str, ShardedParam]  # state-dict key -> its sharded parameter
    _comm: Collectives

    def _check_idle(self, what: str) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def gather_full_params(self, device: torch.device | str | None = None) -> dict[str, Any]:
        """The full state dict on every rank: the keys, shapes and dtypes of the unwrapped
        module's `state_dict()` (tied weights: one tensor under both keys), as copies.

        Collective: every rank must call it. Sharded parameters are all-gathered one at a time
        from the fp32 shards (and cast back to their original dtype); `device` (default: where
        the module lives) receives each tensor as soon as it is complete.
        """
        self._check_idle("gather_full_params()")
        return gather_full_state(self.module, self._by_key, self._comm, device)

    @torch.no_grad()
    def load_full_params(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load a full state dict (as `gather_full_params()` returns, or the unwrapped module's
        `state_dict()`): each rank keeps its own rows of the sharded parameters. Local (no
        communication); every rank must load the same values."""
        self._check_idle("load_full_params()")
        load_full_state(self.module, self._by_key, state_dict, self.rank, self.world_size)

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's part of the model state for torch.distributed.checkpoint, keyed as the
        unwrapped module's `state_dict()`: `FlatShard` views of the shards in the parameters'
        full shapes, the replicated entries as they are. Local; see `sharded_state`."""
        self._check_idle("sharded_state_dict()")
        return model_sharded_state(self.module, self._by_key, self.rank, self.world_size)

    def load_sharded_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a `sharded_state_dict()` (this rank's `FlatShard`s, or full tensors). Local."""
        self._check_idle("load_sharded_state_dict()")
        load_model_sharded_state(self.module, self._by_key, state_dict, self.rank, self.world_size)

    def sharded_optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The state of `optimizer` (over `parameters()`) by parameter name, shard-shaped
        tensors as `FlatShard` views; one that has not stepped gets its state first (a step
        at lr 0). Local; see `sharded_state`."""
        names, sharded = self._optim_maps()
        return optimizer_sharded_state(optimizer, names, sharded, self.rank, self.world_size)

    def load_sharded_optimizer_state_dict(
        self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
    ) -> None:
        """Load a `sharded_optimizer_state_dict()` (or full tensors by name). Local."""
        names, sharded = self._optim_maps()
        load_optimizer_sharded_state(
            optimizer, state_dict, names, sharded, self.rank, self.world_size
        )

    def _optim_maps(self) -> tuple[dict[int, str], dict[int, ShardedParam]]:
        """id(parameter) -> name, id(shard) -> its ShardedParam."""
        sharded = {id(sp.shard): sp for sp in self._by_key.values()}
        return param_names(self.module), sharded
