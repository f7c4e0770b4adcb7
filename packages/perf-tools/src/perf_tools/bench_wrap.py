"""What one rank of a multi-GPU bench cell trains: the job (`DistJob`) and its model, built,
checkpointed, compiled and wrapped (`build_and_wrap`).

Layouts (`DistJob.fsdp`, `.ddp`, `.tp`):
  fsdp ours   the model built on the meta device, then zero_shard.FSDP (compute dtype bf16
              for --precision bf16), which materializes this rank's shards.
  fsdp torch  the meta-built model, torch's fully_shard on every block then the root
              (MixedPrecisionPolicy bf16 / fp32 reduce for bf16), then
              lm_core.fsdp.materialize_fully_sharded.
  ddp torch   the model built on every rank's device (the seed's weights; DDP broadcasts
              rank 0's anyway), then the trainer's `--ddp torch`:
              `lm_core.distributed.wrap_model(model, "torch", env)`, torch's
              DistributedDataParallel with 25 MB buckets, gradients all-reduced inside the
              backward. No compute dtype: bf16 runs under autocast (fp32 weights).
  tp K        `perf_tools.bench_tp.wrap_tp` (lm_core's trainer engine), 2-D with fsdp torch.
Activation checkpointing comes before wrapping (TP: inside its engine, after sharding).

Compile (`DistJob.compile`, `resolve_compile`), in torchtitan's order, after TP and
checkpointing and before the data-parallel wrapper:
  "blocks"  each block compiled on its own: what `--compile` means for fsdp ours, fsdp torch
            and TP (the row's `compile` column says blocks). In place (`block.compile()`,
            lm_core.compile_blocks) for fsdp torch and TP; for fsdp ours each block's
            forward method (`lm_core.compile_block_forwards`, what `lm_core.train --fsdp
            ours --compile` does), so that zero_shard's unit hooks run eagerly around the
            compiled graph (compiled in place, dynamo would trace the hooks' all-gathers).
  True      the whole model: DDP, compiled after wrapping (torch's DDPOptimizer splits the
            graph at bucket boundaries, so the all-reduces still overlap the backward).
Every compile is `dynamic=False` with the job's backend (`--compile-backend`, inductor by
default); the cell's warm-up steps run the compilation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from perf_tools._compile import allow_recompiles, compile_for_bench
from perf_tools.bench_tp import wrap_tp
from perf_tools.cells import compile_blocks_for_bench
from perf_tools.models import build_model, count_params

FSDP_KINDS = ("ours", "torch")
DDP_KINDS = ("torch",)  # torch.nn.parallel.DistributedDataParallel (lm_core's --ddp torch)


@dataclasses.dataclass(frozen=True)
class DistJob:
    """One cell of the multi-GPU mode; picklable (it travels to the spawned ranks)."""

    size: str
    attention: str | None
    precision: str
    mode: str
    context: int
    fsdp: str  # "ours", "torch", or "none" (pure TP, DDP)
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
    ddp: str = "none"  # "torch": DistributedDataParallel over all ranks (fsdp "none", tp 1)
    compile: bool | str = False  # False, True (the whole model: DDP), "blocks"
    compile_backend: str = "inductor"

    @property
    def autocast(self) -> bool:
        """True where no wrapper casts (pure TP, DDP): the step runs under autocast."""
        return self.fsdp == "none"

    def layout(self) -> str:
        """'fsdp ours', 'ddp torch', 'tp 2', 'fsdp torch x tp 2', ... (progress labels)."""
        parts = [f"fsdp {self.fsdp}"] if self.fsdp != "none" else []
        parts += [f"ddp {self.ddp}"] if self.ddp != "none" else []
        parts += [f"tp {self.tp}"] if self.tp > 1 else []
        return " x ".join(parts)


def resolve_compile(value: bool | str, *, fsdp: str, ddp: str) -> bool | str:
    """What `--compile` `value` (False, True, "blocks") compiles under a layout: DDP as asked
    (True: the whole model); the sharded and tensor-parallel layouts block by block."""
    if not value:
        return False
    if ddp != "none":
        return value
    return "blocks"


@dataclasses.dataclass
class Wrapped:
    """A rank's model ready to time."""

    runner: nn.Module  # what the step calls; the optimizer steps runner.parameters()
    sync: Callable[[], None] | None  # gradient sync to call after backward (None: in backward)
    fsdp: Any  # our zero_shard.FSDP (gather waits are recorded), else None
    params: int  # parameter elements of the full model
    act_ckpt_k: int  # blocks per checkpointed group (0: none)


