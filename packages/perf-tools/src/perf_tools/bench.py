"""End-to-end model benchmark (handout 1.1.3): `python -m perf_tools.bench`.

Sweeps sizes x contexts x modes x precisions (x attention backends, x eager/compiled) of
lm_core's TransformerLM on random tokens, optionally beside Hugging Face's LlamaForCausalLM
at the same dims (`--compare hf`). Each configuration: warm-up steps (timed apart, compile
included), then measured steps, each followed by a device synchronize. Reports mean / std /
median ms, per-phase ms (forward, backward, optimizer; CUDA events, no extra sync), tokens/s,
achieved TFLOP/s, MFU and peak memory. Out-of-memory configurations are rows saying OOM.

Multi-GPU mode (`--nprocs N --fsdp ours|torch`, see `perf_tools.bench_dist`): every cell
trains on N ranks (spawned here, or under torchrun), the model sharded by zero_shard.FSDP or
torch's fully_shard; `--batch` is per rank. Rows report the slowest rank's step time (median
over steps), tokens/s over all ranks, MFU and peak memory per GPU, and for `--fsdp ours` how
long the compute waited for the all-gathers (`gather_wait_ms`, `units_waited`).

Examples:
  python -m perf_tools.bench              # a small default on CPU, the full sizes on a GPU
  python -m perf_tools.bench --size small xl --precision fp32 bf16 --mode forward train
  python -m perf_tools.bench --size xl --precision bf16 --compile both --compare hf
  python -m perf_tools.bench --size 2.7B --mode train --steps 3 --memory-snapshot mem.pickle
  nsys profile -c cudaProfilerApi -o trace python -m perf_tools.bench --size small --nvtx
  python -m perf_tools.bench --size xl --nprocs 2 --fsdp ours torch --precision bf16
  python -m perf_tools.bench --size 8B --context 32768 --batch 1 --nprocs 2 --fsdp ours \\
      --precision bf16 --mode train --fused-loss --activation-checkpointing 1 \\
      --attention sdpa --warmup 1 --steps 3
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import math
import os
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from perf_tools import _cli, _dist, hardware, report, timing
from perf_tools._compile import compile_for_bench
from perf_tools.bench_dist import (
    FSDP_KINDS,
    WAIT_THRESHOLD_MS,
    DistJob,
    set_blas,
    set_tf32,
    spawn_cell,
    torch_fully_shard,
    torchrun_cell,
)
from perf_tools.flops import step_flops
from perf_tools.models import DIM_FIELDS, build_model, count_params, random_batch, resolve_config
from perf_tools.steps import (
    MODE_ALIASES,
    MODES,
    PRECISION_ALIASES,
    PRECISIONS,
    Annotator,
    PhaseTimer,
    capture_cuda_graph,
    lm_core_annotations,
    make_step,
)

OURS = "lm_core"
HF = "hf-llama"
GPU_DEFAULT_SIZES = ("small", "medium", "large", "xl", "2.7B")
CPU_DEFAULT_SIZE = "tiny"
TABLE_COLUMNS = [
    "model",
    "size",
    "attention",
    "compile",
    "cuda_graph",
    "precision",
    "mode",
    "context",
    "nprocs",
    "fsdp",
    "act_ckpt",
    "fused_loss",
    "blas",
    "matmul",
    "status",
    "mean_ms",
    "std_ms",
    "median_ms",
    "fwd_ms",
    "bwd_ms",
    "sync_ms",
    "opt_ms",
    "tokens_per_s",
    "tflops",
    "mfu_pct",
    "peak_mem_gib",
    "gather_wait_ms",
    "units_waited",
    "warmup_s",
    "vs_hf",
]
# configuration columns shown in the table only when some row uses them
OPTIONAL_CONFIG_COLUMNS = {
    "act_ckpt": "none",
    "fused_loss": False,
    "blas": "default",
    "matmul": "default",
}
MATMULS = ("default", "tf32x3")  # lm_core.config.MATMUL_BACKENDS (a test checks they match)
BLAS_LIBRARIES = ("default", "cublas", "cublaslt")


@dataclass(frozen=True)
class BenchSpec:
    """One cell of the sweep."""

    impl: str  # OURS or HF
    size: str
    attention: str | None
    compile: bool
    precision: str
    mode: str
    context: int
    graph: bool = False  # the whole step captured in one CUDA graph and replayed
    fsdp: str | None = None  # multi-GPU mode: "ours" or "torch" (None: one process)
    matmul: str = "default"  # lm_core rows: how linear layers multiply in fp32

    @property
    def model_key(self) -> tuple[str, str, str | None, bool, str]:
        """Cells with the same key share one built model."""
        return (self.impl, self.size, self.attention, self.compile, self.matmul)

    def label(self) -> str:
        parts = [self.impl, self.size, self.attention or "default", self.precision, self.mode]
        parts.append(f"ctx{self.context}")
        if self.compile:
            parts.append("compiled")
        if self.graph:
            parts.append("graphed")
        if self.matmul != "default":
            parts.append(f"matmul-{self.matmul}")
        if self.fsdp:
            parts.append(f"fsdp-{self.fsdp}")
        return "-".join(str(p) for p in parts)


@dataclass
class BenchOptions:
    """Settings shared by every cell."""

    device: torch.device
    batch: int
    warmup: int
    steps: int
    overrides: dict[str, Any]
    peak_tflops: float | None = None
    seed: int = 0
    nvtx: bool = False
    memory_snapshot: Path | None = None
    progress: bool = True
    snapshot_paths: list[Path] | None = None
    fused_loss: bool = False  # lm_core rows: loss = model(x, targets) (fused head + CE)
    act_ckpt: str | int = "none"  # lm_core rows: activation checkpointing policy
    nprocs: int | None = None  # multi-GPU mode: ranks per cell (None: one process)
    backend: str = "gloo"  # multi-GPU mode: nccl (GPUs) or gloo (CPU)
    timeout_s: float = 1800.0  # multi-GPU mode: limit per cell
    blas: str = "default"  # CUDA BLAS library (recorded; set process-wide by set_blas)


# ----------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m perf_tools.bench",
        description=__doc__.split("\nExamples:")[0],
        epilog="Examples:"
        + __doc__.split("\nExamples:")[1]
        + "\nLists take several values (--size small xl) or commas (--size small,xl).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_args(p)
    g = p.add_argument_group("sweep")
    g.add_argument(
        "--mode",
        nargs="+",
        type=_cli.listed(_cli.choice(MODES, MODE_ALIASES)),
        help="forward, fwd-bwd (forward+backward), train (fwd+bwd+AdamW step). "
        "Default: forward fwd-bwd train on CPU, train on GPU",
    )
    g.add_argument(
        "--precision",
        nargs="+",
        type=_cli.listed(_cli.choice(PRECISIONS, PRECISION_ALIASES)),
        help="fp32 and/or bf16 (bf16 autocast). Default: fp32 on CPU, fp32 bf16 on GPU",
    )
    g.add_argument(
        "--compile",
        nargs="?",
        const="on",
        default="off",
        type=_cli.choice(("off", "on", "both")),
        help="torch.compile the model: --compile (on), --compile both (eager and compiled)",
    )
    g.add_argument(
        "--cuda-graph",
        nargs="?",
        const="on",
        default="off",
        type=_cli.choice(("off", "on", "both")),
        help="capture each whole step (forward, backward, optimizer) in a CUDA graph and "
        "time its replays: --cuda-graph (on), --cuda-graph both (eager launches and graphed). "
        "GPU only; per-phase times are not reported for graphed rows",
    )
    g.add_argument(
        "--compare",
        nargs="+",
        type=_cli.listed(_cli.choice(("hf",))),
        default=[],
        help="also time a competitor at the same dims: hf = transformers LlamaForCausalLM "
        "(SDPA attention, fused torch AdamW); skipped with a note if not installed",
    )
    m = p.add_argument_group(
        "multi-GPU (FSDP)",
        "train each cell on N ranks with a sharded model (spawned here, or run the command "
        "under torchrun); --batch is then per rank",
    )
    m.add_argument(
        "--nprocs",
        type=_cli.positive_int,
        help="ranks per cell: one GPU each over NCCL (gloo on CPU); needs --fsdp",
    )
    m.add_argument(
        "--fsdp",
        nargs="+",
        type=_cli.listed(_cli.choice(FSDP_KINDS)),
        help="ours = zero_shard.FSDP (bf16 compute for --precision bf16), torch = "
        "torch.distributed.fsdp.fully_shard per block and root (MixedPrecisionPolicy bf16, "
        "fp32 reduce); both: one row each",
    )
    m.add_argument(
        "--timeout-s",
        type=_cli.positive_float,
        default=1800.0,
        help="multi-GPU mode: kill a cell's ranks after this long (default 1800)",
    )
    t = p.add_argument_group("timing")
    t.add_argument(
        "--batch",
        type=_cli.positive_int,
        default=4,
        help="batch size (default 4); per rank with --nprocs",
    )
    t.add_argument(
        "--warmup", type=_cli.nonneg_int, default=5, help="warm-up steps, not timed (default 5)"
    )
    t.add_argument(
        "--no-warmup",
        action="store_true",
        help="same as --warmup 0 (the handout's warm-up question)",
    )
    t.add_argument(
        "--steps",
        type=_cli.positive_int,
        default=None,
        help="measured steps (default 10; with --profile: profiled steps, default 3)",
    )
    t.add_argument(
        "--peak-tflops",
        type=_cli.positive_float,
        help="peak TFLOP/s for MFU (default: the datasheet value of the detected GPU)",
    )
    t.add_argument(
        "--tf32", action="store_true", help="allow TF32 matmuls in fp32 (torch default: off)"
    )
    t.add_argument(
        "--blas",
        choices=BLAS_LIBRARIES,
        default="default",
        help="CUDA BLAS library for matmuls (torch.backends.cuda.preferred_blas_library); "
        "'default' keeps torch's choice",
    )
    t.add_argument("--seed", type=int, default=0, help="seed for weights and tokens")
    d = p.add_argument_group("diagnostics")
    d.add_argument(
        "--nvtx",
        action="store_true",
        help="NVTX ranges on step / forward / backward / optimizer and lm_core's attention "
        "sub-steps (emit_nvtx), and a cudaProfilerApi capture of the measured steps only",
    )
    d.add_argument(
        "--memory-snapshot",
        type=Path,
        metavar="FILE",
        help="record the CUDA allocator history of the measured steps into FILE (a pickle "
        "for pytorch.org/memory_viz); several cells get FILE-<cell>.pickle",
    )
    d.add_argument(
        "--profile",
        type=Path,
        metavar="DIR",
        help="instead of timing, profile each cell with torch.profiler into DIR "
        "(same as python -m perf_tools.profile; naive attention unless --attention)",
    )
    _cli.add_output_args(p)
    return p


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
    valid_attention = ("naive", "sdpa", "flash-torch", "flash-triton")
    for a in args.attentions:
        if a is not None and a not in valid_attention:
            parser.error(
                f"argument --attention: expected one of {', '.join(valid_attention)}; got {a!r}"
            )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    resolve_model_args(parser, args)
    on_gpu = args.device.type == "cuda"
    args.steps = args.steps or (3 if args.profile is not None else 10)
    args.modes = _cli.flatten(args.mode) or (["train"] if on_gpu else list(MODES))
    args.precisions = _cli.flatten(args.precision) or (["fp32", "bf16"] if on_gpu else ["fp32"])
    args.compiles = {"off": [False], "on": [True], "both": [False, True]}[args.compile]
    args.graphs = {"off": [False], "on": [True], "both": [False, True]}[args.cuda_graph]
    args.competitors = _cli.flatten(args.compare) or []
    if args.no_warmup:
        args.warmup = 0
    if args.nvtx and not on_gpu:
        parser.error("argument --nvtx: NVTX ranges need a CUDA device (Nsight Systems reads them)")
    if args.cuda_graph != "off" and not on_gpu:
        parser.error("argument --cuda-graph: CUDA graphs need a CUDA device (use --device cuda)")
    if args.cuda_graph != "off" and args.profile is not None:
        parser.error("argument --cuda-graph: not combined with --profile (kernels inside a graph)")
    if args.memory_snapshot is not None and not on_gpu:
        parser.error(
            "argument --memory-snapshot: the allocator history is recorded by the CUDA "
            "caching allocator; run on a GPU (use --device cuda)"
        )
    check_multi_args(parser, args)
    return args


def check_multi_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Validate the multi-GPU flags; sets args.fsdps (None: one process), args.backend."""
    args.fsdps = _cli.flatten(args.fsdp)
    args.backend = "nccl" if args.device.type == "cuda" else "gloo"
    torchrun = _dist.under_torchrun()
    if args.fsdps is None:
        if args.nprocs is not None:
            parser.error(
                "argument --nprocs: the multi-GPU mode trains a sharded model; add "
                "--fsdp ours or --fsdp torch"
            )
        return
    if args.matmuls != ["default"]:
        parser.error("argument --matmul: the multi-GPU mode runs the default matmul only")
    if args.nprocs is None and not torchrun:
        parser.error(
            "argument --fsdp: needs --nprocs N (ranks to spawn), or run the command under torchrun"
        )
    if torchrun:
        world = int(os.environ["WORLD_SIZE"])
        if args.nprocs is not None and args.nprocs != world:
            parser.error(
                f"argument --nprocs: {args.nprocs} ranks asked, torchrun started {world}; "
                "leave --nprocs out under torchrun"
            )
        args.nprocs = world
    if args.mode is None:
        args.modes = ["train"]
    if "forward" in args.modes:
        parser.error(
            "argument --fsdp: the multi-GPU mode times fwd-bwd and train steps; drop --mode forward"
        )
    for flag, used in (
        ("--compile", args.compile != "off"),
        ("--cuda-graph", args.cuda_graph != "off"),
        ("--compare", bool(args.competitors)),
        ("--nvtx", args.nvtx),
        ("--memory-snapshot", args.memory_snapshot is not None),
        ("--profile", args.profile is not None),
    ):
        if used:
            parser.error(f"argument {flag}: not available in the multi-GPU mode (--fsdp)")
    if args.backend == "nccl":
        have = torch.cuda.device_count()
        if not torchrun and args.nprocs > have:
            parser.error(
                f"argument --nprocs: {args.nprocs} ranks need {args.nprocs} GPUs (one each), "
                f"{have} visible"
            )
        if not (dist.is_available() and dist.is_nccl_available()):
            parser.error("argument --nprocs: this torch has no NCCL for GPU ranks")
    elif not dist.is_available():
        parser.error("argument --nprocs: this torch has no torch.distributed")
    if "torch" in args.fsdps:
        try:
            torch_fully_shard()
        except ImportError as exc:
            parser.error(f"argument --fsdp: torch is not available here: {exc}; use --fsdp ours")
    if "ours" in args.fsdps:
        try:
            import zero_shard  # noqa: F401
        except ImportError:
            parser.error(
                "argument --fsdp: ours needs the zero-shard package (pip install zero-shard)"
            )


