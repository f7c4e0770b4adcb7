"""The model and step flags `bench` and `profile` share, and their device-dependent defaults.

`add_model_args` (which model: preset or custom dims, context, attention backend, matmul, fused
loss, activation checkpointing, device) and `add_step_args` (which steps: --mode, --precision)
add the flags; `resolve_model_args` fills the defaults that depend on the device and checks
what argparse cannot (a custom model's dims, d_model divisible by the heads); `profile_fields`
maps the flags both commands parse alike to `ProfileConfig` fields.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import torch

from perf_tools import _cli
from perf_tools.models import DIM_FIELDS
from perf_tools.steps import MODE_ALIASES, MODES, PRECISION_ALIASES, PRECISIONS

GPU_DEFAULT_SIZES = ("small", "medium", "large", "xl", "2.7B")
CPU_DEFAULT_SIZE = "tiny"
ATTENTIONS = ("naive", "sdpa", "flash-torch", "flash-triton")  # lm_core's backends
MATMULS = ("default", "tf32x3")  # lm_core.config.MATMUL_BACKENDS (a test checks they match)


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Model selection flags shared by bench and profile."""
    g = p.add_argument_group("model")
    g.add_argument(
        "--size",
        nargs="+",
        type=_cli.listed(str),
        help="lm_core preset(s) (tiny, small, medium, large, xl, 2.7B, 8B) or custom. "
        "Default: tiny on CPU; small medium large xl 2.7B on GPU",
    )
    g.add_argument(
        "--context",
        nargs="+",
        type=_cli.listed(_cli.positive_int),
        help="context length(s) (default: 128 on CPU, 512 on GPU)",
    )
    g.add_argument(
        "--attention",
        nargs="+",
        type=_cli.listed(str),
        help="lm_core attention backend(s): naive, sdpa, flash-torch, flash-triton "
        "(default: the preset's)",
    )
    for name in DIM_FIELDS:
        kind = float if name == "rope_theta" else _cli.positive_int
        g.add_argument(
            "--" + name.replace("_", "-"),
            type=kind,
            help=f"override the preset's {name} (or define a custom model)",
        )
    g.add_argument(
        "--matmul",
        nargs="+",
        type=_cli.listed(_cli.choice(MATMULS)),
        help="lm_core: how linear layers multiply in fp32: default (torch, cuBLAS) and/or "
        "tf32x3 (fp32-accurate 3xTF32 Triton kernels; bf16 autocast unchanged). Default: default",
    )
    g.add_argument(
        "--fused-loss",
        action="store_true",
        help="lm_core: the loss from model(x, targets), the fused LM head + cross-entropy "
        "(no (B, T, V) logits), instead of logits and cross_entropy (competitor rows unchanged)",
    )
    g.add_argument(
        "--activation-checkpointing",
        type=act_ckpt_arg,
        default="none",
        metavar="{none,sqrt,optimal,K}",
        help="lm_core: checkpoint the blocks in groups of K (lm_core."
        "apply_activation_checkpointing): sqrt, optimal (the memory-optimal K) or none",
    )
    g.add_argument(
        "--device", type=_cli.device_arg, default=None, help="cpu or cuda (default: cuda if any)"
    )


def act_ckpt_arg(text: str) -> str | int:
    """none, sqrt, optimal or a positive int K (blocks per checkpointed group)."""
    t = text.strip().lower()
    if t in ("none", "sqrt", "optimal"):
        return t
    try:
        k = int(t)
    except ValueError:
        k = 0
    if k < 1:
        raise argparse.ArgumentTypeError(
            f"expected none, sqrt, optimal or a positive integer K (blocks per group), got {text!r}"
        )
    return k


def resolve_model_args(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    gpu_default_sizes: Sequence[str] = GPU_DEFAULT_SIZES,
) -> None:
    """Fill defaults that depend on the device, and check values argparse cannot."""
    args.device = args.device or torch.device(_cli.default_device())
    on_gpu = args.device.type == "cuda"
    args.overrides = {k: getattr(args, k) for k in DIM_FIELDS}
    custom = any(v is not None for v in args.overrides.values())
    sizes = _cli.flatten(args.size)
    try:
        from perf_tools.models import size_names

        known = size_names()
    except ImportError as exc:
        parser.error(f"lm_core is not importable ({exc}); install lm-core")
    if sizes is None:
        if custom and args.overrides.get("d_model") is not None:
            sizes = ["custom"]
        elif on_gpu:
            sizes = [s for s in gpu_default_sizes if s in known]
        else:
            sizes = [CPU_DEFAULT_SIZE if CPU_DEFAULT_SIZE in known else known[0]]
    for s in sizes:
        if s not in known and s != "custom":
            parser.error(f"argument --size: expected one of {', '.join(known)}, custom; got {s!r}")
    if "custom" in sizes:
        missing = [f for f in ("d_model", "num_layers", "num_heads") if args.overrides[f] is None]
        if missing:
            flags = ", ".join("--" + m.replace("_", "-") for m in missing)
            parser.error(f"argument --size: a custom model needs {flags}")
    d_model, heads = args.overrides.get("d_model"), args.overrides.get("num_heads")
    if d_model is not None and heads is not None and d_model % heads:
        parser.error(
            f"argument --num-heads: d_model={d_model} is not divisible by num_heads={heads}"
        )
    args.sizes = sizes
    args.contexts = _cli.flatten(args.context) or [512 if on_gpu else 128]
    args.attentions = _cli.flatten(args.attention) or [None]
    args.matmuls = _cli.flatten(args.matmul) or ["default"]
    for a in args.attentions:
        if a is not None and a not in ATTENTIONS:
            parser.error(
                f"argument --attention: expected one of {', '.join(ATTENTIONS)}; got {a!r}"
            )


def profile_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The `ProfileConfig` fields of the flags bench and profile parse alike (the model's,
    resolved; batch, warmup, steps, seed; the output's); each maps its other flags itself."""
    return {
        "sizes": args.sizes,
        "contexts": args.contexts,
        "device": args.device,
        "overrides": args.overrides,
        "attentions": args.attentions,
        "matmuls": args.matmuls,
        "batch": args.batch,
        "warmup": args.warmup,
        "steps": args.steps,
        "seed": args.seed,
        "quiet": args.quiet,
        "fused_loss": args.fused_loss,
        "act_ckpt": args.activation_checkpointing,
        "csv_path": args.csv,
        "json_path": args.json,
    }


def add_step_args(
    group: argparse._ArgumentGroup | argparse.ArgumentParser,
    *,
    mode_default: str,
    precision_default: str,
) -> None:
    """--mode and --precision (lists), with the command's defaults named in the help."""
    group.add_argument(
        "--mode",
        nargs="+",
        type=_cli.listed(_cli.choice(MODES, MODE_ALIASES)),
        help="forward, fwd-bwd (forward+backward), train (fwd+bwd+AdamW step). "
        f"Default: {mode_default}",
    )
    group.add_argument(
        "--precision",
        nargs="+",
        type=_cli.listed(_cli.choice(PRECISIONS, PRECISION_ALIASES)),
        help=f"fp32 and/or bf16 (bf16 autocast). Default: {precision_default}",
    )
