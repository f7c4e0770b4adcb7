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
from pathlib import Path
from typing import Any

import torch

from perf_tools import _cli, hardware, report, timing
from perf_tools._compile import compile_for_bench
from perf_tools.attention_providers import (
    PROVIDERS,
    UnsupportedError,
    is_unsupported_error,
    make_provider,
    triton_runs_here,
)
from perf_tools.flops import attention_flops
from perf_tools.harness import progress as _bar
from perf_tools.harness import release as _release

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
MiB = 2**20


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


def _defaults(args: argparse.Namespace, cmd: str) -> dict[str, Any]:
    """Grid of `cmd` for this device / --quick, with any values given on the command line."""
    gpu = args.device.type == "cuda"
    if cmd == "naive":
        if not gpu:
            base = {"batch": 2, "seq": [32, 64], "d": [16, 32], "dtype": ["fp32"], "passes": 3}
            base |= {"warmup": 1, "providers": ["naive", "naive-compiled"]}
        elif args.quick:
            base = {"batch": 8, "seq": [1024, 4096, 16384], "d": [64], "dtype": ["fp32"]}
            base |= {"passes": 20, "warmup": 5, "providers": ["naive", "naive-compiled"]}
        else:
            base = {"batch": 8, "seq": [256, 1024, 4096, 8192, 16384], "d": [16, 32, 64, 128]}
            base |= {"dtype": ["fp32"], "passes": 100, "warmup": 10}
            base |= {"providers": ["naive", "naive-compiled"]}
    elif cmd == "flash":
        if not gpu:
            providers = ["naive", "flash-torch", "sdpa-flash", "sdpa-math"]
            if triton_runs_here(args.device):
                providers.insert(0, "flash-triton")
            base = {"batch": 1, "seq": [32, 64], "d": [16], "dtype": ["fp32"]}
            base |= {"providers": providers}
        elif args.quick:
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
    for key in ("batch", "passes", "warmup"):
        if getattr(args, key, None) is not None:
            base[key] = getattr(args, key)
    for key in ("seq", "d", "dtype", "providers"):
        given = _cli.flatten(getattr(args, key, None))
        if given:
            base[key] = given
    if not gpu and not triton_runs_here(args.device):
        if "flash-triton" in (_cli.flatten(getattr(args, "providers", None)) or ()):
            # asked for by name: its rows are marked unsupported, never measured as another
            print(
                "warning: flash-triton cannot run here (needs a CUDA device, or "
                "TRITON_INTERPRET=1 on CPU): its rows are marked unsupported",
                file=sys.stderr,
            )
        else:
            base["providers"] = [p for p in base["providers"] if p != "flash-triton"]
    return base


# ----------------------------------------------------------------------------- measuring


def _inputs(
    batch: int, seq: int, d: int, dtype: torch.dtype, device: torch.device, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v (B, N, d) needing grad, and an upstream gradient dO (B, N, d)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    shape = (batch, seq, d)
    q, k, v, do = (torch.randn(shape, generator=gen).to(device=device, dtype=dtype) for _ in "qkvo")
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), do


def _failure(provider: str, exc: BaseException) -> str:
    if timing.is_oom(exc):
        return "OOM"
    if is_unsupported_error(provider, exc):
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"unsupported: {first[:120]}"
    return f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"


def naive_saved_bytes(batch: int, seq: int, d: int, dtype: torch.dtype, causal: bool) -> int:
    """Predicted memory in use between forward and backward of the naive attention.

    Inputs q, k, v and the output o: 4 * B*N*d elements. Saved for backward: the softmax
    output P (B*N*N; kept in fp32 by lm_core's causal path, which runs the softmax in fp32,
    plus its cast to the input dtype when that is not fp32, saved by the P @ V matmul) and the
    causal mask (N*N bools, saved by masked_fill). The plain (non-causal) path saves P only.
    """
    size = torch.empty((), dtype=dtype).element_size()
    total = 4 * batch * seq * d * size
    if causal:
        total += batch * seq * seq * 4 + seq * seq  # fp32 P and the bool mask
        if dtype != torch.float32:
            total += batch * seq * seq * size  # P cast back to the input dtype
    else:
        total += batch * seq * seq * size
    return total


