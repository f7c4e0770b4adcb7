"""Turn torch.profiler events into the answers Nsight Systems would give.

Work items are GPU kernels (on a GPU) or CPU operators with their self time (on CPU). Each
item is attributed to the named ranges (record_function annotations: "forward", "backward",
"optimizer", lm_core's "attention/..." ...) by time: a kernel belongs to a range when the CPU
operator that launched it started inside the range's CPU interval. Kernels run later on the
GPU, but they are launched from inside the range, so the launch time is what identifies them;
the autograd engine's thread that launches backward kernels runs inside the "backward" range
of the main thread, which is why ranges are matched by time and not by thread.

Launch link, GPU (`extract_trace`): read from the exported chrome trace, where every device
event (kernel, memcpy, memset) carries the correlation id of the runtime or driver call that
launched it (cudaLaunchKernel, cuLaunchKernel for Triton); that call's CPU timestamp is the
kernel's anchor. Each device event counts once. (`FunctionEvent.kernels` is not used on GPU:
torch 2.11 attached each of fused AdamW's kernels to dozens of CPU events, counting one
step's optimizer kernels ~50 times.) Device events whose launch was not recorded count in
the totals, outside every range.
CPU (`extract`): operators' self time from the profiler's FunctionEvents.

Matmul rule (`classify`, on the lower-cased name): a fused attention kernel when it contains
flash, fmha, sdpa, scaled_dot_product, attention or attn (our Triton kernels); else a matmul
when it contains gemm, gemv, cutlass, cublas, xmma, nvjet, wgmma or matmul, starts with
triton_tem_ (Inductor's mm templates), or names an mm / bmm / addmm / baddbmm / mv / dot /
linear / einsum op as a word;
everything else is "other" (elementwise, reductions, softmax, norms, copies, the optimizer).
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

PHASES = ("forward", "backward", "optimizer")
OUTSIDE = "(outside forward/backward/optimizer)"
NO_LAUNCH = "(no launching op)"

_MATMUL = re.compile(
    r"gemm|gemv|cutlass|cublas|xmma|nvjet|wgmma|matmul|^triton_tem_"
    r"|(^|[^a-z])(addmm|baddbmm|addbmm|bmm|mm|mv|addmv|dot|linear|einsum|_scaled_mm)([^a-z]|$)"
)
_ATTENTION = re.compile(r"flash|fmha|sdpa|scaled_dot_product|attention|attn")


def classify(name: str) -> str:
    """'matmul', 'attention (fused)' or 'other' for a kernel or operator name (rule above)."""
    low = name.lower()
    if _ATTENTION.search(low):
        return "attention (fused)"
    if _MATMUL.search(low):
        return "matmul"
    return "other"


@dataclass(frozen=True)
class Item:
    """One unit of device work: a kernel (GPU) or an operator's self time (CPU)."""

    name: str
    dur_us: float
    anchor_us: float | None  # launch (or start) time on the CPU clock; None if unknown


@dataclass(frozen=True)
class Span:
    """One occurrence of a named range on the CPU clock."""

    name: str
    start_us: float
    end_us: float


class RangeIndex:
    """Which occurrences of each range name contain a time point (same-name spans are disjoint)."""

    def __init__(self, spans: Iterable[Span]) -> None:
        by_name: dict[str, list[tuple[float, float]]] = {}
        for s in spans:
            by_name.setdefault(s.name, []).append((s.start_us, s.end_us))
        self.names = list(by_name)
        self._starts = {}
        self._ends = {}
        for name, ivs in by_name.items():
            ivs.sort()
            self._starts[name] = [a for a, _ in ivs]
            self._ends[name] = [b for _, b in ivs]
        self.count = {name: len(ivs) for name, ivs in by_name.items()}

    def containing(self, t: float | None) -> list[str]:
        """Names of the ranges that contain time `t`."""
        if t is None:
            return []
        out = []
        for name in self.names:
            i = bisect.bisect_right(self._starts[name], t) - 1
            if i >= 0 and t <= self._ends[name][i]:
                out.append(name)
        return out


# ----------------------------------------------------------------------------- extraction


def _is_cpu(evt: Any) -> bool:
    return str(getattr(evt, "device_type", "CPU")).endswith("CPU")


