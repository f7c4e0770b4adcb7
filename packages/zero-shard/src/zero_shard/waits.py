"""Timing of the compute's waits for all-gathers (`FSDP.record_gather_waits()`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import torch


class GatherWait(NamedTuple):
    """How long the compute waited for one unit's all-gather (`FSDP.gather_waits()`).

    unit: the unit's name; phase: "forward" or "backward" (activation-checkpoint recomputes
    count as backward); prefetched: the all-gather was launched ahead of time (a prefetch)
    rather than by this wait; ms: the time from reaching the wait to the weights having
    arrived (on CUDA: of the compute stream, so ~0 when the all-gather was already done).
    """

    unit: str
    phase: str
    prefetched: bool
    ms: float


class WaitRecorder:
    """The records of `FSDP.record_gather_waits()`: (unit, phase, prefetched, start, end)
    with CUDA events on the compute stream, or host-clock floats on CPU."""

    def __init__(self) -> None:
        self.records: list[tuple] | None = None  # None: not recording

    @property
    def enabled(self) -> bool:
        return self.records is not None

    def enable(self, enabled: bool) -> None:
        self.records = [] if enabled else None

    def timed(
        self,
        unit: str,
        phase: str,
        prefetched: bool,
        device: torch.device,
        wait: Callable[[], None],
    ) -> None:
        """Run `wait` (an all-gather's) between two timestamps."""
        assert self.records is not None
        if device.type == "cuda":
            stream = torch.cuda.current_stream(device)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            wait()
            end.record(stream)
            self.records.append((unit, phase, prefetched, start, end))
        else:
            t0 = time.perf_counter()
            wait()
            self.records.append((unit, phase, prefetched, t0, time.perf_counter()))

    def read(self) -> list[GatherWait]:
        """The records so far as `GatherWait`s (oldest first), forgotten afterwards; on CUDA
        this waits for the recorded events."""
        if self.records is None:
            return []
        out = []
        for name, phase, prefetched, start, end in self.records:
            if isinstance(start, float):
                ms = (end - start) * 1e3
            else:
                end.synchronize()
                ms = start.elapsed_time(end)
            out.append(GatherWait(name, phase, prefetched, ms))
        self.records = []
        return out
