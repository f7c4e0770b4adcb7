"""Linear layers with a selectable float32 matmul: torch's, or the 3xTF32 Triton kernels.

In float32 a linear layer's products dominate a train step, and strict IEEE float32 GEMMs run
on the H100's FMA units (~67 TFLOP/s peak). TF32 tensor cores are ~7x faster but keep 10
mantissa bits (~1e-3 relative error). "3xTF32" keeps float32 accuracy on the tensor cores:
each operand is split into TF32 hi + lo parts and a @ b = a_lo b_hi + a_hi b_lo + a_hi b_hi
(see `lm_core.tf32x3_triton`); measured against a float64 product it is as accurate as
cuBLAS's SGEMM or better.

Backends (`ModelConfig.matmul`, `Linear.matmul`):
- ``"default"``: `torch.nn.functional.linear` (cuBLAS; strict float32 unless the user
  allows TF32 through `torch.backends.cuda.matmul.allow_tf32`).
- ``"tf32x3"``: float32 inputs outside autocast go through `tf32x3_mm`: under torch.compile
  the custom op `lm_core::tf32x3_mm` (one graph node with its own backward), in eager mode an
  autograd.Function (less host time per call); anything else (bf16, autocast) falls back to
  ``"default"``. On a CPU the product is a plain float32 matmul, unless Triton's interpreter
  is on (tests).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from lm_core.config import MATMUL_BACKENDS

__all__ = ["MATMUL_BACKENDS", "Linear", "tf32x3_mm"]


def _kernels():
    try:
        from lm_core import tf32x3_triton
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("matmul='tf32x3' needs triton (pip install 'lm-core[triton]')") from e
    return tf32x3_triton


def _runs_kernels(device: torch.device) -> bool:
    if device.type == "cuda":
        return True
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return _kernels().interpreting()
    return False


def _product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    for name, t in (("a", a), ("b", b)):
        if t.dtype != torch.float32 or t.dim() != 2:
            raise ValueError(
                f"tf32x3_mm: {name} must be a 2-D float32 tensor, got {t.dtype} {tuple(t.shape)}"
            )
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"tf32x3_mm: a {tuple(a.shape)} and b {tuple(b.shape)} do not chain")
    if a.device != b.device:
        raise ValueError(f"tf32x3_mm: a is on {a.device}, b on {b.device}")
    if _runs_kernels(a.device):
        return _kernels().mm(a, b)
    return (a @ b).contiguous()


def _mm_like(mm, x: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """left @ right by `mm`, laid out like x: computed as (right^T @ left^T)^T when x is a
    transposed (column-major) matrix, e.g. the gradient of a weight used as weight.t()."""
    if x.stride(0) == 1 and x.stride(1) != 1:
        return mm(right.t(), left.t()).t()
    return mm(left, right)


def _grads(mm, needs: tuple[bool, ...], a: torch.Tensor, b: torch.Tensor, grad: torch.Tensor):
    """(d a, d b) of a @ b for the output gradient `grad`, each product by `mm`."""
    grad_a = _mm_like(mm, a, grad, b.t()) if needs[0] else None
    grad_b = _mm_like(mm, b, a.t(), grad) if needs[1] else None
    return grad_a, grad_b


# Under torch.compile: a custom op, one opaque graph node with a fake (meta) implementation
# and its own backward, so the compiled graph has no break around the Triton launches.
@torch.library.custom_op("lm_core::tf32x3_mm", mutates_args=())
def _tf32x3_mm_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _product(a, b)


@_tf32x3_mm_op.register_fake
def _(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[1]))


def _op_setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _op_backward(ctx, grad: torch.Tensor):
    return _grads(_tf32x3_mm_op, ctx.needs_input_grad, *ctx.saved_tensors, grad)


_tf32x3_mm_op.register_autograd(_op_backward, setup_context=_op_setup_context)


# In eager mode: the same product through an autograd.Function, which costs far less host
# time per call than dispatching a custom op (the launches are already ~3 per product).
class _Tf32x3MM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return _product(a, b)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _grads(tf32x3_mm, ctx.needs_input_grad, *ctx.saved_tensors, grad)


def tf32x3_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a (M, K) @ b (K, N) for float32 a and b (any strides) with float32 accuracy on TF32
    tensor cores: a new contiguous (M, N) float32 tensor, differentiable in a and b."""
    if torch.compiler.is_compiling():
        return _tf32x3_mm_op(a, b)
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        return _Tf32x3MM.apply(a, b)
    return _product(a, b)


def _tf32x3_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.dtype == torch.float32
        and weight.dtype == torch.float32
        and not torch.is_autocast_enabled(x.device.type)
    )


class Linear(nn.Linear):
    """`nn.Linear` whose float32 product can run on the 3xTF32 kernels (`matmul="tf32x3"`).

    Same arguments, parameters, state-dict keys and init as `nn.Linear`; `matmul` may be
    changed at any time (`TransformerLM.set_matmul`)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 matmul: str = "default") -> None:  # fmt: skip
        super().__init__(in_features, out_features, bias=bias)
        self.matmul = check_matmul(matmul)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.matmul == "tf32x3" and _tf32x3_applies(x, self.weight):
            y = tf32x3_mm(x.reshape(-1, self.in_features), self.weight.t())
            y = y.view(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, matmul={self.matmul!r}"


def check_matmul(name: str) -> str:
    """`name` if it is a known matmul backend, else a ValueError naming the choices."""
    if name not in MATMUL_BACKENDS:
        raise ValueError(
            f"matmul: unknown backend {name!r}; expected one of {list(MATMUL_BACKENDS)}"
        )
    return name
