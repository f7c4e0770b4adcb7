"""Triton kernel of the fused LM-head cross-entropy: the per-chunk softmax step.

`lm_core.fused_loss` computes a chunk of logits (C, V) with one matmul and hands it here; one
program per row then
  1. streams the row in tiles of BLOCK_V with an online max / sum-of-exp (fp32) -> lse,
     loss = lse - logit[target] (0 for ignored rows, NaN for a target outside [0, V)),
  2. (COMPUTE_GRAD) streams it again and overwrites the logits in place with the loss gradient
     (softmax - onehot(target)) * scale, where scale = 1 / (number of non-ignored rows) is read
     from a device scalar (no host sync), 0 for ignored rows.
So the chunk buffer holds logits on entry and dlogits on exit: no second (C, V) buffer.

This module imports triton at the top; `lm_core.fused_loss` imports it lazily, at the first
call that runs the Triton backend, so lm_core itself does not depend on triton.
TRITON_INTERPRET=1 must be set before that first call to run on CPU (Triton's interpreter).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from lm_core._triton_util import is_interpreted

MAX_BLOCK_V = 4096  # vocab tile of a GPU launch (fp32 registers: 16 per thread at 8 warps)
INTERPRETER_BLOCK_V = 1024  # smaller tiles keep numpy's temporaries small in the interpreter


@triton.jit
def ce_chunk_kernel(
    LOGITS,  # (C, V) logits in, dlogits out (COMPUTE_GRAD); unit stride along V
    TARGETS,  # (C,) integer ids
    LOSS,  # (C,) float32 out: per-row loss
    LSE,  # (C,) float32 out: per-row log-sum-exp
    SCALE,  # () float32: gradient scale, 1 / number of non-ignored rows
    stride_row,
    n_vocab,
    ignore_index,
    COMPUTE_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    base = LOGITS + row.to(tl.int64) * stride_row
    offs = tl.arange(0, BLOCK_V)
    target = tl.load(TARGETS + row).to(tl.int64)
    ignored = target == ignore_index
    in_range = (target >= 0) & (target < n_vocab)

    # pass 1: online log-sum-exp over vocab tiles; every tile holds >= 1 real column, so the
    # running max is finite after the first tile (exp(-inf - m) = 0 discards the start value)
    m = -float("inf")
    s = 0.0
    for start in range(0, n_vocab, BLOCK_V):
        cols = start + offs
        x = tl.load(base + cols, mask=cols < n_vocab, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)
    x_target = tl.load(base + target, mask=in_range, other=0.0).to(tl.float32)
    loss = tl.where(in_range, lse - x_target, float("nan"))
    loss = tl.where(ignored, 0.0, loss)
    tl.store(LOSS + row, loss)
    tl.store(LSE + row, lse)

    if COMPUTE_GRAD:
        # pass 2: dlogits = (softmax - onehot) * scale, written over the logits
        scale = tl.load(SCALE)
        scale = tl.where(ignored, 0.0, tl.where(in_range, scale, float("nan")))
        for start in range(0, n_vocab, BLOCK_V):
            cols = start + offs
            mask = cols < n_vocab
            x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
            p = tl.exp(x - lse)
            p = tl.where(cols == target, p - 1.0, p)
            tl.store(base + cols, (p * scale).to(LOGITS.dtype.element_ty), mask=mask)


def interpreting() -> bool:
    """True when the kernel was built for Triton's CPU interpreter (TRITON_INTERPRET=1 was set
    before this module was first imported)."""
    return is_interpreted(ce_chunk_kernel)


def _block_v(n_vocab: int, block_v: int | None) -> int:
    if block_v is not None:
        return block_v
    cap = INTERPRETER_BLOCK_V if interpreting() else MAX_BLOCK_V
    return min(triton.next_power_of_2(n_vocab), cap)


def ce_chunk(
    logits: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
    scale: torch.Tensor,
    compute_grad: bool,
    block_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss and log-sum-exp of a logits chunk; with `compute_grad` the chunk is
    overwritten with dloss/dlogits (same dtype).

    logits (C, V) fp16/bf16/fp32 with unit stride along V; targets (C,) integer; scale () fp32
    on the same device. Returns loss (C,) and lse (C,), both float32.
    """
    c, v = logits.shape
    loss = torch.empty(c, dtype=torch.float32, device=logits.device)
    lse = torch.empty(c, dtype=torch.float32, device=logits.device)
    if c == 0:
        return loss, lse
    if logits.stride(1) != 1:
        raise ValueError(f"logits: expected unit stride along the vocab dim, got {logits.stride()}")
    if logits.dtype == torch.bfloat16 and logits.device.type == "cpu" and interpreting():
        # numpy (the interpreter's engine) has no bfloat16: run on a float32 copy
        work = logits.float()
        loss, lse = ce_chunk(work, targets, ignore_index, scale, compute_grad, block_v)
        if compute_grad:
            logits.copy_(work)
        return loss, lse
    block = _block_v(v, block_v)
    if block < 16 or block & (block - 1):
        raise ValueError(f"block_v: expected a power of two >= 16, got {block}")
    guard = torch.cuda.device(logits.device) if logits.is_cuda else contextlib.nullcontext()
    with guard:
        ce_chunk_kernel[(c,)](
            logits, targets, loss, lse, scale, logits.stride(0), v, ignore_index,
            COMPUTE_GRAD=compute_grad, BLOCK_V=block, num_warps=8 if block >= 2048 else 4,
        )  # fmt: skip
    return loss, lse
