"""Attention benchmarks of the handout (1.2.1, 1.3, 1.3.2): `python -m perf_tools.attention`.

  naive        pytorch_attention + torch_compile (a): lm_core's naive attention, eager and
               torch.compile'd, batch 8, no heads, d x seq grid: forward ms, memory in use
               before backward (measured and predicted), backward ms, OOM cells marked, and
               the memory accounting of one configuration.
  flash        flash_benchmarking: batch 1, causal, seq 128..65536, d 16..128, bf16 and fp32:
               forward / backward / forward+backward ms (triton do_bench median) of ours
               (FlashAttention2Triton) vs naive PyTorch vs SDPA backends, TFLOP/s, speedups,
               FLOPs and the floor (FLOPs / peak) per row.
  leaderboard  the course leaderboard shape: (16, 16384, 64) bf16 causal, compiled apply,
               o.sum().backward(), do_bench median, ours beside SDPA flash and cuDNN.

With no sub-command: naive, then flash. `--quick` runs a representative subset (about a minute
on an H100); on a machine without a GPU every sub-command uses tiny sizes.

Examples:
  python -m perf_tools.attention --quick --csv attn.csv --plot attn.png
  python -m perf_tools.attention naive --d 16 32 64 128 --seq 256 1024 4096 8192 16384
  python -m perf_tools.attention flash --dtype bf16 --providers flash-triton sdpa-cudnn naive
  python -m perf_tools.attention leaderboard
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from perf_tools import _cli, hardware, report, timing
from perf_tools._compile import compile_for_bench
from perf_tools.attention_naive import (
    DTYPE_ALIASES,
    DTYPES,
    NAIVE_COLUMNS,
    AttentionGrid,
    MiB,
    NaiveConfig,
    failure,
    make_inputs,
    naive_accounting,
    naive_grid,
    naive_saved_bytes,
    plot_naive,
    print_accounting,
    run_naive,
)
from perf_tools.attention_providers import PROVIDERS, make_provider, triton_runs_here
from perf_tools.flops import attention_flops
from perf_tools.harness import progress as _bar
from perf_tools.harness import release as _release

# the naive sweep's names stay importable from here, where they used to live
__all__ = [
    "DTYPES", "DTYPE_ALIASES", "FLASH_COLUMNS", "NAIVE_COLUMNS", "AttentionGrid", "FlashConfig",
    "MiB", "NaiveConfig", "Outputs", "build_parser", "config_from_args", "main",
    "naive_accounting", "naive_saved_bytes", "print_accounting", "run_flash", "run_naive",
]  # fmt: skip


# ----------------------------------------------------------------------------- CLI


def _common(p: argparse.ArgumentParser, *, inherit: bool = False) -> None:
    """Options accepted before and after the subcommand. With ``inherit`` (the subcommands)
    an option left out keeps the value given before the subcommand: argparse would otherwise
    copy the subcommand's default over it (``--csv x.csv flash`` wrote no CSV)."""
    d = {"default": argparse.SUPPRESS} if inherit else {}
    p.add_argument(
        "--device",
        type=_cli.device_arg,
        help="cpu or cuda (default: cuda if any)",
        **(d or {"default": None}),
    )
    p.add_argument(
        "--quick", action="store_true", help="a representative subset (~1 min on GPU)", **d
    )
    p.add_argument(
        "--peak-tflops", type=_cli.positive_float, help="peak TFLOP/s for the floor column", **d
    )
    p.add_argument("--seed", type=int, **(d or {"default": 0}))
    _cli.add_output_args(p, inherit=inherit)