def specs_from_args(args: argparse.Namespace) -> list[BenchSpec]:
    """The cartesian product, grouped so each model is built once and reused."""
    fsdps = getattr(args, "fsdps", None)
    if fsdps:
        return [
            BenchSpec(OURS, size, attention, False, precision, mode, context, fsdp=kind)
            for size in args.sizes
            for attention in args.attentions
            for kind in fsdps
            for precision in args.precisions
            for context in sorted(args.contexts)
            for mode in args.modes
        ]
    specs = []
    impls = [OURS] + ([HF] if "hf" in args.competitors else [])
    for impl in impls:
        attentions = args.attentions if impl == OURS else ["sdpa"]
        matmuls = args.matmuls if impl == OURS else ["default"]
        for size, attention, matmul, compiled, precision in itertools.product(
            args.sizes, attentions, matmuls, args.compiles, args.precisions
        ):
            for context in sorted(args.contexts):
                for mode, graph in itertools.product(args.modes, args.graphs):
                    specs.append(
                        BenchSpec(
                            impl,
                            size,
                            attention,
                            compiled,
                            precision,
                            mode,
                            context,
                            graph,
                            matmul=matmul,
                        )
                    )
    return specs


# ----------------------------------------------------------------------------- measuring


def _loss_fn(impl: str) -> Any:
    if impl == OURS:
        from lm_core import cross_entropy

        return cross_entropy
    return torch.nn.functional.cross_entropy


