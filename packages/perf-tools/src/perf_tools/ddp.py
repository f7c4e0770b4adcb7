"""Data-parallel step time and exposed communication (handout 2.2-2.3): `python -m perf_tools.ddp`.

Trains an lm_core model (default: xl on GPUs, 2 sequences of 512 tokens per rank, fp32, AdamW;
`tiny` on CPU) for a few steps under each gradient synchronization scheme, side by side in one
run: no communication (every rank trains alone: the baseline), ddp_kit's NaiveDDP, FlatDDP,
DDPIndividualParameters, DDPBucketed at each bucket size of the sweep (1, 10, 100, 1000 MiB),
and torch's DistributedDataParallel (defaults: 25 MiB buckets). Each process builds the model
and optimizer once and reuses them for every scheme (wrappers are closed in between).

Columns (median over measured steps of the slowest rank; see --warmup / --iters):
  step_ms      one full step: zero_grad, forward, backward, gradient sync, AdamW step
  overhead_ms  step_ms minus the no-communication step_ms on the same model and ranks (mean of
               the two baseline runs, first and before torch DDP): the communication, and its
               bookkeeping, that backward did not hide
  sync_ms      time inside finish_gradient_synchronization() (CUDA events on the compute stream:
               from the end of backward's kernels to the point where all reductions are done);
               torch DDP waits inside backward, so it has none
  fwd/bwd/opt  phase times; model_ms / pipeline_ms the predictions below

Communication-overhead model (`model_ms`, `pipeline_ms`): see `perf_tools.ddp_model`.

Launching: by default the tool spawns its own ranks (--nprocs, default 2, NCCL on GPUs, gloo on
CPU). Under torchrun it uses the ranks torchrun started instead:
  torchrun --nproc_per_node 2 -m perf_tools.ddp --size xl

Examples:
  python -m perf_tools.ddp                          # GPU: xl, 2 ranks, all schemes, 4 buckets
  python -m perf_tools.ddp --size tiny --nprocs 2 --context 32 --csv ddp.csv --plot ddp.png
  python -m perf_tools.ddp --size xl --nprocs 4 --wrappers bucketed torch --bucket-sizes-mb 100
  python -m perf_tools.ddp --wrappers bucketed torch --bucket-sizes-mb 25 --reduce-dtype bf16
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from perf_tools import _cli, _dist, harness, report, timing
from perf_tools.ddp_model import (
    handout_overhead_s,
    min_overhead_s,
    optimal_bucket_bytes,
    pipeline_overhead_s,
)

MIB = 1024 * 1024
WRAPPERS = ("naive", "flat", "individual", "bucketed", "torch")
GPU_BUCKETS_MB = (1.0, 10.0, 100.0, 1000.0)
CPU_BUCKETS_MB = (0.01, 0.1, 1.0)
GPU_PROBE_MB = (0.0625, 1.0, 8.0, 64.0, 256.0)
REDUCE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
CPU_PROBE_MB = (0.0625, 0.25, 1.0)
COLUMNS = [
    "wrapper",
    "bucket_MiB",
    "n_buckets",
    "status",
    "step_ms",
    "overhead_ms",
    "sync_ms",
    "fwd_ms",
    "bwd_ms",
    "opt_ms",
    "model_ms",
    "pipeline_ms",
]


# ----------------------------------------------------------------------------- CLI


@dataclass
class Options:
    """What every rank needs to run the sweep (picklable for spawned workers)."""

    size: str
    context: int
    batch: int
    warmup: int
    iters: int
    wrappers: list[str]
    bucket_sizes_mb: list[float]
    probe_sizes_mb: list[float]
    backend: str
    seed: int = 0
    quiet: bool = False
    reduce_dtype: str | None = None  # "bf16" / "fp16": gradients sent in that dtype
    extra: dict[str, Any] = field(default_factory=dict)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m perf_tools.ddp",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__[__doc__.index("Examples:") :],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--size", help="lm_core preset (default: xl on GPU, tiny on CPU)")
    p.add_argument("--context", type=_cli.positive_int, help="tokens per sequence (512 / 32)")
    p.add_argument(
        "--batch", type=_cli.positive_int, default=2, help="sequences per rank (default 2)"
    )
    p.add_argument("--nprocs", type=_cli.positive_int, default=2, help="ranks to spawn (default 2)")
    p.add_argument(
        "--backend",
        type=_cli.choice(("gloo", "nccl")),
        help="default: nccl when GPUs are visible, else gloo",
    )
    p.add_argument(
        "--wrappers",
        nargs="+",
        type=_cli.listed(_cli.choice(WRAPPERS)),
        help=f"schemes besides the no-communication baseline (default: {' '.join(WRAPPERS)})",
    )
    p.add_argument(
        "--bucket-sizes-mb",
        nargs="+",
        type=_cli.listed(_cli.positive_float),
        help="DDPBucketed sweep in MiB (default 1 10 100 1000 on GPU, 0.01 0.1 1 on CPU)",
    )
    p.add_argument(
        "--probe-sizes-mb",
        nargs="+",
        type=_cli.listed(_cli.positive_float),
        help="all-reduce sizes (MiB) to fit o and w (default: 0.0625 1 8 64 256 on GPU, "
        "0.0625 0.25 1 on CPU)",
    )
    p.add_argument(
        "--reduce-dtype",
        type=_cli.choice(tuple(REDUCE_DTYPES)),
        help="send gradients in this dtype: ddp_kit's reduce_dtype, torch DDP's bf16 / fp16 "
        "compress hook (default: each gradient's own dtype)",
    )
    p.add_argument("--no-probe", action="store_true", help="skip the probe and the model")
    p.add_argument("--warmup", type=_cli.nonneg_int, help="warm-up steps (default 3 / 2)")
    p.add_argument("--iters", type=_cli.positive_int, default=5, help="timed steps (default 5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--timeout-s",
        type=_cli.positive_float,
        default=900.0,
        help="kill the spawned ranks after this long (default 900)",
    )
    _cli.add_output_args(p)
    return p


def parse_args(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, Options]:
    parser = build_parser()
    args = parser.parse_args(argv)
    backend = args.backend or _dist.default_backend()
    if backend == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
        parser.error("argument --backend: nccl needs CUDA GPUs and a torch built with NCCL")
    on_gpu = backend == "nccl"
    if not _dist.under_torchrun() and on_gpu and args.nprocs > torch.cuda.device_count():
        parser.error(
            f"argument --nprocs: {args.nprocs} ranks need {args.nprocs} GPUs with NCCL, "
            f"{torch.cuda.device_count()} visible"
        )
    from perf_tools.models import size_names

    size = args.size or ("xl" if on_gpu else "tiny")
    if size not in size_names():
        parser.error(f"argument --size: expected one of {', '.join(size_names())}, got {size!r}")
    probe = (
        []
        if args.no_probe
        else (_cli.flatten(args.probe_sizes_mb) or list(GPU_PROBE_MB if on_gpu else CPU_PROBE_MB))
    )
    if probe and len(probe) < 2:
        parser.error("argument --probe-sizes-mb: the fit needs at least two sizes")
    wrappers = _cli.flatten(args.wrappers) or list(WRAPPERS)
    if args.reduce_dtype and backend != "nccl" and "torch" in wrappers:
        wrappers.remove("torch")
        print(
            "perf_tools.ddp: torch DDP's bf16 / fp16 compress hooks need NCCL; its row is left "
            "out on gloo",
            file=sys.stderr,
        )
    opts = Options(
        size=size,
        context=args.context or (512 if on_gpu else 32),
        batch=args.batch,
        warmup=args.warmup if args.warmup is not None else (3 if on_gpu else 2),
        iters=args.iters,
        wrappers=wrappers,
        bucket_sizes_mb=_cli.flatten(args.bucket_sizes_mb)
        or list(GPU_BUCKETS_MB if on_gpu else CPU_BUCKETS_MB),
        probe_sizes_mb=probe,
        backend=backend,
        seed=args.seed,
        quiet=args.quiet,
        reduce_dtype=args.reduce_dtype,
    )
    return args, opts


def configs(opts: Options) -> list[tuple[str, float | None]]:
    """(wrapper, bucket MiB) in the order they run.

    The no-communication baseline runs first and again before torch DDP (which runs last: its
    hooks cannot be removed); overheads are taken against the mean of the two, so slow drift
    of the machine shows up as the gap between them instead of as overhead.
    """
    out: list[tuple[str, float | None]] = [("none", None)]
    for w in opts.wrappers:
        if w == "bucketed":
            out += [("bucketed", mb) for mb in opts.bucket_sizes_mb]
        elif w != "torch":
            out.append((w, None))
    out.append(("none", None))
    if "torch" in opts.wrappers:
        out.append(("torch", 25.0))
    return out


# ----------------------------------------------------------------------------- worker


def _probe(opts: Options, device: torch.device) -> dict[str, float]:
    """Fit o and w from all-reduces of the probe sizes (slowest rank, median of 5)."""
    nbytes, times = [], []
    for mb in opts.probe_sizes_mb:
        x = torch.ones(max(1, int(mb * MIB) // 4), device=device)  # (numel,)
        for _ in range(2):
            dist.all_reduce(x)
        nbytes.append(x.numel() * 4)
        times.append(
            statistics.median(_dist.time_collective(partial(dist.all_reduce, x), 5, device))
        )
        del x
    o, w = _dist.fit_latency_bandwidth(nbytes, times)
    return {"o_s": o, "w_Bps": w, "points": list(zip(nbytes, times))}


def _wrap(
    kind: str,
    bucket_mb: float | None,
    model: nn.Module,
    device: torch.device,
    reduce_dtype: str | None = None,
) -> tuple[nn.Module, Callable[[], None] | None, list[float] | None, bool]:
    """(runner, finish, bytes each bucket sends in launch order, overlaps backward)."""
    import ddp_kit

    if kind == "none":
        return model, None, [], False
    dtype = REDUCE_DTYPES.get(reduce_dtype) if reduce_dtype else None
    # bytes on the wire: a bucket sent in reduce_dtype carries that dtype's element size
    shrink = 1.0 if dtype is None else dtype.itemsize / 4.0  # the models' gradients are fp32
    if kind == "torch":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        runner = DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=bucket_mb)
        if dtype is not None:
            hook = {
                torch.bfloat16: default_hooks.bf16_compress_hook,
                torch.float16: default_hooks.fp16_compress_hook,
            }[dtype]
            runner.register_comm_hook(None, hook)
        # Modelled as our bucketing at the same cap (torch's first bucket is smaller).
        infos = [ddp_kit.buckets.ParamInfo.of(n, p) for n, p in model.named_parameters()]
        plan = ddp_kit.plan_buckets(infos, bucket_mb * MIB)
        return runner, None, [shrink * sum(infos[i].nbytes for i in b) for b in plan], True
    cls = {
        "naive": ddp_kit.NaiveDDP,
        "flat": ddp_kit.FlatDDP,
        "individual": ddp_kit.DDPIndividualParameters,
    }.get(kind)
    if cls is not None:
        wrapper = cls(model, reduce_dtype=dtype)
    else:
        wrapper = ddp_kit.DDPBucketed(model, bucket_mb, reduce_dtype=dtype)
    overlap = kind in ("individual", "bucketed")
    sizes = [shrink * b for b in wrapper.bucket_sizes_bytes()]
    return wrapper, wrapper.finish_gradient_synchronization, sizes, overlap


def _measure(
    opts: Options,
    runner: nn.Module,
    model: nn.Module,
    optimizer: Any,
    batch: tuple,
    finish: Callable[[], None] | None,
    device: torch.device,
    warmup: int,
) -> dict[str, float]:
    """Step and phase times of this rank, aggregated over ranks (slowest rank)."""
    from lm_core import cross_entropy
    from perf_tools.steps import PhaseTimer

    x, y = batch
    timer = PhaseTimer(device)
    params = list(model.parameters())

    def step() -> None:
        timer.start()
        for p in params:
            p.grad = None
        logits = runner(x)  # (B, T, V)
        loss = cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))  # (B*T, V)
        timer.mark("forward")
        loss.backward()
        timer.mark("backward")
        if finish is not None:
            finish()
            timer.mark("sync")
        optimizer.step()
        timer.mark("optimizer")
        timer.finish()

    timed = timing.time_steps(step, warmup=warmup, iters=opts.iters, device=device)
    phases = timer.mean_ms(opts.iters)
    per_rank = _dist.gather({"samples": timed.samples, "phases": phases})
    steps = _dist.slowest_per_step([r["samples"] for r in per_rank])
    out = {"step_ms": statistics.median(steps) * 1e3}
    for name, col in (
        ("forward", "fwd_ms"),
        ("backward", "bwd_ms"),
        ("sync", "sync_ms"),
        ("optimizer", "opt_ms"),
    ):
        vals = [r["phases"][name] for r in per_rank if name in r["phases"]]
        if vals:
            out[col] = max(vals)
    return out


def _add_overheads(
    rows: list[dict[str, Any]], plans: list[tuple[list[int], bool]], probe: dict | None
) -> None:
    """overhead_ms against the mean baseline, and the models' predictions."""
    base = [r for r in rows if r["wrapper"] == "none" and r.get("status") == "ok"]
    if not base:
        return
    base_step = statistics.fmean(r["step_ms"] for r in base)
    t_bwd = statistics.fmean(r["bwd_ms"] for r in base if "bwd_ms" in r) / 1e3
    for row, (buckets, overlap) in zip(rows, plans):
        if row.get("status") != "ok":
            continue
        row["overhead_ms"] = row["step_ms"] - base_step
        if probe is None or row["wrapper"] == "none" or not buckets:
            continue
        o, w = probe["o_s"], probe["w_Bps"]
        row["model_ms"] = handout_overhead_s(buckets, o, w, overlap) * 1e3
        row["pipeline_ms"] = pipeline_overhead_s(buckets, o, w, t_bwd, overlap) * 1e3