def naive_accounting(batch: int, seq: int, d: int, dtype: torch.dtype, causal: bool) -> list[dict]:
    """Tensor-by-tensor memory of the naive attention at one size (MiB), forward and backward."""
    size = torch.empty((), dtype=dtype).element_size()
    nn_ = batch * seq * seq
    rows = [
        ("q, k, v, o (B, N, d) each x4", 4 * batch * seq * d * size, "inputs/output", "yes"),
        ("S = Q K^T / sqrt(d) (B, N, N)", nn_ * size, "forward, transient", "no"),
    ]
    if causal:
        rows += [
            ("causal mask (N, N) bool", seq * seq, "forward", "yes (masked_fill)"),
            ("masked S (B, N, N)", nn_ * size, "forward, transient", "no"),
        ]
        if dtype != torch.float32:
            rows.append(("S in fp32 for softmax (B, N, N)", nn_ * 4, "forward, transient", "no"))
        rows.append(("P = softmax(S), fp32 (B, N, N)", nn_ * 4, "forward", "yes (softmax)"))
        if dtype != torch.float32:
            rows.append(("P cast to input dtype (B, N, N)", nn_ * size, "forward", "yes (P @ V)"))
    else:
        rows.append(("P = softmax(S) (B, N, N)", nn_ * size, "forward", "yes (softmax, P @ V)"))
    rows += [
        ("dP = dO V^T (B, N, N)", nn_ * (4 if causal else size), "backward, transient", "-"),
        ("dS = softmax backward (B, N, N)", nn_ * (4 if causal else size), "backward", "-"),
    ]
    return [
        {"tensor": name, "mib": nbytes / MiB, "when": when, "saved_for_backward": saved}
        for name, nbytes, when, saved in rows
    ]


def run_naive(args: argparse.Namespace, grid: dict[str, Any]) -> list[dict[str, Any]]:
    """Forward / backward timings and memory of naive attention, eager and compiled."""
    device = args.device
    causal = not getattr(args, "no_causal", False)
    rows = []
    cells = [
        (p, dt, d, n)
        for p in grid["providers"]
        for dt in grid["dtype"]
        for d in grid["d"]
        for n in sorted(grid["seq"])
    ]
    bar = _bar(len(cells), "naive attention", args.quiet)
    for provider, dt_name, d, seq in cells:
        dtype = DTYPES[dt_name]
        row: dict[str, Any] = {
            "provider": provider,
            "dtype": dt_name,
            "batch": grid["batch"],
            "d": d,
            "seq": seq,
            "causal": causal,
            "status": None,
            "fwd_ms": None,
            "bwd_ms": None,
            "mib_before_bwd": None,
        }
        row["predicted_mib_before_bwd"] = (
            naive_saved_bytes(grid["batch"], seq, d, dtype, causal) / MiB
        )
        row.update(_naive_cell(provider, grid, seq, d, dtype, causal, device, args.seed))
        rows.append(row)
        bar.update(1)
        _release(device)
    bar.close()
    return rows


def _naive_cell(
    provider: str,
    grid: dict[str, Any],
    seq: int,
    d: int,
    dtype: torch.dtype,
    causal: bool,
    device: torch.device,
    seed: int,
) -> dict[str, Any]:
    out: dict[str, Any] = {"status": "ok"}
    try:
        if provider not in ("naive", "naive-compiled"):
            raise UnsupportedError("the naive sweep compares naive and naive-compiled only")
        fn = make_provider(provider, device, dtype, causal)
        q, k, v, do = _inputs(grid["batch"], seq, d, dtype, device, seed)
        fwd = timing.time_steps(
            lambda: fn(q, k, v), warmup=grid["warmup"], iters=grid["passes"], device=device
        )
        out["fwd_ms"] = fwd.stats.mean * 1e3
        out["fwd_std_ms"] = fwd.stats.std * 1e3
        out["compile_or_first_s"] = (
            None if fwd.first_step_s != fwd.first_step_s else fwd.first_step_s
        )
        timing.synchronize(device)
        before = timing.memory_allocated_bytes(device)
        o = fn(q, k, v)
        timing.synchronize(device)
        after = timing.memory_allocated_bytes(device)
        if before is not None and after is not None:
            # what the forward left alive: o plus everything saved for backward, plus q, k, v
            out["mib_before_bwd"] = (after - before) / MiB + 3 * q.numel() * q.element_size() / MiB
        bwd = timing.time_steps(
            lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True),
            warmup=grid["warmup"],
            iters=grid["passes"],
            device=device,
        )
        out["bwd_ms"] = bwd.stats.mean * 1e3
        out["bwd_std_ms"] = bwd.stats.std * 1e3
        peak = timing.peak_memory_bytes(device)
        out["peak_mib"] = None if peak is None else peak / MiB
    except Exception as exc:
        out["status"] = _failure(provider, exc)
        if out["status"].startswith("error"):
            import traceback

            traceback.print_exc()
    return out