def _optimizer(impl: str, model: nn.Module, device: torch.device) -> torch.optim.Optimizer:
    if impl == OURS:
        from lm_core import AdamW

        return AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    from perf_tools.hf_baseline import fused_adamw

    return fused_adamw(model.parameters(), device)


def _build(spec: BenchSpec, config: Any, device: torch.device) -> nn.Module:
    if spec.impl == OURS:
        return build_model(config, device)
    from perf_tools.hf_baseline import build_hf_llama

    return build_hf_llama(config, device)


def make_cell_step(
    model: nn.Module,
    runner: nn.Module,
    spec: BenchSpec,
    config: Any,
    opts: BenchOptions,
    annotator: Annotator,
    timer: PhaseTimer,
) -> tuple[Any, torch.optim.Optimizer | None]:
    """The step closure of one cell (patched in tests to simulate failures)."""
    if spec.impl == OURS:
        apply_act_ckpt(model, config, opts.act_ckpt, spec.precision)
    x, y = random_batch(opts.batch, spec.context, config.vocab_size, opts.device, opts.seed)
    optimizer = _optimizer(spec.impl, model, opts.device) if spec.mode == "train" else None
    fused = opts.fused_loss and spec.impl == OURS
    step = make_step(
        runner,
        spec.mode,
        inputs=x,
        targets=y,
        loss_fn=None if fused else _loss_fn(spec.impl),
        precision=spec.precision,
        optimizer=optimizer,
        annotator=annotator,
        timer=None if spec.graph else timer,
        graph_safe=spec.graph,
    )
    if spec.graph:
        step = capture_cuda_graph(step)
    return step, optimizer


