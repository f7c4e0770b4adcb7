"""The SwiGLU activation on the fused w13 output: silu(h[..., :F]) * h[..., F:].

`swiglu(h)` runs two Triton kernels (`lm_core.swiglu_triton`) on CUDA tensors of float32 /
float16 / bfloat16 when triton is importable; the backward writes both halves of dh in one
pass, where autograd through `chunk` concatenates them from two (the kernels' module says
what that costs). Elsewhere (CPU, no triton, other dtypes, tensor subclasses such as
DTensor) it is the plain expression; `backend="triton"` asks for the kernels (on CPU under
Triton's interpreter, TRITON_INTERPRET=1 set before the first call) and `"torch"` for the
expression. Both compute the same math; the kernels keep every intermediate in float32.
Under `torch.compile` the kernels are traced as user Triton kernels (no graph break).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lm_core._triton_util import auto_gate, why_kernels_cannot_run

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# device type -> whether "auto" runs the Triton kernels; _triton_runs reads it
_RUNNABLE, _triton_runs = auto_gate("swiglu_triton")


def swiglu_reference(h: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up with gate, up = h.chunk(2, -1), in plain torch ops."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu(h: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """(..., 2F) -> (..., F): silu of the first half times the second half. backend: "auto"
    (the kernels on CUDA where they run), "triton" or "torch"."""
    if h.dim() == 0 or h.shape[-1] % 2:
        raise ValueError(f"h: expected an even last dimension (gate, up), got {tuple(h.shape)}")
    if backend == "torch":
        return swiglu_reference(h)
    if backend == "auto":
        use = type(h) is torch.Tensor and h.dtype in _DTYPES and _triton_runs(h.device.type)
        return _SwiGLU.apply(h) if use else swiglu_reference(h)
    if backend != "triton":
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    if h.dtype not in _DTYPES:
        raise TypeError(f"backend='triton' takes float32, float16 or bfloat16, got {h.dtype}")
    why = _why_not(h.device.type)
    if why:
        raise RuntimeError(f"backend='triton': {why}")
    return _SwiGLU.apply(h)


def _why_not(device_type: str) -> str:
    """Why the kernels cannot run on this device type here ("" if they can)."""
    return why_kernels_cannot_run(device_type, "swiglu_triton")


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor) -> torch.Tensor:
        from lm_core import swiglu_triton

        rows = h.reshape(-1, h.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        ctx.save_for_backward(rows)
        ctx.shape = h.shape
        return swiglu_triton.forward(rows).view(*h.shape[:-1], h.shape[-1] // 2)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> torch.Tensor:
        from lm_core import swiglu_triton

        (rows,) = ctx.saved_tensors
        dy_rows = dy.reshape(-1, dy.shape[-1])
        if dy_rows.stride(-1) != 1:
            dy_rows = dy_rows.contiguous()
        return swiglu_triton.backward(rows, dy_rows).view(ctx.shape)