def run_flash(
    args: argparse.Namespace, grid: dict[str, Any], *, leaderboard: bool = False
) -> list[dict[str, Any]]:
    """Forward, backward and forward+backward ms of every provider over the grid."""
    device = args.device
    causal = leaderboard or not getattr(args, "no_causal", False)
    rep, warm = getattr(args, "rep_ms", 100.0), getattr(args, "warmup_ms", 25.0)
    if device.type != "cuda":
        rep, warm = min(rep, 20.0), min(warm, 5.0)
    rows: list[dict[str, Any]] = []
    cells = [(dt, d, n) for dt in grid["dtype"] for d in grid["d"] for n in sorted(grid["seq"])]
    oom_at: dict[tuple[str, str, int], int] = {}
    bar = _bar(len(cells) * len(grid["providers"]), "flash benchmark", args.quiet)
    for dt_name, d, seq in cells:
        dtype = DTYPES[dt_name]
        batch = grid["batch"]
        flops = {p: attention_flops(batch, 1, seq, seq, d, causal, p) for p in ("fwd", "bwd")}
        flops["fwd_bwd"] = flops["fwd"] + flops["bwd"]
        peak = args.peak_tflops or hardware.peak_tflops(dt_name, device)
        cell_rows = []
        for provider in grid["providers"]:
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
                row.update(
                    _flash_cell(
                        provider, batch, seq, d, dtype, causal, device, rep, warm, args, leaderboard
                    )
                )
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
    provider: str,
    batch: int,
    seq: int,
    d: int,
    dtype: torch.dtype,
    causal: bool,
    device: torch.device,
    rep: float,
    warm: float,
    args: argparse.Namespace,
    leaderboard: bool,
) -> dict[str, Any]:
    out: dict[str, Any] = {"status": "ok"}
    stage = "build"
    try:
        fn = make_provider(provider, device, dtype, causal)
        q, k, v, do = _inputs(batch, seq, d, dtype, device, args.seed)
        if leaderboard:
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
        status = _failure(provider, exc)
        out["status"] = status if stage in ("build", "fwd") else f"{status} in {stage}"
        if status.startswith("error"):
            import traceback

            traceback.print_exc()
    return out


# ----------------------------------------------------------------------------- output

NAIVE_COLUMNS = [
    "provider", "dtype", "d", "seq", "status", "fwd_ms", "bwd_ms", "mib_before_bwd",
    "predicted_mib_before_bwd", "peak_mib", "compile_or_first_s",
]  # fmt: skip
FLASH_COLUMNS = [
    "dtype", "d", "seq", "provider", "status", "fwd_ms", "bwd_ms", "fwd_bwd_ms",
    "fwd_bwd_tflops", "speedup_vs_naive", "vs_best_sdpa", "gflop_fwd_bwd", "floor_fwd_bwd_ms",
]  # fmt: skip


def _with_suffix(path: Path | None, suffix: str, several: bool) -> Path | None:
    if path is None or not several:
        return path
    return path.with_name(f"{path.stem}-{suffix}{path.suffix}")