def extract(
    events: Sequence[Any], range_names: Iterable[str] | None = None
) -> tuple[list[Item], list[Span], str]:
    """Items, named spans and the unit kind ('kernel' or 'cpu op') from profiler FunctionEvents.

    A span is a CPU event that is a user annotation (record_function) or whose name is in
    `range_names`. If any CUDA kernel was recorded, items are kernels; else CPU operators.
    """
    wanted = set(range_names or ())
    spans: list[Span] = []
    annotation_ids = set()
    for e in events:
        if not _is_cpu(e):
            continue
        if getattr(e, "is_user_annotation", False) or e.name in wanted:
            spans.append(Span(e.name, e.time_range.start, e.time_range.end))
            annotation_ids.add(id(e))
    span_names = {s.name for s in spans}
    device_events = [e for e in events if not _is_cpu(e) and e.name not in span_names]
    device_events = [e for e in device_events if not getattr(e, "is_user_annotation", False)]
    if device_events:
        items = []
        for e in events:
            if _is_cpu(e):
                for k in getattr(e, "kernels", ()):
                    items.append(Item(k.name, float(k.duration), e.time_range.start))
        total = sum(float(e.time_range.elapsed_us()) for e in device_events)
        attributed = sum(i.dur_us for i in items)
        if total - attributed > 1e-3 * max(total, 1.0):
            items.append(Item(NO_LAUNCH, total - attributed, None))
        return items, spans, "kernel"
    items = [
        Item(e.name, float(e.self_cpu_time_total), e.time_range.start)
        for e in events
        if _is_cpu(e) and id(e) not in annotation_ids and e.self_cpu_time_total > 0
    ]
    return items, spans, "cpu op"


def kernel_sequence(events: Sequence[Any]) -> list[str]:
    """The distinct names of the device events (kernels, copies, memsets) among profiler
    FunctionEvents, in the order they first started on the GPU: which kernels a profiled
    call ran. GPU-side user annotations are not kernels and are left out."""
    device = [e for e in events if not _is_cpu(e) and not getattr(e, "is_user_annotation", False)]
    device.sort(key=lambda e: e.time_range.start)
    return list(dict.fromkeys(e.name for e in device))


DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")


def extract_trace(
    trace: dict[str, Any] | Sequence[dict[str, Any]], range_names: Iterable[str] | None = None
) -> tuple[list[Item], list[Span], str]:
    """Items (device events, each once), named spans and 'kernel' from a chrome trace.

    `trace`: the JSON of `prof.export_chrome_trace` (or its "traceEvents" list). Spans are the
    CPU-side user annotations (record_function) and CPU ops named in `range_names`.
    """
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    wanted = set(range_names or ())
    launch_ts: dict[Any, float] = {}
    spans: list[Span] = []
    device: list[dict[str, Any]] = []
    for e in events:
        if e.get("ph") != "X":
            continue
        cat = e.get("cat")
        args = e.get("args") or {}
        if cat in DEVICE_CATEGORIES:
            device.append(e)
        elif cat in LAUNCH_CATEGORIES and "correlation" in args:
            launch_ts[args["correlation"]] = float(e["ts"])
        elif cat == "user_annotation" or (cat == "cpu_op" and e.get("name") in wanted):
            start = float(e["ts"])
            spans.append(Span(e["name"], start, start + float(e.get("dur", 0.0))))
    items = [
        Item(
            e.get("name", "?"),
            float(e.get("dur", 0.0)),
            launch_ts.get((e.get("args") or {}).get("correlation")),
        )
        for e in device
    ]
    return items, spans, "kernel"


# ----------------------------------------------------------------------------- tables


def kernel_table(items: Sequence[Item], steps: int) -> list[dict[str, Any]]:
    """Every kernel (or op) name by total time: calls per step, ms per step, share of all."""
    total = sum(i.dur_us for i in items) or 1.0
    agg: dict[str, list[float]] = {}
    for i in items:
        a = agg.setdefault(i.name, [0.0, 0])
        a[0] += i.dur_us
        a[1] += 1
    rows = []
    for name, (dur, calls) in sorted(agg.items(), key=lambda kv: -kv[1][0]):
        rows.append(
            {
                "name": name,
                "class": classify(name) if name != NO_LAUNCH else "other",
                "calls_per_step": calls / steps,
                "ms_per_step": dur / steps / 1e3,
                "mean_us": dur / calls,
                "share_pct": 100.0 * dur / total,
            }
        )
    return rows


