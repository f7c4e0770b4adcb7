"""Helpers shared by lm_core's Triton modules (imported only by them: needs triton)."""

from __future__ import annotations


def is_interpreted(kernel) -> bool:
    """True when `kernel` (a `triton.jit` function) was built for Triton's CPU interpreter,
    i.e. TRITON_INTERPRET=1 was set before its module was first imported."""
    try:
        import triton.runtime.interpreter as interp
    except ImportError:  # the interpreter's numpy missing
        return False
    return isinstance(kernel, interp.InterpretedFunction)