def build_and_wrap(
    job: DistJob, config: Any, *, rank: int, world: int, device: torch.device
) -> Wrapped:
    """This rank's model of `job` (module docstring): built, checkpointed, compiled, wrapped."""
    torch.manual_seed(job.seed)
    model = build_model(config, "meta" if job.fsdp in FSDP_KINDS and job.tp == 1 else device)
    model.train()
    params = count_params(model)
    options = _compile_options(job)
    if job.tp > 1:  # TP checkpoints and compiles after sharding, inside lm_core's engine
        runner, sync, k = wrap_tp(
            model,
            config,
            rank=rank,
            world=world,
            device=device,
            tp=job.tp,
            sequence_parallel=job.sequence_parallel,
            fsdp=job.fsdp == "torch",
            bf16=job.precision == "bf16",
            act_ckpt=job.act_ckpt,
            compile=options if job.compile else False,
        )
        return Wrapped(runner, sync, None, params, k)
    k = _checkpoint(job, model, config)
    if job.ddp != "none":
        return Wrapped(_wrap_ddp(job, model, rank, world, device, options), None, None, params, k)
    if job.compile == "blocks" and job.fsdp == "torch":
        compile_blocks_for_bench(model, **options)
    elif job.compile == "blocks":  # ours: compiled forwards, the unit hooks outside them
        from lm_core import compile_block_forwards

        allow_recompiles()
        compile_block_forwards(model, **options)
    elif job.compile:
        raise ValueError(f"compile: {job.compile!r} is not available with fsdp {job.fsdp}")
    runner, sync, fsdp = _wrap_fsdp(job, model, rank, world, device)
    return Wrapped(runner, sync, fsdp, params, k)


def _compile_options(job: DistJob) -> dict[str, Any]:
    return {"backend": job.compile_backend, "dynamic": False}


def _checkpoint(job: DistJob, model: nn.Module, config: Any) -> int:
    """Activation checkpointing of `model` per `job.act_ckpt`; the group size (0: none)."""
    if job.act_ckpt == "none":
        return 0
    from lm_core.activation_ckpt import (
        apply_activation_checkpointing,
        block_activation_ratio,
        checkpoint_group_size,
    )

    # FSDP computes in one dtype (no autocast); DDP's bf16 runs under autocast
    ratio = block_activation_ratio(config, autocast=job.autocast and job.precision == "bf16")
    apply_activation_checkpointing(model, job.act_ckpt, activation_ratio=ratio)
    return checkpoint_group_size(model)


def _wrap_ddp(
    job: DistJob,
    model: nn.Module,
    rank: int,
    world: int,
    device: torch.device,
    options: dict[str, Any],
) -> nn.Module:
    """The trainer's `--ddp torch` around `model`, compiled as `job.compile` says."""
    from lm_core.distributed import DistEnv, wrap_model

    if job.compile == "blocks":
        compile_blocks_for_bench(model, **options)
    local = device.index if device.index is not None else rank
    env = DistEnv(rank=rank, world_size=world, local_rank=local, device=device)
    wrapped = wrap_model(model, job.ddp, env).module
    return compile_for_bench(wrapped, **options) if job.compile is True else wrapped


def _wrap_fsdp(
    job: DistJob, model: nn.Module, rank: int, world: int, device: torch.device
) -> tuple[nn.Module, Callable[[], None] | None, Any]:
    """(runner, gradient sync to call after backward, our FSDP or None): the meta-device
    `model` sharded and materialized on `device` by the trainer's engine (`lm_core.fsdp`:
    zero_shard.FSDP, or torch's fully_shard per block then the root)."""
    from lm_core.engine import DistEnv
    from lm_core.fsdp import TorchFSDP, ZeroShardFSDP

    env = DistEnv(rank, world, device=device)
    bf16 = job.precision == "bf16"
    if job.fsdp == "ours":
        pm = ZeroShardFSDP(model, env, bf16=bf16)
        return pm.module, pm.finish_sync, pm.fsdp
    return TorchFSDP(model, env, bf16=bf16).module, None, None
