"""A whole training step captured in one CUDA graph and replayed: the trainer's `--cuda-graph`.

Eager PyTorch issues a step's kernels one by one from Python; on small and medium models the
host is slower than the GPU and the GPU waits. A CUDA graph records every kernel of one step
(forward, loss, backward, gradient clipping, the fused AdamW update) once, and each later step
is one launch. The pieces:

- `GraphedStep`: runs the first `warmup` steps eagerly on a side stream (they are real
  training steps: compilation, autotuning, optimizer state, cuBLAS workspaces happen there),
  then captures the step and from then on copies each batch into static buffers and replays.
- `StaticBatches`: the graph's fixed input/target buffers, refilled in place every step.
- `DeviceLR`: the learning rate as a device tensor that the fused AdamW kernel reads, so the
  schedule changes inside the graph; `fill_` before each replay.
- `check_config` / `check_device` / `check_optimizer`: the combinations that cannot be
  captured, refused with an error naming the options.
- `capture_cuda_graph`: warm up and capture any step closure (what `perf_tools.bench
  --cuda-graph` times).

Whole-step capture uses torch's public `torch.cuda.graph`; `torch.cuda.make_graphed_callables`
graphs forward and backward of a module but not the optimizer step, which is half the point.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

import torch

from lm_core import graph_priority, optim_lowp
from lm_core.optim import AdamW, _fused_available, implementation
from lm_core.train_config import ConfigError, KeyNames, TrainConfig

WARMUP_STEPS = 3  # eager steps before the capture (torch's docs: a few, on a side stream)
# Whether GraphedStep (the trainer) and perf_tools.bench replay with node priorities
# (`CudaGraphs`); a switch for A/B benchmarks.
NODE_PRIORITIES = True
KEY = "training.cuda_graph"

T = TypeVar("T")
Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs, targets), int64 (rows, seq) each
# step(batches, lr) -> (mean loss over the micro-batches, grad norm before clipping or None);
# lr is a float for eager steps and the `DeviceLR` tensor while capturing
StepFn = Callable[[list[Batch], float | torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]


# ----------------------------------------------------------------------------- refusals


def _where(config: TrainConfig) -> torch.device | None:
    """The device `training.device` names (None: 'auto', or a name torch does not know)."""
    if config.training.device == "auto":
        return None
    try:
        return torch.device(config.training.device)
    except RuntimeError:
        return None


def check_config(config: TrainConfig, names: KeyNames | None = None) -> None:
    """Refuse, with a ConfigError naming the options, what `training.cuda_graph` cannot run
    with: a device that is not CUDA, several processes (--ddp, --zero, --fsdp, --tp: their
    collectives and sharded parameters are not captured here, so the graph path stays one
    process), and packed documents (the document offsets change length from batch to batch;
    a graph replays fixed shapes)."""
    if not config.training.cuda_graph:
        return
    n = names or KeyNames()
    flag = n(KEY)
    device = _where(config)
    if device is not None and device.type != "cuda":
        raise ConfigError(
            KEY,
            f"{flag} needs a CUDA device, not "
            f"{n.setting('training.device', config.training.device)}",
        )
    p = config.parallel
    for key, value, off in (
        ("parallel.ddp", p.ddp, "none"),
        ("parallel.zero", p.zero, False),
        ("parallel.fsdp", p.fsdp, "none"),
        ("parallel.tp", p.tp, 1),
    ):
        if value != off:
            raise ConfigError(
                KEY,
                f"{flag} trains in one process on one GPU: it is not supported with "
                f"{n.setting(key, value)} (collectives and sharded parameters are not "
                f"captured); drop {flag} for multi-GPU runs",
            )
    if config.data.pack_documents:
        raise ConfigError(
            KEY,
            f"{flag} is not supported with {n('data.pack_documents')}: the document offsets "
            "change length from batch to batch, and a graph replays fixed shapes",
        )


def check_device(device: torch.device, option: str = f"--cuda-graph ({KEY})") -> None:
    """ValueError unless `device` is a CUDA device (where `--device auto` found no GPU)."""
    if device.type != "cuda":
        raise ValueError(
            f"{option} needs a CUDA device; this run is on {device} (no GPU visible, or "
            "--device chose another)"
        )


def check_optimizer(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """RuntimeError unless every group of `optimizer` steps with torch's fused AdamW kernel
    taking a tensor learning rate: its step counts live on the device and it reads the LR
    from device memory, so one captured update serves every step of the schedule. With bf16
    moments (`state_dtype`) the Triton kernel of `lm_core.adamw_triton` must serve, which
    does the same."""
    where = f"--cuda-graph ({KEY})"
    units = getattr(optimizer, "optimizers", None)  # OverlappedOptimizer: each unit's
    if units is not None and not isinstance(optimizer, AdamW):
        for unit in units:
            check_optimizer(unit, device)
        return
    if not isinstance(optimizer, AdamW):
        raise RuntimeError(f"{where} needs lm_core.AdamW, got {type(optimizer).__name__}")
    overloads = getattr(getattr(torch.ops.aten, "_fused_adamw_", None), "overloads", list)
    if not _fused_available() or "tensor_lr" not in overloads():
        raise RuntimeError(
            f"{where}: this torch has no fused AdamW kernel with a tensor learning rate "
            "(torch._fused_adamw_.tensor_lr); train without --cuda-graph"
        )
    for i, group in enumerate(optimizer.param_groups):
        lowp = any(
            optim_lowp.moment_dtype(p, optimizer.state_dtype) != p.dtype for p in group["params"]
        )
        if lowp and optim_lowp.backend(group.get("fused"), device) != "triton":
            raise RuntimeError(
                f"{where}: parameter group {i} keeps bf16 moments (state_dtype, "
                "--optimizer-state-dtype bf16) or fp32 masters of bf16 weights "
                "(lm_core.lowp_weights) and steps them without the Triton kernel "
                f"(fused={group.get('fused')!r}, or triton is not installed); its step counts "
                "would stay on the host"
            )
        if implementation(group.get("fused"), device) != "fused":
            raise RuntimeError(
                f"{where}: parameter group {i} does not use the fused AdamW kernel "
                f"(fused={group.get('fused')!r}); its step counts would stay on the host"
            )


# ----------------------------------------------------------------------------- static state


class StaticBatches:
    """The graph's input and target buffers, int64 (micro_steps, rows, seq) on `device`.

    A captured graph reads fixed addresses, so every step's batch is copied into these
    tensors in place (`fill`) and the step always runs on `views()`."""

    def __init__(self, micro_steps: int, rows: int, seq: int, device: torch.device) -> None:
        for name, value in (("micro_steps", micro_steps), ("rows", rows), ("seq", seq)):
            if value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value}")
        shape = (micro_steps, rows, seq)
        self.inputs = torch.zeros(shape, dtype=torch.long, device=device)
        self.targets = torch.zeros(shape, dtype=torch.long, device=device)

    def fill(self, batches: Sequence[Batch]) -> None:
        """Copy one step's micro-batches [(x, y)] into the buffers (no host sync)."""
        micro, rows, seq = self.inputs.shape
        if len(batches) != micro:
            raise ValueError(f"batches: expected {micro} micro-batches, got {len(batches)}")
        for i, (x, y) in enumerate(batches):
            for name, t in (("inputs", x), ("targets", y)):
                if tuple(t.shape) != (rows, seq):
                    raise ValueError(
                        f"batches[{i}] {name}: expected shape {(rows, seq)}, got {tuple(t.shape)}"
                    )
            self.inputs[i].copy_(x, non_blocking=True)
            self.targets[i].copy_(y, non_blocking=True)

    def views(self) -> list[Batch]:
        """[(inputs[i], targets[i])]: what the captured step reads."""
        return [(self.inputs[i], self.targets[i]) for i in range(self.inputs.shape[0])]