def _grid(p: argparse.ArgumentParser, batch_help: str) -> None:
    p.add_argument("--batch", type=_cli.positive_int, help=batch_help)
    p.add_argument("--seq", nargs="+", type=_cli.listed(_cli.positive_int), help="sequence lengths")
    p.add_argument("--d", nargs="+", type=_cli.listed(_cli.positive_int), help="head dims")
    p.add_argument(
        "--dtype",
        nargs="+",
        type=_cli.listed(_cli.choice(tuple(DTYPES), DTYPE_ALIASES)),
        help="fp32, bf16, fp16",
    )
    p.add_argument(
        "--providers",
        nargs="+",
        type=_cli.listed(_cli.choice(PROVIDERS)),
        help=f"any of: {', '.join(PROVIDERS)}",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m perf_tools.attention",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    _common(p)
    sub = p.add_subparsers(dest="cmd", metavar="{naive,flash,leaderboard}")
    n = sub.add_parser("naive", help="naive attention eager vs compiled (handout 1.2.1, 1.3 a)")
    _common(n, inherit=True)
    _grid(n, "batch size (default 8)")
    n.add_argument(
        "--passes", type=_cli.positive_int, help="timed passes each (default 100; 3 on CPU)"
    )
    n.add_argument("--warmup", type=_cli.nonneg_int, help="warm-up passes (default 10; 1 on CPU)")
    n.add_argument(
        "--no-causal",
        action="store_true",
        help="plain softmax(QK^T/sqrt(d))V instead of lm_core's causal naive attention",
    )
    f = sub.add_parser("flash", help="ours vs PyTorch vs SDPA (handout flash_benchmarking)")
    _common(f, inherit=True)
    _grid(f, "batch size (default 1)")
    f.add_argument("--rep-ms", type=_cli.positive_float, default=100.0, help="do_bench rep (ms)")
    f.add_argument("--warmup-ms", type=_cli.positive_float, default=25.0, help="do_bench warmup")
    f.add_argument("--no-causal", action="store_true", help="no causal mask (default causal)")
    lb = sub.add_parser("leaderboard", help="the course leaderboard shape, compiled apply")
    _common(lb, inherit=True)
    _grid(lb, "batch (heads as batch; default 16)")
    lb.add_argument("--rep-ms", type=_cli.positive_float, default=1000.0)
    lb.add_argument("--warmup-ms", type=_cli.positive_float, default=200.0)
    return p


# ----------------------------------------------------------------------------- configs


@dataclass(frozen=True, kw_only=True)
class FlashConfig(AttentionGrid):
    """One flash (or leaderboard) sweep: the sub-command's flags, defaults filled in."""

    rep_ms: float = 100.0  # do_bench rep
    warmup_ms: float = 25.0  # do_bench warm-up
    # the course procedure: compiled apply, o.sum().backward(), forward+backward time only
    leaderboard: bool = False
    peak_tflops: float | None = None  # None: hardware.peak_tflops of each dtype

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("rep_ms", "warmup_ms", "peak_tflops"):
            value = getattr(self, name)
            if value is not None or name != "peak_tflops":
                _cli.config_number(name, value, 0)
        if self.leaderboard and not self.causal:
            raise ValueError("causal: the leaderboard shape is causal, got causal=False")


@dataclass(frozen=True)
class Outputs:
    """Where the tables go (--csv, --json, --plot). With ``several`` sub-commands in one run
    each file is named after its sub-command (x.csv: x-naive.csv, x-flash.csv)."""

    csv: Path | None = None
    json: Path | None = None
    plot: Path | None = None
    several: bool = False

    def __post_init__(self) -> None:
        for name in ("csv", "json", "plot"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str | Path):
                raise ValueError(f"{name}: expected a path or None, got {value!r}")
            if isinstance(value, str):
                object.__setattr__(self, name, Path(value))


def _flash_grid(cmd: str, device: torch.device, quick: bool) -> dict[str, Any]:
    """The default grid of flash / leaderboard: tiny off the GPU, a subset with ``quick``."""
    gpu = device.type == "cuda"
    if cmd == "flash":
        if not gpu:
            providers = ["naive", "flash-torch", "sdpa-flash", "sdpa-math"]
            if triton_runs_here(device):
                providers.insert(0, "flash-triton")
            base = {"batch": 1, "seq": [32, 64], "d": [16], "dtype": ["fp32"]}
            base |= {"providers": providers}
        elif quick:
            base = {"batch": 1, "seq": [1024, 4096, 16384], "d": [64, 128]}
            base |= {"dtype": ["bf16", "fp32"]}
            base |= {"providers": ["flash-triton", "naive", "sdpa-flash", "sdpa-cudnn"]}
        else:
            base = {"batch": 1, "seq": [2**i for i in range(7, 17)], "d": [16, 32, 64, 128]}
            base |= {"dtype": ["bf16", "fp32"]}
            base |= {"providers": ["flash-triton", "naive", "sdpa-flash", "sdpa-cudnn"]}
    else:  # leaderboard
        if gpu:
            base = {"batch": 16, "seq": [16384], "d": [64], "dtype": ["bf16"]}
        else:
            base = {"batch": 2, "seq": [64], "d": [16], "dtype": ["fp32"]}
        providers = ["flash-triton", "sdpa-flash", "sdpa-cudnn"]
        if not gpu:
            providers = ["flash-triton", "sdpa-flash", "naive"]
        base |= {"providers": providers}
    return base


def config_from_args(args: argparse.Namespace, cmd: str) -> NaiveConfig | FlashConfig:
    """The typed config of sub-command ``cmd`` (naive, flash or leaderboard): the grid for this
    device / --quick, with any values given on the command line. The one reader of the
    parser's Namespace: everything below takes the config."""
    device = args.device or torch.device(_cli.default_device())
    gpu = device.type == "cuda"
    base = naive_grid(gpu, args.quick) if cmd == "naive" else _flash_grid(cmd, device, args.quick)
    # the sub-command's own options are absent when no sub-command was named
    for key in ("batch", "passes", "warmup"):
        if getattr(args, key, None) is not None:
            base[key] = getattr(args, key)
    for key in ("seq", "d", "dtype", "providers"):
        given = _cli.flatten(getattr(args, key, None))
        if given:
            base[key] = given
    if not gpu and not triton_runs_here(device):
        if "flash-triton" in (_cli.flatten(getattr(args, "providers", None)) or ()):
            # asked for by name: its rows are marked unsupported, never measured as another
            print(
                "warning: flash-triton cannot run here (needs a CUDA device, or "
                "TRITON_INTERPRET=1 on CPU): its rows are marked unsupported",
                file=sys.stderr,
            )
        else:
            base["providers"] = [p for p in base["providers"] if p != "flash-triton"]
    grid: dict[str, Any] = {
        "device": device, "batch": base["batch"], "seq": base["seq"], "d": base["d"],
        "dtypes": base["dtype"], "providers": base["providers"], "seed": args.seed,
        "quiet": args.quiet,
        "causal": cmd == "leaderboard" or not getattr(args, "no_causal", False),
    }  # fmt: skip
    if cmd == "naive":
        return NaiveConfig(**grid, passes=base["passes"], warmup=base["warmup"])
    rep, warm = getattr(args, "rep_ms", 100.0), getattr(args, "warmup_ms", 25.0)
    if not gpu:  # tiny sizes off the GPU: short timings too
        rep, warm = min(rep, 20.0), min(warm, 5.0)
    return FlashConfig(
        **grid, rep_ms=rep, warmup_ms=warm, leaderboard=cmd == "leaderboard",
        peak_tflops=args.peak_tflops,
    )  # fmt: skip


# ----------------------------------------------------------------------------- measuring


def run_flash(cfg: FlashConfig) -> list[dict[str, Any]]:
    """Forward, backward and forward+backward ms of every provider over the grid."""
    device, causal = cfg.device, cfg.causal
    rows: list[dict[str, Any]] = []
    cells = [(dt, d, n) for dt in cfg.dtypes for d in cfg.d for n in sorted(cfg.seq)]
    oom_at: dict[tuple[str, str, int], int] = {}
    bar = _bar(len(cells) * len(cfg.providers), "flash benchmark", cfg.quiet)
    for dt_name, d, seq in cells:
        dtype = DTYPES[dt_name]
        batch = cfg.batch
        flops = {p: attention_flops(batch, 1, seq, seq, d, causal, p) for p in ("fwd", "bwd")}
        flops["fwd_bwd"] = flops["fwd"] + flops["bwd"]
        peak = cfg.peak_tflops or hardware.peak_tflops(dt_name, device)
        cell_rows = []
        for provider in cfg.providers:
            row: dict[str, Any] = {
                "seq": seq,
                "d": d,
                "dtype": dt_name,
                "batch": batch,
                "causal": causal,
                "provider": provider,
                "status": None,
                "fwd_ms": None,
                "bwd_ms": None,
                "fwd_bwd_ms": None,
                "gflop_fwd": flops["fwd"] / 1e9,
                "gflop_fwd_bwd": flops["fwd_bwd"] / 1e9,
                "floor_fwd_ms": None if peak is None else flops["fwd"] / (peak * 1e12) * 1e3,
                "floor_fwd_bwd_ms": None
                if peak is None
                else flops["fwd_bwd"] / (peak * 1e12) * 1e3,
            }
            first_oom = oom_at.get((provider, dt_name, d))
            if first_oom is not None and seq > first_oom:
                row["status"] = f"OOM (skipped: OOM at seq {first_oom})"
            else:
                row.update(_flash_cell(cfg, provider, seq, d, dtype))
                if str(row.get("status")).startswith("OOM"):
                    oom_at[(provider, dt_name, d)] = seq
            for key, f in (
                ("fwd", flops["fwd"]),
                ("bwd", flops["bwd"]),
                ("fwd_bwd", flops["fwd_bwd"]),
            ):
                ms = row.get(f"{key}_ms")
                row[f"{key}_tflops"] = f / (ms * 1e-3) / 1e12 if ms else None
            cell_rows.append(row)
            bar.update(1)
            _release(device)
        _speedups(cell_rows)
        rows.extend(cell_rows)
    bar.close()
    return rows


def _speedups(cell_rows: list[dict[str, Any]]) -> None:
    """speedup_vs_naive and vs_best_sdpa on forward+backward, within one (seq, d, dtype)."""
    key = "fwd_bwd_ms"
    naive = next((r[key] for r in cell_rows if r["provider"] == "naive" and r.get(key)), None)
    sdpa = [r[key] for r in cell_rows if r["provider"].startswith("sdpa-") and r.get(key)]
    best_sdpa = min(sdpa) if sdpa else None
    for r in cell_rows:
        ms = r.get(key)
        r["speedup_vs_naive"] = naive / ms if naive and ms else None
        r["vs_best_sdpa"] = best_sdpa / ms if best_sdpa and ms else None


def _flash_cell(
    cfg: FlashConfig, provider: str, seq: int, d: int, dtype: torch.dtype
) -> dict[str, Any]:
    device, warm, rep = cfg.device, cfg.warmup_ms, cfg.rep_ms
    out: dict[str, Any] = {"status": "ok"}
    stage = "build"
    try:
        fn = make_provider(provider, device, dtype, cfg.causal)
        q, k, v, do = make_inputs(cfg.batch, seq, d, dtype, device, cfg.seed)
        if cfg.leaderboard:
            # exactly the course procedure: compiled apply, o.sum().backward(), grads accumulate
            compiled = compile_for_bench(fn, dynamic=None)

            def fwd_bwd_lb() -> None:
                compiled(q, k, v).sum().backward()

            stage = "fwd_bwd"
            out["fwd_bwd_ms"] = timing.bench_ms(
                fwd_bwd_lb, device=device, warmup_ms=warm, rep_ms=rep
            )
            return out
        stage = "fwd"
        out["fwd_ms"] = timing.bench_ms(
            lambda: fn(q, k, v), device=device, warmup_ms=warm, rep_ms=rep
        )
        stage = "bwd"

        def backward_ms() -> float:
            o = fn(q, k, v)  # one forward; its graph is kept for the repeated backward passes
            return timing.bench_ms(
                lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True),
                device=device,
                warmup_ms=warm,
                rep_ms=rep,
            )

        out["bwd_ms"] = backward_ms()
        stage = "fwd_bwd"
        out["fwd_bwd_ms"] = timing.bench_ms(
            lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), do),
            device=device,
            warmup_ms=warm,
            rep_ms=rep,
        )
    except Exception as exc:
        status = failure(provider, exc)
        out["status"] = status if stage in ("build", "fwd") else f"{status} in {stage}"
        if status.startswith("error"):
            import traceback

            traceback.print_exc()
    return out


