"""All-reduce time and bandwidth (handout 2.1): `python -m perf_tools.allreduce`.

Sweeps backend (gloo on CPU, NCCL on GPUs) x process count x float32 tensor size. One command
does the whole sweep: for each (backend, process count) it spawns that many local workers
(`perf_tools._dist.run_ranks`: file-store rendezvous, tracebacks, a time limit) which time
every size in turn.

Per size, each rank: warm-up all-reduces (default 5), then timed all-reduces (default 10), each
preceded by a barrier and bracketed by device synchronizations. Timings of all ranks are
gathered (all_gather_object); an iteration's time is the slowest rank's (a collective ends when
every rank has its result), and the table reports the median over iterations.
  algbw = bytes per rank / time;  busbw = algbw * 2 (n - 1) / n
(busbw is the per-link traffic of a ring all-reduce: comparable across process counts and
against the link's peak). Each size has a time budget (--budget-s): the iteration count shrinks
if the first call shows it would not fit. Sizes are MiB (2**20 bytes); GB/s are 1e9 bytes/s.

Process counts the machine cannot run are skipped with a reason (NCCL: one GPU per process);
gloo with more processes than CPU cores runs oversubscribed and the table says so.

Examples:
  python -m perf_tools.allreduce                              # GPU: nccl, 2 4 6, 1..1000 MiB
  python -m perf_tools.allreduce --backend gloo --nprocs 2 4 6 --sizes-mb 1 10 100
  python -m perf_tools.allreduce --backend nccl --nprocs 2 --csv ar.csv --plot ar.png
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from perf_tools import _cli, _dist, harness, report, timing

MIB = 1024 * 1024
BACKENDS = ("gloo", "nccl")
GPU_DEFAULT_SIZES_MB = (1, 10, 100, 1000)
CPU_DEFAULT_SIZES_MB = (1, 10, 100)
COLUMNS = [
    "backend",
    "device",
    "nprocs",
    "size_MiB",
    "status",
    "iters",
    "median_ms",
    "min_ms",
    "mean_ms",
    "algbw_GBps",
    "busbw_GBps",
    "note",
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m perf_tools.allreduce",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__[__doc__.index("Examples:") :],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--backend",
        nargs="+",
        type=_cli.listed(_cli.choice(BACKENDS)),
        help="gloo (CPU tensors) and/or nccl (one GPU per process). Default: nccl when GPUs "
        "are visible, else gloo",
    )
    p.add_argument(
        "--nprocs",
        nargs="+",
        type=_cli.listed(_cli.positive_int),
        help="process counts (default 2 4 6; NCCL counts above the GPU count are skipped)",
    )
    p.add_argument(
        "--sizes-mb",
        nargs="+",
        type=_cli.listed(_cli.positive_float),
        help="float32 tensor sizes in MiB (default 1 10 100 1000 for nccl, 1 10 100 for gloo)",
    )
    p.add_argument("--warmup", type=_cli.nonneg_int, default=5, help="warm-up calls (default 5)")
    p.add_argument("--iters", type=_cli.positive_int, default=10, help="timed calls (default 10)")
    p.add_argument(
        "--budget-s",
        type=_cli.positive_float,
        default=30.0,
        help="time budget per (backend, nprocs, size): fewer iterations when exceeded (default 30)",
    )
    _cli.add_output_args(p)
    return p


@dataclass(frozen=True)
class AllReduceConfig:
    """What one sweep runs (the CLI's flags, typed)."""

    backends: tuple[str, ...]  # these three: lists are accepted, held as tuples
    nprocs: tuple[int, ...] = (2, 4, 6)
    sizes_mb: tuple[float, ...] | None = None  # None: each backend's defaults (sizes_for)
    warmup: int = 5
    iters: int = 10
    budget_s: float = 30.0  # per (backend, nprocs, size): fewer iterations when exceeded
    quiet: bool = False

    def __post_init__(self) -> None:
        # lists are accepted and held as tuples, so the frozen config hashes
        object.__setattr__(self, "backends", _cli.config_tuple("backends", self.backends, BACKENDS))
        nprocs = _cli.config_tuple("nprocs", self.nprocs)
        object.__setattr__(self, "nprocs", tuple(_cli.config_int("nprocs", n, 1) for n in nprocs))
        if self.sizes_mb is not None:
            sizes = _cli.config_tuple("sizes_mb", self.sizes_mb)
            sizes = tuple(_cli.config_number("sizes_mb", mb, 0) for mb in sizes)
            object.__setattr__(self, "sizes_mb", sizes)
        _cli.config_int("warmup", self.warmup, 0)
        _cli.config_int("iters", self.iters, 1)
        _cli.config_number("budget_s", self.budget_s, 0, finite=False)  # inf: no budget


def config_from_args(a: argparse.Namespace) -> AllReduceConfig:
    """The parsed flags as a config; unset lists take their defaults."""
    sizes = _cli.flatten(a.sizes_mb)
    return AllReduceConfig(
        backends=tuple(_cli.flatten(a.backend) or [_dist.default_backend()]),
        nprocs=tuple(_cli.flatten(a.nprocs) or [2, 4, 6]),
        sizes_mb=tuple(sizes) if sizes else None,
        warmup=a.warmup,
        iters=a.iters,
        budget_s=a.budget_s,
        quiet=a.quiet,
    )


def sizes_for(backend: str, sizes_mb: Sequence[float] | None) -> list[float]:
    """The sizes (MiB) to time for `backend`: the given ones, else its defaults."""
    if sizes_mb:
        return list(sizes_mb)
    return list(GPU_DEFAULT_SIZES_MB if backend == "nccl" else CPU_DEFAULT_SIZES_MB)


def skip_reason(backend: str, nprocs: int) -> str | None:
    """Why (backend, nprocs) cannot run here, or None."""
    if backend == "nccl" and nprocs > torch.cuda.device_count():
        return f"skipped: needs {nprocs} GPUs, {torch.cuda.device_count()} visible"
    return None


def oversubscription_note(backend: str, nprocs: int) -> str:
    cores = os.cpu_count() or 1
    if backend == "gloo" and nprocs > cores:
        return f"oversubscribed: {nprocs} procs on {cores} CPU cores"
    return ""


# ----------------------------------------------------------------------------- worker


def _worker(
    rank: int,
    world: int,
    backend: str,
    sizes_mb: list[float],
    warmup: int,
    iters: int,
    budget_s: float,
) -> list[dict[str, Any]]:
    """Time every size on this rank; rank 0 returns the aggregated rows."""
    if backend == "gloo":
        torch.set_num_threads(1)  # gloo's own threads do the work; keep ranks off each other
    device = _dist.device_for(backend, rank)
    rows = []
    for size_mb in sizes_mb:
        rows.append(_time_size(backend, device, world, size_mb, warmup, iters, budget_s))
        _dist.tick()
    return rows if rank == 0 else []


def _time_size(
    backend: str,
    device: torch.device,
    world: int,
    size_mb: float,
    warmup: int,
    iters: int,
    budget_s: float,
) -> dict[str, Any]:
    numel = max(1, int(size_mb * MIB) // 4)
    row: dict[str, Any] = {
        "backend": backend,
        "device": device.type,
        "nprocs": world,
        "size_MiB": size_mb,
    }
    try:
        x = torch.ones(numel, dtype=torch.float32, device=device)  # (numel,)
    except Exception as exc:  # OOM on some rank: every rank must learn it and skip together
        if not timing.is_oom(exc):
            raise
        x = None
    if _dist.agree_max(1.0 if x is None else 0.0, device) > 0:
        x = None  # this rank's buffer, if it got one, goes before the release
        harness.release(device)
        return {**row, "status": "OOM"}
    timing.synchronize(device)
    t0 = time.perf_counter()
    dist.all_reduce(x)
    timing.synchronize(device)
    first = _dist.agree_max(time.perf_counter() - t0, device)
    n_warm = min(max(warmup - 1, 0), int(budget_s / 4 / max(first, 1e-9)))
    n_iter = max(1, min(iters, int(budget_s / 2 / max(first, 1e-9))))
    for _ in range(n_warm):
        dist.all_reduce(x)
    timing.synchronize(device)
    per_iter = _dist.time_collective(lambda: dist.all_reduce(x), n_iter, device)
    med = statistics.median(per_iter)
    nbytes = numel * 4
    algbw = nbytes / med / 1e9
    return {
        **row,
        "status": "ok",
        "iters": n_iter,
        "median_ms": med * 1e3,
        "min_ms": min(per_iter) * 1e3,
        "mean_ms": statistics.fmean(per_iter) * 1e3,
        "algbw_GBps": algbw,
        "busbw_GBps": algbw * 2 * (world - 1) / world,
    }


# ----------------------------------------------------------------------------- driver


def run(cfg: AllReduceConfig) -> list[dict[str, Any]]:
    """One row per (backend, process count, size); a configuration that cannot run or fails
    gives rows that say so."""
    rows: list[dict[str, Any]] = []
    for backend in cfg.backends:
        sizes = sizes_for(backend, cfg.sizes_mb)
        for nprocs in cfg.nprocs:
            base = {"backend": backend, "nprocs": nprocs}
            reason = skip_reason(backend, nprocs)
            if reason is not None:
                rows += [{**base, "size_MiB": s, "status": reason} for s in sizes]
                continue
            note = oversubscription_note(backend, nprocs)
            # Generous wall limit: start-up, plus each size's budget (warm-up and timed calls
            # are capped at ~3/4 of it) and a first call that may itself be slow.
            limit = 120.0 + len(sizes) * 2.5 * cfg.budget_s
            try:
                results = _dist.run_ranks(
                    _worker,
                    nprocs,
                    backend=backend,
                    args=(backend, sizes, cfg.warmup, cfg.iters, cfg.budget_s),
                    timeout_s=limit,
                    progress_total=len(sizes),
                    label=f"all-reduce {backend} x{nprocs}",
                    quiet=cfg.quiet,
                )
                new = results[0]
            except Exception as exc:  # a failed configuration is a row, not a crash
                status = harness.failure_status(exc)
                new = [{**base, "size_MiB": s, "status": status} for s in sizes]
            for r in new:
                r.setdefault("note", note)
                if note and not r.get("note"):
                    r["note"] = note
            rows += new
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    if "nccl" in cfg.backends and not (torch.cuda.is_available() and dist.is_nccl_available()):
        parser.error("argument --backend: nccl needs CUDA GPUs and a torch built with NCCL")
    rows = run(cfg)
    report.print_table(rows, COLUMNS, title="all-reduce (float32), slowest rank per call")
    meta = {
        **report.run_metadata(),
        "cpu_count": os.cpu_count(),
        "gpu_count": torch.cuda.device_count(),
    }
    report.save_rows(rows, csv_path=args.csv, json_path=args.json, meta=meta)
    if args.plot is not None:
        ok = [r for r in rows if r.get("status") == "ok"]
        report.plot_lines(
            ok,
            x="size_MiB",
            y="busbw_GBps",
            group_by=["backend", "nprocs"],
            path=args.plot,
            title="all-reduce bus bandwidth",
            logx=True,
            ylabel="bus bandwidth (GB/s)",
        )
    return (
        0
        if all(r.get("status") == "ok" or str(r.get("status")).startswith("skipped") for r in rows)
        else 1
    )


if __name__ == "__main__":
    raise SystemExit(main())
