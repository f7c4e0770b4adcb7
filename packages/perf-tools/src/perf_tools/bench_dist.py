"""The multi-GPU mode of `python -m perf_tools.bench`: sharded (FSDP) training steps on N ranks.

`bench --nprocs N --fsdp ours|torch` runs each cell of the sweep on N ranks (`run_dist_sweep`):
spawned by the tool itself (`_dist.run_ranks`, i.e. `ddp_kit.launch.spawn`: file-store
rendezvous, NCCL with one GPU per rank, gloo on CPU), fresh processes for every cell so that no
cell inherits another one's memory; or, under `torchrun` (`run_torchrun_sweep`), the ranks
torchrun started (every cell in turn). The rank side (`run_rank`) builds, wraps and times; the
parent side (`aggregate`) turns every rank's measurements into the row.

Each rank builds the model on the meta device, applies activation checkpointing, wraps it
(the wrapper materializes only this rank's shards on its device, as the full build for the
seed would be) and trains on its own random batch (`--batch` sequences per rank):

  ours   zero_shard.FSDP(model, compute_dtype=bf16 for --precision bf16, else None); lm_core
         AdamW over fsdp.parameters() (the fp32 shards and the replicated norms); the step is
         zero_grad, forward, backward, finish_gradient_synchronization() ("sync"), AdamW.
  torch  torch.distributed.fsdp.fully_shard on every block, then on the root, with
         MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) for bf16, then
         lm_core.fsdp.materialize_fully_sharded (the shards of the full build); lm_core AdamW
         over the (DTensor) parameters. Gradients are reduced inside backward (no sync phase).
  --tp K tensor parallel over K ranks, data parallel (fully_shard) over N / K with --fsdp
         torch: `perf_tools.bench_tp` (lm_core's trainer engine); `--batch` is then per
         data-parallel group, shared by the K ranks of a TP group.

No autocast in this mode: the wrapper's compute dtype is the precision (bf16 weights,
activations and matmuls; fp32 master weights, gradients and optimizer state); pure TP (no
wrapper) runs bf16 under autocast. Train rows also get the planner's prediction
(`perf_tools.bench_predict`).

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
from torch import nn

from perf_tools import _dist, hardware, harness, timing
from perf_tools.bench_predict import fsdp_memory_estimate, planner_columns
from perf_tools.bench_tp import wrap_tp
from perf_tools.cells import BenchOptions, BenchSpec, cell_row
from perf_tools.models import (
    build_model,
    count_local_params,
    count_params,
    random_batch,
    resolve_config,
)
from perf_tools.steps import PhaseTimer, make_step

FSDP_KINDS = ("ours", "torch")
WAIT_THRESHOLD_MS = 0.05  # a wait above this is compute stalled on an all-gather (events: ~us)


@dataclasses.dataclass(frozen=True)
class DistJob:
    """One cell of the multi-GPU mode; picklable (it travels to the spawned ranks)."""

    size: str
    attention: str | None
    precision: str
    mode: str
    context: int
    fsdp: str
    batch: int  # per rank
    warmup: int
    steps: int
    overrides: dict[str, Any]
    backend: str
    seed: int = 0
    fused_loss: bool = False
    act_ckpt: str | int = "none"
    peak_tflops: float | None = None
    quiet: bool = True
    tf32: bool = False  # TF32 matmuls; each spawned rank sets the flag (it is per process)
    blas: str = "default"  # CUDA BLAS library, likewise set by each rank
    # tensor parallel over groups of tp ranks (perf_tools.bench_tp); with fsdp "none" the
    # world is one TP group (pure TP), with "torch" the mesh is 2-D
    tp: int = 1
    sequence_parallel: bool = False


def torch_fully_shard() -> tuple[Callable[..., Any], type]:
    """torch's `fully_shard` and `MixedPrecisionPolicy` (public since torch 2.6, under
    `torch.distributed._composable.fsdp` since 2.4); ImportError naming the need otherwise."""
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        return fully_shard, MixedPrecisionPolicy
    except ImportError:
        pass
    try:
        from torch.distributed._composable.fsdp import (  # type: ignore[no-redef]
            MixedPrecisionPolicy,
            fully_shard,
        )

        return fully_shard, MixedPrecisionPolicy
    except ImportError:
        raise ImportError(
            f"torch {torch.__version__} has no torch.distributed.fsdp.fully_shard "
            "(torch >= 2.4 needed)"
        ) from None


# ----------------------------------------------------------------------------- rank side


def _build(job: DistJob, config: Any, device: torch.device) -> tuple[nn.Module, int]:
    """The lm_core model, checkpointed as asked: on the meta device for the FSDP rows (`_wrap`
    materializes this rank's shards), on `device` for TP (its engine broadcasts rank 0's
    weights before sharding)."""
    torch.manual_seed(job.seed)
    model = build_model(config, "meta" if job.tp == 1 else device)
    model.train()
    k = 0
    if job.act_ckpt != "none" and job.tp == 1:  # TP checkpoints after sharding (bench_tp)
        from lm_core.activation_ckpt import (
            apply_activation_checkpointing,
            block_activation_ratio,
            checkpoint_group_size,
        )

        # one dtype throughout under FSDP (no autocast): the single-dtype ratio
        ratio = block_activation_ratio(config)
        apply_activation_checkpointing(model, job.act_ckpt, activation_ratio=ratio)
        k = checkpoint_group_size(model)
    return model, k


def _wrap(
    job: DistJob, model: nn.Module, device: torch.device
) -> tuple[nn.Module, Callable[[], None] | None, Any]:
    """(runner, gradient sync to call after backward, our FSDP or None); the meta-device
    `model` sharded and materialized on `device`."""
    bf16 = job.precision == "bf16"
    if job.fsdp == "ours":
        from zero_shard import FSDP

        fsdp = FSDP(model, compute_dtype=torch.bfloat16 if bf16 else None, device=device)
        return fsdp, fsdp.finish_gradient_synchronization, fsdp
    fully_shard, policy_cls = torch_fully_shard()
    kwargs: dict[str, Any] = {}
    if bf16:
        kwargs["mp_policy"] = policy_cls(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    from lm_core.fsdp import materialize_fully_sharded

    materialize_fully_sharded(model, device)
    return model, None, None


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
    model, k = _build(job, config, device)
    n_params = count_params(model)
    if job.tp > 1:
        fsdp = None
        runner, sync, k = wrap_tp(
            model,
            config,
            rank=rank,
            world=dist.get_world_size(),
            device=device,
            tp=job.tp,
            sequence_parallel=job.sequence_parallel,
            fsdp=job.fsdp == "torch",
            bf16=job.precision == "bf16",
            act_ckpt=job.act_ckpt,
        )
    else:
        runner, sync, fsdp = _wrap(job, model, device)
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
        # the FSDP wrapper casts: no autocast on top; pure TP has no wrapper: autocast
        precision=job.precision if job.fsdp == "none" else "fp32",
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

    def on_measure() -> None:
        timing.reset_peak_memory(device)
        waits.clear()

    label = None if job.quiet or rank != 0 else f"{job.size} {job.fsdp} FSDP tp {job.tp} rank 0"
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
        "params": n_params,
        "local_params": count_local_params(runner),
        "build_s": build_s,
        "act_ckpt_k": k,
        "config": dataclasses.asdict(config),
    }
    if rank == 0:
        peak = job.peak_tflops
        if peak is None:
            peak = hardware.peak_tflops(job.precision, device)
        out["peak_tflops"] = peak
        out["gpu"] = hardware.device_key(device)  # the planner's hardware (bench_predict)
    del step, optimizer, runner, model
    return out


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
