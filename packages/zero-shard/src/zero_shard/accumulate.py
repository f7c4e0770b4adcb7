"""Gradient accumulation without communication: `FSDP.no_sync()` and
`FSDP.set_requires_gradient_sync(False)`.

While gradient sync is off, a unit's backward adds its weight gradients, unsharded, to a
local buffer of the unit in the layout of its reduce-scatter input (`(N * S,)`: rank r's row
holds row r of every padded flat gradient) and in the shards' dtype (fp32), instead of
reduce-scattering them. The unit's next backward with sync on adds its own gradients to the
buffer and reduce-scatters the sum: one reduce-scatter per unit per step, whatever the
number of micro-batches. `finish_gradient_synchronization()` reduce-scatters any buffer still
held (a unit that ran only while sync was off). Replicated parameters accumulate in their
`.grad` as autograd does and are all-reduced in `finish_gradient_synchronization()` as always.

Memory: while accumulating, each rank holds every unit's full gradient in fp32 (as much as
plain data parallelism holds), until the synchronizing backward frees it unit by unit.
"""

from __future__ import annotations

import torch

from zero_shard.units import Unit


class GradAccumulator:
    """The sync flag, which kinds of backward ran since the last finish, and the buffers."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype  # the master (shards') dtype: sums stay exact to fp32 round-off
        self.sync = True
        self.sync_seen = False  # a backward ran with sync on since the last finish
        self.nosync_seen = False  # ... with sync off
        self._buffers: dict[int, tuple[Unit, torch.Tensor]] = {}

    def saw_backward(self) -> None:
        if self.sync:
            self.sync_seen = True
        else:
            self.nosync_seen = True

    def add(self, unit: Unit, grads: tuple[torch.Tensor | None, ...]) -> None:
        """Add `unit`'s weight gradients (full shapes; None: zeros) to its buffer."""
        rows = unit.grad_rows(grads, self.dtype)  # (N S,)
        held = self._buffers.get(id(unit))
        if held is None:
            self._buffers[id(unit)] = (unit, rows)
        else:
            held[1].add_(rows)

    def take(self, unit: Unit) -> torch.Tensor | None:
        """`unit`'s buffer `(N * S,)`, no longer held, or None."""
        held = self._buffers.pop(id(unit), None)
        return None if held is None else held[1]

    def take_all(self, order: list[Unit]) -> list[tuple[Unit, torch.Tensor]]:
        """Every buffer still held, in `order` (the same on every rank)."""
        out = [(u, t) for u in order if (t := self.take(u)) is not None]
        assert not self._buffers, "a buffer of a unit outside `order`"
        return out

    def clear(self) -> None:
        """Drop the buffers (`FSDP.zero_grad()`)."""
        self._buffers.clear()
        self.nosync_seen = False

    def finished(self) -> None:
        self.sync_seen = self.nosync_seen = False
