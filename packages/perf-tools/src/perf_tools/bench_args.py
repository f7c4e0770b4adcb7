"""`perf_tools.bench`'s flags: the arguments it adds (`add_bench_args`), what its parsed
flags resolve to (`resolve_bench_args`: defaults that depend on the device, the values each
sweep axis takes, and the combinations refused with a message naming the flag), and the
sweep's cells (`specs_from_args`). `perf_tools.bench` is the command around them.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

from perf_tools import _cli
from perf_tools.bench_multi import add_multi_args, check_multi_args, multi_specs
from perf_tools.cells import HF, OURS, BenchSpec
from perf_tools.model_args import add_model_args, add_step_args, resolve_model_args
from perf_tools.steps import MODES

OPT_STATE_DTYPES = ("fp32", "bf16")
BLAS_LIBRARIES = ("default", "cublas", "cublaslt")
COMPILE_CHOICES = ("off", "on", "blocks", "both")
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
# --compile value -> BenchSpec.compile values
_COMPILES = {"off": [False], "on": [True], "blocks": ["blocks"], "both": [False, True]}


def add_bench_args(p: argparse.ArgumentParser) -> None:
    """Every flag of `python -m perf_tools.bench` on parser `p`."""
    add_model_args(p)
    g = p.add_argument_group("sweep")
    add_step_args(
        g,
        mode_default="forward fwd-bwd train on CPU, train on GPU",
        precision_default="fp32 on CPU, fp32 bf16 on GPU",
    )
    g.add_argument(
        "--compile",
        nargs="*",
        type=_cli.listed(_cli.choice(COMPILE_CHOICES)),
        default=None,
        help="torch.compile: on (the whole model), blocks (each block on its own, "
        "lm_core.compile_blocks: one backward node per block, what --optimizer-overlap "
        "needs), off; several for a sweep axis (--compile off on blocks); --compile alone: "
        "on; both: off and on. Multi-GPU mode: on = each block for --fsdp and --tp "
        "(torchtitan's way), the whole model for --ddp",
    )
    g.add_argument(
        "--compile-backend",
        choices=COMPILE_BACKENDS,
        default="inductor",
        help="torch.compile's backend for compiled rows (default inductor; aot_eager traces "
        "forward and backward without generating kernels, eager runs dynamo's graphs as "
        "they are: both isolate tracing from code generation)",
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
        "--optimizer-overlap",
        nargs="?",
        const="on",
        default="off",
        type=_cli.choice(("off", "on", "both")),
        help="train rows of lm_core: step each block's AdamW during the backward as soon as "
        "its gradients are final (lm_core.OverlappedOptimizer; on a side CUDA stream), "
        "instead of one AdamW step after it: --optimizer-overlap (on), both (after and "
        "overlapped). Overlaps only eager or with --compile blocks; opt_ms is then the "
        "optimizer time left after the backward",
    )
    g.add_argument(
        "--optimizer-state-dtype",
        nargs="+",
        type=_cli.listed(_cli.choice(OPT_STATE_DTYPES)),
        default=None,
        metavar="{fp32,bf16}",
        help="train rows of lm_core: the dtype of AdamW's moments (weights stay fp32); "
        "bf16 changes the numerics (lm_core.optim_lowp). Several for a sweep axis "
        "(--optimizer-state-dtype fp32 bf16); default fp32",
    )
    g.add_argument(
        "--matmul-weights",
        nargs="+",
        type=_cli.listed(_cli.choice(OPT_STATE_DTYPES)),
        default=None,
        metavar="{fp32,bf16}",
        help="bf16 train rows of lm_core: bf16 holds the blocks' linear weights in bf16, "
        "their fp32 masters in AdamW (lm_core.lowp_weights: no weight casts in the step, "
        "the same math); several for a sweep axis (--matmul-weights fp32 bf16); default fp32",
    )
    g.add_argument(
        "--autograd-threads",
        nargs="+",
        type=_cli.listed(_cli.choice(("on", "off"))),
        default=None,
        metavar="{on,off}",
        help="fwd-bwd and train rows, one process: on runs the backward on autograd's "
        "device thread (torch's default), off on the calling thread "
        "(torch.autograd.set_multithreading_enabled(False): no hand-off per backward, "
        "which Python autograd Functions such as flash-triton's pay for). Both for an axis",
    )
    g.add_argument(
        "--compare",
        nargs="+",
        type=_cli.listed(_cli.choice(("hf",))),
        default=[],
        help="also time a competitor at the same dims: hf = transformers LlamaForCausalLM "
        "(SDPA attention, fused torch AdamW; with --attention flash-triton also with "
        "flashattn_triton's SDPA drop-in); skipped with a note if not installed",
    )
    add_multi_args(p)
    t = p.add_argument_group("timing")
    t.add_argument(
        "--isolate",
        nargs="?",
        type=_cli.positive_int,
        const=1,
        default=0,
        metavar="N",
        help="run each model's rows (size x attention x compile x matmul) in a fresh process: "
        "a host-bound step's time depends on the process it runs in; N rounds of processes, "
        "models interleaved, and a table of the median over rounds (default 1)",
    )
    t.add_argument(
        "--rounds",
        type=_cli.positive_int,
        default=1,
        metavar="N",
        help="measure every row N times in this process, models interleaved and each built "
        "again per round (each round starts at another model), and a table of the median "
        "over rounds: a single cell of a host-bound step moves between cells (default 1)",
    )
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


def resolve_bench_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fill `args` (parsed by `parser`) with the resolved sweep axes; a refused combination
    exits through `parser.error`, naming the flag."""
    resolve_model_args(parser, args)
    on_gpu = args.device.type == "cuda"
    args.steps = args.steps or (3 if args.profile is not None else 10)
    args.modes = _cli.flatten(args.mode) or (["train"] if on_gpu else list(MODES))
    args.precisions = _cli.flatten(args.precision) or (["fp32", "bf16"] if on_gpu else ["fp32"])
    picked = ["off"] if args.compile is None else _cli.flatten(args.compile) or ["on"]
    args.compiles = list(dict.fromkeys(c for p in picked for c in _COMPILES[p]))
    args.overlaps = {"off": [False], "on": [True], "both": [False, True]}[args.optimizer_overlap]
    args.graphs = {"off": [False], "on": [True], "both": [False, True]}[args.cuda_graph]
    args.opt_states = _cli.flatten(args.optimizer_state_dtype) or ["fp32"]
    args.weights = list(dict.fromkeys(_cli.flatten(args.matmul_weights) or ["fp32"]))
    threads = _cli.flatten(args.autograd_threads) or ["on"]
    args.autograd_threads = [t == "on" for t in dict.fromkeys(threads)]
    args.competitors = _cli.flatten(args.compare) or []
    if args.no_warmup:
        args.warmup = 0
    if args.nvtx and not on_gpu:
        parser.error("argument --nvtx: NVTX ranges need a CUDA device (Nsight Systems reads them)")
    if args.cuda_graph != "off" and not on_gpu:
        parser.error("argument --cuda-graph: CUDA graphs need a CUDA device (use --device cuda)")
    if args.cuda_graph != "off" and args.profile is not None:
        parser.error("argument --cuda-graph: not combined with --profile (kernels inside a graph)")
    if args.optimizer_overlap != "off" and "train" not in args.modes:
        parser.error(
            "argument --optimizer-overlap: overlaps the train step's optimizer; add --mode train"
        )
    if args.opt_states != ["fp32"] and "train" not in args.modes:
        parser.error("argument --optimizer-state-dtype: a train step's option; add --mode train")
    if args.weights != ["fp32"] and ("train" not in args.modes or "bf16" not in args.precisions):
        parser.error(
            "argument --matmul-weights: bf16 weights serve bf16 train steps; add --mode train "
            "--precision bf16"
        )
    if args.autograd_threads != [True] and args.modes == ["forward"]:
        parser.error("argument --autograd-threads: where the backward runs; add --mode train")
    if args.memory_snapshot is not None and not on_gpu:
        parser.error(
            "argument --memory-snapshot: the allocator history is recorded by the CUDA "
            "caching allocator; run on a GPU (use --device cuda)"
        )
    check_multi_args(parser, args)
    if args.isolate and args.rounds > 1:
        parser.error("argument --rounds: rounds in this process; --isolate N has its own rounds")
    for name, used in (("--isolate", args.isolate), ("--rounds", args.rounds > 1)):
        for flag, value in (
            ("--memory-snapshot", args.memory_snapshot),
            ("--profile", args.profile),
            ("the multi-GPU flags (every multi-GPU cell has fresh ranks already)", args.fsdps),
        ):
            if used and value is not None:
                parser.error(f"argument {name}: not combined with {flag}")


