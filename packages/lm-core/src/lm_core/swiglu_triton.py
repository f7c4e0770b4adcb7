"""Triton kernels of the SwiGLU activation on the fused w13 output (`lm_core.swiglu`).

h is (rows, 2F): gate = h[:, :F], up = h[:, F:]. Forward y = silu(gate) * up; backward
writes both halves of dh from one read of gate, up and dy:
    dgate = dy * up * s * (1 + gate * (1 - s)),  s = sigmoid(gate)
    dup   = dy * gate * s
all in float32 whatever the storage dtype. Why not inductor's kernel: the backward of
`chunk` is a concatenation, which it writes element by element from masked loads of both
halves' inputs, reading gate and dy twice (53.7 us per xl layer on an H200, ~2.4 TB/s).

This module imports triton at the top; `lm_core.swiglu` imports it lazily. Under
TRITON_INTERPRET=1 (set before the first import) the kernels run on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lm_core._triton_util import is_interpreted

BLOCK = 1024  # columns per program (8 bf16 values per thread at 4 warps)
INTERPRETER_BLOCK = 64  # small tiles keep the interpreter's temporaries small


# The kernels repeat their loads instead of sharing a @triton.jit helper: torch 2.11's
# analysis of user kernels under torch.compile took the helper's pointer argument as
# written, and inductor then copied the saved w13 output (52 MB per xl layer) before each
# backward launch.


@triton.jit
def swiglu_fwd_kernel(H, Y, n_ff, stride_h, stride_y, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_ff
    h_row = H + row * stride_h
    gate = tl.load(h_row + cols, mask=mask).to(tl.float32)
    up = tl.load(h_row + n_ff + cols, mask=mask).to(tl.float32)
    y = gate * tl.sigmoid(gate) * up
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_bwd_kernel(H, DY, DH, n_ff, stride_h, stride_dy, stride_dh, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_ff
    h_row = H + row * stride_h
    gate = tl.load(h_row + cols, mask=mask).to(tl.float32)
    up = tl.load(h_row + n_ff + cols, mask=mask).to(tl.float32)
    dy = tl.load(DY + row * stride_dy + cols, mask=mask).to(tl.float32)
    s = tl.sigmoid(gate)
    silu = gate * s
    dgate = dy * up * (s + silu * (1.0 - s))
    dup = dy * silu
    dh_row = DH + row * stride_dh
    tl.store(dh_row + cols, dgate.to(DH.dtype.element_ty), mask=mask)
    tl.store(dh_row + n_ff + cols, dup.to(DH.dtype.element_ty), mask=mask)


# Decided once: the kernels are plain or interpreted for the life of the process.
INTERPRETED = is_interpreted(swiglu_fwd_kernel)
_BLOCK = INTERPRETER_BLOCK if INTERPRETED else BLOCK


def forward(h: torch.Tensor) -> torch.Tensor:
    """y (rows, F) of a (rows, 2F) h with a unit last stride."""
    rows, n_ff = h.shape[0], h.shape[1] // 2
    y = torch.empty(rows, n_ff, dtype=h.dtype, device=h.device)
    if y.numel():
        swiglu_fwd_kernel[(rows, triton.cdiv(n_ff, _BLOCK))](
            h, y, n_ff, h.stride(0), y.stride(0), BLOCK=_BLOCK, num_warps=4
        )
    return y


def backward(h: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """dh (rows, 2F) of h (rows, 2F) and dy (rows, F), both with a unit last stride."""
    rows, n_ff = dy.shape
    dh = torch.empty(rows, 2 * n_ff, dtype=h.dtype, device=h.device)
    if dh.numel():
        swiglu_bwd_kernel[(rows, triton.cdiv(n_ff, _BLOCK))](
            h, dy, dh, n_ff, h.stride(0), dy.stride(0), dh.stride(0), BLOCK=_BLOCK, num_warps=4
        )
    return dh
