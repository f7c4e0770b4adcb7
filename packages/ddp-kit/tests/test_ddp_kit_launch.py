"""The spawn helper reports worker failures with their traceback and kills hung runs."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from ddp_kit.launch import WorkerError, spawn


def _ok(rank: int, world: int, base: int) -> tuple[int, int]:
    return (base + rank, dist.get_world_size())


def _fail_on_rank1(rank: int, world: int) -> None:
    if rank == 1:
        raise KeyError("boom-from-rank-1")
    dist.barrier()  # rank 0 waits for a rank that died: must not hang the parent


def _sleep_forever(rank: int, world: int) -> None:
    time.sleep(600)


def test_results_come_back_by_rank() -> None:
    assert spawn(_ok, 2, args=(10,), timeout_s=60) == [(10, 2), (11, 2)]


def test_worker_exception_carries_traceback() -> None:
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match="boom-from-rank-1"):
        spawn(_fail_on_rank1, 2, timeout_s=60, collective_timeout_s=30)
    assert time.monotonic() - t0 < 40


def test_hung_workers_are_killed() -> None:
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish"):
        spawn(_sleep_forever, 2, timeout_s=4)
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize(
    ("kwargs", "exc"),
    [({"nprocs": 0}, ValueError), ({"backend": "mpi"}, ValueError), ({"timeout_s": 0}, ValueError)],
)
def test_bad_arguments(kwargs: dict, exc: type) -> None:
    args = {"nprocs": 2, **kwargs}
    nprocs = args.pop("nprocs")
    with pytest.raises(exc):
        spawn(_ok, nprocs, **args)
