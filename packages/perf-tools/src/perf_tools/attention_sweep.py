"""Ours against SDPA where users feel it: `python -m perf_tools.attention_sweep`.

For each head dim, causal flag and mode (eager: the autograd Function as a model calls it;
compiled: the same function under `torch.compile` with static shapes, each shape compiled for
itself as a model's fixed shapes are; rows record flashattn_triton's `traced_compile` and
`cpp_launch_compiled` options, settable by `FLASHATTN_TRITON_TRACED_COMPILE=1`, `0` or `auto`
and `FLASHATTN_TRITON_CPP_LAUNCH_COMPILED=1` or `0`), every shape of the sweep
is timed for every provider in one process: q, k, v of shape (B, heads, N, d) (B from
`--batch`, 1 by default), forward and backward (`torch.autograd.grad(o, (q, k, v), dO)`, so
no gradient accumulation), median of
`triton.testing.do_bench`. That is host and GPU time together, what a training step sees.
Rows carry each provider's ms and `ours / best SDPA` (below 1: ours is faster). `--csv` /
`--json` are rewritten after every row, so a sweep stopped part-way keeps what it finished.

    python -m perf_tools.attention_sweep --csv sweep.csv --plot sweep.png
    python -m perf_tools.attention_sweep --d 64 --modes eager --shapes 128x512 32x2048
    python -m perf_tools.attention_sweep --graphed   # + GPU-only time (one CUDA graph per call)
    python -m perf_tools.attention_sweep --host      # + host time to issue one call (us)
    python -m perf_tools.attention_sweep --modes eager --autograd-threads on off
    python -m perf_tools.attention_sweep --rounds 3  # interleaved rounds: medians, ratio range
    python -m perf_tools.attention_sweep --batch 8 --shapes 16x2048 32x4096  # training batches
    python -m perf_tools.attention_sweep --kernels   # + the GPU kernels each provider ran
    python -m perf_tools.attention_sweep --replot sweep.json --plot sweep.png  # no timing

`--autograd-threads off` runs the backward on the calling thread
(`torch.autograd.set_multithreading_enabled(False)`) instead of autograd's device thread. A
Python autograd Function (ours) pays for that thread on every backward (the Function's
Python backward needs the interpreter from the device thread); SDPA's C++ backward does not,
so the eager rows of the two settings measure that cost side by side.

Host-bound rows (short sequences) move by tens of percent between timings. `--rounds N`
times every provider of a row N times, interleaved (round r starts at the r-th provider), and
reports each provider's median over the rounds, with `ours_vs_best_min` / `_max`: the
lowest and highest of the per-round ratios (ours against the best SDPA of the same round)
and `ours_vs_best_rounds`, every round's ratio in round order.

Rows whose calls may replay from flashattn_triton's C++ path (column `cpp_launch`) also
count, over all rounds, ours' forwards and backwards that did (`ours_cpp_forward`,
`ours_cpp_backward`) and backwards of a replayed forward that went to Python
(`ours_cpp_backward_fallback`).

`--kernels` (GPU only) profiles one more forward + backward per provider and row after its
timings and records the kernels it ran, in launch order, as `<provider>_kernels` (CSV, JSON
and one printed line per row): which of our kernels a row took (the Triton or the Gluon
forward, the backward's scheme) and which kernels SDPA's backends chose.

Providers: `ours` (`flashattn_triton.flash_attention`), `sdpa-flash` and `sdpa-cudnn`
(`F.scaled_dot_product_attention` pinned to one backend for the whole timing, so the pin
costs nothing per call). Without a GPU it runs tiny shapes on the CPU (ours only: there
``flash_attention`` takes its PyTorch implementation) so the command can be tried anywhere.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from perf_tools import _cli, report, timing
from perf_tools._compile import (
    allow_recompiles,
    compile_for_bench,
    compiled_launch_options,
    cpp_launch_counters,
    ready_cpp_launch,
)
from perf_tools.attention_sweep_results import (
    add_ratios,
    fill_medians,
    plot,
    ratio_range,
    shape_label,
    summary,
)

# (heads, N) of the sweep; (32, 32768) is the 8B model's shape, swept at d = 128 only.
SHAPES: tuple[tuple[int, int], ...] = (
    (128, 512),
    (64, 1024),
    (32, 2048),
    (16, 4096),
    (8, 8192),
    (16, 16384),
    (32, 32768),
)
D128_ONLY = {(32, 32768)}
CPU_SHAPES: tuple[tuple[int, int], ...] = ((2, 64), (1, 128))
PROVIDERS = ("ours", "sdpa-flash", "sdpa-cudnn")
MODES = ("eager", "compiled")
_SDPA = {"sdpa-flash": "FLASH_ATTENTION", "sdpa-cudnn": "CUDNN_ATTENTION"}


@dataclass(frozen=True)
class SweepConfig:
    """What one sweep runs (the CLI's flags, typed)."""

    shapes: tuple[tuple[int, int], ...]  # (heads, N); the sequences: lists held as tuples
    head_dims: tuple[int, ...] = (64, 128)
    causal: tuple[bool, ...] = (True, False)
    modes: tuple[str, ...] = MODES
    providers: tuple[str, ...] = PROVIDERS
    dtype: torch.dtype = torch.bfloat16
    # normalized to a torch.device (a name is accepted); None: cuda when visible, else cpu
    device: torch.device | str | None = None
    rep_ms: float = 200.0
    warmup_ms: float = 50.0
    graphed: bool = False
    quiet: bool = False
    # autograd's device thread on (torch's default) / off (the backward on the calling thread)
    autograd_threads: tuple[bool, ...] = (True,)
    rounds: int = 1  # interleaved timings of each row's providers (medians reported)
    batch: int = 1  # sequences per call: q, k, v are (batch, heads, N, d)
    kernels: bool = False  # profile one more call per provider and row: its GPU kernels
    host: bool = False  # also the host time to issue one call (``_host_us``)

    def __post_init__(self) -> None:
        device = self.device if self.device is not None else _cli.default_device()
        object.__setattr__(self, "device", _cli.config_device(device))
        # lists are accepted and held as tuples, so the frozen config hashes
        shapes = _cli.config_tuple("shapes", self.shapes)
        for shape in shapes:
            pair = _cli.config_tuple("shapes", shape)
            if len(pair) != 2:
                raise ValueError(f"shapes: expected (heads, N) pairs, got {shape!r}")
            for n in pair:
                _cli.config_int("shapes", n, 1)
        object.__setattr__(self, "shapes", tuple(tuple(shape) for shape in shapes))
        head_dims = _cli.config_tuple("head_dims", self.head_dims)
        object.__setattr__(
            self, "head_dims", tuple(_cli.config_int("head_dims", d, 1) for d in head_dims)
        )
        for name, allowed in (
            ("causal", (True, False)),
            ("modes", MODES),
            ("providers", PROVIDERS),
            ("autograd_threads", (True, False)),
        ):
            object.__setattr__(self, name, _cli.config_tuple(name, getattr(self, name), allowed))
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"dtype: expected a torch.dtype, got {self.dtype!r}")
        for name in ("rep_ms", "warmup_ms"):
            _cli.config_number(name, getattr(self, name), 0)
        _cli.config_int("rounds", self.rounds, 1)
        _cli.config_int("batch", self.batch, 1)
        if self.kernels and self.device.type != "cuda":
            raise ValueError("kernels: profiling the GPU kernels needs a CUDA device")


