"""Timers, memory probes and OOM detection shared by every perf_tools command.

Every timer synchronizes the device before reading the clock, keeps warm-up (and compile) time
apart from the measured steps, and reports the median beside the mean.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from perf_tools._progress import progress as progress_bar


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for queued work on `device` (no-op on CPU)."""
    device = torch.device(device) if device is not None else None
    if torch.cuda.is_available() and (device is None or device.type == "cuda"):
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Stats:
    """Summary of repeated measurements, in the unit of the samples (seconds or ms)."""

    mean: float
    std: float
    median: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, samples: list[float]) -> Stats:
        if not samples:
            raise ValueError("samples: need at least one measurement")
        std = statistics.stdev(samples) if len(samples) > 1 else 0.0
        return cls(
            mean=statistics.fmean(samples),
            std=std,
            median=statistics.median(samples),
            min=min(samples),
            max=max(samples),
            n=len(samples),
        )

    def scaled(self, factor: float) -> Stats:
        """The same statistics with every value multiplied by `factor` (e.g. 1e3 for ms)."""
        d = asdict(self)
        return Stats(**{k: (v * factor if k != "n" else v) for k, v in d.items()})


@dataclass(frozen=True)
class StepTiming:
    """Per-step wall times of a measured loop, plus the separately reported warm-up."""

    stats: Stats  # seconds per measured step
    samples: list[float]
    warmup_s: float  # total time of the warm-up steps (includes any compilation)
    first_step_s: float  # the first warm-up step alone (compile, autotune, allocator growth)


def time_steps(
    step: Callable[[], Any],
    *,
    warmup: int,
    iters: int,
    device: torch.device | str,
    progress: str | None = None,
    on_measure: Callable[[], Any] | None = None,
    after_step: Callable[[], Any] | None = None,
) -> StepTiming:
    """Run `step` `warmup` times untimed, then `iters` times, synchronizing around each step.

    `progress`, when given, labels a progress bar over the steps. `on_measure`, when given,
    is called once between the warm-up and the measured steps, outside every timed interval
    (e.g. to reset the peak-memory counter or start a memory / Nsight capture). `after_step`,
    when given, is called after every step (warm-up included) once the device is synchronized,
    outside the timed interval (e.g. to read CUDA events recorded during the step).
    """
    if warmup < 0:
        raise ValueError(f"warmup: expected >= 0, got {warmup}")
    if iters < 1:
        raise ValueError(f"iters: expected >= 1, got {iters}")
    bar = progress_bar(warmup + iters, progress or "", progress is None, leave=False)
    synchronize(device)
    t_warm = time.perf_counter()
    first = math.nan
    for i in range(warmup):
        t0 = time.perf_counter()
        step()
        synchronize(device)
        if i == 0:
            first = time.perf_counter() - t0
        if after_step is not None:
            after_step()
        bar.update(1)
    warmup_s = time.perf_counter() - t_warm
    if on_measure is not None:
        on_measure()
        synchronize(device)
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        step()
        synchronize(device)
        samples.append(time.perf_counter() - t0)
        if after_step is not None:
            after_step()
        bar.update(1)
    bar.close()
    return StepTiming(Stats.of(samples), samples, warmup_s, first)


def bench_ms(
    fn: Callable[[], Any],
    *,
    device: torch.device | str,
    warmup_ms: float = 25.0,
    rep_ms: float = 100.0,
) -> float:
    """Median ms of `fn`: triton's event-based `do_bench` on CUDA, a synced loop on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    fn()  # warm-up
    samples = []
    deadline = time.perf_counter() + rep_ms / 1e3
    while not samples or (time.perf_counter() < deadline and len(samples) < 1000):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def host_us_per_call(
    fn: Callable[[], Any], device: torch.device | str, calls: int, rounds: int
) -> float:
    """Host time to issue one call of ``fn``, us: ``calls`` back-to-back calls with the clock
    stopped before synchronizing, median over ``rounds`` (on the CPU, the call's wall time)."""
    synchronize(device)
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
        synchronize(device)
    return statistics.median(samples)


def host_op_us(device: torch.device | str, calls: int = 2000, rounds: int = 5) -> float:
    """Host time of one tiny in-place op on ``device`` (median over ``rounds`` of ``calls``
    back-to-back calls, us): how fast this process issues work. Processes on one machine
    differed by up to ~1.5x in it, which moves every host-bound step with it."""
    x = torch.zeros(16, device=device)
    return host_us_per_call(lambda: x.add_(1.0), device, calls, rounds)


def reset_peak_memory(device: torch.device | str) -> None:
    """Start a fresh peak-memory window on CUDA (no-op on CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device | str) -> int | None:
    """Peak bytes allocated by the caching allocator since the last reset; None on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return None


def memory_allocated_bytes(device: torch.device | str) -> int | None:
    """Bytes currently allocated by tensors on `device`; None on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    return None


def is_oom(exc: BaseException) -> bool:
    """True for a device (or host) out-of-memory error, whatever layer raised it."""
    if isinstance(exc, torch.cuda.OutOfMemoryError | MemoryError):
        return True
    text = str(exc).lower()
    return "out of memory" in text or "outofmemory" in text