def apply_act_ckpt(model: nn.Module, config: Any, policy: str | int, precision: str) -> int:
    """Checkpoint an lm_core model's blocks per `policy` (none, sqrt, optimal, K) unless it
    already is in the same way; returns the group size (0: none). "optimal" uses the block
    activation ratio of the precision (bf16 autocast keeps an fp32 residual stream)."""
    from lm_core.activation_ckpt import (
        apply_activation_checkpointing,
        block_activation_ratio,
        checkpoint_group_size,
        resolve_group_size,
    )

    ratio = block_activation_ratio(config, autocast=precision == "bf16")
    k = resolve_group_size(policy, config.num_layers, ratio)
    if checkpoint_group_size(model) != k:
        apply_activation_checkpointing(model, k if k > 0 else "none")
    return k


def _peak(spec: BenchSpec, opts: BenchOptions) -> float | None:
    if opts.peak_tflops is not None:
        return opts.peak_tflops
    return hardware.peak_tflops(spec.precision, opts.device)


def _snapshot_path(opts: BenchOptions, spec: BenchSpec, n_cells: int) -> Path | None:
    if opts.memory_snapshot is None:
        return None
    base = opts.memory_snapshot
    if n_cells == 1:
        return base
    suffix = base.suffix or ".pickle"
    return base.with_name(f"{base.stem}-{spec.label()}{suffix}")


