"""Running a perf_tools measurement on N ranks: self-spawned or under torchrun.

The multi-process side of the harness (`perf_tools.harness`). `run_ranks(fn, nprocs, backend,
...)` starts `nprocs` local workers through `ddp_kit.launch.spawn` (file-store rendezvous,
worker tracebacks, a hard time limit) and shows a progress bar fed by rank 0's `tick()` calls.
Under `torchrun` (RANK and WORLD_SIZE in the environment) `init_from_env` joins the group
torchrun describes and the same worker function runs in this process instead. On the ranks,
`time_collective` times a collective (barrier, synchronize, call, synchronize; the slowest
rank per call), and `gather` / `slowest_per_step` aggregate step timings. `fit_latency_bandwidth`
fits the all-reduce cost model o + b / w.
"""

from __future__ import annotations

import datetime
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from perf_tools import timing
from perf_tools._progress import progress

_LOCAL_BAR: Any = None  # rank 0's own progress bar under torchrun


def under_torchrun() -> bool:
    """True when torchrun (or another launcher) set RANK and WORLD_SIZE for this process."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def default_backend() -> str:
    """'nccl' when at least one GPU and NCCL are available, else 'gloo'."""
    if torch.cuda.is_available() and dist.is_available() and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def device_for(backend: str, local_rank: int) -> torch.device:
    """cuda:<local_rank> for NCCL, cpu for gloo."""
    if backend == "nccl":
        return torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
    return torch.device("cpu")


def init_from_env(backend: str, timeout_s: float = 600.0) -> tuple[int, int, torch.device]:
    """Join the process group torchrun describes; returns (rank, world_size, device)."""
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    device = device_for(backend, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size(), device


def start_local_bar(total: int, label: str, enabled: bool) -> None:
    """Under torchrun: rank 0's own progress bar for `tick()`."""
    global _LOCAL_BAR
    if enabled and dist.get_rank() == 0:
        _LOCAL_BAR = progress(total, label, leave=False)


def close_local_bar() -> None:
    global _LOCAL_BAR
    if _LOCAL_BAR is not None:
        _LOCAL_BAR.close()
        _LOCAL_BAR = None


def tick(n: int = 1) -> None:
    """From rank 0 of a worker: advance the progress bar by `n` configurations."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    if _LOCAL_BAR is not None:
        _LOCAL_BAR.update(n)
        return
    from ddp_kit.launch import report_progress

    report_progress(n)


def run_ranks(
    fn: Callable[..., Any],
    nprocs: int,
    *,
    backend: str,
    args: Sequence[Any] = (),
    timeout_s: float,
    progress_total: int | None = None,
    label: str = "",
    quiet: bool = False,
    on_message: Callable[[int, Any], None] | None = None,
) -> list[Any]:
    """`fn(rank, world, *args)` on `nprocs` spawned ranks; returns the ranks' results.

    Workers' `tick(n)` (an int) advances the progress bar; any other payload a worker sends
    with `ddp_kit.launch.report_progress` goes to `on_message(rank, payload)`.
    """
    from ddp_kit.launch import spawn

    bar = progress(progress_total, label, leave=False) if progress_total and not quiet else None
    env = {"NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE", "0")}

    def handle(rank: int, payload: Any) -> None:
        if isinstance(payload, int) and not isinstance(payload, bool):
            if bar is not None:
                bar.update(payload)
        elif on_message is not None:
            on_message(rank, payload)

    try:
        return spawn(
            fn,
            nprocs,
            backend=backend,
            args=args,
            timeout_s=timeout_s,
            on_progress=handle if bar is not None or on_message is not None else None,
            env=env,
        )
    finally:
        if bar is not None:
            bar.close()


def gather(obj: Any) -> list[Any]:
    """All ranks' `obj`, by rank (a collective: every rank must call it)."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def agree_max(value: float, device: torch.device) -> float:
    """The largest `value` over the ranks (a collective), so all ranks take the same decision."""
    t = torch.tensor([value], dtype=torch.float64, device=device)  # (1,)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def time_collective(op: Callable[[], Any], iters: int, device: torch.device) -> list[float]:
    """Seconds of `iters` calls of the collective `op`, each after a barrier and between two
    device synchronizations; per call the slowest rank's time (a collective ends when every
    rank has its result). A collective itself: every rank must call it."""
    samples = []
    for _ in range(iters):
        dist.barrier()
        timing.synchronize(device)
        t0 = time.perf_counter()
        op()
        timing.synchronize(device)
        samples.append(time.perf_counter() - t0)
    return slowest_per_step(gather(samples))


def slowest_per_step(samples_by_rank: Sequence[Sequence[float]]) -> list[float]:
    """Per measured step, the slowest rank's time: a collective step ends when all ranks do."""
    n = min(len(s) for s in samples_by_rank)
    return [max(s[i] for s in samples_by_rank) for i in range(n)]


def fit_latency_bandwidth(nbytes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """Fit t = o + b / w to (bytes, time) points; returns (o in s, w in bytes/s).

    Weighted least squares on relative error (weights 1/t^2): the points span orders of
    magnitude, and a plain fit would let the largest size decide the intercept alone. o is
    clamped at 0 (a slightly negative intercept is noise); w is inf when time does not grow
    with size.
    """
    if len(nbytes) != len(seconds) or len(nbytes) < 2:
        raise ValueError("fit_latency_bandwidth: need at least two (bytes, seconds) points")
    if any(t <= 0 for t in seconds):
        raise ValueError("fit_latency_bandwidth: times must be positive")
    wts = [1.0 / (t * t) for t in seconds]
    sw = sum(wts)
    mx = sum(w * x for w, x in zip(wts, nbytes)) / sw
    my = sum(w * y for w, y in zip(wts, seconds)) / sw
    sxx = sum(w * (x - mx) ** 2 for w, x in zip(wts, nbytes))
    sxy = sum(w * (x - mx) * (y - my) for w, x, y in zip(wts, nbytes, seconds))
    slope = sxy / sxx if sxx > 0 else 0.0
    intercept = my - slope * mx
    bandwidth = 1.0 / slope if slope > 0 else math.inf
    return max(intercept, 0.0), bandwidth
