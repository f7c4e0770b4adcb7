"""The measurement harness every perf_tools command runs its cells through.

A command sweeps cells, one configuration each. For every cell:

    spec -> step      the command builds what the cell runs (a model step, an attention
                      call, a collective) from its spec
    step -> time      `time_steps`: untimed warm-up steps (their time reported apart), then
                      measured steps, each between two device synchronizations
    time -> row       the command turns the timings into the row's columns
    release           `Sweep.measure` frees what the cell left (`release`: garbage, the CUDA
                      cache, the peak-memory counter) before the next one starts
    failure           an exception becomes the row's status (`failure_status`): "OOM",
                      "unsupported: ...", "timeout: ..." or "error: ..." (its traceback on
                      stderr), and the sweep goes on; a command exits 1 if any row errs
    progress          one bar per sweep (`progress`, tqdm; `--quiet` turns it off)

`Sweep` strings these together for a loop of cells in one process; `perf_tools._dist` runs a
cell on N ranks (spawned, or under torchrun) and `_dist.time_collective` times collectives the
same way on every rank.
"""

from __future__ import annotations

import gc
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch

from perf_tools._progress import progress
from perf_tools.timing import StepTiming, is_oom, time_steps

__all__ = [
    "StepTiming",
    "Sweep",
    "cells_by",
    "failure_status",
    "has_errors",
    "progress",
    "release",
    "time_steps",
    "unsupported_status",
]

Row = dict[str, Any]
T = TypeVar("T")


def release(device: torch.device | str) -> None:
    """Free what the last cell left: unreachable objects (reference cycles included), the
    CUDA caching allocator's blocks, and the peak-memory window (on CUDA)."""
    device = torch.device(device)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def failure_status(
    exc: BaseException, classify: Callable[[BaseException], str | None] | None = None
) -> str:
    """The status column of a cell that raised `exc`.

    "OOM" for any out-of-memory error; else the command's own status when `classify(exc)`
    gives one (e.g. "unsupported: ..." for a configuration that cannot run here, "skipped:
    ..." for a missing optional competitor); "timeout: <message>" for a TimeoutError; else
    "error: <Type>: <message>". An exception whose message carries spawned ranks' tracebacks
    (ddp_kit.launch.WorkerError) is summarized by the last line of the last traceback.
    """
    if is_oom(exc):
        return "OOM"
    own = classify(exc) if classify is not None else None
    if own:
        return own
    if isinstance(exc, TimeoutError):
        return f"timeout: {_first_line(exc)}"[:200]
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    if len(lines) > 1 and "Traceback" in str(exc):
        last = next((ln for ln in reversed(lines) if not ln.startswith("---")), lines[-1])
        return f"error: {last}"[:200]
    return f"error: {type(exc).__name__}: {lines[0] if lines else ''}"[:200]


def unsupported_status(exc: BaseException) -> str:
    """ "unsupported: <first line of the message>", for a `classify` hook to return."""
    return f"unsupported: {_first_line(exc)[:120]}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def has_errors(rows: Sequence[Row]) -> bool:
    """Whether some row failed with an error (OOM, unsupported and skipped cells are results)."""
    return any(str(r.get("status", "")).startswith(("error", "timeout")) for r in rows)


class Sweep:
    """A loop of cells in this process: a progress bar, failure rows, memory released between
    cells. Use as a context manager (the bar closes on exit):

        with Sweep(len(cells), "flash benchmark", device=device, quiet=args.quiet) as sweep:
            for cell in cells:
                rows.append({**describe(cell), **sweep.measure(partial(measure, cell))})

    `classify(exc)` may name a failure's status itself (see `failure_status`); `fatal(exc)`
    marks failures that must stop the sweep (re-raised after the release): on data-parallel
    ranks, where one rank cannot skip a cell its peers run, any error but OOM. `advance(n)`,
    when given, replaces the local bar (a rank's progress sent to its parent).
    """

    def __init__(
        self,
        total: int,
        label: str,
        *,
        device: torch.device | str,
        quiet: bool = False,
        classify: Callable[[BaseException], str | None] | None = None,
        fatal: Callable[[BaseException], bool] | None = None,
        advance: Callable[[int], None] | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.classify = classify
        self.fatal = fatal
        self._bar = progress(total, label, quiet or advance is not None)
        self._advance = advance

    def attempt(self, fn: Callable[[], T]) -> tuple[T | None, str | None]:
        """(fn(), None), or (None, its failure status) if it raised; an error's traceback goes
        to stderr. No release, no progress: for a step shared by several cells (building the
        model they all use)."""
        try:
            return fn(), None
        except Exception as exc:
            status = failure_status(exc, self.classify)
            if self.fatal is not None and self.fatal(exc):
                raise
            if status.startswith("error"):
                traceback.print_exc(file=sys.stderr)
            return None, status

    def measure(self, fn: Callable[[], Row], *, cleanup: Callable[[], None] | None = None) -> Row:
        """One cell: `fn()`'s columns (status "ok" unless it set one), or {"status": failure}
        if it raised; then `cleanup()`, `release`, one step of progress (also when a fatal
        failure propagates)."""
        try:
            out, status = self.attempt(fn)
        finally:
            if cleanup is not None:
                cleanup()
            release(self.device)
            self.skip(1)
        return {"status": status} if status is not None else {"status": "ok", **(out or {})}

    def skip(self, n: int = 1) -> None:
        """Count `n` cells as done (also those that did not run: their rows say why)."""
        if self._advance is not None:
            self._advance(n)
        self._bar.update(n)

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> Sweep:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def cells_by(items: Sequence[Any], key: Callable[[Any], Any]) -> Iterator[tuple[Any, list[Any]]]:
    """`items` grouped by `key`, groups in order of first appearance (e.g. cells that share
    one built model)."""
    groups: dict[Any, list[Any]] = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    yield from groups.items()
