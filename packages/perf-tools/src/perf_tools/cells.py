"""The cells of the model benchmark, shared by `bench` (timing) and `profile` (torch.profiler).

A cell (`BenchSpec`) is one point of the sweep: implementation (lm_core or the HF competitor),
size, attention backend, eager or compiled (the whole model, or block by block), precision,
mode, context, CUDA graph or not, optimizer step after or overlapped with the backward.
`run_sweep` runs them through the harness (`perf_tools.harness.Sweep`): cells that share a
model are grouped so that it is built once (a build failure becomes every such cell's status),
and each cell is measured by `measure_cell` (the default: warm-up, then timed steps) or by the
hook a command passes (`profile.Profiler`); `cell_row` turns the result into the row.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from perf_tools import hardware, harness, hf_baseline, isolated_runs, timing
from perf_tools._compile import (
    allow_recompiles,
    compile_for_bench,
    compiled_launch_options,
    cpp_launch_counters,
    cpp_launch_status,
    cpp_replays_per_step,
)
from perf_tools.flops import step_flops
from perf_tools.models import build_model, count_params, random_batch, resolve_config
from perf_tools.steps import Annotator, PhaseTimer, lm_core_annotations, make_step

OURS = "lm_core"
HF = "hf-llama"
Row = dict[str, Any]
# measure(model, runner, spec, config, opts, n_cells) -> the cell's measured columns
Measure = Callable[..., Row]


@dataclass(frozen=True)
class BenchSpec:
    """One cell of the sweep."""

    impl: str  # OURS or HF
    size: str
    attention: str | None
    compile: bool | str  # False (eager), True (torch.compile(model)), "blocks" (each block)
    precision: str
    mode: str
    context: int
    graph: bool = False  # the whole step captured in one CUDA graph and replayed
    fsdp: str | None = None  # multi-GPU mode: "ours", "torch" or "none" (None: one process)
    ddp: str = "none"  # multi-GPU mode: "torch" (DistributedDataParallel; fsdp "none")
    matmul: str = "default"  # lm_core rows: how linear layers multiply in fp32
    overlap: bool = False  # train rows of lm_core: lm_core.OverlappedOptimizer
    opt_state: str = "fp32"  # train rows of lm_core: AdamW's moments, fp32 or bf16
    # train rows of lm_core in bf16: "bf16" holds the blocks' linear weights in bf16 with
    # fp32 masters in AdamW (lm_core.lowp_weights)
    weights: str = "fp32"
    # train rows: the backward on autograd's device thread (torch's default) or, False, on
    # the calling thread (torch.autograd.set_multithreading_enabled(False))
    autograd_threads: bool = True

    @property
    def model_key(self) -> tuple[str, str, str | None, bool | str, str, str]:
        """Cells with the same key share one built model."""
        return (self.impl, self.size, self.attention, self.compile, self.matmul, self.weights)

    def label(self) -> str:
        parts = [self.impl, self.size, self.attention or "default", self.precision, self.mode]
        parts.append(f"ctx{self.context}")
        if self.compile:
            parts.append("compiled-blocks" if self.compile == "blocks" else "compiled")
        if self.graph:
            parts.append("graphed")
        if self.matmul != "default":
            parts.append(f"matmul-{self.matmul}")
        if self.overlap:
            parts.append("opt-overlap")
        if self.opt_state != "fp32":
            parts.append(f"opt-state-{self.opt_state}")
        if self.weights != "fp32":
            parts.append(f"weights-{self.weights}")
        if not self.autograd_threads:
            parts.append("autograd-threads-off")
        if self.fsdp and self.fsdp != "none":
            parts.append(f"fsdp-{self.fsdp}")
        if self.ddp != "none":
            parts.append(f"ddp-{self.ddp}")
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
    tp: int = 1  # multi-GPU mode: tensor-parallel degree (perf_tools.bench_tp)
    sequence_parallel: bool = False  # multi-GPU mode with tp > 1
    compile_backend: str = "inductor"  # torch.compile's backend for compiled cells
    isolate: int = 0  # N > 0: each model's cells in a fresh process, N rounds (run_sweep)
    rounds: int = 1  # N > 1: N rounds in this process, each model rebuilt per round


def _loss_fn(impl: str) -> Any:
    if impl == OURS:
        from lm_core import cross_entropy

        return cross_entropy
    return torch.nn.functional.cross_entropy


def _optimizer(spec: BenchSpec, model: nn.Module, device: torch.device) -> Any:
    kwargs = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    if spec.impl == OURS:
        from lm_core.optim_lowp import STATE_DTYPE_NAMES

        kwargs["state_dtype"] = STATE_DTYPE_NAMES[spec.opt_state]
    if spec.impl == OURS and spec.overlap:
        from lm_core import OverlappedOptimizer

        return OverlappedOptimizer(model, **kwargs)  # one fused AdamW per block (and rest)
    if spec.impl == OURS:
        from lm_core import AdamW

        return AdamW(model.parameters(), **kwargs)
    from perf_tools.hf_baseline import fused_adamw

    return fused_adamw(model.parameters(), device)


def _build(spec: BenchSpec, config: Any, device: torch.device) -> nn.Module:
    if spec.impl == OURS:
        model = build_model(config, device)
        if spec.weights == "bf16":
            from lm_core import lowp_weights

            lowp_weights.hold_in_bf16(lowp_weights.matmul_weights(model))
        return model
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
    optimizer = _optimizer(spec, model, opts.device) if spec.mode == "train" else None
    fused = opts.fused_loss and spec.impl == OURS
    try:
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
        if spec.impl == HF and spec.attention == "flash-triton":
            step = hf_baseline.with_sdpa_dropin(step)
        if spec.graph:
            from lm_core import graph_step

            # the bench's models draw no random numbers on the GPU: node priorities are safe
            step = graph_step.capture_cuda_graph(step, node_priorities=graph_step.NODE_PRIORITIES)
    except BaseException:
        release_optimizer(optimizer)
        raise
    return step, optimizer


def release_optimizer(optimizer: Any) -> None:
    """Remove an overlapped optimizer's gradient hooks from the model (the next cell of the
    same model must not step in its backward); nothing for other optimizers."""
    remove = getattr(optimizer, "remove", None)
    if remove is not None:
        remove()


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
    # flashattn_triton's C++ replays over the measured steps (GPU cells with its attention)
    replays = spec.attention == "flash-triton" and device.type == "cuda"
    replays_before: dict[str, int] = {}

    def on_measure() -> None:
        timing.reset_peak_memory(device)
        if snapshot is not None:
            torch.cuda.memory._record_memory_history(max_entries=1_000_000)
            started.append("snapshot")
        if opts.nvtx:
            torch.cuda.cudart().cudaProfilerStart()
            started.append("nvtx")
        if replays:
            replays_before.update(cpp_launch_counters())

    label = spec.label() if opts.progress else None
    try:
        with (
            torch.autograd.set_multithreading_enabled(spec.autograd_threads),
            lm_core_annotations(opts.nvtx and spec.impl == OURS),
        ):
            nvtx = torch.autograd.profiler.emit_nvtx() if opts.nvtx else contextlib.nullcontext()
            with nvtx:
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
    finally:
        release_optimizer(optimizer)
    peak_mem = timing.peak_memory_bytes(device)
    dropin = hf_baseline.dropin_calls(step)
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
        "dropin_calls": dropin,
        "cpp_replays": cpp_replays_per_step(replays_before, opts.steps) if replays else None,
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


def run_sweep(
    specs: Sequence[BenchSpec],
    opts: BenchOptions,
    measure: Measure | None = None,
    on_rows: Callable[[list[Row]], None] | None = None,
) -> list[Row]:
    """Measure every cell; one model per model_key, OOM / errors recorded and the sweep goes on.
    ``on_rows(rows)`` runs after each model's cells with the rows so far (``bench.main``
    saves them, so a sweep stopped part-way keeps the models it finished).

    `measure(model, runner, spec, config, opts, n_cells) -> dict` (default `measure_cell`).
    With `opts.isolate` (N) each model's cells run in a fresh process (`_isolated_cells`),
    which runs `measure_cell` (no other `measure` with it), in N rounds that interleave the
    models; with N > 1 each row says its round (`run`; `isolated_runs` summarizes them).
    `opts.rounds` (N > 1) does the same in this process, each model built again per round.
    """
    if opts.isolate and measure is not None:
        raise ValueError("measure: a spawned process runs measure_cell; not with opts.isolate")
    if opts.rounds < 1 or (opts.isolate and opts.rounds > 1):
        raise ValueError(
            f"opts.rounds: a positive count, 1 with opts.isolate (which has its own rounds); "
            f"got {opts.rounds} with isolate={opts.isolate}"
        )
    measure = measure or measure_cell
    rows: list[Row] = []
    quiet = not opts.progress or len(specs) < 2
    total = len(specs) * max(opts.isolate, opts.rounds)
    with harness.Sweep(
        total, "configs", device=opts.device, quiet=quiet, classify=_skipped
    ) as sweep:
        groups = list(harness.cells_by(specs, lambda s: s.model_key))
        rounds = opts.isolate or opts.rounds
        for run in range(1, rounds + 1):  # rounds interleave the models
            # in-process rounds rotate the order; fresh processes keep it (A, B, A, B, ...)
            order = groups if opts.isolate else isolated_runs.rotated(groups, run - 1)
            for key, cells in order:
                if opts.isolate:
                    done = _isolated_cells(key, cells, opts, sweep, len(specs))
                else:
                    done = _model_cells(key, cells, opts, measure, sweep, len(specs))
                rows += [{**r, "run": run} for r in done] if rounds > 1 else done
                if on_rows is not None:
                    on_rows(rows)
    add_hf_speedups(rows)
    return rows


def _cells_in_child(
    rank: int, world: int, key: tuple, cells: list[BenchSpec], opts: BenchOptions, n_cells: int
) -> list[Row]:
    """The body of `_isolated_cells`' process: one model's cells, as `run_sweep` runs them,
    each row with this process's speed at issuing work (`timing.host_op_us`) before the
    cells (`host_op_start_us`) and after them (`host_op_us`): a process slow from its start
    is a draw, one that slowed down was slowed by what it ran."""
    start = round(timing.host_op_us(opts.device), 2)
    with harness.Sweep(
        len(cells), "configs", device=opts.device, quiet=True, classify=_skipped
    ) as sweep:
        rows = _model_cells(key, cells, opts, measure_cell, sweep, n_cells)
    after = round(timing.host_op_us(opts.device), 2)
    return [{**row, "host_op_start_us": start, "host_op_us": after} for row in rows]


def _isolated_cells(
    key: tuple, cells: list[BenchSpec], opts: BenchOptions, sweep: harness.Sweep, n_cells: int
) -> list[Row]:
    """One model's cells in a freshly spawned process. A host-bound step (a small model,
    compiled) runs at the speed of its process's host (perf-tools DESIGN, "Why separate
    processes disagree"), so rows meant to be compared can each get a process of their own,
    in interleaved rounds."""
    from perf_tools import _dist

    try:
        (rows,) = _dist.run_ranks(
            _cells_in_child, 1, backend="gloo", args=(key, cells, opts, n_cells),
            timeout_s=opts.timeout_s, quiet=True,
        )  # fmt: skip
    except Exception as exc:  # the child's traceback (WorkerError) or a timeout
        failed = {"status": harness.failure_status(exc), "error": str(exc)}
        rows = [cell_row(c, {"model": key[0], "size": key[1]}, opts, failed) for c in cells]
    sweep.skip(len(cells))
    return rows


def _model_cells(
    key: tuple,
    cells: list[BenchSpec],
    opts: BenchOptions,
    measure: Measure,
    sweep: harness.Sweep,
    n_cells: int,
) -> list[Row]:
    """The cells that share one model: build it once, then measure each cell on it."""
    impl, size, attention, compiled, matmul, _ = key  # weights: _build reads cells[0]
    base = {"model": impl, "size": size}
    overrides = dict(opts.overrides, matmul=matmul) if impl == OURS else opts.overrides
    try:
        config = resolve_config(
            size,
            context_length=max(c.context for c in cells),
            attention=attention if impl == OURS else None,
            overrides=overrides,
        )
    except (ValueError, TypeError) as exc:
        sweep.skip(len(cells))
        return [cell_row(c, base, opts, {"status": f"error: {exc}"}) for c in cells]
    t0 = time.perf_counter()
    built, status = sweep.attempt(partial(_build_runner, cells[0], config, opts, compiled))
    build_s = time.perf_counter() - t0
    if built is None:
        harness.release(opts.device)
        sweep.skip(len(cells))
        return [cell_row(c, base, opts, {"status": status}) for c in cells]
    model, runner = built
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
    rows = []
    for cell in cells:
        measured = sweep.measure(
            partial(measure, model, runner, cell, config, opts, n_cells=n_cells),
            cleanup=partial(_drop_grads, model),
        )
        rows.append(cell_row(cell, info, opts, measured))
    del model, runner, built  # before the release: nothing else holds the model
    if compiled:
        torch._dynamo.reset()
    harness.release(opts.device)
    return rows


def _build_runner(
    spec: BenchSpec, config: Any, opts: BenchOptions, compiled: bool | str
) -> tuple[nn.Module, nn.Module]:
    """(model, what the step calls: the model, its compiled version, or the model with each
    block compiled in place)."""
    torch.manual_seed(opts.seed)
    model = _build(spec, config, opts.device)
    model.train()
    backend = opts.compile_backend
    if compiled == "blocks":
        compile_blocks_for_bench(model, backend=backend)
        return model, model
    return model, compile_for_bench(model, backend=backend) if compiled else model


def compile_blocks_for_bench(model: nn.Module, **kwargs: Any) -> None:
    """Compile each block in place: lm_core's `compile_blocks`, or each decoder layer of the
    HF competitor (`model.model.layers`), with `dynamic=False` (unless `kwargs`, torch.compile's
    options, say otherwise) and enough recompiles."""
    allow_recompiles()
    kwargs.setdefault("dynamic", False)
    if hasattr(model, "layers"):
        from lm_core import compile_blocks

        compile_blocks(model, **kwargs)
        return
    for layer in model.model.layers:
        layer.compile(**kwargs)


def _drop_grads(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


def _skipped(exc: BaseException) -> str | None:
    """A missing optional competitor is a skipped cell, not an error."""
    from perf_tools.hf_baseline import MissingBaselineError

    return f"skipped: {exc}" if isinstance(exc, MissingBaselineError) else None


def cell_row(
    spec: BenchSpec, info: dict[str, Any], opts: BenchOptions, measured: dict[str, Any]
) -> dict[str, Any]:
    """The row of a cell: its configuration, the model's `info`, the `measured` columns."""
    row: dict[str, Any] = {
        "model": spec.impl,
        "size": spec.size,
        "attention": spec.attention,
        "compile": spec.compile,
        "cuda_graph": spec.graph,
        "precision": spec.precision,
        "tf32": bool(torch.backends.cuda.matmul.allow_tf32),
        "blas": opts.blas,
        "matmul": spec.matmul,
        "opt_overlap": spec.overlap,
        "opt_state": spec.opt_state,
        "weights": spec.weights,
        "autograd_threads": "on" if spec.autograd_threads else "off",
        "mode": spec.mode,
        "context": spec.context,
        "batch": opts.batch,
        "fused_loss": opts.fused_loss and spec.impl == OURS,
        "act_ckpt": opts.act_ckpt if spec.impl == OURS else "none",
        "warmup_steps": opts.warmup,
        "steps": opts.steps,
        "device": str(opts.device),
    }
    if spec.compile:
        row["compile_backend"] = opts.compile_backend
        if spec.attention == "flash-triton":  # how compiled graphs call our kernels
            row.update(compiled_launch_options())
    replays = not spec.compile or row.get("cpp_launch_compiled")
    if spec.attention == "flash-triton" and opts.device.type == "cuda" and replays:
        row["cpp_launch"] = cpp_launch_status()  # whether the calls replay from C++
    if spec.fsdp is not None:
        assert opts.nprocs is not None
        dp = opts.nprocs // opts.tp  # data-parallel groups; --batch is per group
        row.update(nprocs=opts.nprocs, fsdp=spec.fsdp, ddp=spec.ddp, global_batch=opts.batch * dp)
        row.update(tp=opts.tp, dp=dp, mesh=f"{dp}x{opts.tp}", seq_parallel=opts.sequence_parallel)
        row["device"] = f"{opts.backend}: {opts.nprocs} x {opts.device.type}"
    row.update(info)
    row["attention"] = row.get("attention") or spec.attention or "default"
    row.update(measured)
    return row


def add_hf_speedups(rows: list[dict[str, Any]]) -> None:
    """vs_hf = HF step time / ours, for cells measured for both (same size/precision/...):
    against HF with the same attention where there is such an HF row (sdpa, flash-triton),
    else against HF with SDPA."""
    key = ("size", "compile", "cuda_graph", "precision", "mode", "context")
    hf = {
        (*(r[k] for k in key), r["attention"]): r["mean_ms"]
        for r in rows
        if r["model"] == HF and r.get("status") == "ok"
    }
    for r in rows:
        same = tuple(r[k] for k in key)
        ref = hf.get((*same, r["attention"])) or hf.get((*same, "sdpa"))
        if r["model"] == OURS and r.get("status") == "ok" and ref:
            r["vs_hf"] = ref / r["mean_ms"]
