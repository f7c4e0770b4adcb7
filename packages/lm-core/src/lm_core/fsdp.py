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

Both take a model built on the meta device (the trainer builds it so under --fsdp): each
rank materializes only its shards, initialized bitwise as the full build for the seed (rank
0's generator state), one init root at a time (the embedding, each block, the final norm,
the head: `TransformerLM.reset_parameters()`'s order). Ours does it inside
`zero_shard.FSDP`; for torch's, `materialize_fully_sharded` runs after `fully_shard` and
`to_empty()`: each root's `reset_parameters()` fills full-size plain tensors, and every rank
copies its DTensor shard out of them. (Calling `reset_parameters()` on the DTensors
directly, torch's recipe, is not the full build: DTensor random ops on a CPU mesh are not the
full tensor's numbers, and an in-place init of a split along the sharded dim, as the fused
qkv and w13 inits do, writes to a temporary and leaves the parameter uninitialized.)

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

Sharded checkpoints (`--checkpoint-format dcp`, `lm_core.dcp_checkpoint`) skip the gathers:
each rank hands torch.distributed.checkpoint its own shards by name (`sharded_state_dict`,
`sharded_optimizer_state_dict`): zero_shard's `FlatShard`s for ours, torch's DTensors for
`fully_shard`, in the same full shapes, so these load into either engine at any world size.
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

    Gradient accumulation: non-final micro-steps run under `FSDP.no_sync()` (gradients
    accumulate unsharded in a local fp32 buffer per unit; the last micro-step reduce-scatters
    each unit once).
    """

    def __init__(
        self,
        model: nn.Module,
        env: DistEnv,
        *,
        bf16: bool = False,
        reshard_after_forward: bool = True,
    ) -> None:
        zero_shard = optional_import("zero_shard", "zero")
        before = dict(model.named_parameters())
        self._shapes = {k: v.shape for k, v in model.state_dict().items()}
        meta = any(p.is_meta for p in model.parameters())  # materialized by FSDP
        wrapped = zero_shard.FSDP(
            model,
            compute_dtype=torch.bfloat16 if bf16 else None,
            device=env.device if meta else None,
            reshard_after_forward=reshard_after_forward,
        )
        super().__init__(
            wrapped, wrapped.finish_gradient_synchronization, wrapped.no_sync, env.rank
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

    def param_names(self) -> list[str]:
        return list(self._keys)

    def sharded_state_dict(self) -> dict[str, Any]:
        return self.fsdp.sharded_state_dict()  # zero_shard.FlatShard views of the shards

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        self.fsdp.load_sharded_state_dict(state)

    def sharded_optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return self.fsdp.sharded_optimizer_state_dict(optimizer)

    def load_sharded_optimizer_state_dict(
        self, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        self.fsdp.load_sharded_optimizer_state_dict(optimizer, state)

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

    A built model: rank 0's parameters and buffers are broadcast first (as every other
    wrapper does); a meta-device one: materialized after sharding (`materialize_fully_sharded`).
    Gradient accumulation: non-final micro-steps run with `set_requires_gradient_sync(False)`
    (gradients stay unsharded and accumulate; one reduce-scatter in the last micro-step).
    """

    def __init__(
        self,
        model: nn.Module,
        env: DistEnv,
        *,
        bf16: bool = False,
        compile: bool = False,
        reshard_after_forward: bool = True,
    ) -> None:
        fully_shard, policy_cls = torch_fsdp_api()
        meta = any(p.is_meta for p in model.parameters())
        if not meta:
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
        kwargs: dict[str, Any] = {"reshard_after_forward": reshard_after_forward}
        if bf16:
            kwargs["mp_policy"] = policy_cls(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in blocks:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
        if meta:
            materialize_fully_sharded(model, env.device)
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

    def param_names(self) -> list[str]:
        return list(self._keys)

    # torch's own sharded state dicts (DTensor shards by name), the layout of ours
    def sharded_state_dict(self) -> dict[str, Any]:
        return _state_dict_api().get_model_state_dict(self.module)

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        _state_dict_api().set_model_state_dict(self.module, state)

    def sharded_optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return _state_dict_api().get_optimizer_state_dict(self.module, optimizer)

    def load_sharded_optimizer_state_dict(
        self, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        api = _state_dict_api()
        api.set_optimizer_state_dict(self.module, optimizer, optim_state_dict=state)


def _nothing() -> None:
    return None


def init_roots(model: nn.Module) -> list[nn.Module]:
    """The topmost modules below `model` that define `reset_parameters()`, in registration
    order (TransformerLM: token_embeddings, each block, ln_final, lm_head); ValueError when a
    module holding a parameter or buffer lies under none of them."""
    roots: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if callable(getattr(child, "reset_parameters", None)):
                roots.append(child)
            else:
                visit(child)

    visit(model)
    covered = {id(m) for root in roots for m in root.modules()}
    for name, m in model.named_modules():
        tensors = [t for t in [*m._parameters.values(), *m._buffers.values()] if t is not None]
        if tensors and id(m) not in covered:
            raise ValueError(
                f"meta-device init: {name or '<root>'!r} holds tensors that no child's "
                "reset_parameters() initializes"
            )
    return roots


@torch.no_grad()
def materialize_fully_sharded(model: nn.Module, device: torch.device) -> None:
    """Give a meta-device model sharded by `fully_shard` memory on `device` and the values of
    the full build, one init root at a time (collective: every rank calls it).

    Rank 0's generator state of `device` is set on every rank; `model.to_empty()` allocates
    the DTensor shards and the buffers; then for each root of `init_roots(model)` its DTensor
    parameters are replaced by full-size plain tensors, `reset_parameters()` fills them (and
    the root's buffers), and each rank copies its shard out. Peak: one root at full size."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    _sync_rng_from_rank0(device)
    model.to_empty(device=device)
    for root in init_roots(model):
        full: dict[int, tuple[torch.Tensor, nn.Parameter]] = {}  # tied: one full tensor
        slots = []
        for m in root.modules():
            for name, p in m._parameters.items():
                if isinstance(p, DTensor):
                    if id(p) not in full:
                        t = torch.empty(p.shape, dtype=p.dtype, device=device)
                        full[id(p)] = (nn.Parameter(t, requires_grad=p.requires_grad), p)
                    slots.append((m, name, p))
                    m._parameters[name] = full[id(p)][0]
        try:
            root.reset_parameters()  # type: ignore[operator]
        finally:
            for m, name, p in slots:
                m._parameters[name] = p
        for value, p in full.values():
            try:  # every rank cuts its own shard out of its (identical) full tensor
                piece = distribute_tensor(value, p.device_mesh, p.placements, src_data_rank=None)
            except TypeError:  # torch without src_data_rank: rank 0's, scattered
                piece = distribute_tensor(value, p.device_mesh, p.placements)
            p.to_local().copy_(piece.to_local())


def _sync_rng_from_rank0(device: torch.device) -> None:
    """Set rank 0's state of `device`'s default generator on every rank."""
    cuda = device.type == "cuda"
    state = torch.cuda.get_rng_state(device) if cuda else torch.get_rng_state()
    buf = state.to(device)  # NCCL moves CUDA tensors only
    dist.broadcast(buf, src=0)
    if cuda:
        torch.cuda.set_rng_state(buf.cpu(), device)
    else:
        torch.set_rng_state(buf.cpu())
