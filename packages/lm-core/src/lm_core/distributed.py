"""Data parallelism for the trainer, applied beside the model (the model knows none of it).

`setup_distributed` joins (or creates) a process group; `wrap_model` applies torch.compile and
a data-parallel or fully sharded wrapper in a fixed order; `build_optimizer` optionally shards
optimizer state. The wrappers come from optional packages imported lazily: `ddp_kit` (naive,
flat, individual, bucketed) and `zero_shard` (--zero, --fsdp ours); "torch" is
`torch.nn.parallel.DistributedDataParallel` for --ddp and `fully_shard` for --fsdp
(`lm_core.fsdp`). The result, a `ParallelModel`, also knows how to clip the gradients and how
to read and load the full (unsharded) model and optimizer state for checkpoints.
"""

from __future__ import annotations

import contextlib
import os
import socket
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# DistEnv, ParallelModel and optional_import live in lm_core.engine, which lm_core.fsdp
# imports too (re-exported here: their public home stays lm_core.distributed).
from lm_core.engine import DistEnv, ParallelModel, optional_import

DDP_CHOICES = ("none", "naive", "flat", "individual", "bucketed", "torch")
FSDP_CHOICES = ("none", "ours", "torch")  # ours: zero_shard.FSDP; torch: torch's fully_shard
_DDP_KIT_CLASSES = {
    "naive": "NaiveDDP",
    "flat": "FlatDDP",
    "individual": "DDPIndividualParameters",
    "bucketed": "DDPBucketed",
}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolve_device(name: str, local_rank: int) -> torch.device:
    """'auto' -> cuda:<local_rank> when CUDA is available, else cpu; anything else as given."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank % torch.cuda.device_count())
        return torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"--device {name}: CUDA is not available on this machine")
        if device.index is None:  # plain "cuda": this rank's GPU
            device = torch.device("cuda", local_rank % torch.cuda.device_count())
    return device


def setup_distributed(
    ddp: str, device: str = "auto", backend: str = "auto", *, fsdp: str = "none", tp: int = 1
) -> DistEnv:
    """Join the process group for a data-parallel `ddp` != "none", a sharded `fsdp` !=
    "none" or tensor parallelism `tp` > 1, or run on one device.

    An existing group (initialized by the caller) is used as is. Under torchrun (WORLD_SIZE in
    the environment) a group is created from the environment; with a wrapper chosen but no
    torchrun, a one-process group on localhost (useful to try a wrapper on one device).
    """
    env_world = int(os.environ.get("WORLD_SIZE", "1"))
    if ddp == "none" and fsdp == "none" and tp == 1:
        world = env_world
        if dist.is_available() and dist.is_initialized():
            world = dist.get_world_size()  # a group of one is one process training alone
        if world > 1:
            raise ValueError(
                f"--ddp none: this process is one of {world} ranks; choose a "
                f"data-parallel wrapper with --ddp {{{','.join(DDP_CHOICES[1:])}}} or "
                f"--fsdp {{{','.join(FSDP_CHOICES[1:])}}}"
            )
        return DistEnv(device=resolve_device(device, 0))
    flag = f"--tp {tp}" if tp > 1 else f"--fsdp {fsdp}" if fsdp != "none" else f"--ddp {ddp}"
    if not dist.is_available():
        raise RuntimeError(f"{flag}: this torch build has no torch.distributed")
    if "LOCAL_RANK" in os.environ:
        local_rank = int(os.environ["LOCAL_RANK"])
    elif dist.is_initialized() and torch.cuda.is_available():
        local_rank = torch.cuda.current_device()  # a caller's group: the GPU it picked
    else:
        local_rank = 0
    dev = resolve_device(device, local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    owns = False
    if not dist.is_initialized():
        if backend == "auto":
            backend = "nccl" if dev.type == "cuda" else "gloo"
        if "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(
                backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
            )
        owns = True
    world = dist.get_world_size()
    if world % tp:
        if owns:
            dist.destroy_process_group()
        raise ValueError(
            f"--tp {tp} must divide the number of ranks ({world}): run under "
            f"torchrun --nproc_per_node {tp} (or a multiple of {tp})"
        )
    return DistEnv(
        rank=dist.get_rank(),
        world_size=world,
        local_rank=local_rank,
        device=dev,
        owns_group=owns,
        tp=tp,
    )


def agree_to_start(env: DistEnv, refusal: str | None = None, share: Any = None) -> Any:
    """Every rank's verdict on its options, gathered: the first collective of a multi-rank
    run. A rank that refused them (`refuse_together`) passes its message; on the others this
    raises a RuntimeError quoting it. The options are the same on every rank, so a refusal
    on some ranks only comes from what their host sees (a file missing, an old run in
    --out-dir): without this, those ranks would exit and the rest wait for them until the
    process group's timeout. Returns rank 0's small picklable `share` on every rank (the
    marker of `lm_core.shared_dir`, riding on this gather)."""
    if env.world_size == 1:
        return share
    gathered: list[Any] = [None] * env.world_size
    dist.all_gather_object(gathered, (refusal, share))
    refused = [(rank, msg) for rank, (msg, _) in enumerate(gathered) if msg is not None]
    if refusal is None and refused:
        rank, msg = refused[0]
        raise RuntimeError(
            f"rank {rank} refused the options: {msg} (rank {env.rank} accepted them: the "
            "ranks see different files; on several hosts give every host the same paths, "
            "on a shared filesystem or as copies, for --data, --val-data, --resume, "
            "--tokenizer and --out-dir)"
        )
    return gathered[0][1]


def refuse_together(
    message: str, ddp: str, device: str = "auto", backend: str = "auto", *, fsdp: str, tp: int
) -> None:
    """Under torchrun (several ranks): join the process group as `setup_distributed` would
    and hand `message` to the other ranks' `agree_to_start` before this rank exits with it.
    Nothing on one process, or where joining fails as it then fails on every rank."""
    several = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if not several and not (dist.is_available() and dist.is_initialized()):
        return
    try:
        env = setup_distributed(ddp, device, backend, fsdp=fsdp, tp=tp)
    except Exception:  # decided by the options alone, so the same on every rank
        return
    try:
        agree_to_start(env, message)
    finally:
        teardown_distributed(env)


def model_init_device(env: DistEnv, fsdp: str, tp: int = 1) -> torch.device:
    """Where the trainer builds the model: the meta device under `--fsdp` without `--tp` (the
    wrapper then materializes only this rank's shards, bitwise as the full build for the
    seed; `lm_core.fsdp`), else this rank's device."""
    return torch.device("meta") if fsdp != "none" and tp == 1 else env.device


