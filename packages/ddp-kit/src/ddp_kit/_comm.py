"""Collectives that fail instead of waiting forever, with errors that name them.

Every collective ddp_kit issues goes through a `Comm`. It calls the process group's own methods
(what `torch.distributed.all_reduce` and the like call underneath) because only those take
per-call options, and it applies the owner's `timeout`:

- `timeout=None`: each call gets the process group's timeout (`init_process_group(timeout=...)`;
  torch's default is 30 min on gloo, 10 min on NCCL, whose watchdog then ends the process).
- `timeout=T` on gloo: T goes into each call's options, so a call that a peer never joins fails
  after T on this rank; gloo then closes the connection, so the peers' pending calls fail at
  once too, every rank raises, and every process can exit (a timed-out `Work.wait(T)` alone
  would leave gloo's worker thread stuck, and the process unable to exit, until the process
  group's timeout).
- `timeout=T` elsewhere (NCCL ignores per-call timeouts): `wait` blocks the host for at most T.
  On NCCL that makes the host wait for the GPU at every wait, instead of only ordering streams.

A failed call raises `CollectiveError` naming the owner, the collective, this rank and the group
size; afterwards the process group is unusable (its calls are out of step), so every rank should
end its process.

Exit: a gloo worker thread drops its last reference to a finished call's tensors after `wait`
has returned, and must take the GIL to do so (torch keeps tensors' Python objects alive from
C++). When that happens while the interpreter is finalizing, the thread is killed inside a C++
destructor and the process aborts ("terminate called without an active exception"), with or
without a wrapper alive and whether or not `destroy_process_group()` ran. `install_exit_guard`
releases the GIL for a moment at exit, before finalization, so those threads finish first.
"""

from __future__ import annotations

import atexit
import datetime
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

_DistError: type[Exception] = getattr(dist, "DistError", RuntimeError)
_c10d: Any = getattr(dist, "distributed_c10d", None)

# How long the exit guard lets gloo's worker threads run; they only need the GIL briefly.
_EXIT_GRACE_S = 0.05
_exit_guard_installed = False


class CollectiveError(_DistError):  # type: ignore[misc, valid-type]
    """A collective that ddp_kit issued failed or timed out on this rank.

    Attributes: `collective` (what it was), `rank` and `world_size` (this rank, in the group),
    `timeout_s` (the per-call timeout, or None for the process group's).
    """

    def __init__(
        self, message: str, collective: str, rank: int, world_size: int, timeout_s: float | None
    ) -> None:
        super().__init__(message)
        self.collective = collective
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s


def check_timeout(timeout: object, owner: str) -> datetime.timedelta | None:
    """`timeout` (None, seconds, or a timedelta) as a timedelta, or a TypeError / ValueError
    naming the argument and what it accepts."""
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, int | float) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(
            f"{owner}: timeout: expected None (the process group's timeout), a number of "
            f"seconds or a datetime.timedelta, got {timeout!r}"
        )
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"{owner}: timeout: expected a positive, finite duration, got {timeout!r}")
    return datetime.timedelta(seconds=seconds)


def install_exit_guard() -> None:
    """Once per process: at exit, release the GIL briefly so that gloo's worker threads drop
    their finished calls before the interpreter finalizes (see the module docstring)."""
    global _exit_guard_installed
    if not _exit_guard_installed:
        atexit.register(time.sleep, _EXIT_GRACE_S)
        _exit_guard_installed = True


class Pending:
    """One launched collective. `wait()` completes it or raises `CollectiveError`."""

    __slots__ = ("_bounded", "_comm", "_what", "_work")

    def __init__(self, comm: Comm, work: Any, what: tuple[str, tuple], bounded: bool) -> None:
        self._comm = comm
        self._work = work
        self._what = what
        self._bounded = bounded  # the backend itself enforces the per-call timeout

    def wait(self) -> None:
        if self._work is None:
            return
        work, self._work = self._work, None
        self._comm.wait_work(work, self._what, self._bounded)


