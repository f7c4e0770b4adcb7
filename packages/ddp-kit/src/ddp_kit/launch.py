"""Run a function in N local processes with a process group, for tests, tools and examples.

`spawn(fn, nprocs)` starts `nprocs` fresh interpreters (multiprocessing "spawn"), initializes
the default process group in each through a file store in a private temporary directory (no
port to pick, safe to run in parallel), calls `fn(rank, world_size, *args)`, and returns the
ranks' return values. A rank that raises makes `spawn` raise `WorkerError` with that rank's
traceback; a run that exceeds `timeout_s` is killed and raises `TimeoutError`. Nothing hangs.

Each worker ends with a barrier, `destroy_process_group()` and `os._exit`: exiting through the
interpreter's normal shutdown with gloo threads alive has aborted now and then
("terminate called without an active exception").

For training jobs prefer `torchrun`; this helper is for single-machine jobs one command drives.
Ours stays beside torch.multiprocessing.spawn, which returns no results, has no time limit and
no progress channel (the tests and perf_tools need all three).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["WorkerError", "report_progress", "spawn", "worker_device"]

_PROGRESS: Any = None  # the worker's progress queue (set in the worker only)
_RANK = -1


class WorkerError(RuntimeError):
    """A worker process raised or died; the message carries its traceback."""


def worker_device(backend: str, rank: int) -> torch.device:
    """The device a `spawn` worker of `rank` should use: cuda:rank for NCCL, else cpu."""
    if backend == "nccl":
        return torch.device("cuda", rank % max(torch.cuda.device_count(), 1))
    return torch.device("cpu")


def report_progress(payload: Any) -> None:
    """From inside a worker: send `payload` to the parent's `on_progress` (no-op elsewhere)."""
    if _PROGRESS is not None:
        _PROGRESS.put((_RANK, payload))


def spawn(
    fn: Callable[..., Any],
    nprocs: int,
    *,
    backend: str = "gloo",
    args: Sequence[Any] = (),
    timeout_s: float = 120.0,
    collective_timeout_s: float | None = None,
    on_progress: Callable[[int, Any], None] | None = None,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run `fn(rank, nprocs, *args)` in `nprocs` processes; return their results by rank.

    `fn` must be picklable (a module-level function). `backend` is "gloo" or "nccl" (NCCL
    workers call `torch.cuda.set_device(rank)` first). `collective_timeout_s` is the process
    group timeout (default: `timeout_s`). `on_progress(rank, payload)` receives what workers
    pass to `report_progress`. `env` entries are set in the workers before torch.distributed
    starts.
    """
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs: expected a positive int, got {nprocs!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend: expected 'gloo' or 'nccl', got {backend!r}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s: expected a positive number of seconds, got {timeout_s!r}")
    if backend == "nccl" and torch.cuda.device_count() < nprocs:
        raise RuntimeError(
            f"backend='nccl' with nprocs={nprocs} needs {nprocs} GPUs; "
            f"{torch.cuda.device_count()} visible"
        )
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue() if on_progress is not None else None
    pg_timeout = collective_timeout_s if collective_timeout_s is not None else timeout_s
    with tempfile.TemporaryDirectory(prefix="ddp_kit_spawn_") as tmp:
        out = Path(tmp)
        procs = [
            ctx.Process(
                target=_worker_main,
                args=(fn, rank, nprocs, backend, str(out), tuple(args), pg_timeout, queue, env),
                daemon=True,
            )
            for rank in range(nprocs)
        ]
        for p in procs:
            p.start()
        try:
            _wait(procs, out, timeout_s, queue, on_progress)
        finally:
            _kill(procs)
        return [_read_result(out, rank)[1] for rank in range(nprocs)]


def _wait(procs: list, out: Path, timeout_s: float, queue: Any, on_progress: Any) -> None:
    deadline = time.monotonic() + timeout_s
    failed_at: float | None = None
    grace_s = 5.0  # after one rank fails, how long the others get to report their own errors
    while True:
        _drain(queue, on_progress)
        codes = [p.exitcode for p in procs]
        if all(c is not None for c in codes):
            break
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = time.monotonic()
        now = time.monotonic()
        if (failed_at is not None and now - failed_at > grace_s) or now > deadline:
            break
        time.sleep(0.02)
    _drain(queue, on_progress)
    codes = [p.exitcode for p in procs]
    errors = []
    for rank, code in enumerate(codes):
        status, payload = _read_result(out, rank)
        if status == "error":
            errors.append(f"--- rank {rank} raised:\n{payload}")
        elif code not in (None, 0):
            errors.append(f"--- rank {rank} exited with code {code} before reporting a result")
    if errors:
        raise WorkerError("spawned worker(s) failed:\n" + "\n".join(errors))
    if any(c is None for c in codes):
        hung = [r for r, c in enumerate(codes) if c is None]
        raise TimeoutError(
            f"spawned workers {hung} did not finish within {timeout_s:.0f} s and were killed"
        )


def _drain(queue: Any, on_progress: Any) -> None:
    if queue is None:
        return
    while not queue.empty():
        rank, payload = queue.get()
        on_progress(rank, payload)


def _kill(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def _read_result(out: Path, rank: int) -> tuple[str, Any]:
    path = out / f"rank{rank}.pkl"
    if not path.exists():
        return ("missing", None)
    with path.open("rb") as f:
        return pickle.load(f)


def _write_result(out: Path, rank: int, status: str, payload: Any) -> None:
    tmp = out / f"rank{rank}.pkl.tmp"
    with tmp.open("wb") as f:
        pickle.dump((status, payload), f)
    tmp.replace(out / f"rank{rank}.pkl")


def _worker_main(
    fn: Callable[..., Any],
    rank: int,
    world: int,
    backend: str,
    out_dir: str,
    args: tuple,
    pg_timeout_s: float,
    queue: Any,
    env: dict[str, str] | None,
) -> None:
    global _PROGRESS, _RANK
    _PROGRESS, _RANK = queue, rank
    out = Path(out_dir)
    code = 1
    try:
        os.environ.update(env or {})
        if backend == "nccl":
            torch.cuda.set_device(worker_device(backend, rank))
        dist.init_process_group(
            backend,
            init_method=f"file://{out / 'store'}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        result = fn(rank, world, *args)
        _write_result(out, rank, "ok", result)
        dist.barrier()
        dist.destroy_process_group()
        code = 0
    except BaseException:
        with contextlib.suppress(BaseException):
            _write_result(out, rank, "error", traceback.format_exc())
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