def teardown_distributed(env: DistEnv) -> None:
    """Destroy the process group if `setup_distributed` created it."""
    if env.owns_group and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


_REDUCE_DTYPES = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def wrap_model(
    model: nn.Module,
    ddp: str,
    env: DistEnv,
    *,
    compile: bool = False,
    bucket_size_mb: float = 25.0,
    reduce_dtype: str = "none",
    fsdp: str = "none",
    bf16: bool = False,
) -> ParallelModel:
    """Apply torch.compile and the data-parallel wrapper `ddp` or the sharding `fsdp`, in
    this order:

    - ddp_kit wrappers: compile the model first, then wrap it, so the wrapper's gradient hooks
      run eagerly around the compiled graphs;
    - torch DDP: wrap first, then compile (torch's DDPOptimizer splits graphs at buckets);
    - fsdp "ours" (`zero_shard.FSDP`, compute dtype bf16 with `bf16`): each block's forward
      method compiled first (`compile_block_forwards`), so the wrapper's gathers and frees
      run eagerly in the module hooks around the compiled graphs;
    - fsdp "torch" (`fully_shard` per block, then the root; bf16 parameters and fp32
      gradient reduction with `bf16`): each block compiled in place first (torch skips its
      FSDP hooks when tracing), as torchtitan does.
    Activation checkpointing, when wanted, is applied to `model` before this. `reduce_dtype`
    ("bf16", "fp16"; "none": each gradient's dtype): what the `ddp` wrapper sends gradients
    in (ddp_kit's `reduce_dtype`, torch DDP's compress hook).
    """
    if ddp not in DDP_CHOICES:
        raise ValueError(f"--ddp: expected one of {list(DDP_CHOICES)}, got {ddp!r}")
    if fsdp not in FSDP_CHOICES:
        raise ValueError(f"--fsdp: expected one of {list(FSDP_CHOICES)}, got {fsdp!r}")
    if reduce_dtype not in _REDUCE_DTYPES:
        raise ValueError(
            f"--ddp-reduce-dtype: expected one of {list(_REDUCE_DTYPES)}, got {reduce_dtype!r}"
        )
    if fsdp != "none":
        if ddp != "none":
            raise ValueError(f"--fsdp {fsdp} excludes --ddp (got --ddp {ddp})")
        from lm_core import fsdp as sharding

        if fsdp == "ours":
            if compile:
                from lm_core.compiling import compile_block_forwards

                compile_block_forwards(model)
            return sharding.ZeroShardFSDP(model, env, bf16=bf16)
        return sharding.TorchFSDP(model, env, bf16=bf16, compile=compile)

    def nothing() -> None:
        return None

    if ddp == "none":
        module = torch.compile(model) if compile else model
        return ParallelModel(module, nothing, contextlib.nullcontext, env.rank)
    if ddp == "torch":
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [env.device.index] if env.device.type == "cuda" else None
        wrapped = DistributedDataParallel(
            model, device_ids=device_ids, bucket_cap_mb=bucket_size_mb
        )
        if reduce_dtype != "none":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            hooks = {
                "bf16": default_hooks.bf16_compress_hook,
                "fp16": default_hooks.fp16_compress_hook,
            }
            wrapped.register_comm_hook(None, hooks[reduce_dtype])
        module = torch.compile(wrapped) if compile else wrapped
        return ParallelModel(module, nothing, wrapped.no_sync, env.rank)
    ddp_kit = optional_import("ddp_kit", "ddp")
    cls = getattr(ddp_kit, _DDP_KIT_CLASSES[ddp])
    inner = torch.compile(model) if compile else model
    options = {"reduce_dtype": _REDUCE_DTYPES[reduce_dtype]}
    if ddp == "bucketed":
        options["bucket_size_mb"] = bucket_size_mb
    wrapped = cls(inner, **options)
    return ParallelModel(
        wrapped, wrapped.finish_gradient_synchronization, wrapped.no_sync, env.rank
    )


def build_optimizer(
    params: list[nn.Parameter],
    optimizer_cls: type[torch.optim.Optimizer],
    zero: bool,
    **kwargs: Any,
) -> torch.optim.Optimizer:
    """`optimizer_cls(params, **kwargs)`, or with `zero` a `zero_shard.ShardedOptimizer` that
    keeps state only for this rank's shard of the parameters."""
    if not zero:
        return optimizer_cls(params, **kwargs)
    zero_shard = optional_import("zero_shard", "zero")
    return zero_shard.ShardedOptimizer(params, optimizer_cls, **kwargs)


def all_reduce_mean(value: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Mean of a tensor over ranks (identity on one process)."""
    if env.world_size == 1:
        return value
    value = value.clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value / env.world_size
