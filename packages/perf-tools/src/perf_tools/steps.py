"""One benchmark step (forward, forward+backward, or a full AdamW training step), with ranges.

A `graph_safe` step is captured by `lm_core.graph_step.capture_cuda_graph` (lm_core's: the
trainer's `--cuda-graph` builds on the same capture).

The same step runs under the end-to-end timer (`bench`), under Nsight Systems (`bench --nvtx`)
and under torch.profiler (`profile`): `Annotator` wraps the phases "step", "forward",
"backward" and "optimizer" in NVTX ranges, `record_function` ranges, or nothing.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

MODES = ("forward", "fwd-bwd", "train")
MODE_ALIASES = {
    "fwd": "forward",
    "forward+backward": "fwd-bwd",
    "fwd+bwd": "fwd-bwd",
    "forward-backward": "fwd-bwd",
    "fwd_bwd": "fwd-bwd",
    "step": "train",
}
PRECISIONS = ("fp32", "bf16")
PRECISION_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "bf16-autocast": "bf16"}
PHASES = ("forward", "backward", "optimizer")


class Annotator:
    """Named ranges around the step phases: NVTX (Nsight), record_function (torch.profiler)."""

    def __init__(self, *, nvtx: bool = False, record: bool = False) -> None:
        self.nvtx = nvtx
        self.record = record

    @contextlib.contextmanager
    def range(self, name: str) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if self.record:
                stack.enter_context(torch.profiler.record_function(name))
            if self.nvtx:
                stack.enter_context(torch.cuda.nvtx.range(name))
            yield


@contextlib.contextmanager
def lm_core_annotations(enabled: bool) -> Iterator[bool]:
    """Turn lm_core's attention sub-step ranges on for the block; yields whether it could."""
    if not enabled:
        yield False
        return
    import lm_core

    setter = getattr(lm_core, "set_annotations", None)
    if setter is None:
        yield False
        return
    setter(True)
    try:
        yield True
    finally:
        setter(False)


@dataclass
class PhaseTimer:
    """Per-step durations of the phases: CUDA events on a GPU (no extra sync), clocks on CPU."""

    device: torch.device
    steps: list[dict[str, float]] = field(default_factory=list)
    _marks: list[tuple[str, Any]] = field(default_factory=list)
    _pending: list[list[tuple[str, Any]]] = field(default_factory=list)

    def _now(self) -> Any:
        if self.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def start(self) -> None:
        self._marks = [("start", self._now())]

    def mark(self, phase: str) -> None:
        """Close the phase `phase` (it began at the previous mark)."""
        self._marks.append((phase, self._now()))

    def finish(self) -> None:
        self._pending.append(self._marks)
        self._marks = []

    def _resolve(self) -> None:
        for marks in self._pending:
            out = {}
            for (_, a), (name, b) in itertools.pairwise(marks):
                if self.device.type == "cuda":
                    out[name] = a.elapsed_time(b)  # ms, both events done after the step's sync
                else:
                    out[name] = (b - a) * 1e3
            self.steps.append(out)
        self._pending = []

    def mean_ms(self, last: int) -> dict[str, float]:
        """Mean ms of each phase over the last `last` steps."""
        self._resolve()
        recent = self.steps[-last:] if last > 0 else []
        names = dict.fromkeys(k for s in recent for k in s)
        return {k: sum(s.get(k, 0.0) for s in recent) / len(recent) for k in names}


def autocast_context(
    precision: str, device: torch.device, *, cache_enabled: bool = True
) -> contextlib.AbstractContextManager:
    """bf16 autocast on `device`, or nothing for fp32.

    `cache_enabled=False` for steps captured in a CUDA graph: autocast's cache of casted
    weights would otherwise hold tensors from outside the graph's memory pool."""
    if precision == "bf16":
        return torch.autocast(
            device_type=device.type, dtype=torch.bfloat16, cache_enabled=cache_enabled
        )
    if precision == "fp32":
        return contextlib.nullcontext()
    raise ValueError(f"precision: expected one of {PRECISIONS}, got {precision!r}")


def make_step(
    model: nn.Module,
    mode: str,
    *,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
    precision: str,
    optimizer: torch.optim.Optimizer | None = None,
    annotator: Annotator | None = None,
    timer: PhaseTimer | None = None,
    graph_safe: bool = False,
    sync: Callable[[], None] | None = None,
) -> Callable[[], None]:
    """A closure running one step of `mode` on (B, T) `inputs` / `targets`.

    forward: logits under torch.no_grad (inference); fwd-bwd: loss and backward (gradients
    reset to None first, so they never accumulate across steps); train: fwd-bwd then
    `optimizer.step()`. `loss_fn(logits (B*T, V), targets (B*T,))` -> scalar; `loss_fn=None`:
    the model computes the loss itself, `model(inputs, targets)` -> scalar (lm_core's fused
    LM head + cross-entropy, no (B, T, V) logits), in forward mode too.
    `sync`, when given, runs after backward as its own phase "sync" (a data-parallel wrapper's
    `finish_gradient_synchronization`). `graph_safe=True` builds a step that
    `lm_core.graph_step.capture_cuda_graph` can record (no autocast cache; pass no timer:
    events inside a graph do not time its replays).
    """
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    if mode == "train" and optimizer is None:
        raise ValueError("optimizer: mode 'train' needs an optimizer")
    device = inputs.device
    ann = annotator or Annotator()
    clock = timer
    cache = not graph_safe

    def forward_loss() -> torch.Tensor:
        with autocast_context(precision, device, cache_enabled=cache):
            if loss_fn is None:
                return model(inputs, targets)  # 0-dim: the model's own (fused) loss
            logits = model(inputs)  # (B, T, V)
            flat = logits.reshape(-1, logits.shape[-1])  # (B*T, V)
            return loss_fn(flat, targets.reshape(-1))  # targets (B*T,)

    def step() -> None:
        with ann.range("step"):
            if clock is not None:
                clock.start()
            if mode == "forward":
                with (
                    ann.range("forward"),
                    torch.no_grad(),
                    autocast_context(precision, device, cache_enabled=cache),
                ):
                    if loss_fn is None:
                        model(inputs, targets)
                    else:
                        model(inputs)
                if clock is not None:
                    clock.mark("forward")
            else:
                for p in model.parameters():
                    p.grad = None
                with ann.range("forward"):
                    loss = forward_loss()
                if clock is not None:
                    clock.mark("forward")
                with ann.range("backward"):
                    loss.backward()
                if clock is not None:
                    clock.mark("backward")
                if sync is not None:
                    with ann.range("sync"):
                        sync()
                    if clock is not None:
                        clock.mark("sync")
                if mode == "train":
                    assert optimizer is not None
                    with ann.range("optimizer"):
                        optimizer.step()
                    if clock is not None:
                        clock.mark("optimizer")
            if clock is not None:
                clock.finish()

    return step
