"""Where one leaderboard step's GPU time goes: ours against SDPA's cuDNN backend.

The step is the leaderboard's (``leaderboard_bench.py``): a ``torch.compile``d apply on
(H, N, d) bf16 q, k, v, causal, then ``o.sum().backward()``. Three views, each printed as a
table and saved to ``--out`` as JSON:

1. ``kernels``: every GPU kernel of a step from ``torch.profiler`` (calls per step, mean
   time), and the step's span against the sum of its kernels (idle gaps).
2. ``sustained``: steps back to back with no profiler, as ``do_bench`` runs them (an L2 flush
   before each), timed by CUDA events around the step and, for ours, around
   ``launch.forward`` / ``launch.backward`` (regions ``forward``, ``backward``) and each
   kernel ``_run`` starts (regions named by kernel kind: ``fwd``, ``dkdv``, ``dq``); ours
   runs these steps through its launchers (``fast_launch`` and ``traced_compile`` off, which
   changes nothing at the leaderboard shape, too large to be traced).
3. ``power`` (``--seconds`` > 0, needs ``nvidia-smi``): the SM clock, the board power and
   whether the software power cap throttles, sampled every 100 ms while each provider runs
   steps for that many seconds.

Why the second view: on the H100 here the profiler's kernel times were 4-6% shorter than
the sustained ones, because back-to-back steps hold the board at its power limit and the
clock drops; a profile alone misplaces the gap.

    PYTHONPATH=packages/flashattn-triton/src python3 \\
        packages/flashattn-triton/benchmarks/step_breakdown.py --seconds 3 --out $OUT
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

SW_POWER_CAP = 0x4  # nvidia-smi clocks_event_reasons bit: software power cap
SMI_FIELDS = "timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"


def parse_smi_line(line: str) -> dict | None:
    """One ``nvidia-smi --query-gpu=SMI_FIELDS --format=csv,noheader`` line -> sample
    (time in seconds since the epoch, local time as nvidia-smi prints it), or None."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 5:
        return None
    try:
        stamp = time.mktime(time.strptime(parts[0].split(".")[0], "%Y/%m/%d %H:%M:%S"))
        frac = float("0." + parts[0].split(".")[1]) if "." in parts[0] else 0.0
        return {
            "t": stamp + frac,
            "sm_mhz": float(parts[1].split()[0]),
            "watts": float(parts[2].split()[0]),
            "temp_c": float(parts[3]),
            "power_capped": bool(int(parts[4], 16) & SW_POWER_CAP),
        }
    except (ValueError, IndexError):
        return None


def summarize_samples(samples: list[dict], t0: float, t1: float) -> dict:
    """Median clock and power, and the share of samples under the power cap, in [t0, t1]."""
    inside = [s for s in samples if t0 <= s["t"] <= t1]
    if not inside:
        return {"samples": 0}
    return {
        "samples": len(inside),
        "sm_mhz": statistics.median(s["sm_mhz"] for s in inside),
        "watts": statistics.median(s["watts"] for s in inside),
        "power_capped": sum(s["power_capped"] for s in inside) / len(inside),
    }


def aggregate_kernels(events: list[tuple[str, float, float]], steps: int) -> dict:
    """(name, start_us, end_us) of every kernel of ``steps`` steps -> per-name calls per step
    and mean time, plus the span per step and the kernels' sum per step (both in us)."""
    if not events:
        return {"span_us": 0.0, "busy_us": 0.0, "kernels": []}
    per_name: dict[str, list[float]] = {}
    for name, start, end in events:
        per_name.setdefault(name, []).append(end - start)
    span = max(e for _, _, e in events) - min(s for _, s, _ in events)
    rows = [
        {"name": n, "per_step": len(d) / steps, "mean_us": sum(d) / len(d), "total_us": sum(d)}
        for n, d in per_name.items()
    ]
    rows.sort(key=lambda r: -r["total_us"])
    busy = sum(r["total_us"] for r in rows)
    return {"span_us": span / steps, "busy_us": busy / steps, "kernels": rows}


def region_medians(marks: list[tuple[str, float]]) -> dict[str, float]:
    """Event marks ('x<' opens region x, 'x>' closes it; times in ms) -> median duration of
    each region, and of the gaps between consecutive marks named 'a..b'."""
    opened: dict[str, float] = {}
    spans: dict[str, list[float]] = {}
    for tag, t in marks:
        if tag.endswith("<"):
            opened[tag[:-1]] = t
        elif tag[:-1] in opened:
            spans.setdefault(tag[:-1], []).append(t - opened.pop(tag[:-1]))
    for (a, ta), (b, tb) in itertools.pairwise(marks):
        if a != "step>" and not (a.endswith("<") and b == a[:-1] + ">"):
            spans.setdefault(f"{a}..{b}", []).append(tb - ta)
    return {k: statistics.median(v) for k, v in spans.items()}


# ------------------------------------------------------------------------ GPU parts


def _step_fn(fn, q, k, v):
    import torch

    compiled = torch.compile(fn)

    def step():
        compiled(q, k, v, True).sum().backward()

    return step