def _attention(provider: str, causal: bool, compiled: bool) -> Callable[..., torch.Tensor]:
    """The provider's attention (q, k, v) -> o. Compiled, SDPA's backend is pinned inside the
    traced function (each provider its own code, so Dynamo keeps one graph per backend);
    eager, ``_pinned`` pins it around the whole timing instead."""
    if provider == "ours":
        from flashattn_triton import flash_attention

        def ours(q, k, v):
            return flash_attention(q, k, v, causal=causal)

        return compile_for_bench(ours) if compiled else ours
    if not compiled:
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, _SDPA[provider])

    def sdpa_flash(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def sdpa_cudnn(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return compile_for_bench(sdpa_flash if provider == "sdpa-flash" else sdpa_cudnn)


@contextlib.contextmanager
def _pinned(provider: str) -> Iterator[None]:
    """SDPA restricted to the provider's backend while it is timed (no-op for ours)."""
    if provider not in _SDPA:
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(getattr(SDPBackend, _SDPA[provider])):
        yield


def _runs_here(provider: str, device: torch.device) -> str | None:
    """None if the provider can run on ``device``, else why not (``flash_attention`` runs
    anywhere: off-GPU it takes its PyTorch implementation)."""
    if device.type != "cuda" and provider in _SDPA:
        return "SDPA's flash / cuDNN backends need a GPU"
    return None


def _bench(fn: Callable[[], Any], cfg: SweepConfig) -> float:
    """Median ms of fn: do_bench on a GPU, a wall-clock median on the CPU."""
    if cfg.device.type == "cuda":
        import triton

        return triton.testing.do_bench(
            fn, warmup=cfg.warmup_ms, rep=cfg.rep_ms, return_mode="median"
        )
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[1]


def _graphed_ms(fn: Callable[[], Any], cfg: SweepConfig) -> float:
    """GPU time of one call captured in a CUDA graph (no host cost)."""
    import triton

    graph = _capture(fn)
    return triton.testing.do_bench(
        graph.replay, warmup=cfg.warmup_ms, rep=cfg.rep_ms, return_mode="median"
    )


def _capture(fn: Callable[[], Any]) -> torch.cuda.CUDAGraph:
    """One call of ``fn`` recorded in a CUDA graph, after a warm-up call on a side stream.
    Where the capture fails, ``torch.cuda.graph``'s exit can leave its capture stream
    current (it restores the stream only after ending the capture succeeds), and then every
    later cell of a sweep failed; here the calling stream is made current again."""
    calling = torch.cuda.current_stream()
    stream = torch.cuda.Stream()
    stream.wait_stream(calling)
    with torch.cuda.stream(stream):
        fn()
    calling.wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    finally:
        if torch.cuda.current_stream() != calling:
            torch.cuda.set_stream(calling)
    return graph


# Host time per call: back-to-back calls per sample (fewer for long calls, so that a sample
# queues about HOST_QUEUE_MS of GPU work at most), and samples per cell (median).
HOST_CALLS, HOST_MIN_CALLS, HOST_QUEUE_MS, HOST_SAMPLES = 20, 3, 50.0, 5


def _host_us(fn: Callable[[], Any], ms: float, cfg: SweepConfig) -> float:
    """Microseconds the host takes to issue one call of ``fn`` (timed at ``ms`` per call):
    back-to-back calls with the clock stopped before synchronizing, median of HOST_SAMPLES.
    Where the GPU is slower than the host this is the submission cost alone, what a step
    pays on the host per call; on the CPU it is the call's wall time."""
    calls = max(HOST_MIN_CALLS, min(HOST_CALLS, int(HOST_QUEUE_MS / max(ms, 1e-3))))
    return timing.host_us_per_call(fn, cfg.device, calls, HOST_SAMPLES)


def _inputs(heads: int, n: int, d: int, cfg: SweepConfig, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device=cfg.device).manual_seed(seed)
    shape = (cfg.batch, heads, n, d)
    q, k, v = (
        torch.randn(shape, device=cfg.device, generator=g, dtype=cfg.dtype).requires_grad_()
        for _ in range(3)
    )
    do = torch.randn(shape, device=cfg.device, generator=g, dtype=cfg.dtype)
    return q, k, v, do


def _fwd_bwd(attn, q, k, v, do, fresh_leaves: bool = False) -> Callable[[], None]:
    """One forward and backward of ``attn``, as every cell times it. ``fresh_leaves``: q, k,
    v are detached into new leaves per call, for CUDA graph capture: a leaf's gradient node
    belongs to the stream it was first used on, and the backward of a leaf used on the
    default stream makes that stream wait on the capturing one, which ends the capture
    ("operation would make the legacy stream depend on a capturing blocking stream")."""

    def fwd_bwd() -> None:
        o = attn(q, k, v)
        torch.autograd.grad(o, (q, k, v), do)

    def fwd_bwd_fresh() -> None:
        leaves = tuple(t.detach().requires_grad_() for t in (q, k, v))
        torch.autograd.grad(attn(*leaves), leaves, do)

    return fwd_bwd_fresh if fresh_leaves else fwd_bwd


def _cell(attn, q, k, v, do, cfg: SweepConfig) -> dict[str, float]:
    fwd_bwd = _fwd_bwd(attn, q, k, v, do)
    out = {"ms": _bench(fwd_bwd, cfg)}
    if cfg.graphed and cfg.device.type == "cuda":
        out["graphed_ms"] = _graphed_ms(_fwd_bwd(attn, q, k, v, do, fresh_leaves=True), cfg)
    if cfg.host:
        out["host_us"] = _host_us(fwd_bwd, out["ms"], cfg)
    return out


def _shapes_for(d: int, cfg: SweepConfig) -> list[tuple[int, int]]:
    return [s for s in cfg.shapes if d == 128 or s not in D128_ONLY]


def run_sweep(
    cfg: SweepConfig, on_row: Callable[[list[dict[str, Any]]], None] | None = None
) -> list[dict[str, Any]]:
    """One row per (mode, causal, d, heads, N, autograd threads): each provider's ms and ours /
    best SDPA. ``on_row(rows)`` runs after each row with the rows so far (``main`` saves
    them, so a sweep stopped part-way keeps its finished rows)."""
    allow_recompiles()
    cpp = ready_cpp_launch() if "ours" in cfg.providers and cfg.device.type == "cuda" else None
    rows: list[dict[str, Any]] = []
    groups = [
        (m, c, d, t)
        for m in cfg.modes
        for t in cfg.autograd_threads
        for c in cfg.causal
        for d in cfg.head_dims
    ]
    total = sum(len(_shapes_for(d, cfg)) for _, _, d, _ in groups) * len(cfg.providers)
    from tqdm import tqdm

    bar = tqdm(total=total * cfg.rounds, desc="attention sweep", disable=cfg.quiet, leave=False)
    for mode, causal, d, threads in groups:
        fns = {p: _attention(p, causal, mode == "compiled") for p in cfg.providers}
        for heads, n in _shapes_for(d, cfg):
            row: dict[str, Any] = {"mode": mode, "causal": causal, "d": d, "heads": heads, "N": n}
            if cfg.autograd_threads != (True,):
                row["autograd_threads"] = "on" if threads else "off"
            if cfg.batch != 1:
                row["batch"] = cfg.batch
            if mode == "compiled" and "ours" in cfg.providers and cfg.device.type == "cuda":
                row.update(compiled_launch_options())
            if cpp is not None and (mode == "eager" or row.get("cpp_launch_compiled")):
                row["cpp_launch"] = cpp  # whether the calls replay from C++
            q, k, v, do = _inputs(heads, n, d, cfg, seed=len(rows))
            label = f"{mode} causal={causal} d={d} {shape_label(row)}"
            before = cpp_launch_counters() if "cpp_launch" in row else None
            cells, notes = _time_providers(fns, (q, k, v, do), mode, threads, cfg, bar, label)
            if before:  # ours' calls of every round that replayed from C++ (SDPA adds none)
                after = cpp_launch_counters()
                row.update({f"ours_cpp_{name}": after[name] - before[name] for name in after})
            fill_medians(row, cfg.providers, cells, notes)
            add_ratios(row, cfg.providers)
            if cfg.rounds > 1:
                ratio_range(row, cfg.providers, cells, notes)
            if cfg.kernels:
                _record_kernels(row, fns, (q, k, v, do), mode, threads, notes)
                if not cfg.quiet:
                    bar.write(_kernels_line(row, label, cfg.providers))
            rows.append(row)
            del q, k, v, do
            if on_row is not None:
                on_row(rows)
    bar.close()
    return rows


def _time_providers(
    fns: dict[str, Callable[..., torch.Tensor]],
    inputs: tuple[torch.Tensor, ...],
    mode: str,
    threads: bool,
    cfg: SweepConfig,
    bar: Any,
    label: str,
) -> tuple[dict[str, list[dict[str, float]]], dict[str, str]]:
    """Each provider's cells over cfg.rounds interleaved rounds (round r starts at the r-th
    provider), and why a provider did not run (not here, OOM, an SDPA backend refusing)."""
    cells: dict[str, list[dict[str, float]]] = {p: [] for p in cfg.providers}
    notes: dict[str, str] = {}
    providers = list(cfg.providers)
    for r in range(cfg.rounds):
        first = r % len(providers)
        for p in providers[first:] + providers[:first]:
            bar.set_postfix_str(f"{label} {p}")
            why = notes.get(p) or _runs_here(p, cfg.device)
            if why is None:
                try:
                    with (
                        _pinned(p) if mode == "eager" else contextlib.nullcontext(),
                        torch.autograd.set_multithreading_enabled(threads),
                    ):
                        cells[p].append(_cell(fns[p], *inputs, cfg))
                except torch.OutOfMemoryError:
                    why = "OOM"
                except RuntimeError as e:  # e.g. no kernel of that SDPA backend here
                    why = str(e).splitlines()[0][:80]
            if why is not None:
                notes[p] = why
            if cfg.device.type == "cuda":
                torch.cuda.empty_cache()
            bar.update()
    return cells, notes


def profile_kernels(fn: Callable[[], Any]) -> str:
    """The GPU kernels one call of ``fn`` runs, in launch order, joined by " + " (a profiler
    that fails leaves a note instead: the timings already taken stand)."""
    from torch.profiler import ProfilerActivity, profile

    from perf_tools.trace_analysis import kernel_sequence

    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        names = kernel_sequence(prof.events())
    except RuntimeError as e:  # e.g. no CUPTI in this build of torch
        return f"(profiler failed: {str(e).splitlines()[0][:80] if str(e) else type(e).__name__})"
    return " + ".join(names) or "(none recorded)"


def _record_kernels(
    row: dict[str, Any],
    fns: dict[str, Callable[..., torch.Tensor]],
    inputs: tuple[torch.Tensor, ...],
    mode: str,
    threads: bool,
    notes: dict[str, str],
    profile: Callable[[Callable[[], Any]], str] | None = None,
) -> None:
    """``<provider>_kernels``: the kernels of one forward + backward of each provider that
    ran, under the settings it was timed with (``profile``: ``profile_kernels``)."""
    profile = profile or profile_kernels
    for p, attn in fns.items():
        if p in notes:
            continue
        with (
            _pinned(p) if mode == "eager" else contextlib.nullcontext(),
            torch.autograd.set_multithreading_enabled(threads),
        ):
            row[f"{p}_kernels"] = profile(_fwd_bwd(attn, *inputs))


def _kernels_line(row: dict[str, Any], label: str, providers: Sequence[str]) -> str:
    """One printed line per row: each provider's kernels."""
    parts = [f"{p}: {row[f'{p}_kernels']}" for p in providers if f"{p}_kernels" in row]
    return f"{label} | " + " | ".join(parts)


def _shape(text: str) -> tuple[int, int]:
    try:
        heads, n = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"shape: expected HEADSxN like 32x2048, got {text!r}"
        ) from None
    if heads < 1 or n < 1:
        raise argparse.ArgumentTypeError(f"shape: heads and N must be positive, got {text!r}")
    return heads, n


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m perf_tools.attention_sweep",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--shapes", nargs="+", type=_shape, help="HEADSxN (default: the sweep)")
    p.add_argument(
        "--batch", type=_cli.positive_int, default=1, help="sequences per call (default 1)"
    )
    p.add_argument("--d", nargs="+", type=_cli.positive_int, default=[64, 128])
    p.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--device", type=_cli.device_arg, default=None)
    p.add_argument("--rep-ms", type=_cli.positive_float, default=200.0)
    p.add_argument("--warmup-ms", type=_cli.positive_float, default=50.0)
    p.add_argument("--graphed", action="store_true", help="also the GPU-only (CUDA graph) time")
    p.add_argument(
        "--host",
        action="store_true",
        help="also the host time to issue one call (us: back-to-back calls, the clock "
        "stopped before synchronizing)",
    )
    p.add_argument(
        "--kernels",
        action="store_true",
        help="GPU only: profile one more call per provider and row and record the kernels "
        "it ran (<provider>_kernels in the CSV / JSON)",
    )
    p.add_argument(
        "--autograd-threads",
        nargs="+",
        choices=("on", "off"),
        default=["on"],
        help="on: the backward on autograd's device thread (torch's default); off: on the "
        "calling thread (torch.autograd.set_multithreading_enabled(False)); both: a row each",
    )
    p.add_argument(
        "--rounds",
        type=_cli.positive_int,
        default=1,
        help="time each row's providers N times, interleaved; report medians and the range "
        "of the per-round ratios (ours_vs_best_min / _max)",
    )
    p.add_argument(
        "--replot",
        type=Path,
        metavar="JSON",
        help="print the rows of an earlier run's --json instead of timing, with their ratios "
        "derived again; --plot draws them, --csv / --json save them with that run's metadata",
    )
    _cli.add_output_args(p)
    return p


