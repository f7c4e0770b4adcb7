"""The multi-GPU mode of `python -m perf_tools.bench`: training steps on N ranks, data parallel
(DDP), sharded (FSDP) or tensor parallel.

`bench --nprocs N --fsdp ours|torch` (`--ddp`, `--tp K`) runs each cell of the sweep on N ranks
(`run_dist_sweep`): spawned by the tool itself (`_dist.run_ranks`, i.e. `ddp_kit.launch.spawn`:
file-store rendezvous, NCCL with one GPU per rank, gloo on CPU), fresh processes for every cell
so that no cell inherits another one's memory; or, under `torchrun` (`run_torchrun_sweep`), the
ranks torchrun started (every cell in turn). The rank side (`run_rank`) builds, wraps and
times; the parent side (`aggregate`) turns every rank's measurements into the row.

Each rank builds, checkpoints, compiles and wraps its model as `perf_tools.bench_wrap` says
(the FSDP rows build on the meta device and materialize only this rank's shards, as the full
build for the seed would be) and trains on its own random batch (`--batch` sequences per rank;
per data-parallel group with `--tp K`, whose K ranks share it):

  ours   zero_shard.FSDP; lm_core AdamW over fsdp.parameters() (the fp32 shards and the
         replicated norms); the step is zero_grad, forward, backward,
         finish_gradient_synchronization() ("sync"), AdamW.
  torch  torch's fully_shard per block and root; lm_core AdamW over the (DTensor)
         parameters. Gradients are reduced inside backward (no sync phase).
  --ddp  torch's DistributedDataParallel over a replicated model; gradients all-reduced
         inside backward.
  --tp K tensor parallel over K ranks, data parallel (fully_shard) over N / K with --fsdp
         torch: `perf_tools.bench_tp` (lm_core's trainer engine).

Precision: the FSDP wrappers' compute dtype is the precision (bf16 weights, activations and
matmuls; fp32 master weights, gradients and optimizer state), no autocast; pure TP and DDP
(no casting wrapper) run bf16 under autocast. `--compile`: per block for FSDP and TP, the
whole model for DDP (`bench_wrap`); the warm-up steps compile, and `measured_compiles` counts
graphs compiled during the measured steps (0 unless a step recompiled). Train rows also get
the planner's prediction (`perf_tools.bench_predict`).

Per cell: warm-up steps, then measured steps, each ending with a device synchronize. A step's
time is the slowest rank's (a collective step ends when every rank is done); the row shows the
median over the measured steps and derives tokens/s (the global batch's), TFLOP/s and MFU per
GPU (FLOPs of the global batch / N / step time / peak) from that median; peak memory is the
largest `max_memory_allocated` over the ranks. With `--fsdp ours` every wait of a unit for its
all-gather is timed (`FSDP.record_gather_waits`: CUDA events on the compute stream): per step
the summed wait (`gather_wait_ms`, forward and backward apart) and the number of units whose
wait exceeded WAIT_THRESHOLD_MS (`units_waited`, of `gathers`): 0 means every prefetch
arrived before its unit needed it.

Out of memory: a rank that runs out catches the error and reports it to the parent, which
ends the cell at once (killing its ranks: a peer may be waiting inside a collective that the
failed rank will never join) and records OOM. Under torchrun, where no parent watches, the
ranks free what they can and agree through an all-reduce of an OOM flag (so no rank hangs
when, as in SPMD training, all of them run out at the same point); a rank stuck in a
collective its peer left ends at the process-group timeout (`--timeout-s`).
"""

from __future__ import annotations

import dataclasses
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from perf_tools import _dist, hardware, harness, timing
from perf_tools.bench_predict import fsdp_memory_estimate, planner_columns
from perf_tools.bench_wrap import (
    DDP_KINDS,
    FSDP_KINDS,
    DistJob,
    build_and_wrap,
)
from perf_tools.cells import BenchOptions, BenchSpec, cell_row
from perf_tools.models import count_local_params, random_batch, resolve_config
from perf_tools.steps import PhaseTimer, make_step