# ----------------------------------------------------------------------------- output

FLASH_COLUMNS = [
    "dtype", "d", "seq", "provider", "status", "fwd_ms", "bwd_ms", "fwd_bwd_ms",
    "fwd_bwd_tflops", "speedup_vs_naive", "vs_best_sdpa", "gflop_fwd_bwd", "floor_fwd_bwd_ms",
]  # fmt: skip


def _with_suffix(path: Path | None, suffix: str, several: bool) -> Path | None:
    if path is None or not several:
        return path
    return path.with_name(f"{path.stem}-{suffix}{path.suffix}")


def _emit(
    out: Outputs,
    name: str,
    rows: list[dict[str, Any]],
    columns: Sequence[str],
    title: str,
    plot: Callable[[list[dict[str, Any]], Path], Path] | None,
) -> None:
    """Print the table, save CSV / JSON and the plot where asked, and say where they went."""
    cols = [c for c in columns if any(r.get(c) is not None for r in rows)]
    report.print_table(rows, cols, title=title)
    csv_path = _with_suffix(out.csv, name, out.several)
    json_path = _with_suffix(out.json, name, out.several)
    report.save_rows(rows, csv_path=csv_path, json_path=json_path)
    for what, path in (("csv", csv_path), ("json", json_path)):
        if path is not None:
            print(f"{what}: {path}")
    plot_path = _with_suffix(out.plot, name, out.several)
    if plot_path is not None and plot is not None:
        print(f"plot: {plot(rows, plot_path)}")


