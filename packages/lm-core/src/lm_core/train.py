"""`python -m lm_core.train`: train a TransformerLM on one device or under torchrun.

Examples:
    python -m lm_core.train --size tiny --steps 200                       # CPU, synthetic data
    python -m lm_core.train --size small --data train.bin --pack-documents --eot-id 0 \
        --num-kv-heads 4 --sliding-window 256 --attention flash-triton --bf16
    python -m lm_core.train --size small --data train.bin --val-data val.bin --bf16 --compile \
        --batch-size 32 --context-length 512 --steps 5000 --out-dir runs/small
    torchrun --nproc_per_node 2 -m lm_core.train --size xl --bf16 --ddp bucketed \
        --bucket-size-mb 100 --zero --batch-size 8 --context-length 512
    torchrun --nproc_per_node 2 -m lm_core.train --size 2.7B --bf16 --fsdp ours \
        --activation-checkpointing optimal --fused-loss --batch-size 8 --context-length 2048
    torchrun --nproc_per_node 4 -m lm_core.train --size 2.7B --bf16 --tp 2 --fsdp torch \
        --sequence-parallel --fused-loss --batch-size 8 --context-length 1024

`--batch-size` is the global number of sequences per micro-step, split evenly over ranks;
each optimizer step sees batch-size x grad-accum-steps sequences. The logic lives in
`lm_core.trainer.train(args)`; `main(argv)` parses and runs it (tests call it in-process).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from lm_core.activation_ckpt import parse_every
from lm_core.config import ATTENTION_BACKENDS, MATMUL_BACKENDS, MODEL_SIZES, get_config
from lm_core.distributed import DDP_CHOICES, FSDP_CHOICES, FSDP_OURS_NO_COMPILE
from lm_core.run_dir import CHECKPOINT_NAME, existing_run_files, same_file
from lm_core.train_monitor import add_monitor_args, check_monitor_args


def build_parser() -> argparse.ArgumentParser:
    """The trainer's argument parser, flags grouped by concern."""
    p = argparse.ArgumentParser(
        prog="python -m lm_core.train",
        description="Train a TransformerLM (single device or torchrun).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("model")
    g.add_argument("--size", default="tiny", choices=list(MODEL_SIZES), help="preset")
    g.add_argument("--vocab-size", type=int, help="override the preset's vocab_size")
    g.add_argument("--context-length", type=int, help="sequence length trained on (and max)")
    g.add_argument("--d-model", type=int, help="override d_model")
    g.add_argument("--num-layers", type=int, help="override num_layers")
    g.add_argument("--num-heads", type=int, help="override num_heads")
    g.add_argument("--d-ff", type=int, help="override d_ff")
    g.add_argument("--rope-theta", type=float, help="override rope_theta")
    g.add_argument("--attention", choices=list(ATTENTION_BACKENDS), help="attention backend")
    g.add_argument(
        "--num-kv-heads", type=int, help="k/v heads, dividing --num-heads (grouped-query)"
    )
    g.add_argument(
        "--sliding-window", type=int, help="attend to the last N tokens only (and itself)"
    )
    g.add_argument(
        "--matmul",
        choices=list(MATMUL_BACKENDS),
        help="fp32 linear layers: default (torch) or tf32x3 (fp32-accurate, TF32 tensor cores; "
        "fastest with --compile and CUDA graphs)",
    )

    g = p.add_argument_group("data")
    g.add_argument("--data", type=Path, help="training tokens (.npy, or raw .bin of --data-dtype)")
    g.add_argument("--val-data", type=Path, help="validation tokens (same formats)")
    g.add_argument(
        "--data-dtype", help="dtype of raw .bin token files [their JSON sidecar's, else uint16]"
    )
    g.add_argument(
        "--synthetic",
        default="pattern",
        choices=["pattern", "random"],
        help="synthetic tokens when --data is not given (pattern: learnable; random: benchmark)",
    )
    g.add_argument("--synthetic-tokens", type=int, default=200_000, help="synthetic stream size")
    g.add_argument(
        "--pack-documents",
        action="store_true",
        help="attend within documents only: each window is split at every --eot-id token "
        "(lm_core.data.document_offsets) and the model gets the offsets (cu_seqlens)",
    )
    g.add_argument("--eot-id", type=int, help="end-of-text token id (with --pack-documents)")

    g = p.add_argument_group("optimization")
    g.add_argument("--steps", type=int, default=100, help="optimizer steps in total")
    g.add_argument("--batch-size", type=int, default=8, help="global sequences per micro-step")
    g.add_argument("--grad-accum-steps", type=int, default=1, help="micro-steps per step")
    g.add_argument("--max-lr", type=float, default=1e-3, help="peak learning rate")
    g.add_argument("--min-lr", type=float, help="final learning rate [default: max-lr / 10]")
    g.add_argument("--warmup-steps", type=int, default=0, help="linear warmup steps")
    g.add_argument("--cosine-steps", type=int, help="step where cosine decay ends [--steps]")
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--beta1", type=float, default=0.9)
    g.add_argument("--beta2", type=float, default=0.95)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--grad-clip", type=float, default=1.0, help="max grad L2 norm (0: off)")

    g = p.add_argument_group("precision and compilation")
    g.add_argument("--bf16", action="store_true", help="bf16 autocast (weights stay fp32)")
    g.add_argument("--tf32", action="store_true", help="allow TF32 matmuls on CUDA")
    g.add_argument("--compile", action="store_true", help="torch.compile the model")

    g = p.add_argument_group("memory")
    g.add_argument(
        "--activation-checkpointing",
        default="none",
        metavar="{none,sqrt,optimal,K}",
        help="checkpoint groups of K consecutive blocks; sqrt: K = ceil(sqrt(layers)); "
        "optimal: the K that minimizes stored activations (lm_core.activation_ckpt)",
    )
    g.add_argument(
        "--fused-loss",
        action="store_true",
        help="fused LM head + cross-entropy: no (batch, seq, vocab) logits in memory",
    )

    g = p.add_argument_group("distributed (run under torchrun)")
    g.add_argument("--ddp", default="none", choices=list(DDP_CHOICES), help="gradient sync")
    g.add_argument("--bucket-size-mb", type=float, default=25.0, help="bucketed/torch DDP")
    g.add_argument("--zero", action="store_true", help="shard optimizer state (zero_shard)")
    g.add_argument(
        "--fsdp",
        default="none",
        choices=list(FSDP_CHOICES),
        help="shard weights, gradients and optimizer state: ours = zero_shard.FSDP, "
        "torch = torch's fully_shard (per block, then the root); excludes --ddp and --zero",
    )
    g.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor parallel degree: shard attention heads and the SwiGLU over groups of N "
        "consecutive ranks (lm_core.parallel); with --fsdp torch, 2-D on a (ranks/N, N) mesh",
    )
    g.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="with --tp: norms and the residual stream split along the sequence",
    )
    g.add_argument("--dist-backend", default="auto", choices=["auto", "nccl", "gloo"])

    g = p.add_argument_group("evaluation, checkpoints, logging")
    g.add_argument("--out-dir", type=Path, help="checkpoint.pt and metrics.jsonl go here")
    g.add_argument("--metrics", type=Path, help="metrics JSONL [out-dir/metrics.jsonl]")
    g.add_argument("--ckpt-every", type=int, default=0, help="steps between checkpoints (0: end)")
    g.add_argument("--resume", type=Path, help="checkpoint to resume from")
    g.add_argument(
        "--overwrite",
        action="store_true",
        help="start over in an --out-dir that holds a run: its checkpoint is replaced at the "
        "first save, its metrics log restarts (without it the trainer refuses)",
    )
    g.add_argument("--eval-every", type=int, default=0, help="steps between evaluations (0: off)")
    g.add_argument("--eval-batches", type=int, default=4, help="global batches per evaluation")
    g.add_argument("--log-every", type=int, default=10, help="steps between log lines")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    add_monitor_args(p)
    return p


