"""Triton kernel of AdamW with bf16 moments and fp32 master weights (`AdamW(state_dtype=
torch.bfloat16)` on CUDA).

One program per BLOCK elements of one parameter tensor reads the fp32 parameter and gradient
and the two bf16 moments, does the whole update in fp32 registers (the same math as
`lm_core.optim.AdamW`'s foreach update), and writes the parameter and the moments rounded back
to bf16: 12 bytes read and 8 written per parameter, where the fp32 fused update moves 16 + 12.
The moments are passed as int16 views of their bf16 storage and converted with bit operations
(bf16 is the top half of an fp32), which is exact, runs the same in Triton's CPU interpreter
(numpy has no bfloat16) and fixes the rounding to what `lm_core.optim_lowp` does in PyTorch:

- nearest: round half to even, as `Tensor.to(torch.bfloat16)`; NaN -> 0x7FC0;
- stochastic: add 16 random bits below the bf16 mantissa, then truncate (rounds up with the
  probability of the dropped fraction, so the stored moment is unbiased). The bits are
  `hash32(i ^ hash32(2 * step + k))` for element i (k = 0: exp_avg, 1: exp_avg_sq): no RNG
  state, the same bits in PyTorch (`optim_lowp.stochastic_bits`), and a resumed run draws
  what an uninterrupted one would.

The step count and (optionally) the learning rate are read from device memory, so a CUDA graph
captures one launch per tensor that serves every step of the schedule. Bias corrections are
fp32 (`exp2(step * log2(beta))`), as in torch's fused AdamW kernel.

This module imports triton at the top; `lm_core.optim_lowp` imports it lazily.
"""

from __future__ import annotations

import contextlib
import math

import torch
import triton
import triton.language as tl

from lm_core._triton_util import is_interpreted

BLOCK = 1024  # elements per program: 8 per thread at 4 warps (memory-bound, no reuse)


@triton.jit
def _hash32(x):
    # "lowbias32" (uint32 -> uint32, a bijection); mirrored in optim_lowp.hash32
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    x = x ^ (x >> 16)
    return x


