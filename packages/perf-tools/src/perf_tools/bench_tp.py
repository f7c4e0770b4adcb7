"""Tensor parallelism in the multi-GPU mode of `python -m perf_tools.bench` (`--tp K`).

`bench --nprocs N --tp K [--sequence-parallel] [--fsdp torch]`: the N ranks form lm_core's
("dp", "tp") mesh of N / K data-parallel groups of K consecutive ranks
(`lm_core.parallel.make_mesh`). Each rank builds the model as the FSDP rows do, then hands it
to the trainer's engine, `lm_core.tp_engine.TensorParallel`, which applies in torchtitan's
order `lm_core.parallel.apply_tensor_parallel` on the "tp" axis (Megatron layout, optionally
sequence parallel), activation checkpointing, and with `--fsdp torch` torch's `fully_shard`
on the "dp" axis (2-D). So the bench times exactly what `lm_core.train --tp K` trains.

Data: `--batch` sequences per data-parallel group; the K ranks of a TP group take the same
tokens (seeded by the group's index), so the global batch is N / K x `--batch`.
Precision: with `--fsdp torch` the wrapper's MixedPrecisionPolicy (bf16 compute, fp32 master
weights, as the FSDP rows); pure TP (`--tp N`, no `--fsdp`) runs bf16 under autocast (fp32
weights), as the trainer's `--bf16` does.

Composition: `--fsdp ours` (zero_shard.FSDP) flattens plain tensors and does not take the
DTensor parameters of tensor parallelism: refused. With N / K > 1 the data-parallel groups
need `--fsdp torch` to share gradients. What lm_core cannot split (heads, d_ff, the sequence
with `--sequence-parallel`) is an argument error before any rank starts
(`lm_core.parallel.check_tensor_parallel`'s message, with shapes that would split).

This module holds the flags' checks (parent side) and the rank side's wrapping.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from perf_tools import _cli
from perf_tools._compile import allow_recompiles

__all__ = ["add_tp_args", "check_tp_args", "heads_advice", "wrap_tp"]


def add_tp_args(group: argparse._ArgumentGroup) -> None:
    """--tp K and --sequence-parallel, in the multi-GPU group of bench's flags."""
    group.add_argument(
        "--tp",
        type=_cli.positive_int,
        default=1,
        metavar="K",
        help="tensor parallel over K ranks (lm_core.parallel): the N ranks form an "
        "(N/K, K) mesh; N/K > 1 data-parallel groups need --fsdp torch (2-D); "
        "--batch is then per data-parallel group. Default 1 (none)",
    )
    group.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="with --tp K: norms and the residual stream split along the sequence "
        "(the context must divide by K)",
    )


