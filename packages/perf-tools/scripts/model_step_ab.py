"""A model train step under several settings in one process, interleaved rounds.

Settings are the product of
  - the variant: ``sdpa``, ``flash-triton`` (flashattn_triton's default options),
    ``flash-triton-opaque`` (compiled graphs call our opaque ops, which run the Python
    launchers: ``traced_compile=False, cpp_launch_compiled=False``),
    ``flash-triton-traced`` (compiled graphs launch our kernels themselves at every size:
    ``traced_compile=True``), ``flash-triton-auto`` (``traced_compile="auto"`` with
    ``cpp_launch_compiled=False``: small calls traced) and ``flash-triton-cpp`` (the opaque
    ops replayed from C++: ``cpp_launch_compiled=True``, the default, with which ``auto``
    traces nothing);
  - the backward's thread: ``device`` (autograd's device thread, torch's default) or
    ``calling`` (``torch.autograd.set_multithreading_enabled(False)``);
  - the CPUs: ``free`` (as started), ``one-core`` (every thread of the process pinned to one
    CPU after warm-up, so the calling and device threads share its caches) or ``awake``
    (``/dev/cpu_dma_latency`` held at 0, which keeps idle cores out of deep sleep states;
    needs root, else the cells are skipped). Each cell records the machine's steal time
    (CPU time a hypervisor gave elsewhere) per step, and flashattn_triton's C++ replays per
    step (``cpp_forward``, ``cpp_backward``, ``cpp_backward_fallback``: which calls replayed
    from C++, which backward went to Python).
With ``--profile N``, after the rounds each variant's steps run N more times under
``torch.profiler`` (CPU and CUDA): ``profile_ops.csv`` holds every operator's calls, self CPU
time and GPU time per step per variant, and the operators whose host time differs most
between the first variant and each other one are printed (where a setting's host time goes).
Each variant is compiled once (``Options`` objects are reused, so a compiled graph's guards
hold), then each round times every setting in turn: warm-up steps, then ``--steps``
synchronized steps, median. Per-process noise (the host's speed drifts within a lease) hits
every setting alike, which separate processes per setting do not give.

  python packages/perf-tools/scripts/model_step_ab.py --compile --rounds 5 --out DIR
  python packages/perf-tools/scripts/model_step_ab.py --size xl --context 512 --blocks \
      --variants sdpa flash-triton-opaque flash-triton-auto --threads device --cpus free
  python packages/perf-tools/scripts/model_step_ab.py --size xl --context 512 --blocks \
      --variants flash-triton-auto flash-triton-cpp --threads device --cpus free --profile 3
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import json
import os
import statistics
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from model_host_profile import _step_fn, _sync
from model_host_profile import _time as _time_steps

from perf_tools import _cli
from perf_tools._compile import cpp_launch_counters, ready_cpp_launch

VARIANTS = (
    "sdpa", "flash-triton", "flash-triton-opaque", "flash-triton-traced", "flash-triton-auto",
    "flash-triton-cpp",
)  # fmt: skip
CHANGES: dict[str, dict[str, object]] = {  # flashattn_triton option changes per variant
    "flash-triton-opaque": {"traced_compile": False, "cpp_launch_compiled": False},
    "flash-triton-traced": {"traced_compile": True},
    "flash-triton-auto": {"traced_compile": "auto", "cpp_launch_compiled": False},
    "flash-triton-cpp": {"traced_compile": "auto", "cpp_launch_compiled": True},
}
THREADS = ("device", "calling")
CPUS = ("free", "one-core", "awake")


def _pin_all_threads(cpus: set[int]) -> None:
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(tid), cpus)


@contextlib.contextmanager
def _cpu_setting(name: str, allowed: set[int]) -> Iterator[bool]:
    """Apply a CPU setting; yields False where it cannot be applied here."""
    if name == "free":
        yield True
        return
    if name == "one-core":
        _pin_all_threads({sorted(allowed)[min(2, len(allowed) - 1)]})  # any one will do
        try:
            yield True
        finally:
            _pin_all_threads(allowed)
        return
    try:
        fd = os.open("/dev/cpu_dma_latency", os.O_WRONLY)
        os.write(fd, struct.pack("i", 0))
    except OSError:
        yield False
        return
    try:
        yield True
    finally:
        os.close(fd)


def _steal_s() -> float:
    """CPU time the hypervisor gave to others, all cores, in seconds (/proc/stat)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()
    return int(fields[8]) / os.sysconf("SC_CLK_TCK") if len(fields) > 8 else 0.0