def _phase_of(names: list[str]) -> str:
    for p in PHASES:
        if p in names:
            return p
    return OUTSIDE


def split_table(items: Sequence[Item], index: RangeIndex, steps: int) -> list[dict[str, Any]]:
    """Matmul / fused attention / other time, for the whole step and for each phase in it."""
    acc: dict[tuple[str, str], float] = {}
    for i in items:
        cls = classify(i.name) if i.name != NO_LAUNCH else "other"
        phase = _phase_of(index.containing(i.anchor_us))
        for scope in ("step", phase):
            acc[(scope, cls)] = acc.get((scope, cls), 0.0) + i.dur_us
    rows = []
    scopes = ["step", *PHASES, OUTSIDE]
    for scope in scopes:
        scope_total = sum(v for (s, _), v in acc.items() if s == scope)
        if scope_total <= 0:
            continue
        for cls in ("matmul", "attention (fused)", "other"):
            dur = acc.get((scope, cls), 0.0)
            if dur <= 0 and cls == "attention (fused)":
                continue
            rows.append(
                {
                    "scope": scope,
                    "class": cls,
                    "ms_per_step": dur / steps / 1e3,
                    "share_of_scope_pct": 100.0 * dur / scope_total,
                }
            )
    return rows


def range_table(
    items: Sequence[Item], index: RangeIndex, steps: int, exclude: Iterable[str] = ("step",)
) -> list[dict[str, Any]]:
    """Device time of the work launched inside each named range (inclusive of nested ranges).

    Level-0 rows are the phases plus what ran outside them: their shares add up to 100%.
    Level-1 rows are nested ranges (attention, its sub-steps, ffn): shares of the whole step.
    """
    skip = set(exclude)
    total = sum(i.dur_us for i in items) or 1.0
    dur: dict[str, float] = {}
    calls: dict[str, int] = {}
    top: dict[str, dict[str, float]] = {}
    for i in items:
        names = [n for n in index.containing(i.anchor_us) if n not in skip]
        phase = _phase_of(names)
        if phase == OUTSIDE:
            names.append(OUTSIDE)
        for n in names:
            dur[n] = dur.get(n, 0.0) + i.dur_us
            calls[n] = calls.get(n, 0) + 1
            t = top.setdefault(n, {})
            t[i.name] = t.get(i.name, 0.0) + i.dur_us
    rows = []
    order = [*PHASES, OUTSIDE, *sorted(n for n in dur if n not in PHASES and n != OUTSIDE)]
    for n in order:
        if n not in dur:
            continue
        best = max(top[n].items(), key=lambda kv: kv[1])[0]
        rows.append(
            {
                "range": n,
                "level": 0 if n in PHASES or n == OUTSIDE else 1,
                "occurrences_per_step": index.count.get(n, 0) / steps,
                "items_per_step": calls[n] / steps,
                "ms_per_step": dur[n] / steps / 1e3,
                "share_pct": 100.0 * dur[n] / total,
                "top_item": best,
            }
        )
    return rows


def attention_table(
    ranges: Sequence[dict[str, Any]], flops: dict[str, float], steps_flops_scale: float = 1.0
) -> list[dict[str, Any]]:
    """Softmax vs the two attention matmuls: time, FLOPs, TFLOP/s, ratios to softmax.

    `flops` maps 'scores' / 'softmax' / 'weighted_sum' to forward FLOPs per step; a range
    matches a key when its name ends with it (e.g. "attention/softmax").
    """
    found = {}
    for key in ("scores", "softmax", "weighted_sum"):
        for r in ranges:
            if r["range"].split("/")[-1] == key or r["range"].endswith(key):
                found[key] = r
                break
    if not found:
        return []
    soft = found.get("softmax")
    rows = []
    for key, r in found.items():
        f = flops[key] * steps_flops_scale
        ms = r["ms_per_step"]
        row = {
            "sub_step": r["range"],
            "ms_per_step": ms,
            "gflop_per_step": f / 1e9,
            "tflops": f / (ms * 1e-3) / 1e12 if ms > 0 else None,
            "time_vs_softmax": ms / soft["ms_per_step"] if soft and soft["ms_per_step"] else None,
            "flops_vs_softmax": f / flops["softmax"] if flops.get("softmax") else None,
        }
        rows.append(row)
    return rows