class DeviceLR:
    """The learning rate of a captured optimizer step: a 0-dim float32 tensor on the device.

    The fused AdamW kernel reads it from device memory (its tensor-LR overload, float32), so
    the graph follows the schedule once `set` has written each step's value. The param
    groups keep the float too (`record`), as the eager trainer leaves them: that is what
    `optimizer.state_dict()` and checkpoints hold."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        self.optimizer = optimizer
        self.tensor = torch.zeros((), dtype=torch.float32, device=device)

    def set(self, lr: float) -> None:
        """Write `lr` into the tensor (a fill kernel on the current stream: no host sync)."""
        self.tensor.fill_(lr)

    def record(self, lr: float) -> None:
        """The param groups' `lr` as a float again (capture set it to the tensor)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr


# ----------------------------------------------------------------------------- capture


class GraphRunner(Protocol):
    """How `GraphedStep` runs eager warm-up steps and records the step (a test double can
    re-run the function instead of recording it)."""

    def eager(self, fn: Callable[[], T]) -> T: ...

    def capture(self, fn: Callable[[], object]) -> Callable[[], None]: ...


def _compiling_for_graphs() -> contextlib.AbstractContextManager:
    """flashattn_triton's `for_cuda_graphs()` where the model uses it (already imported),
    else nothing: graphs compiled during warm-up then call its opaque ops, which suit a
    replayed graph (no host time per call to save, and they keep its fastest kernels)."""
    flash = sys.modules.get("flashattn_triton")
    hint = getattr(flash, "for_cuda_graphs", None)
    return hint() if hint is not None else contextlib.nullcontext()