def _cells(rows: list[dict], variant: str, thread: str, cpu: str) -> list[dict]:
    return [x for x in rows if (x["variant"], x["thread"], x["cpu"]) == (variant, thread, cpu)]


def _write_rounds(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _cpp_calls() -> dict[str, int]:
    """flashattn_triton's C++ replay counters (zeros where it or its extension is missing): a
    cell's difference says which of its calls replayed from C++ and which backward went to
    Python."""
    return cpp_launch_counters() or dict.fromkeys(("forward", "backward", "backward_fallback"), 0)


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _profile_ops(step, steps: int) -> dict[str, dict[str, float]]:
    """Operator name -> calls, self CPU us, CPU us with children and self GPU us, each per
    step, over ``steps`` steps under ``torch.profiler``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        _sync()
    ops = {}
    for e in prof.key_averages():
        device_us = getattr(e, "self_device_time_total", None)
        if device_us is None:  # (older torch)
            device_us = getattr(e, "self_cuda_time_total", 0.0)
        ops[e.key] = {
            "calls": e.count / steps, "self_cpu_us": e.self_cpu_time_total / steps,
            "cpu_us": e.cpu_time_total / steps, "self_gpu_us": device_us / steps,
        }  # fmt: skip
    return ops


def _write_profiles(path: Path, profiles: dict[str, dict[str, dict[str, float]]]) -> None:
    fields = ("variant", "op", "calls", "self_cpu_us", "cpu_us", "self_gpu_us")
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(fields)
        for variant, ops in profiles.items():
            for name, row in sorted(ops.items(), key=lambda kv: -kv[1]["self_cpu_us"]):
                w.writerow([variant, name, *(round(row[k], 2) for k in fields[2:])])


def _print_profile_diffs(profiles: dict[str, dict[str, dict[str, float]]], top: int = 15) -> None:
    """Per variant after the first: the operators whose self CPU time per step differs most
    from the first variant's."""
    names = list(profiles)
    base = profiles[names[0]]
    zero = {"calls": 0.0, "self_cpu_us": 0.0, "cpu_us": 0.0}
    for other in names[1:]:
        ops = profiles[other]
        keys = set(base) | set(ops)
        delta = {
            k: ops.get(k, zero)["self_cpu_us"] - base.get(k, zero)["self_cpu_us"] for k in keys
        }
        total = sum(delta.values())
        print(f"\n{other} against {names[0]}: self CPU us per step ({total:+.0f} in all)")
        print(f"{'op':60} {'calls':>13} {'self CPU us':>19} {'delta':>8}")
        for k in sorted(keys, key=lambda k: -abs(delta[k]))[:top]:
            a, b = base.get(k, zero), ops.get(k, zero)
            print(
                f"{k[:60]:60} {a['calls']:6.0f}/{b['calls']:<6.0f} "
                f"{a['self_cpu_us']:9.0f}/{b['self_cpu_us']:<9.0f} {delta[k]:+8.0f}"
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--size", default="small")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--batch", type=_cli.positive_int, default=4)
    p.add_argument("--device", default="cuda", help="cuda; cpu for a dry run of the script")
    p.add_argument("--compile", action="store_true", help="the whole model compiled")
    p.add_argument("--blocks", action="store_true", help="each block compiled (faster to build)")
    p.add_argument("--fused-loss", action="store_true")
    p.add_argument(
        "--variants",
        nargs="+",
        choices=VARIANTS,
        default=["sdpa", "flash-triton", "flash-triton-traced"],
    )
    p.add_argument("--threads", nargs="+", choices=THREADS, default=list(THREADS))
    p.add_argument("--cpus", nargs="+", choices=CPUS, default=list(CPUS))
    p.add_argument("--warmup", type=_cli.nonneg_int, default=5, help="compile and warm-up steps")
    p.add_argument("--cell-warmup", type=_cli.nonneg_int, default=3, help="untimed steps per cell")
    p.add_argument("--steps", type=_cli.positive_int, default=20)
    p.add_argument("--rounds", type=_cli.positive_int, default=5)
    p.add_argument("--out", type=Path, default=Path("runs/model_step_ab"))
    p.add_argument(
        "--profile", type=_cli.nonneg_int, default=0,
        help="after the rounds, profile this many steps of each variant (0: none)",
    )  # fmt: skip
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    from flashattn_triton import get_options, set_options

    plain = get_options()
    options = {
        v: dataclasses.replace(plain, **CHANGES[v]) if v in CHANGES else plain
        for v in args.variants
    }
    # the C++ launch path built before the first step (else it compiles in the background
    # and the warm-up steps, or more, take the Python path)
    cpp_status = ready_cpp_launch() if any(v != "sdpa" for v in args.variants) else None
    steps = {}
    for variant in args.variants:
        set_options(options[variant])
        attention = "sdpa" if variant == "sdpa" else "flash-triton"
        steps[variant] = _step_fn(attention, args)
        t0 = time.perf_counter()
        for _ in range(args.warmup):
            steps[variant]()
        _sync()
        print(f"{variant}: compiled and warmed in {time.perf_counter() - t0:.1f} s", flush=True)
    graphs_before = _graphs()
    allowed = os.sched_getaffinity(0)

    rows = []
    for r in range(args.rounds):
        for cpu in args.cpus:
            for thread in args.threads:
                for variant in args.variants:
                    set_options(options[variant])
                    with (
                        _cpu_setting(cpu, allowed) as applied,
                        torch.autograd.set_multithreading_enabled(thread == "device"),
                    ):
                        if not applied:
                            continue
                        for _ in range(args.cell_warmup):
                            steps[variant]()
                        steal, calls = _steal_s(), _cpp_calls()
                        step_ms, host_ms = _time_steps(steps[variant], args.steps)
                        steal = (_steal_s() - steal) * 1e3 / args.steps
                        calls = {k: v - calls[k] for k, v in _cpp_calls().items()}
                    rows.append(
                        {"round": r, "variant": variant, "thread": thread, "cpu": cpu,
                         "step_ms": round(step_ms, 3), "host_ms": round(host_ms, 3),
                         "steal_ms_per_step": round(steal, 3),
                         **{f"cpp_{k}_per_step": v / args.steps for k, v in calls.items()}}
                    )  # fmt: skip
        if not rows:
            raise SystemExit(f"no cell could run here (--cpus {' '.join(args.cpus)})")
        _write_rounds(args.out / "rounds.csv", rows)  # each round kept, should a limit stop us
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    if args.profile:
        profiles = {}
        for variant in args.variants:
            set_options(options[variant])
            profiles[variant] = _profile_ops(steps[variant], args.profile)
        _write_profiles(args.out / "profile_ops.csv", profiles)
        _print_profile_diffs(profiles)
    set_options(plain)

    summary = []
    for cpu in args.cpus:
        for thread in args.threads:
            base = [x["step_ms"] for x in _cells(rows, "sdpa", thread, cpu)]
            for variant in args.variants:
                got = _cells(rows, variant, thread, cpu)
                if not got:
                    continue
                ms = [x["step_ms"] for x in got]
                med = statistics.median(ms)
                ratios = [a / b for a, b in zip(ms, base)] if len(base) == len(ms) else []
                summary.append(
                    {"variant": variant, "thread": thread, "cpu": cpu,
                     "median_ms": round(med, 3), "min_ms": min(ms), "max_ms": max(ms),
                     "host_ms": round(statistics.median(x["host_ms"] for x in got), 3),
                     "vs_sdpa": round(med / statistics.median(base), 3) if base else None,
                     "vs_sdpa_rounds": [round(x, 3) for x in ratios]}
                )  # fmt: skip
    meta = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "size": args.size, "context": args.context, "batch": args.batch,
        "compile": args.compile, "blocks": args.blocks, "rounds": args.rounds, "steps": args.steps,
        "cpus_allowed": len(allowed),
        "graphs_compiled_during_rounds": _graphs() - graphs_before, "cpp_launch": cpp_status,
    }  # fmt: skip
    (args.out / "summary.json").write_text(json.dumps({"meta": meta, "rows": summary}, indent=1))
    print(json.dumps(meta))
    names = ("median", "min", "max", "host", "vs_sdpa")
    print(f"{'variant':22} {'thread':8} {'cpu':9} " + " ".join(f"{n:>8}" for n in names))
    for s in summary:
        print(
            f"{s['variant']:22} {s['thread']:8} {s['cpu']:9} {s['median_ms']:8.2f} "
            f"{s['min_ms']:8.2f} {s['max_ms']:8.2f} {s['host_ms']:8.2f} {s['vs_sdpa'] or 0:8.3f}"
        )


if __name__ == "__main__":
    main()
