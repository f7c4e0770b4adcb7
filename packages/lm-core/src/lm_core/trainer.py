"""The training loop behind `python -m lm_core.train`, as importable functions.

Data parallel semantics: every rank draws the same global batch of window starts from one
seeded generator and reads only its own rows; each rank's loss is the mean over its rows and
the wrappers average gradients, so N ranks compute the gradient of the mean loss over the
whole global batch, as one rank would. With gradient accumulation each micro-step's loss is
divided by the number of micro-steps. The data generator's state goes into checkpoints, so a
resumed run draws the same batches as an uninterrupted one.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from lm_core.activation_ckpt import apply_activation_checkpointing, block_activation_ratio
from lm_core.checkpoint import (
    check_optimizer_state,
    checked_model_state,
    read_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from lm_core.data import (
    document_offsets,
    gather_windows,
    load_tokens,
    sample_starts,
    synthetic_tokens,
    to_device,
)
from lm_core.distributed import (
    DistEnv,
    ParallelModel,
    all_reduce_mean,
    build_optimizer,
    model_init_device,
    setup_distributed,
    teardown_distributed,
    wrap_model,
)
from lm_core.loss import cross_entropy
from lm_core.model import TransformerLM
from lm_core.optim import AdamW, cosine_lr
from lm_core.run_dir import CHECKPOINT_NAME, continue_metrics
from lm_core.train_monitor import Monitor


@dataclass
class TrainResult:
    """What a run leaves behind, for callers and tests."""

    model: TransformerLM  # unwrapped (under --fsdp its parameters are this rank's shards)
    optimizer: torch.optim.Optimizer
    step: int  # optimizer steps completed
    history: list[dict[str, Any]] = field(default_factory=list)  # logged train records
    evals: list[dict[str, Any]] = field(default_factory=list)  # {"step", "val_loss"}
    parallel: ParallelModel | None = None  # how the model was wrapped

    @property
    def final_loss(self) -> float | None:
        return self.history[-1]["loss"] if self.history else None

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The trained model's full (unsharded) state dict. Under --fsdp this is a
        collective: call it on every rank while the process group is still up (a group that
        the trainer created itself is gone when `train` returns: read the checkpoint then);
        rank 0 gets the whole dict."""
        if self.parallel is None:
            return self.model.state_dict()
        return self.parallel.full_state_dict()


@dataclass
class Data:
    """Training and validation token streams and the generator that draws batches."""

    train: np.ndarray
    val: np.ndarray | None
    generator: torch.Generator