def _emit(
    args: argparse.Namespace,
    name: str,
    rows: list[dict[str, Any]],
    columns: Sequence[str],
    title: str,
    several: bool,
    plot: Callable[[list[dict[str, Any]], Path], Path] | None,
) -> None:
    cols = [c for c in columns if any(r.get(c) is not None for r in rows)]
    report.print_table(rows, cols, title=title)
    csv_path = _with_suffix(args.csv, name, several)
    json_path = _with_suffix(args.json, name, several)
    report.save_rows(rows, csv_path=csv_path, json_path=json_path)
    for what, path in (("csv", csv_path), ("json", json_path)):
        if path is not None:
            print(f"{what}: {path}")
    plot_path = _with_suffix(args.plot, name, several)
    if plot_path is not None and plot is not None:
        print(f"plot: {plot(rows, plot_path)}")


def _plot_naive(rows: list[dict[str, Any]], path: Path) -> Path:
    return report.plot_lines(
        rows, x="seq", y="fwd_ms", group_by=["provider", "dtype", "d"], path=path,
        title="naive attention forward (ms)", logx=True, logy=True, ylabel="forward ms",
    )  # fmt: skip


def _plot_flash(rows: list[dict[str, Any]], path: Path) -> Path:
    ds = sorted({r["d"] for r in rows})
    d = 64 if 64 in ds else ds[len(ds) // 2]
    sel = [r for r in rows if r["d"] == d]
    return report.plot_lines(
        sel, x="seq", y="fwd_bwd_ms", group_by=["provider", "dtype"], path=path,
        title=f"attention forward+backward, batch 1, causal, d={d}", logx=True, logy=True,
        ylabel="forward+backward ms (do_bench median)",
    )  # fmt: skip


def print_accounting(rows: list[dict[str, Any]], causal: bool) -> list[dict[str, Any]]:
    """Memory accounting of the smallest OOM configuration (else the largest that ran)."""
    ooms = [r for r in rows if str(r.get("status", "")).startswith("OOM")]
    if ooms:
        pick = min(ooms, key=lambda r: (r["seq"], r["d"]))
        why = "smallest configuration that ran out of memory"
    else:
        pick = max(rows, key=lambda r: (r["seq"], r["d"]))
        why = "largest configuration (none ran out of memory)"
    dtype = DTYPES[pick["dtype"]]
    acc = naive_accounting(pick["batch"], pick["seq"], pick["d"], dtype, causal)
    title = (
        f"memory accounting, {why}: batch {pick['batch']}, seq {pick['seq']}, d {pick['d']}, "
        f"{pick['dtype']} (one N x N matrix = B*N*N*bytes; saved-for-backward N x N memory "
        "grows as N^2: a tiled kernel that recomputes P in backward removes it)"
    )
    report.print_table(acc, title=title)
    return acc


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.device = args.device or torch.device(_cli.default_device())
    cmds = [args.cmd] if args.cmd else ["naive", "flash"]
    several = len(cmds) > 1
    dev = report.run_metadata()["device"]
    failed = False
    for cmd in cmds:
        grid = _defaults(args, cmd)
        if cmd == "naive":
            rows = run_naive(args, grid)
            _emit(args, "naive", rows, NAIVE_COLUMNS,
                  f"naive attention on {dev}: batch {grid['batch']}, mean ms over "
                  f"{grid['passes']} passes", several, _plot_naive)  # fmt: skip
            if rows:
                print_accounting(rows, causal=not getattr(args, "no_causal", False))
        else:
            rows = run_flash(args, grid, leaderboard=cmd == "leaderboard")
            title = (
                f"{'leaderboard shape' if cmd == 'leaderboard' else 'flash benchmark'} on {dev}:"
                f" batch {grid['batch']}, do_bench median ms"
            )
            _emit(args, cmd, rows, FLASH_COLUMNS, title, several,
                  _plot_flash if cmd == "flash" else None)  # fmt: skip
        failed |= any(str(r.get("status", "")).startswith("error") for r in rows)
        if rows and all(str(r.get("status", "")).startswith("unsupported") for r in rows):
            print(f"error: no provider of {cmd} can run on {args.device}", file=sys.stderr)
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
