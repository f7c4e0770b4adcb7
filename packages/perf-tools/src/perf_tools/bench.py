"""End-to-end model benchmark (handout 1.1.3): `python -m perf_tools.bench`.

Sweeps sizes x contexts x modes x precisions (x attention backends, x eager/compiled whole or
block by block, x CUDA graph, x optimizer after or overlapped with the backward) of lm_core's
TransformerLM on random tokens, optionally beside Hugging Face's LlamaForCausalLM at the same
dims (`--compare hf`). Each configuration: warm-up steps (timed apart, compile
included), then measured steps, each followed by a device synchronize. Reports mean / std /
median ms, per-phase ms (forward, backward, optimizer; CUDA events, no extra sync), tokens/s,
achieved TFLOP/s, MFU and peak memory. Out-of-memory configurations are rows saying OOM.

Multi-GPU mode (`--nprocs N --fsdp ours|torch`, `--ddp`, see `perf_tools.bench_dist`): every
cell trains on N ranks (spawned here, or under torchrun), the model sharded by zero_shard.FSDP
or torch's fully_shard, or replicated under torch's DistributedDataParallel (`--ddp`);
`--batch` is per rank; `--compile` compiles each block (the whole model under DDP). Rows
report the slowest rank's step time (median over steps), tokens/s over all ranks, MFU and peak
memory per GPU, and for `--fsdp ours` how long the compute waited for the all-gathers
(`gather_wait_ms`, `units_waited`). `--tp K` (`perf_tools.bench_tp`): tensor parallel over
K ranks, with `--fsdp torch` data parallel over N / K (2-D); `--batch` is then per
data-parallel group. Train rows on a known GPU add the planner's prediction (`pred_step_ms`,
`pred_mem_gib`; `perf_tools.bench_predict`).

This module is the command (the table, the outputs, one process or N ranks); its flags and
the sweep's cells are `perf_tools.bench_args`; the cells are measured by `perf_tools.cells`
(one process) or `perf_tools.bench_dist` (N ranks) through the harness.

Examples:
  python -m perf_tools.bench              # a small default on CPU, the full sizes on a GPU
  python -m perf_tools.bench --size small xl --precision fp32 bf16 --mode forward train
  python -m perf_tools.bench --size xl --precision bf16 --compile both --compare hf
  python -m perf_tools.bench --size xl --precision bf16 --mode train --compile on blocks \\
      --cuda-graph both --optimizer-overlap both
  python -m perf_tools.bench --size xl --precision bf16 --mode train --compile \\
      --cuda-graph --optimizer-state-dtype fp32 bf16
  python -m perf_tools.bench --size 2.7B --mode train --steps 3 --memory-snapshot mem.pickle
  nsys profile -c cudaProfilerApi -o trace python -m perf_tools.bench --size small --nvtx
  python -m perf_tools.bench --size xl --nprocs 2 --fsdp ours torch --precision bf16
  python -m perf_tools.bench --size xl --num-heads 20 --nprocs 2 --tp 2 --precision bf16
  python -m perf_tools.bench --size xl --num-heads 20 --nprocs 2 --ddp --fsdp torch \
      --precision bf16 --batch 2 --compile both
  python -m perf_tools.bench --size 2.7B --nprocs 4 --tp 2 --fsdp torch --sequence-parallel
  python -m perf_tools.bench --size 8B --context 32768 --batch 1 --nprocs 2 --fsdp ours \\
      --precision bf16 --mode train --fused-loss --activation-checkpointing 1 \\
      --attention sdpa --warmup 1 --steps 3
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from perf_tools import _cli, _dist, harness, isolated_runs, report
from perf_tools.bench_args import add_bench_args, resolve_bench_args, specs_from_args
from perf_tools.bench_dist import (
    gather_wait_notes,
    run_dist_sweep,
    run_torchrun_sweep,
    set_blas,
    set_tf32,
)
from perf_tools.cells import HF, OURS, BenchOptions, BenchSpec, run_sweep
from perf_tools.model_args import (
    GPU_DEFAULT_SIZES,
    MATMULS,
    add_model_args,
    profile_fields,
    resolve_model_args,
)

# Names other modules and users reach through `perf_tools.bench` (their homes are the imports
# above).
__all__ = [
    "GPU_DEFAULT_SIZES",
    "HF",
    "MATMULS",
    "OURS",
    "BenchOptions",
    "BenchSpec",
    "add_model_args",
    "build_parser",
    "cli",
    "main",
    "parse_args",
    "resolve_model_args",
    "run_sweep",
    "specs_from_args",
]

TABLE_COLUMNS = [
    "model",
    "size",
    "attention",
    "compile",
    "cuda_graph",
    "precision",
    "mode",
    "context",
    "nprocs",
    "fsdp",
    "ddp",
    "tp",
    "dp",
    "seq_parallel",
    "act_ckpt",
    "fused_loss",
    "blas",
    "matmul",
    "opt_overlap",
    "opt_state",
    "weights",
    "autograd_threads",
    "status",
    "dropin_calls",
    "cpp_replays",
    "mean_ms",
    "std_ms",
    "median_ms",
    "fwd_ms",
    "bwd_ms",
    "sync_ms",
    "opt_ms",
    "tokens_per_s",
    "tflops",
    "mfu_pct",
    "peak_mem_gib",
    "pred_step_ms",
    "pred_mem_gib",
    "gather_wait_ms",
    "units_waited",
    "warmup_s",
    "host_op_start_us",
    "host_op_us",
    "run",
    "vs_hf",
]
# configuration columns shown in the table only when some row uses them
OPTIONAL_CONFIG_COLUMNS = {
    "act_ckpt": "none",
    "fused_loss": False,
    "seq_parallel": False,
    "ddp": "none",
    "blas": "default",
    "matmul": "default",
    "opt_overlap": False,
    "opt_state": "fp32",
    "weights": "fp32",
    "autograd_threads": "on",
}
# ----------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m perf_tools.bench",
        description=__doc__.split("\nExamples:")[0],
        epilog="Examples:"
        + __doc__.split("\nExamples:")[1]
        + "\nLists take several values (--size small xl) or commas (--size small,xl).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_bench_args(p)
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The parsed and resolved flags (`bench_args.resolve_bench_args`)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    resolve_bench_args(parser, args)
    return args


def _profile(args: argparse.Namespace) -> int:
    """`--profile DIR`: `perf_tools.profile` on these flags, mapped to its typed config here
    (no Namespace crosses into profile)."""
    from perf_tools.profile import ProfileConfig, main_from_bench

    return main_from_bench(ProfileConfig(
        **profile_fields(args), out=args.profile, compiles=args.compiles,
        precisions=args.precisions, modes=args.modes, overlaps=args.overlaps,
        opt_states=args.opt_states, weights=args.weights, compile_backend=args.compile_backend,
    ))  # fmt: skip


# ----------------------------------------------------------------------------- output


def plot_rows(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """Step time against context (several contexts) or against model size (one context)."""
    ok = [r for r in rows if r.get("status") == "ok"]
    cols = ["model", "size", "attention", "compile", "cuda_graph", "opt_overlap", "precision"]
    cols += ["opt_state", "weights", "mode"]
    contexts = {r["context"] for r in rows}
    x = "context" if len(contexts) > 1 else "params_M"
    group = [c for c in cols if (len({r.get(c) for r in rows}) > 1 and c != "size") or c == "mode"]
    if x == "context" and len({r["size"] for r in rows}) > 1:
        group.append("size")
    return report.plot_lines(
        ok,
        x=x,
        y="median_ms",
        group_by=list(dict.fromkeys(group)),
        path=path,
        title="perf_tools.bench: median step time",
        logx=x == "context",
        logy=True,
        ylabel="median ms per step",
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.tf32:
        set_tf32(True)
    set_blas(args.blas)
    if args.profile is not None:
        return _profile(args)
    opts = BenchOptions(
        device=args.device,
        batch=args.batch,
        warmup=args.warmup,
        steps=args.steps,
        overrides=args.overrides,
        peak_tflops=args.peak_tflops,
        seed=args.seed,
        nvtx=args.nvtx,
        memory_snapshot=args.memory_snapshot,
        progress=not args.quiet,
        snapshot_paths=[],
        fused_loss=args.fused_loss,
        act_ckpt=args.activation_checkpointing,
        nprocs=args.nprocs,
        backend=args.backend,
        timeout_s=args.timeout_s,
        blas=args.blas,
        tp=args.tp,
        sequence_parallel=args.sequence_parallel,
        compile_backend=args.compile_backend,
        isolate=args.isolate,
        rounds=args.rounds,
    )
    specs = specs_from_args(args)
    multi = args.fsdps is not None
    if multi and _dist.under_torchrun():
        rows = run_torchrun_sweep(specs, opts)
        if rows is None:  # ranks other than 0 print nothing
            return 0
    elif multi:
        rows = run_dist_sweep(specs, opts)
    else:
        rows = run_sweep(specs, opts, on_rows=report.rows_saver(args.csv, args.json))
    cols = [c for c in TABLE_COLUMNS if _shown(c, rows)]
    report.print_table(rows, cols, title=_title(opts, rows))
    summary = None
    if opts.isolate > 1:
        summary = _rounds_summary(rows, cols, f"{opts.isolate} rounds of fresh processes")
    elif opts.rounds > 1:
        summary = _rounds_summary(rows, cols, f"{opts.rounds} rounds in one process")
    for line in gather_wait_notes(rows):
        print(line)
    report.save_rows(rows, csv_path=args.csv, json_path=args.json, summary=summary)
    if args.plot is not None and any(r.get("status") == "ok" for r in rows):
        print(f"plot: {plot_rows(rows, args.plot)}")
    for path in opts.snapshot_paths or []:
        print(f"memory snapshot: {path} (open at https://pytorch.org/memory_viz)")
    for what, path in (("csv", args.csv), ("json", args.json)):
        if path is not None:
            print(f"{what}: {path}")
    if harness.has_errors(rows):
        print("some configuration(s) failed with an error (see status)", file=sys.stderr)
        return 1
    return 0


def _rounds_summary(
    rows: Sequence[dict[str, Any]], cols: Sequence[str], rounds: str
) -> list[dict[str, Any]]:
    """The median over `--isolate N` or `--rounds N` rounds, one row per configuration:
    printed as a table and returned (the JSON's ``summary``)."""
    summary = isolated_runs.median_over_runs(rows, cols)
    if not summary:
        return summary
    config = [c for c in cols if c in summary[0] and c not in isolated_runs.SUMMARY_COLUMNS]
    shown = config + [
        c for c in isolated_runs.SUMMARY_COLUMNS if any(s.get(c) is not None for s in summary)
    ]
    title = f"median over {rounds} (spread: slowest / fastest run)"
    report.print_table(summary, shown, title=title)
    return summary


def _shown(col: str, rows: Sequence[dict[str, Any]]) -> bool:
    """A column is in the table when some row has it (config columns: a non-default value)."""
    if col in OPTIONAL_CONFIG_COLUMNS:
        return any(r.get(col) not in (None, OPTIONAL_CONFIG_COLUMNS[col]) for r in rows)
    if rows and all(r.get("fsdp") for r in rows):  # the multi-GPU mode
        if col == "cuda_graph":
            return False  # not available there
        if col == "compile":
            return any(r.get("compile") for r in rows)
    return any(r.get(col) is not None for r in rows)


def _title(opts: BenchOptions, rows: Sequence[dict[str, Any]]) -> str:
    """The table's title: device, batch, steps, and what the numbers are (MFU only where a
    peak is known: on a CPU or an unknown GPU the column is absent, and so is its name)."""
    dev = report.run_metadata()["device"]
    mfu = any(r.get("mfu_pct") is not None for r in rows)
    if opts.nprocs is not None:
        per_gpu = "TFLOP/s, MFU, memory per GPU" if mfu else "TFLOP/s, memory per GPU"
        per = "rank" if opts.tp == 1 else f"data-parallel group (tp {opts.tp})"
        return (
            f"perf_tools.bench on {opts.nprocs} x {dev} ({opts.backend}): batch {opts.batch} "
            f"per {per}, {opts.warmup} warm-up + {opts.steps} measured steps (median ms per "
            f"step of the slowest rank; tokens/s of the global batch; {per_gpu})"
        )
    what = "ms per step; MFU against the peak TFLOP/s" if mfu else "ms per step"
    return (
        f"perf_tools.bench on {dev}: batch {opts.batch}, {opts.warmup} warm-up + "
        f"{opts.steps} measured steps ({what})"
    )


def cli() -> None:
    """`python -m perf_tools.bench` and the `perf-bench` script: run `main`, exit with its code."""
    code = main()
    if _dist.under_torchrun():
        # A torchrun rank skips the interpreter's shutdown, as ddp_kit.launch's workers do:
        # with gloo's threads alive it has aborted now and then ("terminate called without
        # an active exception") after the results were written.
        _cli.exit_now(code)
    sys.exit(code)


if __name__ == "__main__":
    cli()