def load_data(args: argparse.Namespace) -> Data:
    """Token files from --data/--val-data, or a synthetic stream (validation: another seed)."""
    vocab = args.model_config.vocab_size
    if args.data is not None:
        train = load_tokens(args.data, args.data_dtype)
        val = load_tokens(args.val_data, args.data_dtype) if args.val_data else None
    else:
        n = args.synthetic_tokens
        train = synthetic_tokens(n, vocab, args.synthetic, seed=args.seed)
        # The pattern's cycle depends only on the seed, so validation shares it (it measures
        # whether the pattern was learned); random tokens get an independent stream.
        val_seed = args.seed if args.synthetic == "pattern" else args.seed + 1
        val = synthetic_tokens(
            max(n // 10, args.context_length + 1), vocab, args.synthetic, val_seed
        )
    generator = torch.Generator().manual_seed(args.seed)
    return Data(train=train, val=val, generator=generator)


def _autocast(args: argparse.Namespace, device: torch.device) -> contextlib.AbstractContextManager:
    if args.bf16:
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _loss(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    args: argparse.Namespace,
    env: DistEnv,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean loss (0-dim fp32) of one batch: through the fused LM head + cross-entropy with
    --fused-loss (model(x, y)), else logits (B, T, V) then cross_entropy. `cu_seqlens`:
    packed documents (--pack-documents)."""
    packing = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
    with _autocast(args, env.device):
        if args.fused_loss:
            return model(x, y, **packing)
        logits = model(x, **packing)  # (B, T, V)
    return cross_entropy(logits, y)


def _step_starts(
    tokens: np.ndarray, args: argparse.Namespace, micro_steps: int, generator: torch.Generator
) -> np.ndarray:
    """Window starts of one optimizer step, identical on every rank: int64 (micro, batch).

    All micro-batches are drawn at once, so accumulating k micro-batches of b sequences sees
    exactly the windows of one batch of k*b."""
    starts = sample_starts(
        len(tokens), micro_steps * args.batch_size, args.context_length, generator
    )
    return starts.reshape(micro_steps, args.batch_size)  # (micro, batch)


def _rank_batch(
    tokens: np.ndarray, starts: np.ndarray, args: argparse.Namespace, env: DistEnv
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """This rank's rows of a global batch of starts (B,): (x, y) int64 (B / world, T), and
    with --pack-documents the documents' offsets in x (found on the host, then copied)."""
    mine = starts[env.rows(args.batch_size)]
    if not args.pack_documents:
        return (*gather_windows(tokens, mine, args.context_length, env.device), None)
    x, y = gather_windows(tokens, mine, args.context_length, "cpu")
    cu_seqlens, _ = document_offsets(x, args.eot_id)
    return to_device(x, env.device), to_device(y, env.device), to_device(cu_seqlens, env.device)


def train_step(
    pm: ParallelModel,
    optimizer: torch.optim.Optimizer,
    data: Data,
    args: argparse.Namespace,
    env: DistEnv,
    lr: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One optimizer step over grad_accum_steps micro-batches.

    Returns (this rank's mean loss, grad norm before clipping or None), as device tensors:
    nothing here waits for the device.
    """
    accum = args.grad_accum_steps
    loss_sum = torch.zeros((), device=env.device)
    starts = _step_starts(data.train, args, accum, data.generator)  # (accum, batch)
    for micro in range(accum):
        x, y, cu_seqlens = _rank_batch(data.train, starts[micro], args, env)
        last = micro == accum - 1
        with contextlib.nullcontext() if last else pm.no_sync():
            loss = _loss(pm.module, x, y, args, env, cu_seqlens)
            (loss / accum).backward()
        loss_sum += loss.detach()
    pm.finish_sync()
    grad_norm = None
    if args.grad_clip > 0:
        grad_norm = pm.clip_grad_norm(args.grad_clip)  # global norm (sharded: collective)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum / accum, grad_norm


@torch.no_grad()
def evaluate(model: nn.Module, data: Data, args: argparse.Namespace, env: DistEnv) -> float:
    """Mean loss over --eval-batches global batches of the validation stream.

    A fresh generator with a fixed seed draws the same windows at every evaluation, so the
    values are comparable across steps (and across world sizes).
    """
    assert data.val is not None
    generator = torch.Generator().manual_seed(args.seed + 12345)
    total = torch.zeros((), device=env.device)
    starts = _step_starts(data.val, args, args.eval_batches, generator)  # (batches, batch)
    for batch_starts in starts:
        x, y, cu_seqlens = _rank_batch(data.val, batch_starts, args, env)
        total += _loss(model, x, y, args, env, cu_seqlens)
    return all_reduce_mean(total / args.eval_batches, env).item()


class _Log:
    """Progress bar (tqdm if installed) and metrics JSONL, on rank 0 only."""

    def __init__(self, args: argparse.Namespace, env: DistEnv, start: int) -> None:
        """The metrics log starts anew only with --overwrite; a resumed run continues it
        (lines of steps after `start` dropped: they are logged again), any other run appends
        (`lm_core.train.parse_args` refused to start over an existing log)."""
        self.enabled = env.is_main
        self.bar = None
        self.file = None
        if not self.enabled:
            return
        if not args.no_progress:
            try:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=args.steps, initial=start, desc="train", unit="step")
            except ImportError:
                pass
        if args.metrics is not None:
            args.metrics.parent.mkdir(parents=True, exist_ok=True)
            overwrite = getattr(args, "overwrite", False)
            if args.resume is not None and not overwrite:
                continue_metrics(args.metrics, start)
            self.file = open(args.metrics, "w" if overwrite else "a")  # noqa: SIM115

    def record(self, entry: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if self.file is not None:
            self.file.write(json.dumps(entry) + "\n")
            self.file.flush()
        text = " ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in entry.items()
        )
        if self.bar is not None:
            if "loss" in entry:
                mfu = {"mfu": f"{entry['mfu']:.1%}"} if "mfu" in entry else {}
                self.bar.set_postfix(
                    loss=f"{entry['loss']:.4f}", tok_s=f"{entry['tokens_per_s']:.0f}", **mfu
                )
            else:
                self.bar.write(text)
        else:
            print(text, flush=True)

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.file is not None:
            self.file.close()


def _save(
    path: Path,
    pm: ParallelModel,
    optimizer: torch.optim.Optimizer,
    step: int,
    data: Data,
    args: argparse.Namespace,
    env: DistEnv,
) -> None:
    """Checkpoint from rank 0: the full model and optimizer states, as one process training
    alone would have them (sharded parameters gathered, sharded optimizer state consolidated
    on rank 0 first: every rank takes part)."""
    model_state = pm.full_state_dict()
    optimizer_state = pm.full_optimizer_state_dict(optimizer)
    if env.is_main:
        extra = {"data_generator": data.generator.get_state(), "args": _args_record(args)}
        save_checkpoint(
            path, model_state, optimizer_state, step, config=args.model_config, extra=extra
        )
    if env.world_size > 1:
        torch.distributed.barrier()


def _group_shapes(
    optimizer: torch.optim.Optimizer, param_shapes: list[tuple[int, ...]]
) -> list[list[tuple[int, ...]]]:
    """The full shapes of `param_shapes` (the model's parameters, in order) split as the
    optimizer's groups are: the trainer builds every optimizer over the parameters in order."""
    sizes = [len(g["params"]) for g in optimizer.param_groups]
    if sum(sizes) != len(param_shapes):
        raise RuntimeError(
            f"the optimizer holds {sum(sizes)} parameters, the model {len(param_shapes)}"
        )
    bounds = itertools.accumulate(sizes, initial=0)
    return [param_shapes[a:b] for a, b in itertools.pairwise(bounds)]


def _resume(
    path: Path,
    pm: ParallelModel,
    optimizer: torch.optim.Optimizer,
    data: Data,
    args: argparse.Namespace,
    param_shapes: list[tuple[int, ...]],
) -> int:
    """Restore model, optimizer, RNG and data-generator state from a checkpoint of any world
    size and wrapper (full states: see `_save`); returns its step. Every rank reads the file.
    Model and optimizer state are checked against the model (full shapes `param_shapes`, in
    parameter order) before either is loaded."""
    payload = read_checkpoint(path)
    state = checked_model_state(payload, path, args.model_config, pm.full_shapes())
    start = payload["step"]
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"checkpoint {path}: step is {start!r}, expected a non-negative int")
    if start > args.steps:
        raise ValueError(f"--resume: checkpoint is at step {start}, beyond --steps {args.steps}")
    if payload["optimizer"] is None:
        raise ValueError(f"checkpoint {path} holds no optimizer state")
    check_optimizer_state(payload["optimizer"], _group_shapes(optimizer, param_shapes), path)
    pm.load_full_state_dict(state)
    try:
        pm.load_full_optimizer_state_dict(optimizer, payload["optimizer"])
    except (ValueError, KeyError, RuntimeError) as exc:
        raise ValueError(
            f"checkpoint {path}: optimizer state does not match this optimizer: {exc}"
        ) from exc
    restore_rng_state(payload["rng"])
    generator_state = payload["extra"].get("data_generator")
    if generator_state is not None:
        data.generator.set_state(generator_state)
    return start


def _args_record(args: argparse.Namespace) -> dict[str, Any]:
    return {
        k: (str(v) if isinstance(v, Path) else v)
        for k, v in vars(args).items()
        if isinstance(v, str | int | float | bool | Path | type(None))
    }


def train(args: argparse.Namespace) -> TrainResult:
    """Run training as configured by `lm_core.train.parse_args`; returns a TrainResult."""
    env = setup_distributed(args.ddp, args.device, args.dist_backend, fsdp=args.fsdp, tp=args.tp)
    try:
        return _train(args, env)
    finally:
        teardown_distributed(env)


def _train(args: argparse.Namespace, env: DistEnv) -> TrainResult:
    if args.batch_size % env.dp_size != 0:
        raise ValueError(
            f"--batch-size {args.batch_size} must be divisible by the number of data-parallel "
            f"replicas ({env.dp_size} = ranks / --tp)"
        )
    if args.tf32 and env.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(args.seed)
    data = load_data(args)
    # initialize on the device (xl on a CPU takes minutes); under --fsdp on the meta device,
    # the wrapper materializes this rank's shards only
    with torch.device(model_init_device(env, args.fsdp, args.tp)):
        model = TransformerLM(args.model_config)
    param_shapes = [tuple(p.shape) for p in model.parameters()]  # full shapes, before sharding
    # activation checkpointing, then compile, then data-parallel / FSDP wrappers (wrap_model)
    ratio = block_activation_ratio(args.model_config, autocast=args.bf16)
    if args.tp > 1:  # tensor parallel, checkpointing, compile, FSDP (lm_core.tp_engine)
        from lm_core.tp_engine import TensorParallel

        pm: ParallelModel = TensorParallel(
            model,
            env,
            tp=args.tp,
            sequence_parallel=args.sequence_parallel,
            fsdp=args.fsdp == "torch",
            bf16=args.bf16,
            compile=args.compile,
            activation_checkpointing=args.activation_checkpointing,
            activation_ratio=ratio,
        )
    else:
        apply_activation_checkpointing(model, args.activation_checkpointing, activation_ratio=ratio)
        pm = wrap_model(
            model,
            args.ddp,
            env,
            compile=args.compile,
            bucket_size_mb=args.bucket_size_mb,
            fsdp=args.fsdp,
            bf16=args.bf16,
        )
    optimizer = build_optimizer(
        pm.parameters(),  # under --fsdp: this rank's shards (and the replicated norms)
        AdamW,
        args.zero,
        lr=args.max_lr,
        betas=(args.beta1, args.beta2),
        eps=args.adam_eps,
        weight_decay=args.weight_decay,
    )
    start = 0
    if args.resume is not None:
        start = _resume(args.resume, pm, optimizer, data, args, param_shapes)
    result = TrainResult(model=model, optimizer=optimizer, step=start, parallel=pm)
    monitor = Monitor(args, env, model)  # first: it checks --tokenizer before files open
    log = _Log(args, env, start)
    tokens_per_step = args.batch_size * args.grad_accum_steps * args.context_length
    ckpt_path = args.out_dir / CHECKPOINT_NAME if args.out_dir is not None else None
    loss_acc = torch.zeros((), device=env.device)
    acc_steps = 0
    t_last = time.perf_counter()
    t0 = t_last
    try:
        for step in range(start, args.steps):
            lr = cosine_lr(step, args.max_lr, args.min_lr, args.warmup_steps, args.cosine_steps)
            loss, grad_norm = train_step(pm, optimizer, data, args, env, lr)
            loss_acc += loss
            acc_steps += 1
            done = step + 1
            result.step = done
            log.advance()
            if done % args.log_every == 0 or done == args.steps:
                mean_loss = all_reduce_mean(loss_acc / acc_steps, env).item()  # syncs
                now = time.perf_counter()
                entry = {
                    "step": done,
                    "loss": mean_loss,
                    "lr": lr,
                    "tokens_per_s": acc_steps * tokens_per_step / (now - t_last),
                    "elapsed_s": now - t0,
                }
                if grad_norm is not None:
                    entry["grad_norm"] = grad_norm.item()
                if not math.isfinite(mean_loss):
                    raise FloatingPointError(f"loss is {mean_loss} at step {done}")
                monitor.log(entry)  # + mfu, TensorBoard
                result.history.append(entry)
                log.record(entry)
                loss_acc.zero_()
                acc_steps = 0
                t_last = time.perf_counter()
            if args.eval_every and data.val is not None and done % args.eval_every == 0:
                val = evaluate(pm.module, data, args, env)
                record = monitor.log({"step": done, "val_loss": val})  # + val_ppl
                result.evals.append(record)
                log.record(record)
                t_last = time.perf_counter()
            if monitor.sample_due(done):
                monitor.sample(done)
                t_last = time.perf_counter()
            if ckpt_path is not None and args.ckpt_every and done % args.ckpt_every == 0:
                _save(ckpt_path, pm, optimizer, done, data, args, env)
                t_last = time.perf_counter()
        if ckpt_path is not None and (not args.ckpt_every or result.step % args.ckpt_every):
            _save(ckpt_path, pm, optimizer, result.step, data, args, env)
    finally:
        log.close()
        monitor.close()
    return result
