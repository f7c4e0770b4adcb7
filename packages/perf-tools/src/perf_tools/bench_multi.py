"""The multi-GPU flags of `python -m perf_tools.bench` and the cells they make.

`add_multi_args` (--nprocs, --fsdp, --ddp, --timeout-s, and `bench_tp`'s --tp,
--sequence-parallel), `check_multi_args` (every combination that cannot run is an argument
error naming the flag, before any rank starts) and `multi_specs` (the cells: one per layout x
compile x precision x context x mode, the `compile` value resolved per layout by
`bench_wrap.resolve_compile`).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from perf_tools import _cli, _dist
from perf_tools.bench_tp import add_tp_args, check_tp_args
from perf_tools.bench_wrap import DDP_KINDS, FSDP_KINDS, resolve_compile
from perf_tools.cells import OURS, BenchSpec

__all__ = ["add_multi_args", "check_multi_args", "multi_specs"]


def add_multi_args(p: argparse.ArgumentParser) -> None:
    """The multi-GPU group of bench's flags."""
    m = p.add_argument_group(
        "multi-GPU (DDP, FSDP, TP)",
        "train each cell on N ranks (spawned here, or run the command under torchrun); "
        "--batch is then per rank (per data-parallel group with --tp)",
    )
    m.add_argument(
        "--nprocs",
        type=_cli.positive_int,
        help="ranks per cell: one GPU each over NCCL (gloo on CPU); needs --fsdp, --ddp or --tp",
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
        "--ddp",
        nargs="?",
        const="torch",
        choices=DDP_KINDS,
        help="data parallel over replicated models: torch = "
        "torch.nn.parallel.DistributedDataParallel (lm_core.train's --ddp torch; bf16 under "
        "autocast); --ddp alone: torch. A row of its own, beside any --fsdp rows",
    )
    m.add_argument(
        "--timeout-s",
        type=_cli.positive_float,
        default=1800.0,
        help="multi-GPU mode (and --isolate): kill a cell's ranks (or a model's process) "
        "after this long, compilation included (default 1800)",
    )
    add_tp_args(m)


def check_multi_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Validate the multi-GPU flags; sets args.fsdps (None: one process), args.backend."""
    args.fsdps = _cli.flatten(args.fsdp)
    args.backend = "nccl" if args.device.type == "cuda" else "gloo"
    torchrun = _dist.under_torchrun()
    if args.fsdps is None and args.tp == 1 and args.ddp is None:
        if args.sequence_parallel:
            parser.error("argument --sequence-parallel: needs --tp K with K > 1")
        if args.nprocs is not None:
            parser.error(
                "argument --nprocs: the multi-GPU mode needs a layout; add --ddp, "
                "--fsdp ours or --fsdp torch, or --tp N (tensor parallel)"
            )
        return
    if args.matmuls != ["default"]:
        parser.error("argument --matmul: the multi-GPU mode runs the default matmul only")
    # the flag that asked for the multi-GPU mode
    via = "--fsdp" if args.fsdps else "--ddp" if args.ddp else "--tp"
    if args.nprocs is None and not torchrun:
        parser.error(
            f"argument {via}: needs --nprocs N (ranks to spawn), or run the command under torchrun"
        )
    if torchrun:
        world = int(os.environ["WORLD_SIZE"])
        if args.nprocs is not None and args.nprocs != world:
            parser.error(
                f"argument --nprocs: {args.nprocs} ranks asked, torchrun started {world}; "
                "leave --nprocs out under torchrun"
            )
        args.nprocs = world
    if args.ddp is not None and args.tp > 1:
        parser.error(
            f"argument --ddp: data parallelism over whole replicas, not combined with --tp "
            f"{args.tp}; use --tp {args.tp} --fsdp torch for data parallel x tensor parallel"
        )
    check_tp_args(parser, args)  # pure TP (no --fsdp) sets args.fsdps = ["none"]
    if args.fsdps is None:
        args.fsdps = []  # --ddp alone: the DDP row only
    if args.mode is None:
        args.modes = ["train"]
    if "forward" in args.modes:
        parser.error(
            f"argument {via}: the multi-GPU mode times fwd-bwd and train steps; drop --mode forward"
        )
    for flag, used in (
        ("--optimizer-overlap", args.optimizer_overlap != "off"),
        ("--optimizer-state-dtype", args.opt_states != ["fp32"]),
        ("--matmul-weights", args.weights != ["fp32"]),
        ("--autograd-threads", args.autograd_threads != [True]),
        ("--cuda-graph", args.cuda_graph != "off"),
        ("--compare", bool(args.competitors)),
        ("--nvtx", args.nvtx),
        ("--memory-snapshot", args.memory_snapshot is not None),
        ("--profile", args.profile is not None),
    ):
        if used:
            parser.error(f"argument {flag}: not available in the multi-GPU mode ({via})")
    _check_compile(parser, args)
    _check_backend(parser, args, torchrun)


def _check_compile(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.compiles == [False]:
        return
    if args.warmup < 1:
        parser.error(
            "argument --warmup: --compile in the multi-GPU mode needs at least one warm-up "
            "step (the first step compiles; it must not be timed)"
        )


def _check_backend(
    parser: argparse.ArgumentParser, args: argparse.Namespace, torchrun: bool
) -> None:
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
        from lm_core.fsdp import torch_fsdp_api

        try:
            torch_fsdp_api()
        except ImportError as exc:
            parser.error(f"argument --fsdp: torch is not available here: {exc}; use --fsdp ours")
    if "ours" in args.fsdps:
        try:
            import zero_shard  # noqa: F401
        except ImportError:
            parser.error(
                "argument --fsdp: ours needs the zero-shard package (pip install zero-shard)"
            )


def multi_specs(args: argparse.Namespace) -> list[BenchSpec]:
    """The multi-GPU mode's cells: the DDP row first (with --ddp), then each --fsdp kind (or
    pure TP), each with the compile values of the sweep as that layout compiles them."""
    layouts = [("none", args.ddp)] if args.ddp is not None else []
    layouts += [(kind, "none") for kind in args.fsdps]
    specs = []
    for size in args.sizes:
        for attention in args.attentions:
            for fsdp, ddp in layouts:
                compiles = [resolve_compile(c, fsdp=fsdp, ddp=ddp) for c in args.compiles]
                for compiled in dict.fromkeys(compiles):
                    specs += [
                        BenchSpec(
                            OURS,
                            size,
                            attention,
                            compiled,
                            precision,
                            mode,
                            context,
                            fsdp=fsdp,
                            ddp=ddp,
                        )
                        for precision in args.precisions
                        for context in sorted(args.contexts)
                        for mode in args.modes
                    ]
    return specs
