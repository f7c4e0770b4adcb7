"""Run functions on N spawned ranks joined in a process group; fail with a rank's traceback.

A `WorkerPool` starts the ranks once (each pays torch's import and its first-optimizer-step
imports, several seconds on a small CPU box) and then runs one task after another:
`fn(rank, world_size, device, *args)` on every rank, results back by rank. A task that raises
on any rank, a rank that dies, or a timeout fails the test with the rank's traceback and
kills the pool (a half-finished collective leaves the group unusable); the next task starts a
fresh one. Workers end with barrier, destroy_process_group and os._exit: ending gloo workers
any other way has aborted at interpreter exit now and then.
"""

from __future__ import annotations

import os
import queue as queue_mod
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# gloo runs everywhere; the nccl copies of the same tests run under `nox -s nccl_tests`.
BACKENDS = [
    pytest.param("gloo", id="gloo"),
    pytest.param("nccl", id="nccl", marks=pytest.mark.nccl),
]


def _serve(rank: int, world_size: int, backend: str, init_method: str, tasks: Any, results: Any):
    ok = False
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        else:
            device = torch.device("cpu")
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=300),
        )
        while (task := tasks.get()) is not None:
            fn, args = task
            value = fn(rank, world_size, device, *args)
            dist.barrier()
            results.put(("ok", rank, value))
        dist.barrier()
        ok = True
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))
    results.close()
    results.join_thread()
    if ok:
        dist.destroy_process_group()
    os._exit(0 if ok else 1)


class WorkerPool:
    """`world_size` ranks on `backend` (gloo: CPU; nccl: GPU `rank`), reused across tasks."""

    def __init__(self, world_size: int, backend: str) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.backend = backend
        self._tmp = tempfile.mkdtemp(prefix="zs-pg-")
        init_method = f"file://{os.path.join(self._tmp, 'store')}"
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._procs = [
            ctx.Process(
                target=_serve,
                args=(rank, world_size, backend, init_method, self._tasks[rank], self._results),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self.alive = True

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 600.0) -> list[Any]:
        """`fn(rank, world_size, device, *args)` on every rank; the return values by rank."""
        assert self.alive, "this pool was closed after a failure"
        for q in self._tasks:
            q.put((fn, args))
        values: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(values) < self.world_size:
                dead = [i for i, p in enumerate(self._procs) if p.exitcode is not None]
                try:
                    # A dead worker gets a grace period for its last message to arrive.
                    kind, rank, payload = self._results.get(timeout=3.0 if dead else 1.0)
                except queue_mod.Empty:
                    if dead:
                        codes = [self._procs[i].exitcode for i in dead]
                        msg = f"rank(s) {dead} died without reporting (exit codes {codes})"
                        raise RuntimeError(msg) from None
                    if time.monotonic() > deadline:
                        missing = sorted(set(range(self.world_size)) - values.keys())
                        raise TimeoutError(f"rank(s) {missing} busy after {timeout:.0f}s") from None
                    continue
                if kind == "error":
                    raise RuntimeError(f"rank {rank} of {self.world_size} raised:\n{payload}")
                values[rank] = payload
        except (RuntimeError, TimeoutError) as exc:
            failure = f"[{self.backend}, {self.world_size} ranks] {exc}"
        else:
            return [values[r] for r in range(self.world_size)]
        self.close(graceful=False)
        pytest.fail(failure, pytrace=False)

    def close(self, graceful: bool = True) -> None:
        if not self.alive:
            return
        self.alive = False
        if graceful:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                p.join(timeout=30)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        shutil.rmtree(self._tmp, ignore_errors=True)
        if graceful:
            bad = {i: p.exitcode for i, p in enumerate(self._procs) if p.exitcode != 0}
            assert not bad, f"workers exited abnormally: {bad}"


class Pools:
    """One live pool per (backend, world size), restarted after a failure."""

    def __init__(self) -> None:
        self._pools: dict[tuple[str, int], WorkerPool] = {}

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        backend: str = "gloo",
        world_size: int = 2,
        timeout: float = 600.0,
    ) -> list[Any]:
        key = (backend, world_size)
        pool = self._pools.get(key)
        if pool is None or not pool.alive:
            pool = self._pools[key] = WorkerPool(world_size, backend)
        return pool.run(fn, *args, timeout=timeout)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