def _run_scheme(
    kind: str,
    bucket_mb: float | None,
    model: nn.Module,
    optimizer: Any,
    batch: tuple,
    device: torch.device,
    opts: Options,
    warmup: int,
    plan: dict[str, Any],
) -> dict[str, Any]:
    """One scheme's measured columns; `plan` receives its bucket sizes, overlap and wrapper."""
    runner, finish, buckets, overlap = _wrap(kind, bucket_mb, model, device, opts.reduce_dtype)
    plan.update(buckets=buckets, overlap=overlap, runner=runner)
    measured = _measure(opts, runner, model, optimizer, batch, finish, device, warmup)
    return {"n_buckets": len(buckets), **measured}


def _close(plan: dict[str, Any], model: nn.Module) -> None:
    """Drop the scheme's wrapper (and its bucket buffers) and the gradients before the next."""
    runner = plan.pop("runner", None)
    if runner is not None and hasattr(runner, "close"):
        runner.close()
    for p in model.parameters():
        p.grad = None


def run_worker(rank: int, world: int, opts: Options) -> dict[str, Any]:
    """Every rank: probe, build once, measure each scheme. Rank 0 returns rows and model data."""
    from lm_core import AdamW
    from perf_tools.models import build_model, random_batch, resolve_config

    device = _dist.device_for(
        opts.backend,
        rank if not _dist.under_torchrun() else int(os.environ.get("LOCAL_RANK", rank)),
    )
    if device.type == "cpu":
        torch.set_num_threads(1)  # ranks share the cores
    probe = _probe(opts, device) if opts.probe_sizes_mb else None
    _dist.tick()
    config = resolve_config(opts.size, context_length=opts.context)
    torch.manual_seed(opts.seed)
    model = build_model(config, device)
    optimizer = AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    batch = random_batch(opts.batch, opts.context, config.vocab_size, device, opts.seed + rank)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    harness.release(device)
    rows: list[dict[str, Any]] = []
    plans: list[tuple[list[int], bool]] = []
    # Ranks cannot skip a scheme their peers run: any failure but OOM ends the run.
    sweep = harness.Sweep(
        len(configs(opts)),
        "ddp",
        device=device,
        fatal=lambda exc: not timing.is_oom(exc),
        advance=_dist.tick,
    )
    for kind, bucket_mb in configs(opts):
        plan: dict[str, Any] = {"buckets": [], "overlap": False}
        # the first configuration also absorbs one-time costs (allocator, optimizer state)
        warm = opts.warmup + (2 if not rows else 0)
        scheme = (kind, bucket_mb, model, optimizer, batch, device, opts, warm, plan)
        row = {"wrapper": kind, "bucket_MiB": bucket_mb}
        row.update(
            sweep.measure(partial(_run_scheme, *scheme), cleanup=partial(_close, plan, model))
        )
        rows.append(row)
        plans.append((plan["buckets"], plan["overlap"]))
    sweep.close()
    _add_overheads(rows, plans, probe)
    info = {
        "grad_bytes": grad_bytes,
        "probe": probe,
        "world": world,
        "size": opts.size,
        "context": opts.context,
        "batch_per_rank": opts.batch,
        "reduce_dtype": opts.reduce_dtype,
    }
    return {"rows": rows, "info": info} if rank == 0 else {}