@triton.jit
def _bf16_bits_to_f32(bits):
    # int16 storage of bf16 -> fp32 (exact: bf16 is the high half of an fp32)
    return (bits.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _f32_to_bf16_bits(x, idx, key, STOCHASTIC: tl.constexpr):
    u = x.to(tl.uint32, bitcast=True)
    if STOCHASTIC:
        u = u + (_hash32(idx ^ key) & 0xFFFF)
    else:
        u = u + 0x7FFF + ((u >> 16) & 1)  # round half to even
    out = tl.where(x != x, 0x7FC0, u >> 16)  # NaN: torch's canonical bf16 NaN
    return out.to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def adamw_update(p, g, m, v, step, lr, beta1, beta2, log2_beta1, log2_beta2, eps, weight_decay):
    """One AdamW update in fp32 -> (p, m, v): the foreach update's ops in its order (decay,
    lerp, v * beta2 + (1 - beta2) g^2, the bias-corrected step), so results match it bitwise.
    Shared by both kernels below."""
    p = p * (1.0 - lr * weight_decay)
    w = 1.0 - beta1
    m = tl.where(w < 0.5, m + w * (g - m), g - (g - m) * (1.0 - w))  # torch.lerp's two forms
    v = v * beta2
    v = v + (1.0 - beta2) * g * g
    bias1 = 1.0 - tl.exp2(step * log2_beta1)
    bias2_sqrt = tl.sqrt(1.0 - tl.exp2(step * log2_beta2))
    denom = tl.sqrt(v) / bias2_sqrt + eps
    p = p + (-lr / bias1) * (m / denom)
    return p, m, v


@triton.jit
def adamw_bf16_state_kernel(
    P,  # (n,) float32 parameter, updated in place
    G,  # (n,) gradient (any float dtype; read as fp32)
    M,  # (n,) int16 view of the bf16 exp_avg, updated in place
    V,  # (n,) int16 view of the bf16 exp_avg_sq, updated in place
    STEP,  # () float32: this step's count (already advanced)
    LR,  # () float32 learning rate when LR_ON_DEVICE, else unused
    lr,  # float learning rate when not LR_ON_DEVICE
    beta1,
    beta2,
    log2_beta1,  # log2(beta1) (-inf for beta1 = 0)
    log2_beta2,
    eps,
    weight_decay,
    n,
    LR_ON_DEVICE: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    step = tl.load(STEP)
    if LR_ON_DEVICE:
        lr = tl.load(LR).to(tl.float32)
    p = tl.load(P + offs, mask=mask, other=0.0)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    m = _bf16_bits_to_f32(tl.load(M + offs, mask=mask, other=0))
    v = _bf16_bits_to_f32(tl.load(V + offs, mask=mask, other=0))

    p, m, v = adamw_update(
        p, g, m, v, step, lr, beta1, beta2, log2_beta1, log2_beta2, eps, weight_decay
    )
    tl.store(P + offs, p, mask=mask)

    t = step.to(tl.uint32)
    idx = offs.to(tl.uint32)  # the low 32 bits of the element index
    key_m = _hash32(t * 2)
    key_v = _hash32(t * 2 + 1)
    tl.store(M + offs, _f32_to_bf16_bits(m, idx, key_m, STOCHASTIC), mask=mask)
    tl.store(V + offs, _f32_to_bf16_bits(v, idx, key_v, STOCHASTIC), mask=mask)


@triton.jit
def adamw_master_kernel(
    W,  # (n,) int16 view of the bf16 parameter: written as the new master rounded to nearest
    P,  # (n,) float32 master weight, updated in place
    G,  # (n,) int16 view of the bf16 gradient
    M,  # (n,) exp_avg, updated in place: float32, or the int16 view of bf16 (MOMENTS_BF16)
    V,  # (n,) exp_avg_sq, likewise
    STEP,
    LR,
    GS,  # () float32 gradient scale (clipping) when HAS_GS
    lr,
    beta1,
    beta2,
    log2_beta1,
    log2_beta2,
    eps,
    weight_decay,
    n,
    LR_ON_DEVICE: tl.constexpr,
    HAS_GS: tl.constexpr,
    MOMENTS_BF16: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The update of `adamw_bf16_state_kernel` on an fp32 master of a bf16 parameter: reads
    the bf16 gradient (2 bytes), the master and the moments; writes them and the bf16
    parameter (2 bytes). With fp32 moments: 14 bytes read and 14 written per parameter.
    HAS_GS: the gradient is multiplied by the scale at GS in fp32 first (clipping, as fp32
    gradients are scaled), so the bf16 gradient is never rounded again."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    step = tl.load(STEP)
    if LR_ON_DEVICE:
        lr = tl.load(LR).to(tl.float32)
    p = tl.load(P + offs, mask=mask, other=0.0)
    g = _bf16_bits_to_f32(tl.load(G + offs, mask=mask, other=0))
    if HAS_GS:
        g = g * tl.load(GS)
    if MOMENTS_BF16:
        m = _bf16_bits_to_f32(tl.load(M + offs, mask=mask, other=0))
        v = _bf16_bits_to_f32(tl.load(V + offs, mask=mask, other=0))
    else:
        m = tl.load(M + offs, mask=mask, other=0.0)
        v = tl.load(V + offs, mask=mask, other=0.0)

    p, m, v = adamw_update(
        p, g, m, v, step, lr, beta1, beta2, log2_beta1, log2_beta2, eps, weight_decay
    )
    tl.store(P + offs, p, mask=mask)
    idx = offs.to(tl.uint32)
    tl.store(W + offs, _f32_to_bf16_bits(p, idx, 0, False), mask=mask)
    if MOMENTS_BF16:
        t = step.to(tl.uint32)
        tl.store(M + offs, _f32_to_bf16_bits(m, idx, _hash32(t * 2), STOCHASTIC), mask=mask)
        tl.store(V + offs, _f32_to_bf16_bits(v, idx, _hash32(t * 2 + 1), STOCHASTIC), mask=mask)
    else:
        tl.store(M + offs, m, mask=mask)
        tl.store(V + offs, v, mask=mask)


def interpreting() -> bool:
    """True when the kernel was built for Triton's CPU interpreter (TRITON_INTERPRET=1 was set
    before this module was first imported)."""
    return is_interpreted(adamw_bf16_state_kernel)


def _log2(beta: float) -> float:
    return math.log2(beta) if beta > 0 else float("-inf")


def _lr_args(lr: float | torch.Tensor, step: torch.Tensor) -> tuple[torch.Tensor, float, bool]:
    """(LR pointer, lr value, LR_ON_DEVICE) for a float or a 0-dim tensor learning rate: a
    tensor on the step's device is read there (CUDA graphs); a host tensor by its value."""
    if isinstance(lr, torch.Tensor) and lr.device != step.device:
        lr = float(lr)
    if isinstance(lr, torch.Tensor):
        return lr, 0.0, True
    return step, float(lr), False  # the pointer is unused when the lr is a float


def _device_guard(t: torch.Tensor) -> contextlib.AbstractContextManager:
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def adamw_bf16_state_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    *,
    lr: float | torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    stochastic: bool,
) -> None:
    """One AdamW update of one tensor in place (module docstring): `param` fp32, `grad` of
    the parameter's shape, `exp_avg` / `exp_avg_sq` bf16, all contiguous on one device;
    `step` a 0-dim float32 tensor there holding this step's count (already advanced); `lr` a
    float or a 0-dim tensor on the device."""
    n = param.numel()
    for name, t in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.shape != param.shape or t.device != param.device:
            raise ValueError(f"{name}: expected the parameter's shape and device")
    if param.dtype != torch.float32 or exp_avg.dtype != torch.bfloat16:
        raise TypeError("the bf16-state kernel takes a float32 parameter and bf16 moments")
    if not all(t.is_contiguous() for t in (param, grad, exp_avg, exp_avg_sq)):
        raise ValueError("the bf16-state kernel takes contiguous tensors")
    if n == 0:
        return
    lr_ptr, lr_value, lr_on_device = _lr_args(lr, step)
    with _device_guard(param):
        adamw_bf16_state_kernel[(triton.cdiv(n, BLOCK),)](
            param, grad, exp_avg.view(torch.int16), exp_avg_sq.view(torch.int16), step, lr_ptr,
            lr_value, beta1, beta2, _log2(beta1), _log2(beta2), eps,
            weight_decay, n, LR_ON_DEVICE=lr_on_device, STOCHASTIC=stochastic, BLOCK=BLOCK,
            num_warps=4,
        )  # fmt: skip


def adamw_master_step(
    param: torch.Tensor,
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    *,
    lr: float | torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    stochastic: bool,
    grad_scale: torch.Tensor | None = None,
) -> None:
    """One AdamW update of an fp32 `master` from the bf16 `grad` of the bf16 `param`, which
    is then set to the new master rounded to nearest (`lm_core.lowp_weights`). Moments fp32
    or bf16 (rounded as `stochastic` says); all contiguous, one shape, one device; `step` and
    `lr` as for `adamw_bf16_state_step`; `grad_scale` a 0-dim fp32 tensor there (clipping)
    that multiplies the gradient in fp32."""
    n = master.numel()
    for name, t in (
        ("param", param),
        ("grad", grad),
        ("exp_avg", exp_avg),
        ("exp_avg_sq", exp_avg_sq),
    ):
        if t.shape != master.shape or t.device != master.device:
            raise ValueError(f"{name}: expected the master weight's shape and device")
    if param.dtype != torch.bfloat16 or grad.dtype != torch.bfloat16:
        raise TypeError("the master-weight kernel takes a bf16 parameter and gradient")
    if master.dtype != torch.float32 or exp_avg.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError("the master-weight kernel takes an fp32 master and fp32 or bf16 moments")
    tensors = (param, master, grad, exp_avg, exp_avg_sq)
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError("the master-weight kernel takes contiguous tensors")
    if n == 0:
        return
    lr_ptr, lr_value, lr_on_device = _lr_args(lr, step)
    moments_bf16 = exp_avg.dtype == torch.bfloat16
    m, v = (t.view(torch.int16) if moments_bf16 else t for t in (exp_avg, exp_avg_sq))
    has_gs = grad_scale is not None
    if has_gs and (grad_scale.device != master.device or grad_scale.dtype != torch.float32):
        raise ValueError("grad_scale: expected a float32 tensor on the master weight's device")
    with _device_guard(master):
        adamw_master_kernel[(triton.cdiv(n, BLOCK),)](
            param.view(torch.int16), master, grad.view(torch.int16), m, v, step, lr_ptr,
            grad_scale if has_gs else step, lr_value, beta1, beta2, _log2(beta1), _log2(beta2), eps,
            weight_decay, n, LR_ON_DEVICE=lr_on_device, HAS_GS=has_gs, MOMENTS_BF16=moments_bf16,
            STOCHASTIC=stochastic, BLOCK=BLOCK, num_warps=4,
        )  # fmt: skip
