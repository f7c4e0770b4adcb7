"""The training loop behind `python -m lm_core.train`, as importable functions.

Data parallel semantics: every rank draws the same global batch of window starts from one
seeded generator and reads only its own rows; each rank's loss is the mean over its rows and
the wrappers average gradients, so N ranks compute the gradient of the mean loss over the
whole global batch, as one rank would. With gradient accumulation each micro-step's loss is
divided by the number of micro-steps. The data generator's state goes into checkpoints, so a
resumed run draws the same batches as an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from lm_core import lowp_weights
from lm_core.activation_ckpt import apply_activation_checkpointing, block_activation_ratio
from lm_core.compiling import compile_blocks
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
    refuse_together,
    setup_distributed,
    teardown_distributed,
    wrap_model,
)
from lm_core.graph_step import GraphedStep, check_device
from lm_core.loss import cross_entropy
from lm_core.model import TransformerLM
from lm_core.optim import AdamW, cosine_lr
from lm_core.optim_lowp import STATE_DTYPE_NAMES
from lm_core.optim_overlap import OverlappedOptimizer
from lm_core.run_dir import checkpoint_name, continue_metrics
from lm_core.shared_dir import start_together
from lm_core.train_checks import resolve_config
from lm_core.train_config import TrainConfig
from lm_core.train_monitor import Monitor
from lm_core.train_state import resume_run, save_run


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


def load_data(config: TrainConfig) -> Data:
    """Token files of `config.data`, or a synthetic stream (validation: another seed)."""
    d, seed = config.data, config.training.seed
    if d.path is not None:
        train = load_tokens(d.path, d.dtype)
        val = load_tokens(d.val_path, d.dtype) if d.val_path else None
    else:
        n, kind, vocab = d.synthetic_tokens, d.synthetic, config.model_config.vocab_size
        train = synthetic_tokens(n, vocab, kind, seed=seed)
        # The pattern's cycle depends only on the seed, so validation shares it (it measures
        # whether the pattern was learned); random tokens get an independent stream.
        val_seed = seed if kind == "pattern" else seed + 1
        val = synthetic_tokens(max(n // 10, config.model.context_length + 1), vocab, kind, val_seed)
    generator = torch.Generator().manual_seed(seed)
    return Data(train=train, val=val, generator=generator)


def _autocast(
    config: TrainConfig, device: torch.device, cache: bool = True
) -> contextlib.AbstractContextManager:
    """bf16 autocast with training.bf16; `cache=False` for a step captured in a CUDA graph
    (autocast's cache of cast weights must not outlive the capture)."""
    if config.training.bf16:
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16, cache_enabled=cache)
    return contextlib.nullcontext()


def _loss(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    config: TrainConfig,
    env: DistEnv,
    cu_seqlens: torch.Tensor | None = None,
    autocast_cache: bool = True,
) -> torch.Tensor:
    """Mean loss (0-dim fp32) of one batch: through the fused LM head + cross-entropy with
    training.fused_loss (model(x, y)), else logits (B, T, V) then cross_entropy.
    `cu_seqlens`: packed documents (data.pack_documents)."""
    packing = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
    with _autocast(config, env.device, autocast_cache):
        if config.training.fused_loss:
            return model(x, y, **packing)
        logits = model(x, **packing)  # (B, T, V)
    return cross_entropy(logits, y)


def _step_starts(
    tokens: np.ndarray, config: TrainConfig, micro_steps: int, generator: torch.Generator
) -> np.ndarray:
    """Window starts of one optimizer step, identical on every rank: int64 (micro, batch).

    All micro-batches are drawn at once, so accumulating k micro-batches of b sequences sees
    exactly the windows of one batch of k*b."""
    batch = config.training.batch_size
    starts = sample_starts(len(tokens), micro_steps * batch, config.model.context_length, generator)
    return starts.reshape(micro_steps, batch)  # (micro, batch)