# DistJob lives in perf_tools.bench_wrap (the rank's model); its name stays reachable here
__all__ = [
    "DDP_KINDS",
    "FSDP_KINDS",
    "DistJob",
    "aggregate",
    "run_dist_sweep",
    "run_rank",
    "run_torchrun_sweep",
    "spawn_cell",
]

WAIT_THRESHOLD_MS = 0.05  # a wait above this is compute stalled on an all-gather (events: ~us)


# ----------------------------------------------------------------------------- rank side


def _wait_summary(waits: Sequence[Any]) -> dict[str, Any]:
    """One step's gather waits (`zero_shard.fsdp.GatherWait` records) in a few numbers."""
    worst = max(waits, key=lambda w: w.ms, default=None)
    return {
        "wait_ms": sum(w.ms for w in waits),
        "fwd_ms": sum(w.ms for w in waits if w.phase == "forward"),
        "bwd_ms": sum(w.ms for w in waits if w.phase == "backward"),
        "waited": sum(w.ms > WAIT_THRESHOLD_MS for w in waits),
        "gathers": len(waits),
        "max_ms": worst.ms if worst is not None else 0.0,
        "max_unit": f"{worst.unit} {worst.phase}" if worst is not None else None,
    }


def set_tf32(enabled: bool) -> None:
    """TF32 tensor-core matmuls (and cuDNN convolutions) on or off in this process."""
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


def set_blas(library: str) -> None:
    """Make `library` ('cublas', 'cublaslt') torch's CUDA BLAS in this process; 'default'
    leaves torch's choice. A no-op in a CPU-only torch build (it has no CUDA BLAS)."""
    if library != "default" and torch.backends.cuda.is_built():
        torch.backends.cuda.preferred_blas_library(library)


def _measure(job: DistJob, rank: int, device: torch.device) -> dict[str, Any]:
    """Build, wrap, warm up and time this rank; raises on failure (OOM included)."""
    from lm_core import AdamW, cross_entropy

    set_tf32(job.tf32)  # a spawned rank does not inherit the parent's backend flags
    set_blas(job.blas)
    config = resolve_config(
        job.size, context_length=job.context, attention=job.attention, overrides=job.overrides
    )
    t0 = time.perf_counter()
    built = build_and_wrap(job, config, rank=rank, world=dist.get_world_size(), device=device)
    runner, sync, fsdp = built.runner, built.sync, built.fsdp
    timing.synchronize(device)
    build_s = time.perf_counter() - t0
    optimizer = None
    if job.mode == "train":
        optimizer = AdamW(
            list(runner.parameters()), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1
        )
    # every data-parallel group its own tokens (the ranks of a TP group share them)
    dp_rank = rank // job.tp
    x, y = random_batch(job.batch, job.context, config.vocab_size, device, job.seed + dp_rank)
    timer = PhaseTimer(device)
    step = make_step(
        runner,
        job.mode,
        inputs=x,
        targets=y,
        loss_fn=None if job.fused_loss else cross_entropy,
        # the FSDP wrapper casts: no autocast on top; pure TP and DDP: autocast
        precision=job.precision if job.autocast else "fp32",
        optimizer=optimizer,
        timer=timer,
        sync=sync,
    )
    waits: list[dict[str, Any]] = []
    if fsdp is not None:
        fsdp.record_gather_waits()

    def after_step() -> None:
        if fsdp is not None:
            waits.append(_wait_summary(fsdp.gather_waits()))

    graphs: list[int] = []

    def on_measure() -> None:
        timing.reset_peak_memory(device)
        waits.clear()
        graphs.append(_compiled_graphs())

    label = None if job.quiet or rank != 0 else f"{job.size} {job.layout()} rank 0"
    result = timing.time_steps(
        step,
        warmup=job.warmup,
        iters=job.steps,
        device=device,
        progress=label,
        on_measure=on_measure,
        after_step=after_step,
    )
    out: dict[str, Any] = {
        "rank": rank,
        "samples": result.samples,
        "warmup_s": result.warmup_s,
        "first_step_s": result.first_step_s,
        "phases": timer.mean_ms(job.steps),
        "peak_mem": timing.peak_memory_bytes(device),
        "peak_reserved": (
            int(torch.cuda.max_memory_reserved(device)) if device.type == "cuda" else None
        ),
        "waits": waits,
        "params": built.params,
        "local_params": count_local_params(runner),
        "build_s": build_s,
        "act_ckpt_k": built.act_ckpt_k,
        # graphs dynamo compiled during the measured steps: 0 unless a step recompiled
        "measured_compiles": _compiled_graphs() - graphs[0] if job.compile else None,
        "config": dataclasses.asdict(config),
    }
    if rank == 0:
        peak = job.peak_tflops
        if peak is None:
            peak = hardware.peak_tflops(job.precision, device)
        out["peak_tflops"] = peak
        out["gpu"] = hardware.device_key(device)  # the planner's hardware (bench_predict)
    del step, optimizer, runner, built
    if job.compile:
        torch._dynamo.reset()  # under torchrun the next cell runs in this process
    return out


