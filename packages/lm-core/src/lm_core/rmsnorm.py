"""RMSNorm over the last dimension, optionally fused with the residual add before it.

`rms_norm(x, weight, eps)` is x / sqrt(mean(x^2) + eps) * weight computed in float32 (float64
for float64 input), returned in `out_dtype` (default x's dtype). With `residual=r` it returns
(s, rms_norm(s)) for s = x + r, the sum in torch's promoted dtype: the pre-norm block's
"x = x + attn(...); h = norm(x)" in one call. `return_sum=True` without a residual returns
(x, rms_norm(x)), x passed through as a view, so that the gradient of x's later uses (the
block's residual stream) joins the norm's in the same backward kernel instead of an add.

On CUDA (float32 / float16 / bfloat16 rows of at most 4096, triton importable) two Triton
kernels (`lm_core.rmsnorm_triton`) do it: the forward writes s, y and one float per row; the
backward reads s, dy and s's incoming gradient once and writes s's gradient (and its copy in
the residual's dtype) with per-program partial sums of the weight's gradient. Elsewhere
(CPU, tensor subclasses such as DTensor, float64, wider rows) or with `backend="torch"`, the
plain ops; `backend="triton"` asks for the kernels (on CPU under Triton's interpreter,
TRITON_INTERPRET=1 set before the first call). Both compute the same math; the kernels round
only their outputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lm_core._triton_util import auto_gate, why_kernels_cannot_run

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# device type -> whether "auto" runs the Triton kernels; _triton_runs reads it
_RUNNABLE, _triton_runs = auto_gate("rmsnorm_triton")
_MAX_D = 4096  # rmsnorm_triton.MAX_D, repeated so that this module does not import triton
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # not subclasses such as DTensor


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The norm in plain ops: float32 math (float64 for float64 x), rounded to out_dtype."""
    compute = torch.promote_types(x.dtype, torch.float32)
    out = F.rms_norm(x.to(compute), (x.shape[-1],), weight.to(compute), eps)
    return out.to(x.dtype if out_dtype is None else out_dtype)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-5,
    *,
    residual: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    return_sum: bool = False,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """y = norm(x) of x (..., D) with weight (D,), in out_dtype (default x.dtype); with a
    residual (x's shape) or return_sum=True, (s, norm(s)) for s = x (+ residual). backend:
    "auto" (the kernels on CUDA where they run), "triton" or "torch"."""
    if x.dim() == 0:
        raise ValueError("x: expected at least one dimension (..., D), got a 0-d tensor")
    d = x.shape[-1]
    if weight.shape != (d,):
        raise ValueError(
            f"weight: expected shape ({d},) for x of shape {tuple(x.shape)}, got "
            f"{tuple(weight.shape)}"
        )
    if residual is not None and residual.shape != x.shape:
        raise ValueError(
            f"residual: expected x's shape {tuple(x.shape)}, got {tuple(residual.shape)}"
        )
    if backend == "torch":
        return _plain(x, weight, eps, residual, out_dtype, return_sum)
    tensors = (x, weight) if residual is None else (x, weight, residual)
    dtypes_ok = all(t.dtype in _DTYPES for t in tensors) and (
        out_dtype is None or out_dtype in _DTYPES
    )
    if backend == "auto":
        use = (
            all(type(t) in _PLAIN for t in tensors)
            and dtypes_ok
            and d <= _MAX_D
            and all(t.device == x.device for t in tensors)
            and _triton_runs(x.device.type)
        )
        if not use:
            return _plain(x, weight, eps, residual, out_dtype, return_sum)
        return _RMSNorm.apply(x, residual, weight, eps, out_dtype, return_sum)
    if backend != "triton":
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    if not dtypes_ok:
        raise TypeError(
            "backend='triton' takes float32, float16 or bfloat16 x, weight, residual and "
            f"out_dtype, got {[t.dtype for t in tensors]} and out_dtype={out_dtype}"
        )
    if d > _MAX_D:
        raise ValueError(f"x: backend='triton' normalizes rows of at most {_MAX_D}, got {d}")
    if any(t.device != x.device for t in tensors):
        raise ValueError(f"weight, residual: expected x's device {x.device}")
    why = why_kernels_cannot_run(x.device.type, "rmsnorm_triton")
    if why:
        raise RuntimeError(f"backend='triton': {why}")
    return _RMSNorm.apply(x, residual, weight, eps, out_dtype, return_sum)


def _plain(x, weight, eps, residual, out_dtype, return_sum):
    if residual is None:
        y = rms_norm_reference(x, weight, eps, out_dtype)
        return (x, y) if return_sum else y
    s = x + residual
    return s, rms_norm_reference(s, weight, eps, out_dtype)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t (..., D) as (rows, D) with a unit last stride (a view when it can be)."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _as(dtype, ds, ds2):
    """The gradient ds in dtype: ds itself, its copy ds2 when that has the dtype, or a cast."""
    if ds.dtype == dtype:
        return ds
    return ds2 if ds2 is not None and ds2.dtype == dtype else ds.to(dtype)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps, out_dtype, return_sum):
        from lm_core import rmsnorm_triton

        ctx.set_materialize_grads(False)
        sum_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
        out_dtype = sum_dtype if out_dtype is None else out_dtype
        x_rows = _rows(x)
        r_rows = None if residual is None else _rows(residual)
        s, y, rstd = rmsnorm_triton.forward(x_rows, r_rows, weight, eps, out_dtype, sum_dtype)
        ctx.save_for_backward(x_rows if s is None else s, weight, rstd)
        ctx.shape = x.shape
        ctx.dtypes = (x.dtype, None if residual is None else residual.dtype)
        y = y.view(x.shape)
        if s is not None:
            return s.view(x.shape), y
        return (x.view_as(x), y) if return_sum else y

    @staticmethod
    def backward(ctx, *grads):
        from lm_core import rmsnorm_triton

        s, weight, rstd = ctx.saved_tensors
        ds_in, dy = (None, grads[0]) if len(grads) == 1 else grads
        x_dtype, r_dtype = ctx.dtypes
        if dy is None and ds_in is None:
            return None, None, None, None, None, None
        if dy is None:  # only s was used: its gradient passes through the add
            ds, ds2, dw = ds_in.reshape(s.shape), None, None
        else:
            # the kernel also writes ds in the dtype of x or of the residual, whichever is not
            # the sum's (the model's bf16 attention branch)
            other = [t for t in (x_dtype, r_dtype) if t is not None and t != s.dtype]
            ds, ds2, dw = rmsnorm_triton.backward(
                s, weight, rstd, _rows(dy), None if ds_in is None else _rows(ds_in),
                other[-1] if other else None,
            )  # fmt: skip
            dw = dw.to(weight.dtype)
        dx = _as(x_dtype, ds, ds2).view(ctx.shape)
        dr = None if r_dtype is None else _as(r_dtype, ds, ds2).view(ctx.shape)
        return dx, dr, dw, None, None, None