def check_tp_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Validate --tp / --sequence-parallel against the other flags and every model of the
    sweep, before any rank starts. Call after `args.nprocs` is known (or None: one process).
    Pure TP (`--tp N` without --fsdp) sets `args.fsdps = ["none"]`."""
    tp = args.tp
    if args.sequence_parallel and tp == 1:
        parser.error("argument --sequence-parallel: needs --tp K with K > 1")
    if tp == 1:
        return
    if args.nprocs is None:
        parser.error(
            f"argument --tp: tensor parallelism runs on several ranks; add --nprocs N (a "
            f"multiple of {tp}) or run the command under torchrun"
        )
    n = args.nprocs
    if n % tp:
        parser.error(f"argument --tp: K={tp} must divide --nprocs {n} (the mesh is N/K x K)")
    fsdps = args.fsdps or []
    if "ours" in fsdps:
        parser.error(
            f"argument --fsdp: ours (zero_shard.FSDP) does not take the DTensor parameters "
            f"of --tp {tp}; use --fsdp torch with --tp"
        )
    if not fsdps:
        if n != tp:
            parser.error(
                f"argument --tp: --tp {tp} on --nprocs {n} leaves {n // tp} data-parallel "
                f"groups; add --fsdp torch to shard and sync over them (2-D), or use --tp {n}"
            )
        args.fsdps = ["none"]
    try:
        from lm_core.parallel import check_tensor_parallel
        from lm_core.tp_engine import TensorParallel  # noqa: F401
    except ImportError as exc:
        parser.error(f"argument --tp: tensor parallelism is not available here: {exc}")
    from perf_tools.models import resolve_config

    for size in args.sizes:
        for context in args.contexts:
            for attention in args.attentions:
                try:
                    config = resolve_config(
                        size, context_length=context, attention=attention, overrides=args.overrides
                    )
                except (ValueError, TypeError):
                    continue  # an error row of its own, as without --tp
                try:
                    check_tensor_parallel(
                        config, tp, sequence_parallel=args.sequence_parallel, seq_len=context
                    )
                except ValueError as exc:
                    parser.error(f"argument --tp: size {size}: {exc}{heads_advice(config, tp)}")


def heads_advice(config: Any, tp: int) -> str:
    """'; use ...': what would split `tp` ways when `config`'s heads or d_ff do not: the
    same dims with another head count (the parameters and FLOPs do not depend on it) or a
    d_ff rounded down, and the presets that split; '' when neither is the problem."""
    from lm_core import MODEL_SIZES
    from lm_core.parallel import check_tensor_parallel

    if not (config.num_heads % tp or config.d_ff % tp):
        return ""
    fixes = []
    if config.num_heads % tp:
        d = config.d_model
        fits = [h for h in range(tp, d + 1, tp) if d % h == 0]
        # prefer head dims that are multiples of 8 (tensor cores, flash kernels)
        good = [h for h in fits if (d // h) % 8 == 0] or fits
        if good:
            h = min(good, key=lambda h: (abs(h - config.num_heads), h))
            fixes.append(f"--num-heads {h} (head dim {d // h}; parameters and FLOPs unchanged)")
    if config.d_ff % tp and config.d_ff >= tp:
        fixes.append(f"--d-ff {config.d_ff // tp * tp}")
    tips = []
    if len(fixes) == (config.num_heads % tp > 0) + (config.d_ff % tp > 0):
        tips.append(" ".join(fixes))
    ok = []
    for name, preset in MODEL_SIZES.items():
        try:
            check_tensor_parallel(preset, tp)
        except ValueError:
            continue
        ok.append(name)
    if ok:
        tips.append(f"a preset that splits {tp} ways: {', '.join(ok)}")
    return "; use " + " or ".join(tips) if tips else ""


def wrap_tp(
    model: nn.Module,
    config: Any,
    *,
    rank: int,
    world: int,
    device: torch.device,
    tp: int,
    sequence_parallel: bool,
    fsdp: bool,
    bf16: bool,
    act_ckpt: str | int,
    compile: bool | dict[str, Any] = False,
) -> tuple[nn.Module, Callable[[], None], int]:
    """On every rank: `model` tensor parallel over groups of `tp` ranks through lm_core's
    trainer engine (TP, checkpointing, each block compiled in place with `compile`'s
    torch.compile options, then fully_shard on the "dp" axis with `fsdp`); returns (what to
    call, the gradient sync to run after backward, checkpoint group size)."""
    from lm_core.activation_ckpt import block_activation_ratio, checkpoint_group_size
    from lm_core.engine import DistEnv
    from lm_core.tp_engine import TensorParallel

    if compile:
        allow_recompiles()
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, device=device, tp=tp)
    # FSDP's policy computes in one dtype; pure TP runs bf16 under autocast
    ratio = block_activation_ratio(config, autocast=bf16 and not fsdp)
    pm = TensorParallel(
        model,
        env,
        tp=tp,
        sequence_parallel=sequence_parallel,
        fsdp=fsdp,
        bf16=bf16,
        activation_checkpointing=act_ckpt,
        activation_ratio=ratio,
        compile=compile,
    )
    return pm.module, pm.finish_sync, checkpoint_group_size(model)
