"""Kernel-level profile of a model step, the Nsight questions answered in the terminal.

`python -m perf_tools.profile` (or `python -m perf_tools.bench --profile DIR`) runs the chosen
configurations (size x context x mode x precision; naive attention by default, so the attention
sub-steps exist as separate kernels) under torch.profiler after warm-up, with the ranges of
`bench --nvtx` as record_function ranges (step, forward, backward, optimizer; lm_core's
attention / scores / softmax / weighted-sum / ffn), and prints per configuration:

  1. the top kernels by total GPU time, with calls per step and share of all kernel time;
  2. the matmul / fused-attention / other split, for the step and for each phase;
  3. the GPU time of the work launched inside each named range (how: trace_analysis.py);
  4. softmax vs the two attention matmuls, with their FLOP counts beside them.

It writes, per configuration, the Perfetto / chrome trace (trace.json.gz, open it at
https://ui.perfetto.dev) and the four tables as CSV, plus tables.json; and a summary over all
configurations. On a machine without a GPU the same tables list CPU operators and CPU time.

Examples:
  python -m perf_tools.profile --size small --mode forward fwd-bwd train --out runs/prof
  python -m perf_tools.profile --size xl --precision bf16 --mode train --steps 2
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from perf_tools import _cli, harness, report, timing
from perf_tools.cells import (
    OURS,
    BenchOptions,
    BenchSpec,
    make_cell_step,
    release_optimizer,
    run_sweep,
)
from perf_tools.flops import SOFTMAX_FLOPS_PER_ELEMENT, attention_substep_flops
from perf_tools.model_args import (
    ATTENTIONS,
    MATMULS,
    add_model_args,
    add_step_args,
    profile_fields,
    resolve_model_args,
)
from perf_tools.steps import MODES, PRECISIONS, Annotator, lm_core_annotations
from perf_tools.trace_analysis import (
    RangeIndex,
    attention_table,
    extract,
    extract_trace,
    kernel_table,
    range_table,
    split_table,
)

# Range names looked for besides record_function user annotations (older torch builds may not
# flag those as annotations).
RANGE_NAMES = (
    "step",
    "forward",
    "backward",
    "optimizer",
    "attention",
    "attention/scores",
    "attention/softmax",
    "attention/weighted_sum",
    "ffn",
)
DEFAULT_OUT = Path("runs/profile")
SUMMARY_COLUMNS = [
    "size",
    "attention",
    "compile",
    "opt_overlap",
    "precision",
    "mode",
    "context",
    "status",
    "unit",
    "wall_ms_per_step",
    "busy_ms_per_step",
    "busy_pct",
    "matmul_pct",
    "top_item",
    "top_item_pct",
    "dir",
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m perf_tools.profile",
        description=__doc__.split("\nExamples:")[0],
        epilog="Examples:"
        + __doc__.split("\nExamples:")[1]
        + "\nLists take several values (--mode forward train) or commas.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_args(p)
    g = p.add_argument_group("profile")
    add_step_args(g, mode_default="all three", precision_default="fp32")
    g.add_argument("--compile", action="store_true", help="torch.compile the model")
    g.add_argument("--batch", type=_cli.positive_int, default=4, help="batch size (default 4)")
    g.add_argument(
        "--warmup", type=_cli.nonneg_int, default=3, help="steps before profiling (default 3)"
    )
    g.add_argument("--steps", type=_cli.positive_int, default=3, help="profiled steps (default 3)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--top", type=_cli.positive_int, default=15, help="kernels printed (default 15)")
    g.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        metavar="DIR",
        help=f"output directory (default ./{DEFAULT_OUT}; runs/ is git-ignored)",
    )
    g.add_argument("--no-trace", action="store_true", help="do not write the trace files")
    _cli.add_output_args(p, plot=False)
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    resolve_model_args(parser, args, gpu_default_sizes=("small",))
    return args


_DTYPES = ("fp32", "bf16")  # AdamW's moments, held linear weights (bench's two choices)
_ACT_CKPT = ("none", "sqrt", "optimal")
_AXES = (  # the fields swept over (every combination is a configuration)
    "sizes", "contexts", "attentions", "matmuls", "compiles", "precisions", "modes", "overlaps",
    "opt_states", "weights",
)  # fmt: skip


@dataclass(frozen=True)
class ProfileConfig:
    """What one profile run covers (the flags, typed): `config_from_args` builds it for
    `python -m perf_tools.profile`, bench from its own flags for `bench --profile DIR`."""

    out: Path  # per-configuration tables and traces, and the summary
    sizes: tuple[str, ...]
    contexts: tuple[int, ...]
    # normalized to a torch.device (a name is accepted); None: cuda when visible, else cpu
    device: torch.device | str | None = None
    overrides: dict[str, Any] = field(default_factory=dict)  # the presets' dims overridden
    attentions: tuple[str | None, ...] = (None,)  # None: naive (sub-steps as their own kernels)
    matmuls: tuple[str, ...] = ("default",)
    compiles: tuple[bool | str, ...] = (False,)  # False, True (whole model), "blocks"
    precisions: tuple[str, ...] = ("fp32",)
    modes: tuple[str, ...] = MODES
    # train rows only (bench --profile with --optimizer-overlap, --optimizer-state-dtype and
    # --matmul-weights; held bf16 weights in bf16 train rows only)
    overlaps: tuple[bool, ...] = (False,)
    opt_states: tuple[str, ...] = ("fp32",)
    weights: tuple[str, ...] = ("fp32",)
    batch: int = 4
    warmup: int = 3
    steps: int = 3
    seed: int = 0
    top: int = 15  # kernels printed per configuration
    trace: bool = True  # write trace.json.gz per configuration
    quiet: bool = False
    fused_loss: bool = False
    act_ckpt: str | int = "none"
    compile_backend: str = "inductor"
    csv_path: Path | None = None  # the summary again, where the user asked for it
    json_path: Path | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "out", Path(self.out))
        device = self.device if self.device is not None else _cli.default_device()
        object.__setattr__(self, "device", _cli.config_device(device))
        allowed: dict[str, tuple[Any, ...] | None] = {
            "sizes": None, "contexts": None, "attentions": (None, *ATTENTIONS),
            "matmuls": MATMULS, "compiles": (False, True, "blocks"), "precisions": PRECISIONS,
            "modes": MODES, "overlaps": (False, True), "opt_states": _DTYPES, "weights": _DTYPES,
        }  # fmt: skip
        for name in _AXES:  # lists welcome (the CLI's are), held as tuples
            values = _cli.config_tuple(name, getattr(self, name), allowed[name])
            object.__setattr__(self, name, values)
        for c in self.contexts:
            _cli.config_int("contexts", c, 1)
        for name, low in (("batch", 1), ("warmup", 0), ("steps", 1), ("top", 1)):
            _cli.config_int(name, getattr(self, name), low)
        _cli.config_int("seed", self.seed)
        k = self.act_ckpt  # a policy or K, blocks per checkpointed group
        if k not in _ACT_CKPT and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"act_ckpt: expected one of {_ACT_CKPT} or an int >= 1, got {k!r}")


def config_from_args(a: argparse.Namespace) -> ProfileConfig:
    """The parsed flags (`parse_args`) as the run's config, with the command's defaults."""
    return ProfileConfig(
        **profile_fields(a),
        out=a.out,
        compiles=(bool(a.compile),),
        precisions=_cli.flatten(a.precision) or ["fp32"],
        modes=_cli.flatten(a.mode) or list(MODES),
        top=a.top,
        trace=not a.no_trace,
    )


def _specs(cfg: ProfileConfig) -> list[BenchSpec]:
    attentions = [a or "naive" for a in cfg.attentions]
    return [
        BenchSpec(
            OURS,
            size,
            attention,
            compiled,
            precision,
            mode,
            context,
            matmul=matmul,
            overlap=o,
            opt_state=state,
            weights=w,
        )
        for size in cfg.sizes
        for attention in attentions
        for matmul in cfg.matmuls
        for compiled in cfg.compiles
        for precision in cfg.precisions
        for context in sorted(cfg.contexts)
        for mode in cfg.modes
        for o in (cfg.overlaps if mode == "train" else [False])
        for state in (cfg.opt_states if mode == "train" else ["fp32"])
        for w in (cfg.weights if mode == "train" and precision == "bf16" else ["fp32"])
    ]


class Profiler:
    """The `measure` hook of `cells.run_sweep` that profiles a cell instead of timing it."""

    def __init__(self, out: Path, *, top: int, trace: bool, echo: bool = True) -> None:
        self.out = out
        self.top = top
        self.trace = trace
        self.echo = echo
        self.tables: dict[str, dict[str, list[dict[str, Any]]]] = {}

    def __call__(
        self,
        model: nn.Module,
        runner: nn.Module,
        spec: BenchSpec,
        config: Any,
        opts: BenchOptions,
        n_cells: int = 1,
    ) -> dict[str, Any]:
        device = opts.device
        annotator = Annotator(record=True)
        step, optimizer = make_cell_step(model, runner, spec, config, opts, annotator, timer=None)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        walls = []
        try:
            with lm_core_annotations(spec.impl == OURS) as annotated:
                for _ in range(opts.warmup):
                    step()
                    timing.synchronize(device)
                with torch.profiler.profile(activities=activities) as prof:
                    for _ in range(opts.steps):
                        t0 = time.perf_counter()
                        step()
                        timing.synchronize(device)
                        walls.append(time.perf_counter() - t0)
        finally:
            release_optimizer(optimizer)
        del step, optimizer
        cell_dir = self.out / spec.label()
        cell_dir.mkdir(parents=True, exist_ok=True)
        if self.trace:
            prof.export_chrome_trace(str(cell_dir / "trace.json.gz"))
        if device.type == "cuda":
            items, spans, unit = extract_trace(_trace_json(prof, cell_dir, self.trace), RANGE_NAMES)
        else:
            items, spans, unit = extract(prof.events(), RANGE_NAMES)
        del prof
        tables = analyze(items, spans, opts.steps, config, opts.batch, spec)
        self.tables[spec.label()] = tables
        save_tables(tables, cell_dir, spec, unit)
        if self.echo:
            print_tables(tables, spec, unit, self.top, device, annotated)
        wall_ms = 1e3 * sum(walls) / len(walls)
        busy_ms = sum(r["ms_per_step"] for r in tables["kernels"])
        step_split = [r for r in tables["split"] if r["scope"] == "step"]
        matmul = next((r for r in step_split if r["class"] == "matmul"), None)
        top = tables["kernels"][0] if tables["kernels"] else None
        return {
            "status": "ok",
            "unit": unit,
            "wall_ms_per_step": wall_ms,
            "busy_ms_per_step": busy_ms,
            "busy_pct": 100.0 * busy_ms / wall_ms if wall_ms > 0 else None,
            "matmul_pct": matmul["share_of_scope_pct"] if matmul else 0.0,
            "top_item": top["name"] if top else None,
            "top_item_pct": top["share_pct"] if top else None,
            "dir": str(cell_dir),
        }


def _trace_json(prof: Any, cell_dir: Path, exported: bool) -> dict[str, Any]:
    """The profile's chrome trace as JSON (the one just written, or a temporary export)."""
    if exported:
        with gzip.open(cell_dir / "trace.json.gz", "rt") as f:
            return json.load(f)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text())


