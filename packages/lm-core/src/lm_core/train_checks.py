"""Validation of a `TrainConfig` as a whole, and the values it derives: `resolve_config`.

Runs on the final config, whatever set its values (defaults, a TOML file, flags, Python), so a
cross-option rule (`parallel.zero` needs `parallel.ddp`, `data.pack_documents` excludes
`parallel.tp`, ...) holds for all of them. Errors are `ConfigError`s whose message names the
options as the user wrote them (`KeyNames`: `--zero` on the command line, `parallel.zero` in a
file or in Python).

Derived values: `optim.min_lr` (max_lr / 10), `optim.cosine_steps` (training.steps),
`model.context_length` and `model.vocab_size` (the preset's, or the vocabulary of the `--data`
sidecar written by `lm_core.tokenize encode`), `data.eot_id` (the sidecar's) and a normalized
`training.activation_checkpointing`. The metrics log's path stays derived
(`TrainConfig.metrics_path`), so a resolved config moved to another `out_dir` logs there. A
resolved config resolves to itself.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from lm_core.activation_ckpt import parse_every
from lm_core.config import MODEL_SIZES
from lm_core.data import read_token_meta, token_meta_path
from lm_core.dcp_io import is_checkpoint_dir
from lm_core.graph_step import check_config as check_cuda_graph
from lm_core.run_dir import checkpoint_name, existing_run_files, same_file
from lm_core.train_config import ConfigError, KeyNames, TrainConfig

_POSITIVE = (
    "training.steps",
    "training.batch_size",
    "training.grad_accum_steps",
    "data.synthetic_tokens",
    "logging.every",
    "eval.batches",
    "parallel.bucket_size_mb",
    "parallel.tp",
    "sample.tokens",
)
_NON_NEGATIVE = (
    "optim.warmup_steps",
    "checkpoint.every",
    "eval.every",
    "optim.grad_clip",
    "optim.weight_decay",
    "training.seed",
    "optim.max_lr",
    "optim.eps",
    "sample.every",
    "sample.temperature",
)


def resolve_config(
    config: TrainConfig, names: KeyNames | None = None, *, check_run_dir: bool = True
) -> TrainConfig:
    """A validated copy of `config` with its derived values filled in (module docstring).

    Raises ConfigError naming the option (through `names`; default: dotted keys) for a wrong
    type, a value out of range, options that exclude each other, a missing file, token files
    that disagree with the options, or (with `check_run_dir`) an output directory holding
    another run that this one would overwrite.
    """
    n = names or KeyNames()
    c = config.checked()  # a copy: the caller's config is left alone
    _check_ranges(c, n)
    try:
        c.training.activation_checkpointing = parse_every(c.training.activation_checkpointing)
    except (ValueError, TypeError) as exc:
        raise ConfigError(
            "training.activation_checkpointing", f"{n('training.activation_checkpointing')}: {exc}"
        ) from None
    _check_parallel(c, n)
    check_cuda_graph(c, n)
    _check_checkpoint_format(c, n)
    _check_bf16_weights(c, n)
    _check_overlap(c, n)
    _check_files(c, n)
    _check_sample(c, n)
    _apply_sidecar(c, n)
    _check_data(c, n)
    try:
        model = c.model_config
    except (ValueError, TypeError) as exc:
        raise ConfigError("model", f"model options: {exc}") from None
    c.model.context_length = model.context_length
    c.model.vocab_size = model.vocab_size
    if c.parallel.tp > 1:
        from lm_core.parallel import check_tensor_parallel

        try:
            check_tensor_parallel(
                model,
                c.parallel.tp,
                sequence_parallel=c.parallel.sequence_parallel,
                seq_len=model.context_length,
            )
        except ValueError as exc:
            raise ConfigError("parallel.tp", f"{n('parallel.tp')}: {exc}") from None
    eot = c.data.eot_id
    if eot is not None and not 0 <= eot < model.vocab_size:
        raise ConfigError(
            "data.eot_id",
            f"{n('data.eot_id')} must be a token id in [0, {model.vocab_size}), got {eot}",
        )
    if check_run_dir:
        _check_run_dir(c, n)
    return c


def _check_ranges(c: TrainConfig, n: KeyNames) -> None:
    """Single values in range; fills min_lr and cosine_steps."""
    for key in _POSITIVE:
        value = _get(c, key)
        if value <= 0:
            raise ConfigError(key, f"{n(key)} must be positive, got {value}")
    for key in _NON_NEGATIVE:
        value = _get(c, key)
        if value < 0:
            raise ConfigError(key, f"{n(key)} must be >= 0, got {value}")
    o = c.optim
    if o.min_lr is None:
        o.min_lr = o.max_lr / 10
    if o.min_lr < 0:
        raise ConfigError("optim.min_lr", f"{n('optim.min_lr')} must be >= 0, got {o.min_lr}")
    if o.cosine_steps is None:
        o.cosine_steps = c.training.steps
    if not o.warmup_steps <= o.cosine_steps:
        raise ConfigError(
            "optim.warmup_steps",
            f"{n('optim.warmup_steps')} ({o.warmup_steps}) must be <= "
            f"{n('optim.cosine_steps')} ({o.cosine_steps})",
        )
    for key in ("optim.beta1", "optim.beta2"):
        if not 0 <= _get(c, key) < 1:
            raise ConfigError(key, f"{n(key)} must be in [0, 1), got {_get(c, key)}")
    if c.logging.peak_tflops is not None and not c.logging.peak_tflops > 0:
        key = "logging.peak_tflops"
        raise ConfigError(key, f"{n(key)} must be positive, got {c.logging.peak_tflops}")


def _check_bf16_weights(c: TrainConfig, n: KeyNames) -> None:
    """training.bf16_weights: bf16 autocast, one optimizer step per backward (bf16 gradients
    would be summed in bf16), no wrapper that reduces or shards the gradients, and the full
    checkpoint format (whose model state holds the fp32 masters)."""
    t, p = c.training, c.parallel
    if not t.bf16_weights:
        return
    key = "training.bf16_weights"
    clashes = [
        (not t.bf16, f"needs {n('training.bf16')}"),
        (t.grad_accum_steps > 1, f"excludes {n('training.grad_accum_steps')} > 1"),
        (p.ddp != "none", f"excludes {n('parallel.ddp')}"),
        (p.fsdp != "none", f"excludes {n('parallel.fsdp')}"),
        (p.zero, f"excludes {n('parallel.zero')}"),
        (p.tp > 1, f"excludes {n('parallel.tp')}"),
        (c.checkpoint.format == "dcp", f"needs {n('checkpoint.format')} full"),
    ]
    for clash, why in clashes:
        if clash:
            raise ConfigError(key, f"{n(key)} {why} (lm_core.lowp_weights)")


def _check_overlap(c: TrainConfig, n: KeyNames) -> None:
    """training.compile_blocks: not beside the whole-model compile, nor with the wrappers
    that compile blocks themselves (--fsdp, --tp). training.optimizer_overlap: one process
    (data-parallel wrappers reduce gradients after the hooks that step them), no global-norm
    clipping (it needs every gradient before any update), the full checkpoint format."""
    t, p = c.training, c.parallel
    if t.compile_blocks:
        key = "training.compile_blocks"
        for clash, other in (
            (t.compile, n("training.compile")),
            (p.fsdp != "none", n("parallel.fsdp")),
            (p.tp > 1, n("parallel.tp")),
        ):
            if clash:
                raise ConfigError(
                    key,
                    f"{n(key)} excludes {other} (which compiles the model, or its blocks, itself)",
                )
    if not t.optimizer_overlap:
        return
    key = "training.optimizer_overlap"
    clashes = [
        (p.ddp != "none", f"excludes {n('parallel.ddp')}"),
        (p.zero, f"excludes {n('parallel.zero')}"),
        (p.fsdp != "none", f"excludes {n('parallel.fsdp')}"),
        (p.tp > 1, f"excludes {n('parallel.tp')}"),
        (
            c.optim.grad_clip > 0,
            f"needs {n.setting('optim.grad_clip', 0)}: clipping by the global norm needs "
            "every gradient before any update",
        ),
        (c.checkpoint.format == "dcp", f"needs {n.setting('checkpoint.format', 'full')}"),
    ]
    for clash, why in clashes:
        if clash:
            raise ConfigError(key, f"{n(key)} {why} (lm_core.OverlappedOptimizer)")


def _check_parallel(c: TrainConfig, n: KeyNames) -> None:
    """Wrappers that exclude each other; --tp combines with --fsdp torch only (torch's engine
    on the other mesh axis)."""
    p, s = c.parallel, n.setting
    if p.fsdp != "none":
        fsdp = s("parallel.fsdp", p.fsdp)
        if p.ddp != "none":
            raise ConfigError(
                "parallel.fsdp",
                f"{fsdp} synchronizes gradients itself: it excludes {n('parallel.ddp')} "
                f"(got {s('parallel.ddp', p.ddp)})",
            )
        if p.zero:
            raise ConfigError(
                "parallel.zero", f"{n('parallel.zero')}: {fsdp} already shards the optimizer state"
            )
    if p.sequence_parallel and p.tp == 1:
        raise ConfigError(
            "parallel.sequence_parallel",
            f"{n('parallel.sequence_parallel')} needs {n('parallel.tp')} N with N > 1",
        )
    if p.tp > 1:
        tp = s("parallel.tp", p.tp)
        if p.ddp != "none" or p.zero:
            raise ConfigError(
                "parallel.tp",
                f"{tp}: combine tensor parallelism with {s('parallel.fsdp', 'torch')} (DTensor "
                f"parameters), not {n('parallel.ddp')}/{n('parallel.zero')}",
            )
        if p.fsdp == "ours":
            raise ConfigError(
                "parallel.tp",
                f"{tp}: zero_shard.FSDP does not take DTensor parameters; use "
                f"{s('parallel.fsdp', 'torch')}",
            )
        if c.data.pack_documents:
            raise ConfigError(
                "data.pack_documents",
                f"{n('data.pack_documents')} is not supported with {n('parallel.tp')} yet",
            )
    if p.reduce_dtype != "none" and p.ddp == "none":
        raise ConfigError(
            "parallel.reduce_dtype",
            f"{n('parallel.reduce_dtype')} sets the dtype a {n('parallel.ddp')} wrapper sends "
            "gradients in: it needs one",
        )
    if p.zero and p.ddp == "none":
        raise ConfigError(
            "parallel.zero",
            f"{n('parallel.zero')} shards optimizer state across ranks: it needs a "
            f"{n('parallel.ddp')} wrapper",
        )


def _check_checkpoint_format(c: TrainConfig, n: KeyNames) -> None:
    """checkpoint.format: sharded (dcp) by default where the state is sharded (--fsdp,
    --zero), one full file otherwise; tensor parallelism saves full files only."""
    p, ck = c.parallel, c.checkpoint
    if ck.format is None:
        ck.format = "dcp" if (p.fsdp != "none" or p.zero) and p.tp == 1 else "full"
    if ck.format == "dcp" and p.tp > 1:
        raise ConfigError(
            "checkpoint.format",
            f"{n.setting('checkpoint.format', 'dcp')} is not supported with "
            f"{n.setting('parallel.tp', p.tp)}: the fused qkv / w13 weights are sharded in "
            f"tensor-parallel row order; use {n.setting('checkpoint.format', 'full')}",
        )


def _check_files(c: TrainConfig, n: KeyNames) -> None:
    """Input files exist."""
    for key in ("data.path", "data.val_path", "sample.tokenizer"):
        path = _get(c, key)
        if path is not None and not path.is_file():
            raise ConfigError(key, f"{n(key)}: file not found: {path}")
    resume = c.checkpoint.resume  # a file, or a sharded checkpoint's directory
    if resume is not None and not resume.is_file() and not is_checkpoint_dir(resume):
        expected = ""
        if resume.suffix == ".dcp" or (c.checkpoint.format == "dcp" and resume.suffix != ".pt"):
            expected = (
                "; expected a sharded checkpoint directory (OUT/checkpoint.dcp, written by a "
                f"run with {n.setting('checkpoint.out_dir', 'OUT')} and "
                f"{n.setting('checkpoint.format', 'dcp')})"
            )
        key = "checkpoint.resume"
        raise ConfigError(key, f"{n(key)}: not found: {resume}{expected}")
    if c.eval.every and c.data.val_path is None and c.data.path is not None:
        raise ConfigError(
            "eval.every",
            f"{n('eval.every')} needs {n('data.val_path')} when training on {n('data.path')}",
        )


def _check_sample(c: TrainConfig, n: KeyNames) -> None:
    if c.sample.every and c.sample.tokenizer is None:
        raise ConfigError("sample.every", f"{n('sample.every')} needs {n('sample.tokenizer')}")
    if c.sample.every and c.parallel.fsdp != "none":
        raise ConfigError(
            "sample.every",
            f"{n('sample.every')} is not supported with "
            f"{n.setting('parallel.fsdp', c.parallel.fsdp)} (sharded weights)",
        )


def _apply_sidecar(c: TrainConfig, n: KeyNames) -> None:
    """The --data sidecar's vocabulary replaces the preset's (an explicit vocab_size may not
    be smaller) and its end-of-text id becomes data.eot_id (checked against a given one)."""
    d = c.data
    if d.path is None or d.path.suffix == ".npy":
        return
    try:
        meta = read_token_meta(d.path)
        val_meta = read_token_meta(d.val_path) if d.val_path is not None else None
    except ValueError as exc:
        raise ConfigError("data.path", f"{n('data.path')} / {n('data.val_path')}: {exc}") from None
    if meta is None:
        return
    sidecar = token_meta_path(d.path)
    if d.dtype is not None and np.dtype(d.dtype) != np.dtype(meta.dtype):
        raise ConfigError(
            "data.dtype", f"{n.setting('data.dtype', d.dtype)}: {sidecar} says {meta.dtype}"
        )
    if val_meta is not None:
        ours = (meta.dtype, meta.vocab_size, meta.eot_id)
        theirs = (val_meta.dtype, val_meta.vocab_size, val_meta.eot_id)
        if ours != theirs:
            raise ConfigError(
                "data.val_path",
                f"{n('data.val_path')}: (dtype, vocab_size, eot_id) = {theirs} in its sidecar, "
                f"but {ours} for {n('data.path')}: encoded with another tokenizer?",
            )
    vocab = c.model.vocab_size
    if vocab is None:
        c.model.vocab_size = meta.vocab_size
    elif vocab < meta.vocab_size:
        raise ConfigError(
            "model.vocab_size",
            f"{n.setting('model.vocab_size', vocab)} is smaller than the data's vocabulary "
            f"({meta.vocab_size}, from {sidecar})",
        )
    if d.eot_id is not None and d.eot_id != meta.eot_id:
        raise ConfigError(
            "data.eot_id",
            f"{n.setting('data.eot_id', d.eot_id)}: {sidecar} says the end-of-text id is "
            f"{meta.eot_id}",
        )
    d.eot_id = meta.eot_id  # recorded in checkpoints, for lm_core.generate


def sidecar_notes(config: TrainConfig) -> list[str]:
    """What a resolved config took from the --data sidecar, for the log."""
    d = config.data
    if d.path is None or d.path.suffix == ".npy" or (meta := read_token_meta(d.path)) is None:
        return []
    sidecar = token_meta_path(d.path)
    notes = []
    preset = MODEL_SIZES[config.model.size].vocab_size
    if config.model.vocab_size == meta.vocab_size != preset:
        notes.append(
            f"vocab_size {meta.vocab_size} from {sidecar} (the {config.model.size} preset has "
            f"{preset})"
        )
    notes.append(f"end-of-text id {meta.eot_id} from {sidecar}")
    return notes


def _check_data(c: TrainConfig, n: KeyNames) -> None:
    """Document packing needs an end-of-text id (given, or the sidecar's); a given id is
    only used by packing (one equal to the sidecar's is harmless: resolved configs have it)."""
    d = c.data
    if d.pack_documents and d.eot_id is None:
        raise ConfigError(
            "data.pack_documents",
            f"{n('data.pack_documents')} needs {n('data.eot_id')} (the token that separates "
            f"documents), or {n('data.path')} with a sidecar naming it "
            "(`python -m lm_core.tokenize encode`)",
        )
    if d.eot_id is not None and not d.pack_documents and not _from_sidecar(d.path, d.eot_id):
        raise ConfigError(
            "data.eot_id", f"{n('data.eot_id')} is only used with {n('data.pack_documents')}"
        )


def _from_sidecar(path: Path | None, eot_id: int) -> bool:
    if path is None or path.suffix == ".npy":
        return False
    meta = read_token_meta(path)
    return meta is not None and meta.eot_id == eot_id


def _check_run_dir(c: TrainConfig, n: KeyNames) -> None:
    """Refuse a run that would destroy an earlier run's files (unless checkpoint.overwrite)."""
    ck = c.checkpoint
    if ck.overwrite:
        return
    ckpt = ck.out_dir / checkpoint_name(ck.format) if ck.out_dir is not None else None
    existing = existing_run_files(ckpt, c.metrics_path)
    checkpoints = [ckpt]
    if ck.out_dir is not None:  # a checkpoint of the other format belongs to a run too
        checkpoints.append(ck.out_dir / checkpoint_name("full" if ck.format == "dcp" else "dcp"))
        existing += existing_run_files(checkpoints[-1], None)
    where = (
        n.setting("checkpoint.out_dir", ck.out_dir)
        if ck.out_dir is not None
        else n("logging.metrics")
    )
    overwrite = n.setting("checkpoint.overwrite", True)
    if ck.resume is not None:  # the log is continued; the checkpoint must be this run's
        if ckpt in existing and not same_file(ckpt, ck.resume):
            raise ConfigError(
                "checkpoint.out_dir",
                f"{where} holds another run's {ckpt.name}, not the "
                f"{n('checkpoint.resume')} checkpoint {ck.resume}; the first save would replace "
                f"it: choose another {n('checkpoint.out_dir')}, or pass {overwrite} to replace "
                "that run's files",
            )
        return
    if not existing:
        return
    files = ", ".join(str(p) for p in existing)
    found = [f for f in checkpoints if f in existing]
    resume = n.setting("checkpoint.resume", found[0] if found else "CHECKPOINT")
    raise ConfigError(
        "checkpoint.out_dir",
        f"{where} already holds a training run ({files}); refusing to start a new run over "
        f"it. Pass {resume} to continue that run, or {overwrite} to start over (its "
        "checkpoint is replaced at the first save and its metrics log restarts)",
    )


def _get(config: TrainConfig, key: str) -> object:
    section, _, name = key.partition(".")
    return getattr(getattr(config, section), name)
