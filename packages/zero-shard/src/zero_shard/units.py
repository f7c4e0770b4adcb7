"""Gathering units: which modules' sharded parameters are all-gathered together, and one
unit's gathered storage.

Default units: every child of the outermost `nn.ModuleList` / `nn.Sequential` containers (the
Transformer blocks), then each remaining module that holds a sharded parameter (the embedding,
the LM head), in registration order. A parameter held by modules of two units (tied weights) is
gathered by both; it still has one shard.

A `Unit` owns one padded buffer per parameter, `(N * chunk,)` in the gather dtype, whose
storage is resized to 0 whenever the unit is not gathered; `full[i]` views it in the
parameter's shape. Autograd saves aliases of these buffers during forward, so a re-gather for
backward writes into the very same storage (through `.data`, which leaves the version counter
that autograd checks untouched).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from zero_shard.shard import Collectives, Pending, ShardedParam


@dataclass(frozen=True)
class Slot:
    """`module._parameters[attr]` holds sharded parameter number `index` of its unit."""

    module: nn.Module
    attr: str
    index: int


class Unit:
    """A group of modules whose sharded parameters are gathered with one all-gather.

    `params` are the distinct sharded parameters its modules hold; `offsets[i]` is where
    parameter i's row starts in this rank's `(S,)` send buffer. `active` counts forward calls
    and pending backward passes that need the gathered weights.
    """

    def __init__(
        self,
        name: str,
        root: nn.Module,
        params: list[ShardedParam],
        slots: list[Slot],
        comm: Collectives,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.name = name
        self.root = root
        self.params = params
        self.slots = slots
        self.comm = comm
        self.dtype = dtype
        self.offsets: list[int] = []
        total = 0
        for p in params:
            self.offsets.append(total)
            total += p.chunk
        self.row = total  # S
        world = comm.world
        self.padded = [torch.empty(world * p.chunk, dtype=dtype, device=device) for p in params]
        self.full = [b[: p.numel].view(p.shape) for b, p in zip(self.padded, params)]
        for buf in self.padded:
            buf.untyped_storage().resize_(0)
        # replicated slots in the unit's subtree, cast to `cast` while the unit runs
        self.replicated: list[tuple[nn.Module, str, nn.Parameter]] = []
        self.cast: torch.dtype | None = None
        self.active = 0
        self.gathered = False
        self.kept = False  # gathered after forward for backward (reshard_after_forward=False)
        self._gather: tuple[Pending, torch.Tensor, torch.Tensor] | None = None

    @property
    def holds_memory(self) -> bool:
        """True while gathered or while an all-gather into it is in flight."""
        return self.gathered or self._gather is not None

    def start_gather(self) -> None:
        """Launch the asynchronous all-gather of this unit (a collective)."""
        device = self.padded[0].device
        send = torch.cat([p.shard.detach().to(self.dtype).reshape(-1) for p in self.params])
        recv = torch.empty(self.comm.world * self.row, dtype=self.dtype, device=device)
        pending = self.comm.all_gather(recv, send, f"unit {self.name!r}")
        self._gather = (pending, recv, send)  # send: (S,), recv: (N S,)

    def finish_gather(
        self, around_wait: Callable[[Callable[[], None]], None] | None = None
    ) -> None:
        """Wait for the all-gather and copy each parameter out into its padded buffer.

        `around_wait(wait)`, when given, must call `wait()` (the wait alone, not the copy):
        FSDP times it there (`FSDP.record_gather_waits`)."""
        if self._gather is None:
            return
        pending, recv, _ = self._gather
        if around_wait is None:
            pending.wait()
        else:
            around_wait(pending.wait)
        cols = recv.view(self.comm.world, self.row)  # (N, S)
        for buf, p, off in zip(self.padded, self.params, self.offsets):
            buf.untyped_storage().resize_(buf.numel() * buf.element_size())
            buf.data.view(self.comm.world, p.chunk).copy_(cols[:, off : off + p.chunk])
        self._gather = None
        self.gathered = True

    def free(self) -> None:
        """Release the gathered storage (waits for an all-gather still in flight)."""
        if self._gather is not None:
            self._gather[0].wait()
            self._gather = None
        for buf in self.padded:
            buf.untyped_storage().resize_(0)
        self.gathered = False
        self.kept = False

    def swap_in(self, tensors: tuple[torch.Tensor, ...]) -> None:
        """Point the modules' parameter slots at `tensors` (full shapes) for a forward, and
        the replicated ones at casts to `cast`."""
        for s in self.slots:
            s.module._parameters[s.attr] = tensors[s.index]
        if self.cast is not None:
            cast_slots(self.replicated, self.cast)

    def swap_out(self) -> None:
        """Point the slots back at the shards (what `parameters()` and optimizers see) and at
        the replicated parameters."""
        for s in self.slots:
            s.module._parameters[s.attr] = self.params[s.index].shard
        for m, attr, p in self.replicated:
            m._parameters[attr] = p

    def grad_rows(self, grads: tuple[torch.Tensor | None, ...], dtype: torch.dtype):
        """The reduce-scatter input `(N * S,)` in `dtype`: rank r's row holds row r of every
        parameter's padded flat gradient (None: zeros)."""
        world = self.comm.world
        buf = torch.empty(world, self.row, dtype=dtype, device=self.padded[0].device)  # (N, S)
        for p, off, g in zip(self.params, self.offsets, grads):
            p.write_rows(buf[:, off : off + p.chunk], g)
        return buf.view(-1)


def cast_slots(slots: list[tuple[nn.Module, str, nn.Parameter]], dtype: torch.dtype) -> None:
    """Point each slot at its (floating) parameter cast to `dtype`; the cast is differentiable,
    so gradients reach the parameter in its own dtype. A tied parameter is cast once."""
    cast: dict[int, torch.Tensor] = {}
    for m, attr, p in slots:
        if p.is_floating_point():
            if id(p) not in cast:
                cast[id(p)] = p.to(dtype)
            m._parameters[attr] = cast[id(p)]


def is_container(module: nn.Module) -> bool:
    return isinstance(module, nn.ModuleList | nn.Sequential)


def default_unit_roots(module: nn.Module, holds_shard: set[int]) -> list[tuple[str, nn.Module]]:
    """Children of the outermost ModuleList / Sequential containers that hold a sharded
    parameter (`holds_shard`: ids of modules with one in their subtree)."""
    roots: list[tuple[str, nn.Module]] = []
    claimed: set[int] = set()
    for name, m in module.named_modules():
        if id(m) in claimed or not is_container(m):
            continue
        for child_name, child in m.named_children():
            if id(child) in holds_shard and id(child) not in claimed:
                roots.append((f"{name}.{child_name}" if name else child_name, child))
                claimed.update(id(c) for c in child.modules())
    return roots