def _rank_batch(
    tokens: np.ndarray, starts: np.ndarray, config: TrainConfig, env: DistEnv
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """This rank's rows of a global batch of starts (B,): (x, y) int64 (B / world, T), and
    with data.pack_documents the documents' offsets in x (found on the host, then copied)."""
    mine = starts[env.rows(config.training.batch_size)]
    seq = config.model.context_length
    if not config.data.pack_documents:
        return (*gather_windows(tokens, mine, seq, env.device), None)
    x, y = gather_windows(tokens, mine, seq, "cpu")
    cu_seqlens, _ = document_offsets(x, config.data.eot_id)
    return to_device(x, env.device), to_device(y, env.device), to_device(cu_seqlens, env.device)


def train_step(
    pm: ParallelModel,
    optimizer: torch.optim.Optimizer,
    data: Data,
    config: TrainConfig,
    env: DistEnv,
    lr: float,
    graph: GraphedStep | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One optimizer step over training.grad_accum_steps micro-batches (with `graph`: its
    static buffers refilled and the captured step replayed, `lm_core.graph_step`).

    Returns (this rank's mean loss, grad norm before clipping or None), as device tensors:
    nothing here waits for the device.
    """
    accum = config.training.grad_accum_steps
    starts = _step_starts(data.train, config, accum, data.generator)  # (accum, batch)
    batches = [_rank_batch(data.train, starts[micro], config, env) for micro in range(accum)]
    if graph is not None:
        return graph([(x, y) for x, y, _ in batches], lr)
    return _step_on(batches, pm, optimizer, config, env, lr)


def _step_on(
    batches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
    pm: ParallelModel,
    optimizer: torch.optim.Optimizer,
    config: TrainConfig,
    env: DistEnv,
    lr: float | torch.Tensor,
    autocast_cache: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The step's device work on its micro-batches [(x, y, cu_seqlens)]: forward and
    backward of each, clipping, the optimizer step at `lr` (a device tensor while a CUDA
    graph captures it), gradients set to None."""
    accum = len(batches)
    loss_sum = torch.zeros((), device=env.device)
    # before the backward: an OverlappedOptimizer steps its units during the last one
    for group in optimizer.param_groups:
        group["lr"] = lr
    no_step = getattr(optimizer, "no_step", None)  # OverlappedOptimizer: no update yet
    for micro, (x, y, cu_seqlens) in enumerate(batches):
        last = micro == accum - 1
        quiet = no_step() if no_step is not None and not last else contextlib.nullcontext()
        with contextlib.nullcontext() if last else pm.no_sync(), quiet:
            loss = _loss(pm.module, x, y, config, env, cu_seqlens, autocast_cache)
            (loss / accum).backward()
        loss_sum += loss.detach()
    pm.finish_sync()
    grad_norm = None
    if config.optim.grad_clip > 0:  # global norm (sharded: a collective)
        grad_norm = pm.clip_grad_norm(config.optim.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum / accum, grad_norm


def _graph_step(
    pm: ParallelModel, optimizer: torch.optim.Optimizer, config: TrainConfig, env: DistEnv
) -> GraphedStep:
    """training.cuda_graph: the step of `_step_on`, captured after its warm-up steps."""
    t = config.training

    def step(batches: list[tuple[torch.Tensor, torch.Tensor]], lr: float | torch.Tensor):
        micro = [(x, y, None) for x, y in batches]
        return _step_on(micro, pm, optimizer, config, env, lr, autocast_cache=False)

    return GraphedStep(
        step,
        optimizer,
        micro_steps=t.grad_accum_steps,
        rows=t.batch_size // env.dp_size,
        seq=config.model.context_length,
        device=env.device,
    )


@torch.no_grad()
def evaluate(model: nn.Module, data: Data, config: TrainConfig, env: DistEnv) -> float:
    """Mean loss over eval.batches global batches of the validation stream.

    A fresh generator with a fixed seed draws the same windows at every evaluation, so the
    values are comparable across steps (and across world sizes).
    """
    assert data.val is not None
    batches = config.eval.batches
    generator = torch.Generator().manual_seed(config.training.seed + 12345)
    total = torch.zeros((), device=env.device)
    starts = _step_starts(data.val, config, batches, generator)  # (batches, batch)
    for batch_starts in starts:
        x, y, cu_seqlens = _rank_batch(data.val, batch_starts, config, env)
        total += _loss(model, x, y, config, env, cu_seqlens)
    return all_reduce_mean(total / batches, env).item()


class _Log:
    """Progress bar (tqdm if installed) and metrics JSONL, on rank 0 only."""

    def __init__(self, config: TrainConfig, env: DistEnv, start: int) -> None:
        """The metrics log starts anew only with checkpoint.overwrite; a resumed run continues
        it (lines of steps after `start` dropped: they are logged again), any other run appends
        (`resolve_config` refused to start over an existing log)."""
        self.enabled = env.is_main
        self.bar = None
        self.file = None
        if not self.enabled:
            return
        if config.logging.progress:
            try:
                from tqdm.auto import tqdm

                steps = config.training.steps
                self.bar = tqdm(total=steps, initial=start, desc="train", unit="step")
            except ImportError:
                pass
        metrics, overwrite = config.metrics_path, config.checkpoint.overwrite
        if metrics is not None:
            metrics.parent.mkdir(parents=True, exist_ok=True)
            if config.checkpoint.resume is not None and not overwrite:
                continue_metrics(metrics, start)
            self.file = open(metrics, "w" if overwrite else "a")  # noqa: SIM115

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


def train(config: TrainConfig) -> TrainResult:
    """Check `config` (`resolve_config`: ConfigError naming the option), then train as it
    says; returns a TrainResult. `lm_core.train.run` is the documented entry point."""
    try:
        config = resolve_config(config)
    except ValueError as exc:  # under torchrun: the other ranks learn of it (no hang)
        p = config.parallel
        refuse_together(str(exc), p.ddp, config.training.device, p.backend, fsdp=p.fsdp, tp=p.tp)
        raise
    p = config.parallel
    env = setup_distributed(p.ddp, config.training.device, p.backend, fsdp=p.fsdp, tp=p.tp)
    try:
        # first collective: every rank accepted the options (and sees one --out-dir for dcp)
        start_together(env, config.checkpoint.out_dir, config.checkpoint.format)
        thread = config.training.backward_thread  # None: as torch is set
        # process-wide autograd state, restored on the way out
        with (
            contextlib.nullcontext()
            if thread is None
            else torch.autograd.set_multithreading_enabled(thread == "device")
        ):
            return _train(config, env)
    finally:
        teardown_distributed(env)


def _wrap(model: TransformerLM, config: TrainConfig, env: DistEnv) -> ParallelModel:
    """Activation checkpointing, then compile, then data-parallel / FSDP wrappers
    (`wrap_model`); with parallel.tp > 1 tensor parallel first (`lm_core.tp_engine`)."""
    t, p = config.training, config.parallel
    ratio = block_activation_ratio(model.config, autocast=t.bf16)
    if p.tp > 1:
        from lm_core.tp_engine import TensorParallel

        return TensorParallel(
            model,
            env,
            tp=p.tp,
            sequence_parallel=p.sequence_parallel,
            fsdp=p.fsdp == "torch",
            bf16=t.bf16,
            compile=t.compile,
            activation_checkpointing=t.activation_checkpointing,
            activation_ratio=ratio,
        )
    apply_activation_checkpointing(model, t.activation_checkpointing, activation_ratio=ratio)
    if t.compile_blocks:  # after checkpointing, before wrappers (torchtitan's order)
        compile_blocks(model)
    return wrap_model(
        model,
        p.ddp,
        env,
        compile=t.compile,
        bucket_size_mb=p.bucket_size_mb,
        reduce_dtype=p.reduce_dtype,
        fsdp=p.fsdp,
        bf16=t.bf16,
    )


def _train(config: TrainConfig, env: DistEnv) -> TrainResult:
    t, o = config.training, config.optim
    if t.batch_size % env.dp_size != 0:
        raise ValueError(
            f"--batch-size (training.batch_size) {t.batch_size} must be divisible by the "
            f"number of data-parallel replicas ({env.dp_size} = ranks / --tp)"
        )
    if t.cuda_graph:  # before anything is built: --device auto may have found no GPU
        check_device(env.device)
    if t.tf32 and env.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(t.seed)
    data = load_data(config)
    # initialize on the device (xl on a CPU takes minutes); under --fsdp on the meta device,
    # the wrapper materializes this rank's shards only
    with torch.device(model_init_device(env, config.parallel.fsdp, config.parallel.tp)):
        model = TransformerLM(config.model_config)
    param_shapes = [tuple(p.shape) for p in model.parameters()]  # full shapes, before sharding
    pm = _wrap(model, config, env)
    hparams = {
        "lr": o.max_lr,
        "betas": (o.beta1, o.beta2),
        "eps": o.eps,
        "weight_decay": o.weight_decay,
        "state_dtype": STATE_DTYPE_NAMES[o.state_dtype],
    }
    if t.optimizer_overlap:  # one process (resolve_config): the model's own parameters
        optimizer = OverlappedOptimizer(model, optimizer_cls=AdamW, **hparams)
    else:
        # under --fsdp: this rank's shards (and the replicated norms)
        optimizer = build_optimizer(pm.parameters(), AdamW, config.parallel.zero, **hparams)
    start = 0
    if config.checkpoint.resume is not None:
        start = resume_run(
            config.checkpoint.resume, pm, optimizer, data.generator, config, param_shapes
        )
    if t.bf16_weights:  # after loading: the masters are the loaded fp32 weights
        lowp_weights.hold_in_bf16(lowp_weights.matmul_weights(model))
    # captured after the resume: the graph holds the parameters and optimizer state in place
    graph = _graph_step(pm, optimizer, config, env) if t.cuda_graph else None
    result = TrainResult(model=model, optimizer=optimizer, step=start, parallel=pm)
    monitor = Monitor(config, env, model)  # first: it checks the tokenizer before files open
    log = _Log(config, env, start)
    tokens_per_step = t.batch_size * t.grad_accum_steps * config.model.context_length
    out_dir, ckpt_every = config.checkpoint.out_dir, config.checkpoint.every
    ckpt_name = checkpoint_name(config.checkpoint.format)  # checkpoint.pt or checkpoint.dcp
    ckpt_path = out_dir / ckpt_name if out_dir is not None else None
    loss_acc = torch.zeros((), device=env.device)
    acc_steps = 0
    t_last = time.perf_counter()
    t0 = t_last
    try:
        for step in range(start, t.steps):
            lr = cosine_lr(step, o.max_lr, o.min_lr, o.warmup_steps, o.cosine_steps)
            loss, grad_norm = train_step(pm, optimizer, data, config, env, lr, graph)
            loss_acc += loss
            acc_steps += 1
            done = step + 1
            result.step = done
            log.advance()
            if done % config.logging.every == 0 or done == t.steps:
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
            eval_every = config.eval.every
            if eval_every and data.val is not None and done % eval_every == 0:
                val = evaluate(pm.module, data, config, env)
                record = monitor.log({"step": done, "val_loss": val})  # + val_ppl
                result.evals.append(record)
                log.record(record)
                t_last = time.perf_counter()
            if monitor.sample_due(done):
                monitor.sample(done)
                t_last = time.perf_counter()
            if ckpt_path is not None and ckpt_every and done % ckpt_every == 0:
                save_run(ckpt_path, pm, optimizer, done, data.generator, config, env)
                t_last = time.perf_counter()
        if ckpt_path is not None and (not ckpt_every or result.step % ckpt_every):
            save_run(ckpt_path, pm, optimizer, result.step, data.generator, config, env)
    finally:
        log.close()
        monitor.close()
    return result