def analyze(
    items: Sequence[Any],
    spans: Sequence[Any],
    steps: int,
    config: Any,
    batch: int,
    spec: BenchSpec,
) -> dict[str, list[dict[str, Any]]]:
    """The four tables of one profiled configuration."""
    index = RangeIndex(spans)
    ranges = range_table(items, index, steps)
    flops = attention_substep_flops(config, batch, spec.context)
    return {
        "kernels": kernel_table(items, steps),
        "split": split_table(items, index, steps),
        "ranges": ranges,
        "attention": attention_table(ranges, flops),
    }


def save_tables(
    tables: dict[str, list[dict[str, Any]]], cell_dir: Path, spec: BenchSpec, unit: str
) -> None:
    for name, rows in tables.items():
        if rows:
            report.save_rows(rows, csv_path=cell_dir / f"{name}.csv")
    payload = {
        "meta": {**report.run_metadata(), "config": spec.label(), "unit": unit},
        "softmax_flops_per_element": SOFTMAX_FLOPS_PER_ELEMENT,
        **tables,
    }
    (cell_dir / "tables.json").write_text(json.dumps(payload, indent=2, default=str) + "\n")


def _short(name: str, width: int = 72) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def print_tables(
    tables: dict[str, list[dict[str, Any]]],
    spec: BenchSpec,
    unit: str,
    top: int,
    device: torch.device,
    annotated: bool,
) -> None:
    what = "GPU kernels" if unit == "kernel" else "CPU operators (self time; no GPU here)"
    head = f"{spec.label()} on {device}"
    kernels = [{**r, "name": _short(r["name"])} for r in tables["kernels"][:top]]
    report.print_table(kernels, title=f"{head}: top {what} by total time")
    report.print_table(tables["split"], title=f"{head}: matmul vs other ({unit} time)")
    ranges = [{**r, "top_item": _short(r["top_item"], 48)} for r in tables["ranges"]]
    report.print_table(ranges, title=f"{head}: {unit} time launched inside each named range")
    if tables["attention"]:
        report.print_table(
            tables["attention"],
            title=f"{head}: attention sub-steps, forward only "
            f"(softmax counted as {SOFTMAX_FLOPS_PER_ELEMENT} FLOPs per score)",
        )
    elif not annotated:
        print("note: lm_core has no set_annotations(); attention sub-steps are not ranged")
    else:
        print(
            f"note: attention backend {spec.attention!r} has no separate sub-steps "
            "(use --attention naive to see scores / softmax / weighted sum)"
        )


