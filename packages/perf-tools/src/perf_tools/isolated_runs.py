"""Rounds of `perf_tools.bench`: `--isolate N`, the same rows measured in N rounds of fresh
processes, one process per model per round, rounds interleaved (model A, model B, A, B, ...),
and `--rounds N`, the same in one process, each model built again per round, each round
starting at another model (`rotated`); the median over rounds (`median_over_runs`).

A host-bound step runs at the speed of its process: fresh processes on one H100 machine
issued a tiny eager op in ~7 or ~10.5 us (perf-tools DESIGN.md, "Why separate processes
disagree"), and a model's step followed.
One process per backend is then a draw; the median over rounds, with the spread beside it,
is the comparison to read.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from perf_tools.report import ratio_trail

Row = dict[str, Any]

# What a row measured or observed (not part of its configuration; ``cpp_launch`` is the C++
# path's state when the cell ran, and only flash-triton rows have it); the rest names the
# configuration.
_MEASURED = {
    "run", "status", "error", "mean_ms", "std_ms", "median_ms", "min_ms", "max_ms",
    "first_measured_ms", "fwd_ms", "bwd_ms", "sync_ms", "opt_ms", "tokens_per_s", "tflops",
    "mfu_pct", "peak_mem_gib", "warmup_s", "first_step_s", "build_s", "host_op_us",
    "host_op_start_us",
    "gather_wait_ms", "units_waited", "vs_hf", "dropin_calls", "cpp_replays", "cpp_launch",
}  # fmt: skip

# Configuration columns that only rows of our attention carry (how compiled graphs call our
# kernels): an SDPA row of the same configuration has none of them.
_OURS_ONLY = {"traced_compile", "cpp_launch_compiled"}

SUMMARY_COLUMNS = [
    "runs", "median_ms", "min_run_ms", "max_run_ms", "spread", "vs_sdpa", "vs_sdpa_rounds",
    "median_host_op_us",
]  # fmt: skip


def rotated(groups: Sequence[tuple[Any, list]], shift: int) -> list[tuple[Any, list]]:
    """Model groups ``(model key, cells)`` for round ``shift`` of ``--rounds``: within each
    compile phase (every eager model before any compiled one, as in one round) the order
    starts ``shift`` models later, so no model always runs first after a phase change.
    Within one process a single cell of a host-bound step moved by up to 1.7x between cells
    of the same setting (BENCHMARKS 3.3), in either order."""
    phases: dict[bool, list[tuple[Any, list]]] = {}
    for group in groups:
        phases.setdefault(group[1][0].compile is not False, []).append(group)
    out: list[tuple[Any, list]] = []
    for phase in phases.values():
        k = shift % len(phase)
        out += phase[k:] + phase[:k]
    return out


def config_of(row: Row) -> tuple:
    """A row's configuration: its columns other than what it measured, as a sortable key."""
    return tuple(sorted((k, str(v)) for k, v in row.items() if k not in _MEASURED))


def median_over_runs(rows: Sequence[Row], shown: Sequence[str]) -> list[Row]:
    """One row per configuration: the ``shown`` config columns of its first row, then the
    number of runs that measured it, the median over runs of each run's median step, the
    fastest and slowest run, their ratio and the median ``host_op_us``; rows of an attention
    other than SDPA get ``vs_sdpa``, their median over the median of the SDPA row of the same
    configuration otherwise, and ``vs_sdpa_rounds``, the same ratio run by run in run order
    (e.g. "0.743/0.906/1.008": how far single rounds stray from the medians' verdict).
    Failed runs are left out (their rows keep their status in the per-run table)."""
    groups: dict[tuple, list[Row]] = {}
    for row in rows:
        groups.setdefault(config_of(row), []).append(row)
    summaries: dict[tuple, Row] = {}
    medians: dict[tuple, float] = {}  # configuration -> median over its runs
    by_run: dict[tuple, dict[Any, float]] = {}  # configuration -> run -> its median step
    for key, members in groups.items():
        ok = [r for r in members if r.get("status") == "ok" and r.get("median_ms") is not None]
        if not ok:
            continue
        times = [float(r["median_ms"]) for r in ok]
        probes = [float(r["host_op_us"]) for r in ok if r.get("host_op_us") is not None]
        medians[key] = statistics.median(times)
        by_run[key] = {r.get("run"): float(r["median_ms"]) for r in ok}
        summary = {c: members[0].get(c) for c in shown if c not in _MEASURED}
        summary.update(
            runs=len(ok),
            median_ms=round(medians[key], 3),
            min_run_ms=round(min(times), 3),
            max_run_ms=round(max(times), 3),
            spread=round(max(times) / min(times), 3),
            median_host_op_us=round(statistics.median(probes), 2) if probes else None,
        )
        summaries[key] = summary
    for key, summary in summaries.items():  # every median known: SDPA's may come later
        sdpa = _sdpa_key(key)
        summary["vs_sdpa"] = None
        summary["vs_sdpa_rounds"] = None
        if sdpa in medians:
            summary["vs_sdpa"] = round(medians[key] / medians[sdpa], 3)
            runs = sorted(set(by_run[key]) & set(by_run[sdpa]), key=_run_order)
            ratios = [by_run[key][r] / by_run[sdpa][r] for r in runs]
            summary["vs_sdpa_rounds"] = ratio_trail(ratios) or None
    return list(summaries.values())


def _run_order(run: Any) -> tuple:
    """Runs in their order: numbered ones by number (2 before 10), anything else after."""
    return (0, int(run), "") if str(run).isdigit() else (1, 0, str(run))


def _sdpa_key(key: tuple) -> tuple | None:
    """The configuration ``key`` with SDPA attention (our options' columns, ``_OURS_ONLY``,
    left out); None for SDPA itself and rows without an attention."""
    config = dict(key)
    if config.get("attention") in (None, "None", "sdpa"):
        return None
    config = {k: v for k, v in config.items() if k not in _OURS_ONLY}
    return tuple(sorted({**config, "attention": "sdpa"}.items()))
