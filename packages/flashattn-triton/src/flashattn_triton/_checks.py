"""Input validation shared by every entry point: clear errors before any kernel runs.

Each check names the argument and the value expected, so that a wrong call fails in Python
with a readable message instead of inside a kernel launch.
"""

from __future__ import annotations

import math

import torch

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 128


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> None:
    """Check ranks, dtypes, devices and shapes of q (..., Nq, d), k and v (..., Nk, d)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() < 2:
            raise ValueError(
                f"{name} must have shape (..., seq, head_dim) with at least 2 dims, "
                f"got shape {tuple(t.shape)}"
            )
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if not q.dim() == k.dim() == v.dim():
        raise ValueError(
            f"q, k, v must have the same number of dims, got q {q.dim()}, k {k.dim()}, v {v.dim()}"
        )
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(
            f"q, k, v must be on one device, got q {q.device}, k {k.device}, v {v.device}"
        )
    if k.shape[:-2] != q.shape[:-2] or v.shape[:-2] != q.shape[:-2]:
        raise ValueError(
            "q, k, v must have the same leading (batch, heads) dims, got "
            f"q {tuple(q.shape[:-2])}, k {tuple(k.shape[:-2])}, v {tuple(v.shape[:-2])}"
        )
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"k and v must have the same sequence length, got k {k.shape[-2]}, v {v.shape[-2]}"
        )
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"k head_dim must equal q head_dim {q.shape[-1]}, got k head_dim {k.shape[-1]}"
        )
    if v.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"v head_dim must equal q head_dim {q.shape[-1]}, got v head_dim {v.shape[-1]}"
        )
    if q.shape[-1] < 1:
        raise ValueError(f"head_dim must be at least 1, got {q.shape[-1]}")


def resolve_scale(softmax_scale: float | None, head_dim: int) -> float:
    """Return the softmax scale: 1/sqrt(head_dim) when None, else a checked positive float."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(
            f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}"
        )
    scale = float(softmax_scale)
    if not (math.isfinite(scale) and scale > 0.0):
        raise ValueError(f"softmax_scale must be a finite positive float, got {softmax_scale}")
    return scale


def check_triton_dtype_and_dim(q: torch.Tensor) -> None:
    """The Triton kernels take fp16/bf16/fp32 and head_dim <= 128."""
    if q.dtype not in TRITON_DTYPES:
        raise TypeError(
            f"the Triton backend takes q, k, v in float16, bfloat16 or float32, got {q.dtype}; "
            "use backend='torch' for other floating dtypes"
        )
    if q.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(
            f"the Triton backend supports head_dim 1..{MAX_HEAD_DIM}, got head_dim {q.shape[-1]}; "
            "use backend='torch' for larger heads"
        )