_POSITIVE = ("steps", "batch_size", "grad_accum_steps", "synthetic_tokens", "log_every")
_NON_NEGATIVE = ("warmup_steps", "ckpt_every", "eval_every", "grad_clip", "weight_decay", "seed")
_MODEL_FLAGS = {
    "vocab_size": "vocab_size",
    "context_length": "context_length",
    "d_model": "d_model",
    "num_layers": "num_layers",
    "num_heads": "num_heads",
    "d_ff": "d_ff",
    "rope_theta": "rope_theta",
    "attention": "attention",
    "matmul": "matmul",
    "num_kv_heads": "num_kv_heads",
    "sliding_window": "sliding_window",
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and validate; an invalid value exits with an argparse error naming the flag.

    Adds `args.model_config` (the ModelConfig) and fills defaults that depend on other flags.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in _POSITIVE:
        if getattr(args, name) <= 0:
            parser.error(f"{_flag(name)} must be positive, got {getattr(args, name)}")
    for name in _NON_NEGATIVE:
        if getattr(args, name) < 0:
            parser.error(f"{_flag(name)} must be >= 0, got {getattr(args, name)}")
    if args.eval_batches <= 0:
        parser.error(f"--eval-batches must be positive, got {args.eval_batches}")
    if args.max_lr < 0:
        parser.error(f"--max-lr must be >= 0, got {args.max_lr}")
    if args.min_lr is None:
        args.min_lr = args.max_lr / 10
    if args.min_lr < 0:
        parser.error(f"--min-lr must be >= 0, got {args.min_lr}")
    if args.cosine_steps is None:
        args.cosine_steps = args.steps
    if not 0 <= args.warmup_steps <= args.cosine_steps:
        parser.error(
            f"--warmup-steps ({args.warmup_steps}) must be <= --cosine-steps ({args.cosine_steps})"
        )
    for name in ("beta1", "beta2"):
        if not 0 <= getattr(args, name) < 1:
            parser.error(f"{_flag(name)} must be in [0, 1), got {getattr(args, name)}")
    if args.adam_eps < 0:
        parser.error(f"--adam-eps must be >= 0, got {args.adam_eps}")
    if args.bucket_size_mb <= 0:
        parser.error(f"--bucket-size-mb must be positive, got {args.bucket_size_mb}")
    try:
        args.activation_checkpointing = parse_every(args.activation_checkpointing)
    except (ValueError, TypeError) as exc:
        parser.error(f"--activation-checkpointing: {exc}")
    if args.fsdp != "none":
        if args.ddp != "none":
            parser.error(
                f"--fsdp {args.fsdp} synchronizes gradients itself: it excludes --ddp "
                f"(got --ddp {args.ddp})"
            )
        if args.zero:
            parser.error(f"--zero: --fsdp {args.fsdp} already shards the optimizer state")
        if args.compile and args.fsdp == "ours":
            parser.error(f"--compile is not supported with --fsdp ours: {FSDP_OURS_NO_COMPILE}")
    _check_tp(parser, args)
    if args.pack_documents and args.tp > 1:
        parser.error("--pack-documents is not supported with --tp yet")
    if args.eot_id is not None and not args.pack_documents:
        parser.error("--eot-id is only used with --pack-documents")
    if args.zero and args.ddp == "none":
        parser.error("--zero shards optimizer state across ranks: it needs a --ddp wrapper")
    if args.eval_every and args.val_data is None and args.data is not None:
        parser.error("--eval-every needs --val-data when training on --data")
    for name in ("data", "val_data", "resume"):
        path = getattr(args, name)
        if path is not None and not path.is_file():
            parser.error(f"{_flag(name)}: file not found: {path}")
    check_monitor_args(parser, args)  # the --data sidecar may set --vocab-size and the eot id
    if args.pack_documents and args.eot_id is None:
        parser.error(
            "--pack-documents needs --eot-id (the token that separates documents), or --data "
            "with a sidecar naming it (`python -m lm_core.tokenize encode`)"
        )
    overrides = {
        field: getattr(args, flag)
        for flag, field in _MODEL_FLAGS.items()
        if getattr(args, flag) is not None
    }
    try:
        args.model_config = get_config(args.size, **overrides)
    except (ValueError, TypeError) as exc:
        parser.error(f"model flags: {exc}")
    if args.context_length is None:
        args.context_length = args.model_config.context_length
    if args.tp > 1:
        from lm_core.parallel import check_tensor_parallel

        try:
            check_tensor_parallel(
                args.model_config,
                args.tp,
                sequence_parallel=args.sequence_parallel,
                seq_len=args.context_length,
            )
        except ValueError as exc:
            parser.error(f"--tp: {exc}")
    if args.eot_id is not None and not 0 <= args.eot_id < args.model_config.vocab_size:
        parser.error(
            f"--eot-id must be a token id in [0, {args.model_config.vocab_size}), got {args.eot_id}"
        )
    if args.metrics is None and args.out_dir is not None:
        args.metrics = args.out_dir / "metrics.jsonl"
    message = _existing_run_message(args)
    if message:
        parser.error(message)
    return args


def _check_tp(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--tp combines with --fsdp torch only (torch's engine on the other mesh axis)."""
    if args.tp < 1:
        parser.error(f"--tp must be positive, got {args.tp}")
    if args.sequence_parallel and args.tp == 1:
        parser.error("--sequence-parallel needs --tp N with N > 1")
    if args.tp == 1:
        return
    if args.ddp != "none" or args.zero:
        parser.error(
            f"--tp {args.tp}: combine tensor parallelism with --fsdp torch (DTensor "
            "parameters), not --ddp/--zero"
        )
    if args.fsdp == "ours":
        parser.error(
            f"--tp {args.tp}: zero_shard.FSDP does not take DTensor parameters; use --fsdp torch"
        )


def _existing_run_message(args: argparse.Namespace) -> str | None:
    """Why this run would destroy an earlier run's files, or None when it would not."""
    if args.overwrite:
        return None
    ckpt = args.out_dir / CHECKPOINT_NAME if args.out_dir is not None else None
    existing = existing_run_files(ckpt, args.metrics)
    where = f"--out-dir {args.out_dir}" if args.out_dir is not None else "--metrics"
    if args.resume is not None:  # the log is continued; the checkpoint must be this run's
        if ckpt in existing and not same_file(ckpt, args.resume):
            return (
                f"{where} holds another run's {CHECKPOINT_NAME}, not the --resume checkpoint "
                f"{args.resume}; the first save would replace it: choose another --out-dir, "
                "or pass --overwrite to replace that run's files"
            )
        return None
    if not existing:
        return None
    names = ", ".join(str(p) for p in existing)
    resume = ckpt if ckpt in existing else "CHECKPOINT"
    return (
        f"{where} already holds a training run ({names}); refusing to start a new run over "
        f"it. Pass --resume {resume} to continue that run, or --overwrite to start over "
        "(its checkpoint is replaced at the first save and its metrics log restarts)"
    )


def main(argv: Sequence[str] | None = None):  # returns lm_core.trainer.TrainResult
    """Parse `argv` (default: sys.argv[1:]) and train; returns the `TrainResult`."""
    from lm_core.trainer import train

    args = parse_args(sys.argv[1:] if argv is None else argv)
    return train(args)


def cli() -> None:
    """The `lm-train` console script: `main()`, exit status 0 (its TrainResult is not a code)."""
    main()


if __name__ == "__main__":
    cli()