def config_from_args(a: argparse.Namespace) -> SweepConfig:
    device = a.device or torch.device(_cli.default_device())
    shapes = tuple(a.shapes) if a.shapes else (SHAPES if device.type == "cuda" else CPU_SHAPES)
    causal = {"both": (True, False), "yes": (True,), "no": (False,)}[a.causal]
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float16
    if device.type == "cpu":
        dtype = torch.float32  # the CPU paths (interpreter, SDPA math) run float32
    if a.kernels and device.type != "cuda":
        raise SystemExit("--kernels: profiling the GPU kernels needs a CUDA device")
    return SweepConfig(
        shapes=shapes,
        head_dims=tuple(a.d),
        causal=causal,
        modes=tuple(a.modes),
        providers=tuple(a.providers),
        dtype=dtype,
        device=device,
        rep_ms=a.rep_ms,
        warmup_ms=a.warmup_ms,
        graphed=a.graphed,
        quiet=a.quiet,
        autograd_threads=tuple(dict.fromkeys(t == "on" for t in a.autograd_threads)),
        rounds=a.rounds,
        batch=a.batch,
        kernels=a.kernels,
        host=a.host,
    )


COLUMNS = (
    "mode", "autograd_threads", "traced_compile", "cpp_launch_compiled", "cpp_launch", "causal",
    "d", "batch", "heads", "N",
    "ours_ms", "sdpa-flash_ms", "sdpa-cudnn_ms", "ours_vs_best", "ours_vs_best_min",
    "ours_vs_best_max", "ours_vs_best_rounds", "ours_graphed_ms", "sdpa-flash_graphed_ms",
    "sdpa-cudnn_graphed_ms", "ours_graphed_vs_best", "ours_host_us", "sdpa-flash_host_us",
    "sdpa-cudnn_host_us", "ours_host_vs_best", "ours_cpp_forward", "ours_cpp_backward",
    "ours_cpp_backward_fallback",
)  # fmt: skip