def measure_cell(
    model: nn.Module,
    runner: nn.Module,
    spec: BenchSpec,
    config: Any,
    opts: BenchOptions,
    n_cells: int = 1,
) -> dict[str, Any]:
    """Time one cell; returns the measured columns. Raises on failure (OOM included)."""
    device = opts.device
    annotator = Annotator(nvtx=opts.nvtx)
    timer = PhaseTimer(device)
    step, optimizer = make_cell_step(model, runner, spec, config, opts, annotator, timer)
    snapshot = _snapshot_path(opts, spec, n_cells)
    started: list[str] = []  # captures begun by on_measure (a warm-up OOM begins none)

    def on_measure() -> None:
        timing.reset_peak_memory(device)
        if snapshot is not None:
            torch.cuda.memory._record_memory_history(max_entries=1_000_000)
            started.append("snapshot")
        if opts.nvtx:
            torch.cuda.cudart().cudaProfilerStart()
            started.append("nvtx")

    label = spec.label() if opts.progress else None
    with lm_core_annotations(opts.nvtx and spec.impl == OURS):
        nvtx_ctx = torch.autograd.profiler.emit_nvtx() if opts.nvtx else contextlib.nullcontext()
        with nvtx_ctx:
            try:
                result = timing.time_steps(
                    step,
                    warmup=opts.warmup,
                    iters=opts.steps,
                    device=device,
                    progress=label,
                    on_measure=on_measure,
                )
            finally:
                if "nvtx" in started:
                    torch.cuda.cudart().cudaProfilerStop()
                if snapshot is not None and "snapshot" in started:
                    _dump_snapshot(snapshot)
                    if opts.snapshot_paths is not None:
                        opts.snapshot_paths.append(snapshot)
    peak_mem = timing.peak_memory_bytes(device)
    ckpt_k = None
    if spec.impl == OURS:
        from lm_core.activation_ckpt import checkpoint_group_size

        ckpt_k = checkpoint_group_size(model)
    del step, optimizer
    stats = result.stats.scaled(1e3)
    phases = timer.mean_ms(opts.steps)
    flops = step_flops(config, opts.batch, spec.context, spec.mode)
    mean_s = result.stats.mean
    peak = _peak(spec, opts)
    mfu = hardware.mfu(flops, mean_s, peak)
    return {
        "status": "ok",
        "mean_ms": stats.mean,
        "std_ms": stats.std,
        "median_ms": stats.median,
        "min_ms": stats.min,
        "max_ms": stats.max,
        "first_measured_ms": result.samples[0] * 1e3,
        "fwd_ms": phases.get("forward"),
        "bwd_ms": phases.get("backward"),
        "opt_ms": phases.get("optimizer"),
        "tokens_per_s": opts.batch * spec.context / mean_s,
        "tflops": flops / mean_s / 1e12,
        "mfu_pct": None if mfu is None else 100.0 * mfu,
        "peak_tflops": peak,
        "gflop_per_step": flops / 1e9,
        "peak_mem_gib": None if peak_mem is None else peak_mem / 2**30,
        "warmup_s": result.warmup_s,
        "first_step_s": None if math.isnan(result.first_step_s) else result.first_step_s,
        "act_ckpt_k": ckpt_k,
    }


