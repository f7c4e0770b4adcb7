"""Named ranges for profilers, off by default.

`annotate(name)` is a context manager. While annotations are off (the default) it returns a
shared `contextlib.nullcontext`, so eager code pays one global read and a compiled graph holds
nothing. After `set_annotations(True)` it opens `torch.profiler.record_function(name)`, which
shows up in the PyTorch profiler and, under `torch.autograd.profiler.emit_nvtx()`, as an NVTX
range in Nsight Systems. Turn it on before building/compiling what should carry the ranges
(torch.compile guards on the flag and recompiles when it flips).

The model annotates "attention" and "ffn" in each block and, in the naive attention backend,
"attention/scores", "attention/softmax" and "attention/weighted_sum".
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager

import torch

_ENABLED = False
_NULL = contextlib.nullcontext()


def set_annotations(enabled: bool) -> None:
    """Turn profiler ranges from `annotate` on or off (process-wide)."""
    global _ENABLED
    if not isinstance(enabled, bool):
        raise TypeError(f"set_annotations: enabled must be a bool, got {enabled!r}")
    _ENABLED = enabled


def annotations_enabled() -> bool:
    """Whether `annotate` currently emits profiler ranges."""
    return _ENABLED


def annotate(name: str) -> AbstractContextManager[object]:
    """A profiler range called `name` when annotations are on, else a no-op context."""
    if _ENABLED:
        return torch.profiler.record_function(name)
    return _NULL
