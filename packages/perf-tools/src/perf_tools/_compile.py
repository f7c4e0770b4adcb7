"""torch.compile for benchmarks: enough recompiles that no configuration silently runs eager.

Dynamo keys its cache on a function's code object; a sweep compiles the same code (a model's
forward, an attention function) for many shapes, dtypes and grad modes. Past the recompile
limit (8 by default) Dynamo quietly falls back to eager, and the "compiled" column would lie.
`compiled_launch_options` are the flashattn-triton settings compiled rows record beside it;
`ready_cpp_launch` readies its C++ launch path before a timed run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

RECOMPILE_LIMIT = 256


def allow_recompiles(limit: int = RECOMPILE_LIMIT) -> None:
    """Raise Dynamo's per-code-object recompile limit to at least `limit` (both spellings)."""
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name) and getattr(cfg, name) < limit:
            setattr(cfg, name, limit)
    for name in ("accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(cfg, name) and getattr(cfg, name) < 4 * limit:
            setattr(cfg, name, 4 * limit)


def compile_for_bench(fn: Callable[..., Any], **kwargs: Any) -> Callable[..., Any]:
    """`torch.compile(fn, dynamic=False, **kwargs)` after `allow_recompiles()`."""
    allow_recompiles()
    kwargs.setdefault("dynamic", False)
    return torch.compile(fn, **kwargs)


def compiled_launch_options() -> dict[str, bool | str]:
    """flashattn_triton's options that decide how compiled graphs call its kernels:
    ``traced_compile`` (traced launchers) and ``cpp_launch_compiled`` (the opaque ops
    replayed from C++); empty where it is not installed. Compiled benchmark rows record them."""
    try:
        from flashattn_triton import get_options
    except ImportError:
        return {}
    opts = get_options()
    return {"traced_compile": opts.traced_compile, "cpp_launch_compiled": opts.cpp_launch_compiled}


_CPP_NOTED: set[str] = set()


def cpp_launch_counters() -> dict[str, int]:
    """flashattn_triton's C++ replay counters (``forward``, ``backward``,
    ``backward_fallback``; empty where it is not installed): the difference of two readings
    says which calls in between replayed from C++ and which backward went to Python."""
    try:
        from flashattn_triton import cpp_launch_counters as counters
    except ImportError:
        return {}
    return counters()


def cpp_replays_per_step(before: dict[str, int], steps: int) -> str | None:
    """ "forward/backward/backward_fallback" C++ replays per step since the ``before``
    reading (``cpp_launch_counters``), e.g. "12/12/0" for a small model's step whose 12
    attention calls all replayed; None without a reading."""
    after = cpp_launch_counters()
    if not before or not after or steps <= 0:
        return None
    return "/".join(f"{(after[n] - before[n]) / steps:g}" for n in after)


def cpp_launch_status() -> str | None:
    """flashattn_triton's C++ launch path status (``ready``, ``off``, ``failed: ...``; None
    where it is not installed). Eager benchmark rows with its attention record it."""
    try:
        from flashattn_triton import cpp_launch_status as status
    except ImportError:
        return None
    return status()


def ready_cpp_launch() -> str | None:
    """Build (or load) flashattn_triton's C++ launch path now, so that warm-up and timed steps
    all use it (by default it compiles in the background and the first steps would take the
    Python path); its status ('ready', 'off', 'failed: ...'), None where flashattn_triton is
    not installed or no GPU is present. A failure is printed once and the run goes on."""
    try:
        import flashattn_triton
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    if flashattn_triton.cpp_launch_status() in ("not built", "building"):
        with contextlib.suppress(RuntimeError):  # reported below, through the status
            flashattn_triton.build_cpp_launch()
    status = flashattn_triton.cpp_launch_status()
    if status.startswith("failed") and status not in _CPP_NOTED:
        _CPP_NOTED.add(status)
        print(f"note: flashattn_triton's C++ launch path is not used ({status})", flush=True)
    return status
