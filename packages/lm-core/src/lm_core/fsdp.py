"""Fully sharded data parallelism for the trainer (`--fsdp ours|torch`), beside the model.

Two engines behind one interface (`lm_core.engine.ParallelModel`):

- `ZeroShardFSDP` (`--fsdp ours`): `zero_shard.FSDP(model, compute_dtype=bf16 or None)`.
  Units: the token embedding, each block, the LM head; the norms are replicated. The
  optimizer steps `fsdp.parameters()` (fp32 1/N shards and the replicated norms), gradients
  are clipped by the wrapper's global `clip_grad_norm_`, and `finish_gradient_synchronization()`
  runs before the step.
- `TorchFSDP` (`--fsdp torch`): torch's `fully_shard` on each block, then on the root (the
  embedding, the final norm and the LM head form the root's group), with
  `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)` under bf16. Parameters become
  DTensors; the optimizer steps them directly.

Checkpoints hold full (unsharded) states in the layout of single-process training, so a
checkpoint from any engine and world size loads into any other:
- model: `gather_full_params()` (ours) or `get_model_state_dict(full_state_dict=True)`
  (torch), written by rank 0;
- optimizer: consolidated on rank 0. For ours every per-parameter state tensor of a shard is
  all-gathered into the parameter's full shape (padding dropped), and on load each rank cuts
  its own row back out (zero padding, as the shards have); the result is bitwise the
  optimizer state of an uninterrupted run. For torch: `get_optimizer_state_dict` /
  `set_optimizer_state_dict(full_state_dict=True)`, re-keyed from parameter names to the
  indices of `model.parameters()`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lm_core.engine import DistEnv, ParallelModel, optional_import


class ZeroShardFSDP(ParallelModel):
    """`--fsdp ours`: the whole model under one `zero_shard.FSDP` (see the module docstring).

    Gradient accumulation: every backward reduce-scatters its gradients (zero_shard has no
    `no_sync`); they add up in the shards' `.grad` until `finish_sync()`.
    """

    def __init__(self, model: nn.Module, env: DistEnv, *, bf16: bool = False) -> None:
        zero_shard = optional_import("zero_shard", "zero")
        before = dict(model.named_parameters())
        self._shapes = {k: v.shape for k, v in model.state_dict().items()}
        wrapped = zero_shard.FSDP(model, compute_dtype=torch.bfloat16 if bf16 else None)
        super().__init__(
            wrapped, wrapped.finish_gradient_synchronization, contextlib.nullcontext, env.rank
        )
        self.fsdp = wrapped
        self.world_size = env.world_size
        # After wrapping, the model's sharded parameter slots hold this rank's shards (new
        # Parameters); the replicated ones are the same objects as before.
        after = list(model.named_parameters())
        self._keys = [k for k, _ in after]  # optimizer index -> state-dict key
        self._sharded = {k for k, p in after if p is not before[k]}
        self._params = list(wrapped.parameters())
        if len(self._params) != len(after) or any(
            a is not b for a, (_, b) in zip(self._params, after)
        ):
            raise RuntimeError(
                "--fsdp ours: zero_shard.FSDP.parameters() do not follow the model's parameter "
                "order; cannot map optimizer state to parameter names"
            )

    def parameters(self) -> list[nn.Parameter]:
        return list(self._params)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return self.fsdp.clip_grad_norm_(max_norm)

    def full_shapes(self) -> dict[str, torch.Size]:
        return dict(self._shapes)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return self.fsdp.gather_full_params(device="cpu")

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.fsdp.load_full_params(state)

    def full_optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict | None:
        local = optimizer.state_dict()
        state: dict[int, dict[str, Any]] = {}
        # Every rank holds state for the same indices: each owns a row of every sharded
        # parameter (all get a gradient from the same reduce-scatter) and the replicated
        # gradients are averaged on all ranks, so the collectives below line up.
        for index, entry in sorted(local["state"].items()):
            key = self._keys[index]
            if key in self._sharded:
                shard = self._params[index]
                entry = {
                    name: self._gather(value, key)
                    if isinstance(value, torch.Tensor) and value.shape == shard.shape
                    else value
                    for name, value in entry.items()
                }
            if self.rank == 0:
                state[index] = {
                    name: value.cpu() if isinstance(value, torch.Tensor) else value
                    for name, value in entry.items()
                }
        if self.rank != 0:
            return None
        return {"state": state, "param_groups": local["param_groups"]}

    def load_full_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        local: dict[int, dict[str, Any]] = {}
        for index, entry in state["state"].items():
            index = int(index)
            if not 0 <= index < len(self._keys):
                raise ValueError(
                    f"optimizer state for parameter index {index}, but the model has "
                    f"{len(self._keys)} parameters"
                )
            key = self._keys[index]
            if key in self._sharded:
                entry = {name: self._row(value, key, name) for name, value in entry.items()}
            local[index] = entry
        optimizer.load_state_dict({"state": local, "param_groups": state["param_groups"]})

    def _gather(self, value: torch.Tensor, key: str) -> torch.Tensor:
        """A shard-shaped state tensor (chunk,) of every rank -> the full shape of `key`."""
        parts = [torch.empty_like(value) for _ in range(self.world_size)]
        dist.all_gather(parts, value.contiguous(), group=self.fsdp.process_group)
        shape = self._shapes[key]
        return torch.cat(parts)[: shape.numel()].view(shape)  # (N chunk,) -> full shape

    def _row(self, value: Any, key: str, name: str) -> Any:
        """This rank's row of a full-shape state tensor of `key` (zero-padded at the end, as
        zero_shard pads the parameters); scalars (the step count) as they are."""
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            return value
        shape = self._shapes[key]
        if value.shape != shape:
            raise ValueError(
                f"optimizer state {name!r} of {key} has shape {tuple(value.shape)}, "
                f"expected {tuple(shape)}"
            )
        chunk = -(-shape.numel() // self.world_size)
        flat = value.reshape(-1)
        pad = chunk * self.world_size - flat.numel()
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        return flat[self.rank * chunk : (self.rank + 1) * chunk].clone()  # (chunk,)


def torch_fsdp_api() -> tuple[Any, Any]:
    """(fully_shard, MixedPrecisionPolicy) of this torch: `torch.distributed.fsdp` from 2.6,
    `torch.distributed._composable.fsdp` in 2.4 and 2.5."""
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
        except ImportError as exc:
            raise ImportError(
                f"--fsdp torch needs torch's fully_shard (torch >= 2.4); this is torch "
                f"{torch.__version__}. Use --fsdp ours (zero_shard) instead"
            ) from exc
    return fully_shard, MixedPrecisionPolicy


def _state_dict_api() -> Any:
    try:
        import torch.distributed.checkpoint.state_dict as api
    except ImportError as exc:
        raise ImportError(
            "--fsdp torch checkpoints need torch.distributed.checkpoint.state_dict "
            f"(torch >= 2.4); this is torch {torch.__version__}"
        ) from exc
    return api


class TorchFSDP(ParallelModel):
    """`--fsdp torch`: `fully_shard` per block, then the root (see the module docstring).

    Rank 0's parameters and buffers are broadcast first (as every other wrapper does).
    Gradient accumulation: non-final micro-steps run with `set_requires_gradient_sync(False)`
    (gradients stay unsharded and accumulate; one reduce-scatter in the last micro-step).
    """

    def __init__(
        self, model: nn.Module, env: DistEnv, *, bf16: bool = False, compile: bool = False
    ) -> None:
        fully_shard, policy_cls = torch_fsdp_api()
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                dist.broadcast(t.data, src=0)
        blocks = getattr(model, "layers", None)
        if not isinstance(blocks, nn.ModuleList):
            raise TypeError(
                f"--fsdp torch: expected a model with a `layers` ModuleList of blocks, got "
                f"{type(model).__name__}"
            )
        if compile:
            for block in blocks:
                block.compile()  # in place: keeps the module (and its state-dict keys)
        kwargs = {}
        if bf16:
            kwargs["mp_policy"] = policy_cls(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in blocks:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
        super().__init__(model, _nothing, self._no_sync, env.rank)
        self._keys = [k for k, _ in model.named_parameters()]  # optimizer index -> name

    @contextlib.contextmanager
    def _no_sync(self) -> Iterator[None]:
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        grads = [p for p in self.parameters() if p.grad is not None]
        total = torch.nn.utils.clip_grad_norm_(grads, max_norm)  # a DTensor: the global norm
        return total.full_tensor() if hasattr(total, "full_tensor") else total

    def _options(self) -> Any:
        return _state_dict_api().StateDictOptions(full_state_dict=True, cpu_offload=True)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return _state_dict_api().get_model_state_dict(self.module, options=self._options())

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        api = _state_dict_api()
        api.set_model_state_dict(
            self.module, state, options=api.StateDictOptions(full_state_dict=True)
        )

    def full_optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict | None:
        named = _state_dict_api().get_optimizer_state_dict(
            self.module, optimizer, options=self._options()
        )
        if self.rank != 0:
            return None
        index = {name: i for i, name in enumerate(self._keys)}
        return {
            "state": {index[name]: entry for name, entry in named["state"].items()},
            "param_groups": [
                {**g, "params": [index[name] for name in g["params"]]}
                for g in named["param_groups"]
            ],
        }

    def load_full_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        api = _state_dict_api()

        def name(i: Any) -> str:
            if not 0 <= int(i) < len(self._keys):
                raise ValueError(
                    f"optimizer state for parameter index {i}, but the model has "
                    f"{len(self._keys)} parameters"
                )
            return self._keys[int(i)]

        named = {
            "state": {name(i): entry for i, entry in state["state"].items()},
            "param_groups": [
                {**g, "params": [name(i) for i in g["params"]]} for g in state["param_groups"]
            ],
        }
        api.set_optimizer_state_dict(
            self.module,
            optimizer,
            optim_state_dict=named,
            options=api.StateDictOptions(full_state_dict=True),
        )


def _nothing() -> None:
    return None