def _compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def run_rank(rank: int, world: int, job: DistJob) -> dict[str, Any]:
    """One rank of one cell (a collective: every rank runs it); its measurements or OOM."""
    local = int(os.environ.get("LOCAL_RANK", rank)) if _dist.under_torchrun() else rank
    device = _dist.device_for(job.backend, local)
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    flag = torch.zeros(1, device=device)  # (1,): allocated before anything large
    out: dict[str, Any] | None = None
    try:
        out = _measure(job, rank, device)
    except Exception as exc:
        if not timing.is_oom(exc):
            raise
        # tell the parent first: if a peer is stuck in a collective, the flag below never
        # completes and the parent learns of the OOM only from this message
        from ddp_kit.launch import report_progress

        report_progress(("oom", rank))
        flag.fill_(1.0)
    harness.release(device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # all ranks agree on OOM
    if flag.item() > 0:
        return {"rank": rank, "status": "OOM"}
    assert out is not None
    return out


# ----------------------------------------------------------------------------- parent side


def aggregate(job: DistJob, per_rank: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The row's measured columns from every rank's measurements."""
    from lm_core import ModelConfig
    from perf_tools.flops import step_flops

    if any(r.get("status") == "OOM" for r in per_rank):
        return {"status": "OOM"}
    world = len(per_rank)
    global_batch = job.batch * (world // job.tp)  # --batch is per data-parallel group
    steps = _dist.slowest_per_step([r["samples"] for r in per_rank])
    stats = timing.Stats.of(steps).scaled(1e3)
    median_s = stats.median / 1e3
    r0 = per_rank[0]
    config = ModelConfig(**r0["config"])
    flops = step_flops(config, global_batch, job.context, job.mode)
    per_gpu = flops / world
    peak = r0.get("peak_tflops")
    mfu = hardware.mfu(per_gpu, median_s, peak)

    def phase(name: str) -> float | None:
        vals = [r["phases"][name] for r in per_rank if name in r["phases"]]
        return max(vals) if vals else None

    mems = [r["peak_mem"] for r in per_rank if r["peak_mem"] is not None]
    reserved = [r["peak_reserved"] for r in per_rank if r["peak_reserved"] is not None]
    row: dict[str, Any] = {
        "status": "ok",
        "mean_ms": stats.mean,
        "std_ms": stats.std,
        "median_ms": stats.median,
        "min_ms": stats.min,
        "max_ms": stats.max,
        "first_measured_ms": steps[0] * 1e3,
        "fwd_ms": phase("forward"),
        "bwd_ms": phase("backward"),
        "sync_ms": phase("sync"),
        "opt_ms": phase("optimizer"),
        "tokens_per_s": global_batch * job.context / median_s,
        "tflops": per_gpu / median_s / 1e12,
        "mfu_pct": None if mfu is None else 100.0 * mfu,
        "peak_tflops": peak,
        "gflop_per_step": flops / 1e9,
        "peak_mem_gib": max(mems) / 2**30 if mems else None,
        "peak_reserved_gib": max(reserved) / 2**30 if reserved else None,
        "warmup_s": max(r["warmup_s"] for r in per_rank),
        "first_step_s": _first_step(per_rank),
        "params_M": r0["params"] / 1e6,
        "params_per_rank_M": max(r["local_params"] for r in per_rank) / 1e6,
        "build_s": max(r["build_s"] for r in per_rank),
        "act_ckpt_k": r0["act_ckpt_k"],
        "measured_compiles": _most(r.get("measured_compiles") for r in per_rank),
        "d_model": config.d_model,
        "num_layers": config.num_layers,
        "num_heads": config.num_heads,
        "d_ff": config.d_ff,
        "vocab_size": config.vocab_size,
        "attention": config.attention,
    }
    if job.mode == "train":
        row.update(
            planner_columns(
                config,
                nprocs=world,
                tp=job.tp,
                ddp=job.ddp != "none",
                batch=job.batch,
                context=job.context,
                precision=job.precision,
                act_ckpt=job.act_ckpt,
                gpu=r0.get("gpu"),
                peak_tflops=peak,
            )
        )
    if job.fsdp == "ours":
        row.update(_wait_columns([r["waits"] for r in per_rank]))
        if job.fused_loss and job.mode == "train":
            est = fsdp_memory_estimate(
                config,
                world=world,
                batch=job.batch,
                context=job.context,
                group_size=r0["act_ckpt_k"],
                compute_bytes=2 if job.precision == "bf16" else 4,
            )
            row["est_peak_mem_gib"] = est["peak"] / 2**30
    return row


def _most(values: Any) -> int | None:
    """The largest of the values that are not None; None when all are."""
    known = [v for v in values if v is not None]
    return max(known) if known else None


def _first_step(per_rank: Sequence[dict[str, Any]]) -> float | None:
    vals = [r["first_step_s"] for r in per_rank if r["first_step_s"] == r["first_step_s"]]
    return max(vals) if vals else None  # NaN (no warm-up) on every rank -> None


def _wait_columns(waits_by_rank: Sequence[Sequence[dict[str, Any]]]) -> dict[str, Any]:
    """Per step the slowest rank's wait, then the median over steps."""
    n = min(len(w) for w in waits_by_rank)
    if n == 0:
        return {}

    def med(key: str) -> float:
        return statistics.median(max(w[i][key] for w in waits_by_rank) for i in range(n))

    worst = max(
        (w[i] for w in waits_by_rank for i in range(n)), key=lambda s: s["max_ms"], default=None
    )
    return {
        "gather_wait_ms": med("wait_ms"),
        "gather_wait_fwd_ms": med("fwd_ms"),
        "gather_wait_bwd_ms": med("bwd_ms"),
        "units_waited": med("waited"),
        "gathers": med("gathers"),
        "gather_wait_max_ms": worst["max_ms"] if worst else None,
        "gather_wait_max_unit": worst["max_unit"] if worst else None,
    }


def spawn_cell(
    job: DistJob,
    nprocs: int,
    timeout_s: float,
    fn: Callable[[int, int, DistJob], dict[str, Any]] = run_rank,
) -> dict[str, Any]:
    """Run `job` on `nprocs` fresh ranks; the row's measured columns (status OOM / error).

    `fn` is the rank's body (default `run_rank`; tests pass a module-level wrapper)."""
    oom: list[int] = []

    def on_message(rank: int, payload: Any) -> None:
        if isinstance(payload, tuple) and payload and payload[0] == "oom":
            oom.append(rank)
            # The cell is OOM whatever the other ranks do: end it now (spawn kills the ranks)
            # rather than wait for a peer that may be stuck in a collective.
            raise _CellOOMError(f"rank {rank} ran out of memory")

    try:
        per_rank = _dist.run_ranks(
            fn,
            nprocs,
            backend=job.backend,
            args=(job,),
            timeout_s=timeout_s,
            quiet=True,
            on_message=on_message,
        )
    except Exception as exc:  # WorkerError (a rank's traceback) or TimeoutError
        if oom or timing.is_oom(exc):
            return {"status": "OOM", "note": f"rank(s) {sorted(set(oom))} ran out of memory"}
        return {"status": harness.failure_status(exc), "error": str(exc)}
    return aggregate(job, per_rank)


class _CellOOMError(RuntimeError):
    """A rank reported an out-of-memory error: the cell ends as OOM."""


def torchrun_cell(job: DistJob) -> dict[str, Any] | None:
    """Under torchrun: this process's rank of the cell; the measured columns on rank 0."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = run_rank(rank, world, job)
    per_rank = _dist.gather(mine)
    return aggregate(job, per_rank) if rank == 0 else None


# ----------------------------------------------------------------------------- the sweeps


def gather_wait_notes(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Lines under the table: where our FSDP's compute waited for an all-gather."""
    out = []
    for r in rows:
        if r.get("status") != "ok" or r.get("gather_wait_ms") is None:
            continue
        out.append(
            f"{r['size']} {r['precision']} ctx {r['context']} (fsdp {r['fsdp']}): all-gather "
            f"waits {r['gather_wait_ms']:.3g} ms per step (forward {r['gather_wait_fwd_ms']:.3g}, "
            f"backward {r['gather_wait_bwd_ms']:.3g}); {r['units_waited']:g} of "
            f"{r['gathers']:g} gathers waited > {WAIT_THRESHOLD_MS} ms; longest wait "
            f"{r['gather_wait_max_ms']:.3g} ms ({r['gather_wait_max_unit']})"
        )
    return out


def dist_job(spec: BenchSpec, opts: BenchOptions) -> DistJob:
    assert spec.fsdp is not None
    return DistJob(
        size=spec.size,
        attention=spec.attention,
        precision=spec.precision,
        mode=spec.mode,
        context=spec.context,
        fsdp=spec.fsdp,
        batch=opts.batch,
        warmup=opts.warmup,
        steps=opts.steps,
        overrides=opts.overrides,
        backend=opts.backend,
        seed=opts.seed,
        fused_loss=opts.fused_loss,
        act_ckpt=opts.act_ckpt,
        peak_tflops=opts.peak_tflops,
        quiet=not opts.progress,
        tf32=bool(torch.backends.cuda.matmul.allow_tf32),
        blas=opts.blas,
        tp=opts.tp,
        sequence_parallel=opts.sequence_parallel,
        ddp=spec.ddp,
        compile=spec.compile,
        compile_backend=opts.compile_backend,
    )


def run_dist_sweep(specs: Sequence[BenchSpec], opts: BenchOptions) -> list[dict[str, Any]]:
    """The multi-GPU mode: every cell on `opts.nprocs` freshly spawned ranks."""
    assert opts.nprocs is not None
    rows = []
    quiet = not opts.progress or len(specs) < 2
    with harness.Sweep(len(specs), "configs", device="cpu", quiet=quiet) as sweep:
        for spec in specs:
            info: dict[str, Any] = {}
            try:
                config = resolve_config(
                    spec.size,
                    context_length=spec.context,
                    attention=spec.attention,
                    overrides=opts.overrides,
                )
            except (ValueError, TypeError) as exc:
                sweep.skip(1)
                rows.append(cell_row(spec, info, opts, {"status": f"error: {exc}"}))
                continue
            info.update({f: getattr(config, f) for f in ("d_model", "num_layers", "num_heads")})
            info.update(d_ff=config.d_ff, vocab_size=config.vocab_size, attention=config.attention)
            job = dist_job(spec, opts)
            measured = sweep.measure(partial(spawn_cell, job, opts.nprocs, opts.timeout_s))
            if str(measured.get("status", "")).startswith("error") and measured.get("error"):
                print(f"[perf_tools.bench] {spec.label()}:\n{measured['error']}", file=sys.stderr)
            rows.append(cell_row(spec, info, opts, measured))
    return rows


def run_torchrun_sweep(
    specs: Sequence[BenchSpec], opts: BenchOptions
) -> list[dict[str, Any]] | None:
    """The multi-GPU mode under torchrun: every cell in turn on torchrun's ranks; the rows on
    rank 0 (None elsewhere). A failure other than OOM ends the run (ranks cannot skip a
    collective and stay in step)."""
    _dist.init_from_env(opts.backend, timeout_s=opts.timeout_s)
    rows: list[dict[str, Any]] = []
    try:
        for spec in specs:
            measured = torchrun_cell(dist_job(spec, opts))
            if measured is not None:
                rows.append(cell_row(spec, {}, opts, measured))
        dist.barrier()
    finally:
        rank = dist.get_rank()
        gc.collect()  # models and FSDP wrappers in reference cycles still hold the group
        dist.destroy_process_group()
    return rows if rank == 0 else None