def kernels_view(step, steps: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = [
        (e.name[:90], e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type.name == "CUDA"
    ]
    return aggregate_kernels(events, steps)


class _Marks:
    """CUDA events recorded on the current stream, named; read back after a sync."""

    def __init__(self):
        self.events = []

    def __call__(self, tag: str) -> None:
        import torch

        e = torch.cuda.Event(enable_timing=True)
        e.record()
        self.events.append((tag, e))

    def times(self) -> list[tuple[str, float]]:
        first = self.events[0][1]
        return [(tag, first.elapsed_time(e)) for tag, e in self.events]


def sustained_view(step, steps: int, instrument: bool) -> dict:
    """Median step time (and, with ``instrument``, of our launch regions) over back-to-back
    steps with an L2 flush before each, as ``triton.testing.do_bench`` runs them."""
    import torch

    from flashattn_triton import launch, launch_backward

    mark = _Marks()
    # (module, name, region): the launchers, and ``_run`` where each calls it
    patched = [
        (launch, "forward", "forward"),
        (launch, "backward", "backward"),
        (launch, "_run", "run"),
        (launch_backward, "_run", "run"),
    ]
    saved = [getattr(module, name) for module, name, _ in patched]

    def wrap(name, fn):
        def wrapped(*a, **kw):
            mark(f"{name if name != 'run' else a[0]}<")
            out = fn(*a, **kw)
            mark(f"{name if name != 'run' else a[0]}>")
            return out

        return wrapped

    from flashattn_triton.options import get_options, set_options

    saved_options = get_options()
    if instrument:
        for (module, name, region), fn in zip(patched, saved):
            setattr(module, name, wrap(region, fn))  # kernel regions: fwd, dkdv, dq, ...
        # kernel regions are marked where _run dispatches each kernel: replayed launch
        # plans, and compiled calls traced into the graph (whose kernels inductor launches
        # itself), would skip it
        set_options(fast_launch=False, traced_compile=False)
    try:
        flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        mark.events.clear()
        for _ in range(steps):
            flush.zero_()
            mark("step<")
            step()
            mark("step>")
        torch.cuda.synchronize()
        return region_medians(mark.times())
    finally:
        for (module, name, _), fn in zip(patched, saved):
            setattr(module, name, fn)
        set_options(saved_options)


def power_view(steps_by_name: dict, seconds: float, out_dir: Path | None) -> dict:
    """Each provider's steps for ``seconds`` while nvidia-smi samples clock and power."""
    import tempfile

    import torch

    log = Path(out_dir or tempfile.mkdtemp()) / "step_breakdown_smi.csv"
    cmd = ["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader", "-lms", "100"]
    with open(log, "w") as fh:
        smi = subprocess.Popen(cmd, stdout=fh)
        windows = {}
        try:
            time.sleep(1.0)
            for name, step in steps_by_name.items():
                start, stop = torch.cuda.Event(True), torch.cuda.Event(True)
                t0 = time.time()
                start.record()
                n = 0
                while time.time() - t0 < seconds:
                    for _ in range(10):
                        step()
                    n += 10
                    torch.cuda.synchronize()
                stop.record()
                torch.cuda.synchronize()
                windows[name] = (t0 + 0.5, time.time(), start.elapsed_time(stop) / n)
                time.sleep(1.5)  # let the board cool back toward idle between providers
        finally:
            smi.terminate()
            smi.wait()
    samples = [s for s in map(parse_smi_line, log.read_text().splitlines()) if s]
    return {
        name: {"ms_per_step": ms, **summarize_samples(samples, t0, t1)}
        for name, (t0, t1, ms) in windows.items()
    }


def _print_kernels(name: str, view: dict) -> None:
    print(f"\n### {name}: kernels (torch.profiler)\n")
    print(f"span per step {view['span_us']:.1f} us, kernels per step {view['busy_us']:.1f} us\n")
    print("| kernel | per step | mean us |\n| --- | --- | --- |")
    for r in view["kernels"]:
        print(f"| {r['name'][:70]} | {r['per_step']:.1f} | {r['mean_us']:.1f} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30, help="steps per view")
    ap.add_argument("--seconds", type=float, default=0.0, help="power view: seconds each")
    ap.add_argument("--out", type=Path, default=None, help="folder for the JSON (and smi CSV)")
    a = ap.parse_args(argv)
    for name in ("n", "heads", "d", "steps"):
        if getattr(a, name) < 1:
            ap.error(f"--{name} must be >= 1")
    if a.out:  # before any work: the power view writes its CSV there mid-run
        a.out.mkdir(parents=True, exist_ok=True)
    import torch

    if not torch.cuda.is_available():
        print("step_breakdown: needs a CUDA GPU", file=sys.stderr)
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from leaderboard_bench import make_inputs, providers

    q, k, v = make_inputs(a.heads, a.n, a.d, "cuda")
    provs = providers(["ours", "sdpa_cudnn"])
    steps = {name: _step_fn(fn, q, k, v) for name, fn in provs.items()}
    result: dict = {"shape": [a.heads, a.n, a.d], "device": torch.cuda.get_device_name()}
    for name, step in steps.items():
        result[f"{name}_kernels"] = kernels_view(step, a.steps)
        _print_kernels(name, result[f"{name}_kernels"])
    print("\n### sustained (CUDA events, no profiler; medians in ms)\n")
    for name, step in steps.items():
        regions = sustained_view(step, a.steps, instrument=name == "ours")
        result[f"{name}_sustained"] = regions
        print(f"- {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in regions.items()))
    if a.seconds > 0 and shutil.which("nvidia-smi") is None:
        print("\n(no nvidia-smi on PATH: power view skipped)")
    elif a.seconds > 0:
        result["power"] = power_view(steps, a.seconds, a.out)
        print("\n### power (nvidia-smi every 100 ms)\n")
        print("| provider | ms/step | SM MHz | W | share power-capped |")
        print("| --- | --- | --- | --- | --- |")
        for name, p in result["power"].items():
            if p.get("samples"):
                print(
                    f"| {name} | {p['ms_per_step']:.3f} | {p['sm_mhz']:.0f} | {p['watts']:.0f} "
                    f"| {p['power_capped']:.2f} |"
                )
    if a.out:
        path = a.out / f"step_breakdown_d{a.d}_h{a.heads}_n{a.n}.json"
        path.write_text(json.dumps(result, indent=1))
        print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
