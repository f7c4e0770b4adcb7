"""The SwiGLU activation (`lm_core.swiglu`): the Triton kernels in Triton's interpreter against
a float64 reference, forward and dh, at awkward sizes (F not a multiple of a tile, one row,
strided inputs); the backend rules and errors."""

from __future__ import annotations

import os

import pytest
import torch

from lm_core.swiglu import _why_not, swiglu, swiglu_reference

INTERPRETER = pytest.mark.skipif(
    bool(_why_not("cpu")), reason="the kernels need TRITON_INTERPRET=1 and triton here"
)


def _reference(h: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h64 = h.detach().double().requires_grad_()
    y = swiglu_reference(h64)
    (dh,) = torch.autograd.grad(y, h64, dy.double())
    return y, dh


@INTERPRETER
@pytest.mark.parametrize("shape", [(3, 5, 2 * 70), (1, 2 * 1), (2, 1, 2 * 129)])
def test_kernels_match_float64(shape):
    gen = torch.Generator().manual_seed(sum(shape))
    h = (torch.randn(shape, generator=gen) * 3).requires_grad_()
    dy = torch.randn(*shape[:-1], shape[-1] // 2, generator=gen)
    y = swiglu(h, backend="triton")
    (dh,) = torch.autograd.grad(y, h, dy)
    y_ref, dh_ref = _reference(h, dy)
    assert y.shape == y_ref.shape
    assert dh.shape == h.shape
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dh.double(), dh_ref, rtol=1e-5, atol=1e-5)


@INTERPRETER
def test_kernels_take_strided_inputs():
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(4, 2 * 33, 3, generator=gen)
    h = base[..., 1].requires_grad_()  # last stride 3
    dy = torch.randn(4, 66, generator=gen)[:, ::2]  # (4, 33), last stride 2
    y = swiglu(h, backend="triton")
    (dh,) = torch.autograd.grad(y, h, dy)
    y_ref, dh_ref = _reference(h, dy)
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dh.double(), dh_ref, rtol=1e-5, atol=1e-5)


@INTERPRETER
def test_kernels_take_empty_inputs():
    h = torch.empty(0, 8, requires_grad=True)
    y = swiglu(h, backend="triton")
    assert y.shape == (0, 4)
    (dh,) = torch.autograd.grad(y.sum(), h)
    assert dh.shape == (0, 8)


def test_auto_keeps_cpu_on_torch():
    """On CPU "auto" is the plain expression even under the interpreter: model tests do not
    pay for interpreted kernels, and the result is the reference's bit for bit."""
    h = torch.randn(2, 3, 16)
    assert torch.equal(swiglu(h), swiglu_reference(h))
    assert torch.equal(swiglu(h, backend="torch"), swiglu_reference(h))


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="even last dimension"):
        swiglu(torch.randn(2, 5))
    with pytest.raises(ValueError, match="backend must be"):
        swiglu(torch.randn(2, 4), backend="cuda")
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        swiglu(torch.randn(2, 4, dtype=torch.float64), backend="triton")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="checks the refusal")
def test_triton_backend_on_cpu_needs_the_interpreter():
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        swiglu(torch.randn(2, 4), backend="triton")