class CudaGraphs:
    """Eager calls on a side stream, and `torch.cuda.graph` capture (as torch's docs ask:
    warm-up work on a side stream, so that lazily created state is not captured). Both run
    inside flashattn_triton's `for_cuda_graphs()` when the model uses it.

    node_priorities: capture on a stream of the highest priority and replay with each
    kernel's priority kept (`lm_core.graph_priority`): work the step puts on side streams of
    the default priority (`OverlappedOptimizer`'s updates) yields the SMs to the backward.
    Only for steps that draw no random numbers on the GPU (that replay does not advance the
    generator); where it cannot be done, a warning and torch's replay."""

    def __init__(self, device: torch.device, node_priorities: bool = False) -> None:
        check_device(device, "CudaGraphs")
        self.device = device
        self.node_priorities = node_priorities
        with torch.cuda.device(device):
            self.side = torch.cuda.Stream()

    def eager(self, fn: Callable[[], T]) -> T:
        """`fn()` on the side stream, ordered after and before the current stream's work."""
        current = torch.cuda.current_stream(self.device)
        self.side.wait_stream(current)
        with torch.cuda.stream(self.side), _compiling_for_graphs():
            out = fn()
        current.wait_stream(self.side)
        return out

    def capture(self, fn: Callable[[], object]) -> Callable[[], None]:
        """Record one call of `fn` (its kernels are recorded, not run); returns the replay."""
        # keep_graph and raw_cuda_graph came together (torch 2.8)
        keep = self.node_priorities and hasattr(torch.cuda.CUDAGraph, "raw_cuda_graph")
        graph = torch.cuda.CUDAGraph(keep_graph=True) if keep else torch.cuda.CUDAGraph()
        stream = graph_priority.high_priority_stream(self.device) if keep else None
        try:
            with (
                torch.cuda.device(self.device),
                torch.cuda.graph(graph, stream=stream),
                _compiling_for_graphs(),
            ):
                fn()
        except torch.OutOfMemoryError:
            raise  # as it is: callers tell an OOM from other failures by its type
        except RuntimeError as exc:
            raise RuntimeError(
                f"capturing the step in a CUDA graph failed: {exc}. Something in the step "
                "synchronizes with the host or changes shape; run it without a CUDA graph"
            ) from exc
        if self.node_priorities:
            why = "this torch's CUDAGraph has no keep_graph (torch 2.8+)"
            if keep:
                try:
                    return graph_priority.PriorityGraph(graph, self.device)
                except RuntimeError as exc:
                    why = str(exc)
            warnings.warn(
                f"CUDA graph node priorities: {why}; replaying through torch", stacklevel=2
            )
        return graph.replay