def _torchrun_main(opts: Options) -> dict[str, Any] | None:
    rank, world, _ = _dist.init_from_env(opts.backend)
    _dist.start_local_bar(len(configs(opts)) + 1, f"ddp {opts.size}", not opts.quiet)
    try:
        result = run_worker(rank, world, opts)
    finally:
        _dist.close_local_bar()
    dist.barrier()
    dist.destroy_process_group()
    return result if rank == 0 else None


def summary_lines(info: dict[str, Any]) -> list[str]:
    """The model's inputs and its optimum, as printed under the table."""
    s = info["grad_bytes"]
    lines = [
        f"gradients: {s / MIB:,.1f} MiB per rank, {info['world']} ranks, {info['size']} "
        f"model, {info['batch_per_rank']} x {info['context']} tokens/rank"
    ]
    sent = info.get("reduce_dtype")
    if sent:  # the model's s is what travels
        s = s * REDUCE_DTYPES[sent].itemsize / 4.0
        lines.append(f"sent in {sent}: {s / MIB:,.1f} MiB per step")
    probe = info.get("probe")
    if probe:
        o, w = probe["o_s"], probe["w_Bps"]
        lines.append(f"all-reduce fit: o = {o * 1e6:.1f} us per call, w = {w / 1e9:.2f} GB/s")
        if o > 0 and math.isfinite(w):
            b_star = optimal_bucket_bytes(s, o, w) / MIB
            lines.append(
                f"model optimum: bucket b* = sqrt(s w o) = {b_star:,.1f} MiB, "
                f"overhead 2 sqrt(s o / w) = {min_overhead_s(s, o, w) * 1e3:.2f} ms"
            )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    args, opts = parse_args(argv)
    if _dist.under_torchrun():
        result = _torchrun_main(opts)
        if result is None:
            return 0
    else:
        n_cfg = len(configs(opts)) + 1
        results = _dist.run_ranks(
            run_worker,
            args.nprocs,
            backend=opts.backend,
            args=(opts,),
            timeout_s=args.timeout_s,
            progress_total=n_cfg,
            label=f"ddp {opts.size}",
            quiet=opts.quiet,
        )
        result = results[0]
    rows, info = result["rows"], result["info"]
    report.print_table(rows, COLUMNS, title="data-parallel step (ms, slowest rank, median)")
    for line in summary_lines(info):
        print(line)
    meta = {**report.run_metadata(), "options": asdict(opts), "model": info}
    report.save_rows(rows, csv_path=args.csv, json_path=args.json, meta=meta)
    if args.plot is not None:
        _plot(rows, args.plot)
    return 0 if all(r.get("status") == "ok" for r in rows) else 1


def _plot(rows: list[dict[str, Any]], path: Any) -> None:
    """Overhead vs bucket size: measured and both models, for the bucketed sweep."""
    points = []
    for r in rows:
        if r["wrapper"] != "bucketed" or r.get("status") != "ok":
            continue
        for series, key in (
            ("measured", "overhead_ms"),
            ("model", "model_ms"),
            ("pipeline model", "pipeline_ms"),
            ("sync", "sync_ms"),
        ):
            if r.get(key) is not None:
                points.append({"bucket_MiB": r["bucket_MiB"], "ms": r[key], "series": series})
    report.plot_lines(
        points,
        x="bucket_MiB",
        y="ms",
        group_by=["series"],
        path=path,
        title="DDPBucketed: communication not hidden by backward",
        logx=True,
        ylabel="ms per step",
    )


if __name__ == "__main__":
    raise SystemExit(main())