def hf_attentions(attentions: list[str]) -> list[str]:
    """The HF competitor's attentions for ours: SDPA always, and flash-triton (through
    ``flashattn_triton.sdpa_replaced``) where ours runs it."""
    return ["sdpa", *(["flash-triton"] if "flash-triton" in attentions else [])]


def specs_from_args(args: argparse.Namespace) -> list[BenchSpec]:
    """The cartesian product, grouped so each model is built once and reused, eager cells
    first."""
    if getattr(args, "fsdps", None) is not None:
        return multi_specs(args)
    specs = []
    impls = [OURS] + ([HF] if "hf" in args.competitors else [])
    for impl in impls:
        attentions = args.attentions if impl == OURS else hf_attentions(args.attentions)
        matmuls = args.matmuls if impl == OURS else ["default"]
        for size, attention, matmul, compiled, precision in itertools.product(
            args.sizes, attentions, matmuls, args.compiles, args.precisions
        ):
            for context in sorted(args.contexts):
                for mode, graph in itertools.product(args.modes, args.graphs):
                    # the optimizer overlap and state dtype: train rows of lm_core only
                    ours_train = impl == OURS and mode == "train"
                    overlaps = args.overlaps if ours_train else [False]
                    opt_states = getattr(args, "opt_states", ["fp32"]) if ours_train else ["fp32"]
                    held = ours_train and precision == "bf16"
                    weights = getattr(args, "weights", ["fp32"]) if held else ["fp32"]
                    threads = (
                        getattr(args, "autograd_threads", [True]) if mode != "forward" else [True]
                    )
                    for overlap, opt_state, weight, thread in itertools.product(
                        overlaps, opt_states, weights, threads
                    ):
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
                                overlap=overlap,
                                opt_state=opt_state,
                                weights=weight,
                                autograd_threads=thread,
                            )
                        )
    # Every eager cell before any compiled one (a stable sort: each model's cells stay
    # together): a compile leaves the process changed (inductor's caches and workers, the
    # graphs it holds): in one run the host-bound flash-triton eager cells, each right after
    # a compiled cell, took 1.27x the SDPA eager cells' step, and their optimizer phase, which
    # runs no attention, 1.14-1.17x (cause not found; not inductor's compile workers, idle
    # after starting, BENCHMARKS 3.3).
    return sorted(specs, key=lambda spec: spec.compile is not False)