def _dump_snapshot(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        torch.cuda.memory._dump_snapshot(str(path))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def release_memory(device: torch.device) -> None:
    """Free everything the last cell left in the caching allocator."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    timing.reset_peak_memory(device)


def _failure_status(exc: BaseException) -> str:
    if timing.is_oom(exc):
        return "OOM"
    return f"error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]


def run_sweep(
    specs: Sequence[BenchSpec], opts: BenchOptions, measure: Any = None
) -> list[dict[str, Any]]:
    """Measure every cell; one model per model_key, OOM / errors recorded and the sweep goes on.

    `measure(model, runner, spec, config, opts, n_cells) -> dict` (default `measure_cell`).
    """
    measure = measure or measure_cell
    groups: dict[tuple, list[BenchSpec]] = {}
    for s in specs:
        groups.setdefault(s.model_key, []).append(s)
    rows: list[dict[str, Any]] = []
    bar = _outer_bar(len(specs), opts.progress)
    for key, cells in groups.items():
        impl, size, attention, compiled, matmul = key
        max_ctx = max(c.context for c in cells)
        base = {"model": impl, "size": size}
        overrides = dict(opts.overrides, matmul=matmul) if impl == OURS else opts.overrides
        try:
            config = resolve_config(
                size,
                context_length=max_ctx,
                attention=attention if impl == OURS else None,
                overrides=overrides,
            )
        except (ValueError, TypeError) as exc:
            for c in cells:
                rows.append(_row(c, base, opts, {"status": f"error: {exc}"}))
                bar.update(1)
            continue
        model = runner = None
        status = None
        t0 = time.perf_counter()
        try:
            torch.manual_seed(opts.seed)
            model = _build(cells[0], config, opts.device)
            model.train()
            runner = compile_for_bench(model) if compiled else model
        except Exception as exc:  # recorded per cell below
            status = _skip_status(exc)
            if status.startswith("error"):
                traceback.print_exc()
        build_s = time.perf_counter() - t0
        if status is not None:
            model = runner = None
            release_memory(opts.device)
            for c in cells:
                rows.append(_row(c, base, opts, {"status": status}))
                bar.update(1)
            continue
        assert model is not None
        assert runner is not None
        info = {
            **base,
            "params_M": count_params(model) / 1e6,
            "d_model": config.d_model,
            "num_layers": config.num_layers,
            "num_heads": config.num_heads,
            "d_ff": config.d_ff,
            "vocab_size": config.vocab_size,
            "build_s": build_s,
        }
        if impl == OURS:
            info["attention"] = getattr(config, "attention", attention)
        for c in cells:
            try:
                measured = measure(model, runner, c, config, opts, n_cells=len(specs))
            except Exception as exc:
                measured = {"status": _failure_status(exc)}
                if not timing.is_oom(exc):
                    traceback.print_exc()
            for p in model.parameters():
                p.grad = None
            release_memory(opts.device)
            rows.append(_row(c, info, opts, measured))
            bar.update(1)
        del model, runner
        if compiled:
            torch._dynamo.reset()
        release_memory(opts.device)
    bar.close()
    add_hf_speedups(rows)
    return rows


def _skip_status(exc: BaseException) -> str:
    from perf_tools.hf_baseline import MissingBaselineError

    if isinstance(exc, MissingBaselineError):
        return f"skipped: {exc}"
    return _failure_status(exc)


def _row(
    spec: BenchSpec, info: dict[str, Any], opts: BenchOptions, measured: dict[str, Any]
) -> dict[str, Any]:
    row: dict[str, Any] = {
        "model": spec.impl,
        "size": spec.size,
        "attention": spec.attention if spec.impl == OURS else "sdpa",
        "compile": spec.compile,
        "cuda_graph": spec.graph,
        "precision": spec.precision,
        "tf32": bool(torch.backends.cuda.matmul.allow_tf32),
        "blas": opts.blas,
        "matmul": spec.matmul,
        "mode": spec.mode,
        "context": spec.context,
        "batch": opts.batch,
        "fused_loss": opts.fused_loss and spec.impl == OURS,
        "act_ckpt": opts.act_ckpt if spec.impl == OURS else "none",
        "warmup_steps": opts.warmup,
        "steps": opts.steps,
        "device": str(opts.device),
    }
    if spec.fsdp is not None:
        row.update(nprocs=opts.nprocs, fsdp=spec.fsdp, global_batch=opts.batch * opts.nprocs)
        row["device"] = f"{opts.backend}: {opts.nprocs} x {opts.device.type}"
    row.update(info)
    row["attention"] = row.get("attention") or spec.attention or "default"
    row.update(measured)
    return row


def add_hf_speedups(rows: list[dict[str, Any]]) -> None:
    """vs_hf = HF step time / ours, for cells measured for both (same size/precision/...)."""
    key = ("size", "compile", "cuda_graph", "precision", "mode", "context")
    hf = {
        tuple(r[k] for k in key): r["mean_ms"]
        for r in rows
        if r["model"] == HF and r.get("status") == "ok"
    }
    for r in rows:
        ref = hf.get(tuple(r[k] for k in key))
        if r["model"] == OURS and r.get("status") == "ok" and ref:
            r["vs_hf"] = ref / r["mean_ms"]


class _Bar:
    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = None
        if enabled and total > 1:
            try:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=total, desc="configs", dynamic_ncols=True)
            except ImportError:
                self.bar = None

    def update(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _outer_bar(total: int, enabled: bool) -> _Bar:
    return _Bar(total, enabled)


# ----------------------------------------------------------------------------- output


def plot_rows(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """Step time against context (several contexts) or against model size (one context)."""
    ok = [r for r in rows if r.get("status") == "ok"]
    cols = ["model", "size", "attention", "compile", "cuda_graph", "precision", "mode"]
    contexts = {r["context"] for r in rows}
    x = "context" if len(contexts) > 1 else "params_M"
    group = [c for c in cols if (len({r.get(c) for r in rows}) > 1 and c != "size") or c == "mode"]
    if x == "context" and len({r["size"] for r in rows}) > 1:
        group.append("size")
    return report.plot_lines(
        ok,
        x=x,
        y="median_ms",
        group_by=list(dict.fromkeys(group)),
        path=path,
        title="perf_tools.bench: median step time",
        logx=x == "context",
        logy=True,
        ylabel="median ms per step",
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.tf32:
        set_tf32(True)
    set_blas(args.blas)
    if args.profile is not None:
        from perf_tools import profile

        return profile.main_from_bench(args)
    opts = BenchOptions(
        device=args.device,
        batch=args.batch,
        warmup=args.warmup,
        steps=args.steps,
        overrides=args.overrides,
        peak_tflops=args.peak_tflops,
        seed=args.seed,
        nvtx=args.nvtx,
        memory_snapshot=args.memory_snapshot,
        progress=not args.quiet,
        snapshot_paths=[],
        fused_loss=args.fused_loss,
        act_ckpt=args.activation_checkpointing,
        nprocs=args.nprocs,
        backend=args.backend,
        timeout_s=args.timeout_s,
        blas=args.blas,
    )
    specs = specs_from_args(args)
    if args.fsdps and _dist.under_torchrun():
        rows = run_torchrun_sweep(specs, opts)
        if rows is None:  # ranks other than 0 print nothing
            return 0
    elif args.fsdps:
        rows = run_dist_sweep(specs, opts)
    else:
        rows = run_sweep(specs, opts)
    cols = [c for c in TABLE_COLUMNS if _shown(c, rows)]
    report.print_table(rows, cols, title=_title(opts))
    for line in gather_wait_notes(rows):
        print(line)
    report.save_rows(rows, csv_path=args.csv, json_path=args.json)
    if args.plot is not None and any(r.get("status") == "ok" for r in rows):
        print(f"plot: {plot_rows(rows, args.plot)}")
    for path in opts.snapshot_paths or []:
        print(f"memory snapshot: {path} (open at https://pytorch.org/memory_viz)")
    for what, path in (("csv", args.csv), ("json", args.json)):
        if path is not None:
            print(f"{what}: {path}")
    errors = [r for r in rows if str(r.get("status", "")).startswith("error")]
    if errors:
        print(f"{len(errors)} configuration(s) failed with an error (see status)", file=sys.stderr)
        return 1
    return 0


def _shown(col: str, rows: Sequence[dict[str, Any]]) -> bool:
    """A column is in the table when some row has it (config columns: a non-default value)."""
    if col in OPTIONAL_CONFIG_COLUMNS:
        return any(r.get(col) not in (None, OPTIONAL_CONFIG_COLUMNS[col]) for r in rows)
    if col in ("compile", "cuda_graph") and rows and all(r.get("fsdp") for r in rows):
        return False  # not available in the multi-GPU mode
    return any(r.get(col) is not None for r in rows)


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


def _dist_job(spec: BenchSpec, opts: BenchOptions) -> DistJob:
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
    )


def run_dist_sweep(specs: Sequence[BenchSpec], opts: BenchOptions) -> list[dict[str, Any]]:
    """The multi-GPU mode: every cell on `opts.nprocs` freshly spawned ranks."""
    assert opts.nprocs is not None
    rows = []
    bar = _outer_bar(len(specs), opts.progress)
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
            rows.append(_row(spec, info, opts, {"status": f"error: {exc}"}))
            bar.update(1)
            continue
        info.update({f: getattr(config, f) for f in ("d_model", "num_layers", "num_heads")})
        info.update(d_ff=config.d_ff, vocab_size=config.vocab_size, attention=config.attention)
        measured = spawn_cell(_dist_job(spec, opts), opts.nprocs, opts.timeout_s)
        if str(measured.get("status", "")).startswith("error") and measured.get("error"):
            print(f"[perf_tools.bench] {spec.label()}:\n{measured['error']}", file=sys.stderr)
        rows.append(_row(spec, info, opts, measured))
        bar.update(1)
    bar.close()
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
            measured = torchrun_cell(_dist_job(spec, opts))
            if measured is not None:
                rows.append(_row(spec, {}, opts, measured))
        dist.barrier()
    finally:
        rank = dist.get_rank()
        gc.collect()  # models and FSDP wrappers in reference cycles still hold the group
        dist.destroy_process_group()
    return rows if rank == 0 else None


def _title(opts: BenchOptions) -> str:
    dev = report.run_metadata()["device"]
    if opts.nprocs is not None:
        return (
            f"perf_tools.bench on {opts.nprocs} x {dev} ({opts.backend}): batch {opts.batch} "
            f"per rank, {opts.warmup} warm-up + {opts.steps} measured steps (median ms per step "
            "of the slowest rank; tokens/s of all ranks; TFLOP/s, MFU, memory per GPU)"
        )
    return (
        f"perf_tools.bench on {dev}: batch {opts.batch}, {opts.warmup} warm-up + "
        f"{opts.steps} measured steps (ms per step; MFU vs peak TFLOP/s)"
    )


if __name__ == "__main__":
    code = main()
    if _dist.under_torchrun():
        # A torchrun rank skips the interpreter's shutdown, as ddp_kit.launch's workers do:
        # with gloo's threads alive it has aborted now and then ("terminate called without
        # an active exception") after the results were written.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
