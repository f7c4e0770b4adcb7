"""Tensor parallel and 2-D (FSDP x TP) training for the trainer (`--tp N`, with `--fsdp torch`).

`TensorParallel(model, env, ...)` builds the ("dp", "tp") mesh (`lm_core.parallel.make_mesh`,
TP groups of N consecutive ranks), broadcasts rank 0's weights, then applies in torchtitan's
order: `apply_tensor_parallel` on the "tp" axis, activation checkpointing, `torch.compile` of
each block in place, and with `fsdp=True` torch's `fully_shard` on the "dp" axis (each block,
then the root). Without FSDP the world must be the TP group (one data-parallel replica).

Data: ranks of one TP group read the same rows of the global batch (`DistEnv.dp_rank`), so
B / (world / N) sequences per rank. Gradients: the sharded weights' gradients are complete on
their owners, the replicated ones are equal on every rank of the group; sequence-parallel norm
weights get partial gradients that `finish_sync` sums over the group (FSDP does it itself).

Checkpoints hold full states in single-process layout, as for `--fsdp`: gathered with
`get_model_state_dict` / `get_optimizer_state_dict(full_state_dict=True)` and the fused
weights' rows (and their AdamW moments) put back in order (`from_tp_layout`); loading reorders
and scatters them. A checkpoint of any engine and world size loads into any other.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lm_core.activation_ckpt import apply_activation_checkpointing
from lm_core.distributed import DistEnv, ParallelModel
from lm_core.fsdp import TorchFSDP, torch_fsdp_api
from lm_core.parallel import apply_tensor_parallel, from_tp_layout, make_mesh, to_tp_layout

# Why --tp refuses sharded (DCP) checkpoints: DCP saves DTensors as they are, and the fused
# weights' DTensors hold their rows in TP order (lm_core.parallel.to_tp_layout), which no
# sharding describes: the checkpoint would load into no other TP degree or engine.
_NO_DCP = (
    "--tp: sharded (DCP) checkpoints are not supported with tensor parallelism (the fused "
    "qkv / w13 weights are stored in TP row order); use --checkpoint-format full"
)


class TensorParallel(TorchFSDP):
    """`--tp N` (`fsdp=False`: the world is one TP group) or `--tp N --fsdp torch` (2-D).
    `compile`: True, or torch.compile's keyword arguments for each block (e.g. a backend).

    A `TorchFSDP` for its full-state checkpoint methods (torch's `get/set_*_state_dict`
    gather and scatter TP and 2-D DTensors alike) and `no_sync`; it builds the model itself
    rather than through `TorchFSDP.__init__` (which would shard over the whole world)."""

    def __init__(
        self,
        model: nn.Module,
        env: DistEnv,
        *,
        tp: int,
        sequence_parallel: bool = False,
        fsdp: bool = False,
        bf16: bool = False,
        compile: bool | Mapping[str, Any] = False,
        activation_checkpointing: str | int | None = None,
        activation_ratio: float = 1.0,
    ) -> None:
        if env.world_size % tp:
            raise ValueError(f"--tp {tp} must divide the number of ranks ({env.world_size})")
        if not fsdp and env.world_size != tp:
            raise ValueError(
                f"--tp {tp} on {env.world_size} ranks leaves {env.world_size // tp} "
                "data-parallel replicas: add --fsdp torch to shard (and sync) over them"
            )
        with torch.no_grad():  # before sharding: every rank starts from rank 0's weights
            for t in [*model.parameters(), *model.buffers()]:
                dist.broadcast(t.data, src=0)
        self.tp = tp
        self.mesh = make_mesh(tp, env.device.type)
        apply_tensor_parallel(model, self.mesh["tp"], sequence_parallel)
        apply_activation_checkpointing(
            model, activation_checkpointing, activation_ratio=activation_ratio
        )
        if compile:
            options = dict(compile) if isinstance(compile, Mapping) else {}
            for block in model.layers:
                block.compile(**options)  # in place: keeps the module (and its state-dict keys)
        if fsdp:
            fully_shard, policy_cls = torch_fsdp_api()
            kwargs: dict[str, Any] = {"mesh": self.mesh["dp"]}
            if bf16:
                kwargs["mp_policy"] = policy_cls(
                    param_dtype=torch.bfloat16, reduce_dtype=torch.float32
                )
            for block in model.layers:
                fully_shard(block, **kwargs)
            fully_shard(model, **kwargs)
        no_sync = self._no_sync if fsdp else contextlib.nullcontext
        ParallelModel.__init__(self, model, self._sum_partial_grads, no_sync, env.rank)
        self._keys = [k for k, _ in model.named_parameters()]  # optimizer index -> name

    def _sum_partial_grads(self) -> None:
        """Sequence-parallel norm weights (replicated) get per-rank partial gradients (a
        `Partial` DTensor): sum them over the TP group once, here, rather than in every
        optimizer and clipping op that reads them (DTensor would all-reduce them each time).
        Under FSDP its reduce-scatter does it."""
        from torch.distributed.tensor import DTensor

        for p in self.parameters():
            g = p.grad
            if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
                p.grad = g.redistribute(g.device_mesh, p.placements)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """`lm_core.clip_grad_norm` over gradients that mix plain tensors and DTensors of
        two meshes (torch's refuses such a mix): one norm per mesh, each completed over its
        ranks, combined; the scale multiplies each rank's local values."""
        from torch.distributed.tensor import DTensor

        grads = [p.grad for p in self.parameters() if p.grad is not None]
        groups: dict[Any, list[torch.Tensor]] = defaultdict(list)
        for g in grads:
            groups[g.device_mesh if isinstance(g, DTensor) else None].append(g)
        norms = []
        for group in groups.values():
            norm = torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in group])
            )
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        total = torch.linalg.vector_norm(torch.stack(norms))
        scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        with torch.no_grad():
            for g in grads:
                (g.to_local() if isinstance(g, DTensor) else g).mul_(scale)
        return total

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return from_tp_layout(super().full_state_dict(), self.tp)

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        super().load_full_state_dict(to_tp_layout(state, self.tp))

    def full_optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict | None:
        full = super().full_optimizer_state_dict(optimizer)
        if full is None:
            return None
        full["state"] = self._reorder_state(full["state"], from_tp_layout)
        return full

    def load_full_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        state = {**state, "state": self._reorder_state(state["state"], to_tp_layout)}
        super().load_full_optimizer_state_dict(optimizer, state)

    def sharded_state_dict(self) -> dict[str, Any]:
        raise NotImplementedError(_NO_DCP)

    def sharded_optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        raise NotImplementedError(_NO_DCP)

    def _reorder_state(self, by_index: dict, convert: Any) -> dict:
        """Per-parameter optimizer state (index -> {name: value}) with the fused weights'
        moments reordered by `convert` (to_tp_layout or from_tp_layout)."""
        out = {}
        for index, entry in by_index.items():
            key = self._keys[int(index)] if 0 <= int(index) < len(self._keys) else None
            if key is None:
                out[index] = entry
                continue
            out[index] = {
                name: convert({key: value}, self.tp)[key]
                if isinstance(value, torch.Tensor) and value.dim() >= 1
                else value
                for name, value in entry.items()
            }
        return out
