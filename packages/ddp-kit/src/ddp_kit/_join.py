"""Uneven inputs: what a ddp_kit wrapper does inside torch's `Join` context manager.

`torch.distributed.algorithms.Join([model])` lets ranks with fewer batches finish first. On a
rank that has left its loop, Join's exit runs one round per step that some other rank still
makes: an all-reduce counting the ranks still training (the other ranks match it through
`Join.notify_join_context`), then each joinable's `JoinHook.main_hook`, which must make the
same collectives as that step. When every rank has left, it calls each `post_hook`.

For a ddp_kit wrapper (`DataParallelBase` is the `Joinable`):
- a rank still training calls `notify_join_context` right before the first collective of each
  synchronized step (its first bucket launch). `no_sync()` backwards communicate nothing, so
  they need no round: one round is one optimizer step, however many micro-batches it has.
- `main_hook` runs a synchronized step with no local gradient: every bucket is all-reduced,
  in launch order, with zeros and usage flags 0. The rank's `.grad` then holds the same
  averaged gradient as the other ranks' (a joinable optimizer in the same Join, such as
  torch's ZeroRedundancyOptimizer, steps on it).
- The average divides by the initial world size (`divide_by_initial_world_size=True`, the
  default, as torch DDP), or by the number of ranks still training (False): one more
  one-element all-reduce per step counts them, since the ranks that joined need the count
  too and Join does not hand its own count to the hooks.
- `post_hook`: ranks that joined early skipped the optimizer steps after that, so the last
  rank to join (the highest, when several joined in the last round) broadcasts its
  parameters and buffers to every rank, as torch DDP does.

Every collective here goes through the wrapper's `Comm` (bounded by its `timeout`), except
Join's own per-round count, which torch issues under the process group's timeout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.distributed.algorithms.join import JoinHook

if TYPE_CHECKING:
    from ddp_kit._comm import Pending


class _Shadowing(Protocol):
    """What the hook needs of a wrapper (`DataParallelBase`; named structurally so that this
    module does not import the one that imports it)."""

    def _shadow_step(self) -> None: ...

    def _finish_join(self, is_last_joiner: bool) -> None: ...


DIVIDE_KWARG = "divide_by_initial_world_size"


@dataclass
class JoinState:
    """A wrapper's part in the current `Join` (one per wrapper, replaced by each Join)."""

    open: bool = False  # join_hook() was called and post_hook() has not run yet
    divide_by_initial_world_size: bool = True
    joined: bool = False  # this rank left its loop: main_hook shadows the others' steps
    notify_work: Any = None  # Join's per-step all-reduce, on a rank still training
    count: torch.Tensor | None = None  # (1,) float32: ranks still training in this step
    count_handle: Pending | None = None

    def clear_step(self) -> None:
        """Forget the finished step's collectives."""
        self.notify_work = None
        self.count = None
        self.count_handle = None


def divide_flag(owner: str, kwargs: dict[str, Any]) -> bool:
    """`divide_by_initial_world_size` from Join's keyword arguments (default True), or a
    TypeError naming it. Other keywords belong to other joinables and are ignored."""
    value = kwargs.get(DIVIDE_KWARG, True)
    if not isinstance(value, bool):
        raise TypeError(f"{owner}: {DIVIDE_KWARG}: expected a bool, got {value!r}")
    return value


class WrapperJoinHook(JoinHook):
    """Shadows a ddp_kit wrapper's step on a rank that has run out of data."""

    def __init__(self, wrapper: _Shadowing) -> None:
        super().__init__()
        self._wrapper = wrapper

    def main_hook(self) -> None:
        """Collective: the same calls as one synchronized step of the ranks still training."""
        self._wrapper._shadow_step()

    def post_hook(self, is_last_joiner: bool) -> None:
        """Collective: every rank takes the last joiner's parameters and buffers."""
        self._wrapper._finish_join(is_last_joiner)