class Comm:
    """The collectives of one owner (a wrapper) over `group`, each bounded by `timeout`.

    `what` arguments are a format string and its arguments (formatted only for an error
    message), e.g. `("all_reduce of gradient bucket %d", (3,))`.
    """

    def __init__(
        self, group: dist.ProcessGroup, timeout: datetime.timedelta | None, owner: str
    ) -> None:
        self.group = group
        self.timeout = timeout
        self.owner = owner
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        backend = str(dist.get_backend(group)).lower()
        self._gloo = "gloo" in backend
        self._nccl = "nccl" in backend
        if self._gloo:
            install_exit_guard()

    # ----- launching ----------------------------------------------------------------------
    def all_reduce(
        self, tensor: torch.Tensor, op: dist.ReduceOp, what: tuple[str, tuple]
    ) -> Pending:
        """Asynchronous in-place all-reduce of `tensor`."""
        opts = self._options("AllreduceOptions")
        opts.reduceOp = op
        return self._launch(lambda: self.group.allreduce([tensor], opts), what, tensor)

    def broadcast(self, tensor: torch.Tensor, src: int, what: tuple[str, tuple]) -> Pending:
        """Asynchronous in-place broadcast of `tensor` from group rank `src`."""
        opts = self._options("BroadcastOptions")
        opts.rootRank = src
        opts.rootTensor = 0
        return self._launch(lambda: self.group.broadcast([tensor], opts), what, tensor)

    def all_gather(
        self, outputs: Sequence[torch.Tensor], tensor: torch.Tensor, what: tuple[str, tuple]
    ) -> Pending:
        """Asynchronous all-gather: `outputs[r]` <- rank r's `tensor`."""
        opts = self._options("AllgatherOptions")
        start = lambda: self.group.allgather([list(outputs)], [tensor], opts)
        return self._launch(start, what, tensor)

    # ----- waiting ------------------------------------------------------------------------
    def wait_work(self, work: Any, what: tuple[str, tuple], bounded: bool = False) -> None:
        """Wait for `work` or raise CollectiveError. `bounded`: the backend enforces the
        per-call timeout itself (gloo collectives), so wait without a limit of our own."""
        try:
            if self.timeout is not None and not bounded:
                done = work.wait(self.timeout)
            else:
                done = work.wait()
        except Exception as exc:
            raise self.error(what, exc) from exc
        if done is False:
            raise self.error(what, None)

    def error(self, what: tuple[str, tuple], cause: BaseException | None) -> CollectiveError:
        """The CollectiveError for `what`, quoting the backend's message `cause`."""
        fmt, args = what
        name = fmt % args
        limit = self.timeout.total_seconds() if self.timeout is not None else None
        bound = f"timeout {limit:g} s" if limit is not None else "the process group's timeout"
        said = f"; backend: {str(cause).strip().splitlines()[0]}" if cause is not None else ""
        return CollectiveError(
            f"{self.owner}: rank {self.rank} of {self.world_size}: {name} failed ({bound}"
            f"{said}). Every rank must make the same collective calls in the same order; "
            "another rank failed, skipped this call or made a different one, or has not reached "
            "it in time. The process group cannot be used after this: end the process on every "
            "rank.",
            name,
            self.rank,
            self.world_size,
            limit,
        )

    # ----- helpers ------------------------------------------------------------------------
    def _options(self, cls_name: str) -> Any:
        opts = getattr(_c10d, cls_name)()
        if self.timeout is not None:
            opts.timeout = self.timeout
        return opts

    def _launch(
        self, start: Callable[[], Any], what: tuple[str, tuple], tensor: torch.Tensor
    ) -> Pending:
        try:
            work = start()
        except Exception as exc:
            raise self.error(what, exc) from exc
        # gloo enforces a collective's per-call timeout itself; NCCL does not.
        bounded = self._gloo and not (self._nccl and tensor.device.type == "cuda")
        return Pending(self, work, what, bounded)
