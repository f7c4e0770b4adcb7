"""Helpers shared by lm_core's Triton modules and their dispatchers. Nothing here imports
triton at import time: the dispatchers (`lm_core.swiglu`, `lm_core.qkv_rope`,
`lm_core.rmsnorm`) import this module on every machine."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable

import torch


def is_interpreted(kernel) -> bool:
    """True when `kernel` (a `triton.jit` function) was built for Triton's CPU interpreter,
    i.e. TRITON_INTERPRET=1 was set before its module was first imported."""
    try:
        import triton.runtime.interpreter as interp
    except ImportError:  # the interpreter's numpy missing
        return False
    return isinstance(kernel, interp.InterpretedFunction)


def why_kernels_cannot_run(device_type: str, module: str) -> str:
    """Why the Triton kernels of `lm_core.<module>` (a module exposing INTERPRETED) cannot
    run on this device type here; "" if they can: CUDA with triton importable, or CPU under
    Triton's interpreter (TRITON_INTERPRET=1 set before that module's first import)."""
    if device_type not in ("cuda", "cpu"):
        return f"the kernels run on CUDA (or CPU in Triton's interpreter), not {device_type}"
    if device_type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return "CPU tensors need TRITON_INTERPRET=1 set before the first call"
    try:
        kernels = importlib.import_module(f"lm_core.{module}")
    except ImportError as exc:
        return f"triton is not importable ({exc})"
    if device_type == "cpu" and not kernels.INTERPRETED:
        return f"TRITON_INTERPRET=1 was set after lm_core.{module} was imported"
    return ""


def auto_gate(module: str) -> tuple[dict[str, bool], Callable[[str], bool]]:
    """(cache, runs) for a dispatcher's "auto" backend: runs(device_type) says whether the
    kernels of `lm_core.<module>` run there (CUDA only, `why_kernels_cannot_run` empty),
    checked once per device type into cache (tests and A/B scripts may set its entries).
    `runs` is a constant to torch.compile, so compiled graphs do not re-check it."""
    cache: dict[str, bool] = {}

    @torch.compiler.assume_constant_result
    def runs(device_type: str) -> bool:
        if device_type not in cache:
            cache[device_type] = device_type == "cuda" and not why_kernels_cannot_run(
                device_type, module
            )
        return cache[device_type]

    return cache, runs