def capture_cuda_graph(
    step: Callable[[], None], *, warmup: int = 3, node_priorities: bool = False
) -> Callable[[], None]:
    """Record one call of `step` into a CUDA graph; returns the graph's replay.

    The whole step (forward, backward, optimizer) becomes one launch, so the host no longer
    paces the GPU. `step` must work on fixed input tensors, with an optimizer whose step
    counters live on the device (lm_core's fused AdamW, torch's fused/capturable AdamW), and
    without autocast's weight cache (`torch.autocast(..., cache_enabled=False)`). `warmup`
    eager calls run first on a side stream. The step's gradients end up in the graph's private
    memory pool and are rewritten in place by every replay. `node_priorities`: as
    `CudaGraphs`' (for steps that draw no random numbers on the GPU)."""
    if not torch.cuda.is_available():
        raise RuntimeError("capture_cuda_graph: CUDA graphs need a CUDA device")
    device = torch.device("cuda", torch.cuda.current_device())
    runner = CudaGraphs(device, node_priorities=node_priorities)
    for _ in range(warmup):
        runner.eager(step)
    return runner.capture(step)


class GraphedStep:
    """One training step over fixed-shape micro-batches, captured once and replayed.

    `step(batches, lr)` is the trainer's whole step: every micro-batch's forward, loss and
    backward, clipping, `optimizer.step()` with each param group's `lr` set to `lr`, and
    `optimizer.zero_grad(set_to_none=True)`; it returns (mean loss, grad norm or None). The
    first `warmup` calls run it eagerly (float lr) on a side stream; the next call captures
    it (lr: the `DeviceLR` tensor) and every call from then on refills the static buffers,
    writes the LR and replays. Returns (loss, grad norm or None) as 0-dim device tensors that
    the next call overwrites: read them (or add them up) before calling again.

    Parameters and optimizer state are the graph's: nothing may replace them after the
    capture (load a checkpoint before the first call; `load_state_dict` rebinds the state).
    `node_priorities` (default NODE_PRIORITIES): `CudaGraphs`'; lm_core's models draw no
    random numbers, so the trainer's step replays with them.
    """

    def __init__(
        self,
        step: StepFn,
        optimizer: torch.optim.Optimizer,
        *,
        micro_steps: int,
        rows: int,
        seq: int,
        device: torch.device,
        warmup: int = WARMUP_STEPS,
        runner: GraphRunner | None = None,
        node_priorities: bool | None = None,
    ) -> None:
        if warmup < 1:  # the optimizer's state must exist before the capture, not inside it
            raise ValueError(f"warmup: expected at least 1 eager step, got {warmup}")
        if runner is None:
            check_device(device)
            check_optimizer(optimizer, device)
            priorities = NODE_PRIORITIES if node_priorities is None else node_priorities
            runner = CudaGraphs(device, node_priorities=priorities)
        self.step = step
        self.warmup = warmup
        self.runner = runner
        self.batches = StaticBatches(micro_steps, rows, seq, device)
        self.lr = DeviceLR(optimizer, device)
        self.loss = torch.zeros((), dtype=torch.float32, device=device)
        self.grad_norm = torch.zeros((), dtype=torch.float32, device=device)
        self.has_norm = False
        self.eager_steps = 0
        self.replay: Callable[[], None] | None = None

    @property
    def captured(self) -> bool:
        return self.replay is not None

    def _captured_step(self) -> None:
        # Runs once (its kernels recorded); the outputs are copied into tensors allocated
        # outside the graph, which every replay rewrites in place.
        loss, grad_norm = self.step(self.batches.views(), self.lr.tensor)
        self.loss.copy_(loss)
        self.has_norm = grad_norm is not None
        if grad_norm is not None:
            self.grad_norm.copy_(grad_norm)

    def __call__(
        self, batches: Sequence[Batch], lr: float
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One optimizer step on `batches` [(x, y) per micro-step] at learning rate `lr`."""
        self.batches.fill(batches)
        if self.replay is None and self.eager_steps < self.warmup:
            self.eager_steps += 1
            views = self.batches.views()
            return self.runner.eager(lambda: self.step(views, lr))
        if self.replay is None:
            self.replay = self.runner.capture(self._captured_step)
        self.lr.set(lr)
        self.replay()
        self.lr.record(lr)
        return self.loss, self.grad_norm if self.has_norm else None