def run(cfg: ProfileConfig) -> list[dict[str, Any]]:
    """Profile every configuration of `cfg` into `cfg.out`; returns the summary rows."""
    opts = BenchOptions(
        device=cfg.device,
        batch=cfg.batch,
        warmup=cfg.warmup,
        steps=cfg.steps,
        overrides=dict(cfg.overrides),
        seed=cfg.seed,
        progress=not cfg.quiet,
        fused_loss=cfg.fused_loss,
        act_ckpt=cfg.act_ckpt,
        compile_backend=cfg.compile_backend,
    )
    out = cfg.out
    profiler = Profiler(out, top=cfg.top, trace=cfg.trace)
    rows = run_sweep(_specs(cfg), opts, measure=profiler)
    cols = [c for c in SUMMARY_COLUMNS if any(r.get(c) is not None for r in rows) and c != "dir"]
    if not any(r.get("opt_overlap") for r in rows):
        cols.remove("opt_overlap")
    shown = [{**r, "top_item": _short(str(r.get("top_item") or "-"), 48)} for r in rows]
    report.print_table(shown, cols, title=f"perf_tools.profile summary ({cfg.steps} steps each)")
    out.mkdir(parents=True, exist_ok=True)
    report.save_rows(rows, csv_path=out / "summary.csv", json_path=out / "summary.json")
    report.save_rows(rows, csv_path=cfg.csv_path, json_path=cfg.json_path)
    print(f"tables and traces: {out}/<config>/ (open trace.json.gz at https://ui.perfetto.dev)")
    return rows


def main_from_bench(cfg: ProfileConfig) -> int:
    """`bench --profile DIR`: profile bench's configurations (naive attention by default);
    bench maps its flags to `cfg`, so no argparse Namespace crosses between the modules."""
    return 1 if harness.has_errors(run(cfg)) else 0


def main(argv: Sequence[str] | None = None) -> int:
    cfg = config_from_args(parse_args(argv))
    return 1 if harness.has_errors(run(cfg)) else 0


if __name__ == "__main__":
    sys.exit(main())
