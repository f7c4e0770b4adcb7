"""Where a model train step's host time goes, SDPA against our kernel, in one process.

For each attention backend: an lm_core model (bf16 autocast, AdamW), eager or whole-model
compiled, warm-up steps, then
  - the step time (synchronized, median) and the host time (until the step returns, before
    the synchronize): a host time close to the step time means the GPU waits for Python;
  - cProfile of a few steps: the Python functions with the most own time, and the call
    counts of our launchers (``launch.forward`` / ``launch.backward``, the plan replays and
    the JIT path) per step;
  - the CUDA runtime / driver calls the host makes per step (torch.profiler: launches,
    allocations, copies, synchronizations) and the copies and fills the GPU runs: a
    synchronizing call inside a step would make the host wait for the GPU;
  - dynamo's counters (graphs compiled, graph breaks): a break splits the compiled step;
  - the wall time of each call of our launchers (``launch.forward`` / ``launch.backward``,
    through which the compiled ops run too) by the thread that ran it, and a cProfile of
    what runs inside ``launch.backward``, enabled inside each call on whichever thread runs
    it (the whole-step cProfile above is enabled on the calling thread, which before
    Python 3.12 is all it sees);
each with the backward on autograd's device thread and, with ``--autograd-threads on off``,
on the calling thread. The pstats files and a JSON summary go to --out.

  python packages/perf-tools/scripts/model_host_profile.py --size small --context 1024 \
      --batch 4 --compile
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

WATCH = ("forward", "backward", "run", "_launch_planned", "launch_jit", "_run", "expand")


def _step_fn(attention: str, args: argparse.Namespace):
    """The train step of ``perf_tools.bench --mode train --precision bf16`` for lm_core (the
    bench's own cell step: its loss, optimizer and compile): eager, whole model compiled
    (``args.compile``) or block by block (``args.blocks``, where the caller has it), on
    ``args.device`` (CUDA unless the caller says otherwise)."""
    from perf_tools import cells
    from perf_tools.models import resolve_config
    from perf_tools.steps import Annotator

    compiled = "blocks" if getattr(args, "blocks", False) else args.compile
    config = resolve_config(args.size, context_length=args.context, attention=attention)
    spec = cells.BenchSpec(
        cells.OURS, args.size, attention, compiled, "bf16", "train", args.context
    )
    opts = cells.BenchOptions(
        device=torch.device(getattr(args, "device", "cuda")), batch=args.batch,
        warmup=args.warmup, steps=args.steps, overrides={}, fused_loss=args.fused_loss,
    )  # fmt: skip
    model, runner = cells._build_runner(spec, config, opts, compiled)
    step, _ = cells.make_cell_step(model, runner, spec, config, opts, Annotator(), None)
    return step


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _cpu_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine from /proc/stat."""
    values = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


def _time(step, steps: int) -> tuple[float, float]:
    totals, hosts = [], []
    for _ in range(steps):
        _sync()
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        _sync()
        t2 = time.perf_counter()
        hosts.append((t1 - t0) * 1e3)
        totals.append((t2 - t0) * 1e3)
    return statistics.median(totals), statistics.median(hosts)


def _thread_report(seconds: float = 1.0) -> dict:
    """What else runs in this process while it idles: Python threads, and CPU seconds used by
    each OS thread over ``seconds`` of sleep (a busy thread slows every host-bound step), plus
    the host time of a small eager op (a process-wide slowdown shows there too)."""
    import threading

    def cpu_by_task() -> dict[str, float]:
        ticks = os.sysconf("SC_CLK_TCK")
        out = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
                name = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
            except OSError:
                continue
            out[f"{tid}:{name}"] = (int(fields[11]) + int(fields[12])) / ticks
        return out

    before = cpu_by_task()
    machine = _cpu_jiffies()
    time.sleep(seconds)
    after = cpu_by_task()
    busy_now, total_now = _cpu_jiffies()
    cores_busy = (busy_now - machine[0]) / max(total_now - machine[1], 1) * os.cpu_count()
    busy = {k: round(after[k] - before.get(k, 0.0), 3) for k in after}
    x = torch.empty(16, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(2000):
        x.add_(1.0)
    empty_us = (time.perf_counter() - t0) / 2000 * 1e6
    torch.cuda.synchronize()
    return {
        "python_threads": [t.name for t in threading.enumerate()],
        "os_threads": len(after),
        "busy_threads_cpu_s": {k: v for k, v in busy.items() if v > 0.01},
        "eager_add_us": round(empty_us, 2),
        "machine_cores_busy_idle": round(cores_busy, 2),
        "affinity": len(os.sched_getaffinity(0)),
    }


def _cuda_calls(step, steps: int) -> dict[str, dict[str, float]]:
    """Per step: the CUDA runtime / driver API calls of the host (count, host us) and the
    GPU's copies and fills, from torch.profiler over ``steps`` steps (the closing
    synchronize of the profiled block counts once, i.e. 1 / steps per step)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    out = {}
    for event in prof.key_averages():
        key = event.key
        if key.startswith(("cuda", "cu", "Memcpy", "Memset")) and not key.startswith("cudnn"):
            out[key] = {
                "calls_per_step": round(event.count / steps, 2),
                "host_us_per_step": round(event.cpu_time_total / steps, 1),
            }
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["host_us_per_step"]))


def _dynamo_counters() -> dict[str, object]:
    """Graphs dynamo compiled and the graph breaks it took, so far in this process."""
    from torch._dynamo.utils import counters

    return {
        "stats": dict(counters["stats"]),
        "graph_breaks": sum(counters["graph_break"].values()),
        "graph_break_reasons": list(counters["graph_break"])[:10],
    }


def _top(prof: cProfile.Profile, top: int, chars: int) -> str:
    """The last ``chars`` characters of ``prof``'s ``top`` functions by own time."""
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()[-chars:]


def _watched(stats: pstats.Stats, steps: int) -> dict[str, float]:
    out = {}
    for (file, _line, name), (_cc, nc, _tt, ct, _callers) in stats.stats.items():
        if "flashattn_triton" in file and name in WATCH:
            label = f"{Path(file).stem}.{name}"
            prev = out.get(label, (0.0, 0.0))
            out[label] = (prev[0] + nc / steps, prev[1] + ct * 1e3 / steps)
    return {k: {"calls_per_step": v[0], "cum_ms_per_step": round(v[1], 3)} for k, v in out.items()}


@contextlib.contextmanager
def _launcher_clock(steps: int, top: int) -> Iterator[dict]:
    """Time every call of ``launch.forward`` / ``launch.backward`` inside the block, by the
    thread that ran it, and profile the backward's calls per thread; fills the dict yielded
    on exit: {"forward"/"backward": {thread: {calls_per_step, median_us, total_ms_per_step}},
    "backward_profile": {thread: top functions by own time}}."""
    from flashattn_triton import launch

    main_thread = threading.get_ident()
    samples: dict[tuple[str, str], list[float]] = {}
    profiles: dict[str, cProfile.Profile] = {}
    originals = {name: getattr(launch, name) for name in ("forward", "backward")}

    def timed(name: str, fn):
        def call(*args, **kwargs):
            thread = "calling" if threading.get_ident() == main_thread else "other"
            prof = None
            if name == "backward":
                prof = profiles.setdefault(thread, cProfile.Profile())
                prof.enable()
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - t0
                if prof is not None:
                    prof.disable()
                samples.setdefault((name, thread), []).append(elapsed * 1e6)

        return call

    result: dict = {}
    for name, fn in originals.items():
        setattr(launch, name, timed(name, fn))
    try:
        yield result
    finally:
        for name, fn in originals.items():
            setattr(launch, name, fn)
    for (name, thread), values in samples.items():
        result.setdefault(name, {})[thread] = {
            "calls_per_step": len(values) / steps,
            "median_us": round(statistics.median(values), 1),
            "total_ms_per_step": round(sum(values) / steps / 1e3, 3),
        }
    for thread, prof in profiles.items():
        result.setdefault("backward_profile", {})[thread] = _top(prof, top, 4000)


def _one(attention: str, args: argparse.Namespace) -> dict:
    """Every measurement of one attention backend, in this process, on the current thread
    setting."""
    step = _step_fn(attention, args)
    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    machine = _cpu_jiffies()
    step_ms, host_ms = _time(step, args.steps)
    busy, total = _cpu_jiffies()
    process = _thread_report()
    process["machine_cores_busy_steps"] = round(
        (busy - machine[0]) / max(total - machine[1], 1) * os.cpu_count(), 2
    )
    cuda_calls = _cuda_calls(step, args.profile_steps)
    launchers_by_thread = {}
    if attention == "flash-triton":
        with _launcher_clock(args.steps, args.top) as launchers_by_thread:
            _time(step, args.steps)
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for _ in range(args.profile_steps):
        step()
    torch.cuda.synchronize()
    prof.disable()
    threads = "device" if torch._C._is_multithreading_enabled() else "calling"
    tag = f"{args.size}_{args.context}_{attention}_{'compiled' if args.compile else 'eager'}"
    prof.dump_stats(args.out / f"{tag}_{threads}.pstats")
    row = {
        "attention": attention,
        "compile": args.compile,
        "backward_thread": threads,
        "step_ms": round(step_ms, 3),
        "host_ms": round(host_ms, 3),
        "launchers": _watched(pstats.Stats(prof), args.profile_steps),
        "launchers_by_thread": launchers_by_thread,
        "cuda_calls": cuda_calls,
        "dynamo": _dynamo_counters(),
        "process": process,
    }
    print(json.dumps(row, indent=1))
    print(_top(prof, args.top, 6000))
    del step
    torch.cuda.empty_cache()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="small")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--attention", nargs="+", default=["sdpa", "flash-triton"])
    p.add_argument("--compile", action="store_true")
    p.add_argument("--fused-loss", action="store_true", help="the model's fused head + loss")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", type=Path, default=Path("runs/model_host_profile"))
    p.add_argument(
        "--autograd-threads", nargs="+", choices=("on", "off"), default=["on"],
        help="on: the backward on autograd's device thread (torch's default); off: on the "
        "calling thread; both: every backend measured under each",
    )  # fmt: skip
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    summary = []
    for setting in args.autograd_threads:
        with torch.autograd.set_multithreading_enabled(setting == "on"):
            for attention in args.attention:
                summary.append(_one(attention, args))
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
