"""What the trainer's parallel engines share: where a process runs (`DistEnv`) and a wrapped
model's interface (`ParallelModel`). `lm_core.distributed` builds them for data parallelism,
`lm_core.fsdp` subclasses `ParallelModel` for fully sharded parameters, `lm_core.tp_engine` for
tensor parallelism; they import this module and not each other at module level.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lm_core.checkpoint import unwrap_model
from lm_core.optim import clip_grad_norm
from lm_core.optim_state import init_optimizer_state, state_by_index, state_by_name


@dataclass
class DistEnv:
    """Where this process runs: rank, world size, its device, and who owns the process group."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")  # noqa: RUF009 - immutable default
    owns_group: bool = False  # True when setup_distributed created the group (and must end it)
    tp: int = 1  # tensor-parallel group size: groups of tp consecutive ranks share their data

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas: ranks / tp."""
        return self.world_size // self.tp

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index (the same on every rank of a TP group)."""
        return self.rank // self.tp

    def rows(self, global_batch: int) -> slice:
        """This rank's rows of a global batch split evenly over data-parallel replicas."""
        per_rank = global_batch // self.dp_size
        return slice(self.dp_rank * per_rank, (self.dp_rank + 1) * per_rank)


def optional_import(name: str, extra: str) -> Any:
    """Import an optional package of ours, or raise an ImportError naming the extra."""
    try:
        return __import__(name)
    except ImportError as exc:
        raise ImportError(
            f"{name} is needed for this option: `pip install lm-core[{extra}]`"
        ) from exc


@dataclass
class ParallelModel:
    """A model ready to train: what to call, how to sync gradients, how to skip syncs, and
    the full (unsharded) view of its parameters and optimizer state for checkpoints.

    This class serves unsharded parameters (one device, data-parallel wrappers, sharded
    optimizer state); `lm_core.fsdp` subclasses it for fully sharded ones. Methods marked
    collective must be called on every rank.
    """

    module: nn.Module  # call this for forward
    finish_sync: Callable[[], None]  # call after the last backward of a step
    no_sync: Callable[[], contextlib.AbstractContextManager[Any]]  # wrap non-final micro-steps
    rank: int = 0

    @property
    def model(self) -> nn.Module:
        """The model under the wrappers (the TransformerLM; its parameters may be shards)."""
        return unwrap_model(self.module)

    def parameters(self) -> list[nn.Parameter]:
        """The tensors the optimizer steps."""
        return list(self.model.parameters())

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Scale the gradients so that the global L2 norm of the full gradients is at most
        `max_norm` (collective when sharded); returns the norm before clipping (0-dim fp32,
        on the device: no host sync)."""
        return clip_grad_norm([p for p in self.parameters() if p.grad is not None], max_norm)

    def full_shapes(self) -> dict[str, torch.Size]:
        """State-dict key -> the full (unsharded) shape, to check checkpoints against."""
        return {k: v.shape for k, v in self.model.state_dict().items()}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded model state dict, complete on rank 0 (collective when sharded; other
        ranks may get an empty or a full dict)."""
        return self.model.state_dict()

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load an unsharded model state dict (the same on every rank)."""
        self.model.load_state_dict(state)

    def full_optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict | None:
        """Collective. On rank 0: the state dict an unsharded optimizer over
        `model.parameters()` would have (sharded optimizer state consolidated); None on the
        other ranks."""
        if hasattr(optimizer, "consolidate_state_dict"):  # zero_shard.ShardedOptimizer
            optimizer.consolidate_state_dict(to=0)
        return optimizer.state_dict() if self.rank == 0 else None

    def load_full_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """Load what `full_optimizer_state_dict` returned (every rank passes the same dict)."""
        optimizer.load_state_dict(state)

    # Sharded state for torch.distributed.checkpoint (`lm_core.dcp_checkpoint`): each rank
    # lists its own shards (and the replicated tensors, which DCP writes once), by name, as
    # views of the live tensors: `dcp.load` into them loads in place.
    def param_names(self) -> list[str]:
        """The names of `parameters()`, in order (the optimizer's parameters)."""
        return [name for name, _ in self.model.named_parameters()]

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's part of the model state, keyed as the unwrapped model's state dict
        (unsharded: the state dict itself)."""
        return self.model.state_dict()

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        """Load a `sharded_state_dict()` that `dcp.load` filled."""
        self.model.load_state_dict(state)

    def sharded_optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """This rank's part of the optimizer state by parameter name (`lm_core.optim_state`;
        a ShardedOptimizer lists its own parameters' state only). An optimizer that has not
        stepped gets its state first (a step at lr 0; a collective for a ShardedOptimizer)."""
        names = self.param_names()
        if hasattr(optimizer, "sharded_state_dict"):  # zero_shard.ShardedOptimizer
            return optimizer.sharded_state_dict(names)
        init_optimizer_state(optimizer)
        return state_by_name(optimizer.state_dict(), names)

    def load_sharded_optimizer_state_dict(
        self, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        """Load a `sharded_optimizer_state_dict()` that `dcp.load` filled."""
        names = self.param_names()
        if hasattr(optimizer, "load_sharded_state_dict"):  # zero_shard.ShardedOptimizer
            optimizer.load_sharded_state_dict(state, names)
        else:
            optimizer.load_state_dict(state_by_index(state, names))