def rows_from_json(path: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The rows of an earlier run's ``--json``, their ratios derived again (files written
    before a ratio column existed get it), and that run's metadata."""
    try:
        payload = json.loads(Path(path).read_text())
        rows, meta = payload["rows"], payload.get("meta") or {}
        for row in rows:
            missing = [k for k in ("mode", "causal", "d", "heads", "N") if k not in row]
            if missing:
                raise KeyError(f"a row without {', '.join(missing)}")
            add_ratios(row, PROVIDERS)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise SystemExit(f"--replot: cannot read sweep rows from {path}: {e}") from None
    return rows, meta


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.replot is not None:  # the earlier run's rows and metadata, saved again if asked
        rows, meta = rows_from_json(a.replot)
        report.save_rows(rows, csv_path=a.csv, json_path=a.json, meta=meta)
        dev = str(meta.get("device") or "device unknown")
        batches = {r.get("batch", 1) for r in rows}
        batch = "" if batches <= {1} else f", batch {', '.join(map(str, sorted(batches)))}"
    else:
        cfg = config_from_args(a)
        rows = run_sweep(cfg, on_row=report.rows_saver(a.csv, a.json))
        dev = torch.cuda.get_device_name(cfg.device) if cfg.device.type == "cuda" else "CPU"
        batch = "" if cfg.batch == 1 else f", batch {cfg.batch}"
    cols = [c for c in COLUMNS if any(c in r for r in rows)]
    report.print_table(rows, cols, title=f"attention fwd+bwd, ms (median), {dev}{batch}")
    print(summary(rows))
    if a.plot is not None and rows:
        plot(rows, a.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