def _plot_flash(rows: list[dict[str, Any]], path: Path) -> Path:
    """Forward+backward ms against seq at one d (64 if swept), one line per provider, dtype."""
    ds = sorted({r["d"] for r in rows})
    d = 64 if 64 in ds else ds[len(ds) // 2]
    sel = [r for r in rows if r["d"] == d]
    return report.plot_lines(
        sel, x="seq", y="fwd_bwd_ms", group_by=["provider", "dtype"], path=path,
        title=f"attention forward+backward, batch 1, causal, d={d}", logx=True, logy=True,
        ylabel="forward+backward ms (do_bench median)",
    )  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI: parse, turn the flags into one config per sub-command, run, print and save."""
    args = build_parser().parse_args(argv)
    cmds = [args.cmd] if args.cmd else ["naive", "flash"]
    out = Outputs(csv=args.csv, json=args.json, plot=args.plot, several=len(cmds) > 1)
    dev = report.run_metadata()["device"]
    failed = False
    for cmd in cmds:
        cfg = config_from_args(args, cmd)
        if isinstance(cfg, NaiveConfig):
            rows = run_naive(cfg)
            _emit(out, "naive", rows, NAIVE_COLUMNS,
                  f"naive attention on {dev}: batch {cfg.batch}, mean ms over "
                  f"{cfg.passes} passes", plot_naive)  # fmt: skip
            if rows:
                print_accounting(rows, causal=cfg.causal)
        else:
            rows = run_flash(cfg)
            title = (
                f"{'leaderboard shape' if cmd == 'leaderboard' else 'flash benchmark'} on {dev}:"
                f" batch {cfg.batch}, do_bench median ms"
            )
            _emit(out, cmd, rows, FLASH_COLUMNS, title, _plot_flash if cmd == "flash" else None)
        failed |= any(str(r.get("status", "")).startswith("error") for r in rows)
        if rows and all(str(r.get("status", "")).startswith("unsupported") for r in rows):
            print(f"error: no provider of {cmd} can run on {cfg.device}", file=sys.stderr)
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
