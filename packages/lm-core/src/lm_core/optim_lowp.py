"""AdamW moments stored in bfloat16 beside fp32 master weights: `AdamW(state_dtype=
torch.bfloat16)`, an opt-in that changes numerics (the default stays fp32 states).

Why: the fp32 AdamW update is memory-bound. Per fp32 parameter it reads the parameter, its
gradient and both moments (16 bytes) and writes the parameter and both moments (12 bytes): 28
bytes. With bf16 moments it reads 4 + 4 + 2 + 2 and writes 4 + 2 + 2: 20 bytes (-29%), and the
optimizer state takes 4 bytes per parameter instead of 8 (xl, 2.0 B parameters: 8 GB less).
Only a kernel that reads the bf16 moments and writes them back in one pass saves that traffic:

- CUDA (and triton installed): `lm_core.adamw_triton`, one launch per parameter tensor, the
  whole update in fp32 registers. Step counts and a tensor learning rate are read on the
  device, so the update can be captured in a CUDA graph.
- elsewhere (CPU; `fused=False`): the same math in PyTorch ops on fp32 copies of the moments,
  rounded back into them (`round_into`). It saves the memory, not the traffic: the reference
  the kernel is tested against, and what a CPU trains with.
torch's fused AdamW takes no other state dtype than the parameters' (its CPU kernel raises
"expected scalar type Float but found BFloat16"; CUDA builds differ by version), so it is not
used here.

Rounding the new moments to bf16 (8 significant bits) loses an update smaller than half a bf16
ulp (2^-9 relative): with beta2 = 0.999 the decay `v * 0.999` alone always rounds back to `v`,
so round-to-nearest freezes the second moment. `rounding="stochastic"` (the default) rounds up
with the probability of the dropped fraction, so the stored moments are unbiased and such
updates survive on average; `"nearest"` rounds half to even (deterministic, as `.to(bf16)`).
The random bits are a hash of (step, element index, which moment): no RNG state to save, the
same bits in the kernel and in PyTorch, and splitting the parameters into groups or units
(`OverlappedOptimizer`, ZeRO) draws the same bits; flat shards (FSDP) index differently.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from lm_core import lowp_weights

STATE_DTYPES = (torch.float32, torch.bfloat16)
# the names of the trainer's --optimizer-state-dtype and perf_tools.bench's
STATE_DTYPE_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ROUNDINGS = ("stochastic", "nearest")
MOMENTS = ("exp_avg", "exp_avg_sq")
_MASK32 = 0xFFFFFFFF


def check_state_dtype(state_dtype: Any) -> torch.dtype:
    """`state_dtype` if it is torch.float32 or torch.bfloat16, else ValueError naming it."""
    if not (isinstance(state_dtype, torch.dtype) and state_dtype in STATE_DTYPES):
        raise ValueError(
            f"AdamW: state_dtype must be torch.float32 or torch.bfloat16, got {state_dtype!r}"
        )
    return state_dtype


def check_rounding(rounding: Any) -> str:
    if rounding not in ROUNDINGS:
        raise ValueError(
            f"AdamW: state_rounding must be one of {', '.join(map(repr, ROUNDINGS))}, "
            f"got {rounding!r}"
        )
    return rounding


def moment_dtype(param: torch.Tensor, state_dtype: torch.dtype) -> torch.dtype:
    """The dtype of a parameter's moments: `state_dtype` for an fp32 parameter or a bf16
    one with an fp32 master (`lm_core.lowp_weights`), the parameter's own dtype otherwise
    (bf16 or fp64 parameters keep torch's behaviour)."""
    if param.dtype == torch.float32 or lowp_weights.is_held(param):
        return state_dtype
    return param.dtype


# ----------------------------------------------------------------------------- backend


def _kernel_runnable(device: torch.device) -> tuple[bool, str]:
    """(can the Triton kernel run on `device` here, why not)."""
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return False, "on a CPU it runs only in Triton's interpreter (TRITON_INTERPRET=1)"
    if device.type not in ("cuda", "cpu"):
        return False, f"it runs on CUDA, not {device.type}"
    try:
        from lm_core import adamw_triton
    except ImportError as exc:
        return False, f"triton is not importable ({exc}); pip install 'lm-core[triton]'"
    if device.type == "cpu" and not adamw_triton.interpreting():
        return False, "TRITON_INTERPRET=1 was set after lm_core.adamw_triton was imported"
    return True, ""


def backend(
    fused: bool | None,
    device: torch.device,
    what: str = "AdamW(fused=True, state_dtype=torch.bfloat16): the fused update with bf16 moments",
) -> str:
    """'triton' or 'torch': how an fp32 parameter with bf16 moments steps on `device`.

    fused=None: the Triton kernel for CUDA parameters when triton is importable, else PyTorch
    ops; fused=False: PyTorch ops; fused=True: the kernel (RuntimeError where it cannot run;
    on a CPU it runs in Triton's interpreter under TRITON_INTERPRET=1, for tests)."""
    if fused is False or (fused is None and device.type != "cuda"):
        return "torch"
    ok, why = _kernel_runnable(device)
    if ok:
        return "triton"
    if fused:
        raise RuntimeError(f"{what} is a Triton kernel, and {why}; pass fused=None or False")
    return "torch"


def _kernel_hparams(group: dict[str, Any], rounding: str) -> dict[str, Any]:
    """The keyword arguments of the Triton AdamW steps for one param group."""
    beta1, beta2 = group["betas"]
    return {
        "lr": group["lr"],
        "beta1": beta1,
        "beta2": beta2,
        "eps": group["eps"],
        "weight_decay": group["weight_decay"],
        "stochastic": rounding == "stochastic",
    }


def kernel_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    group: dict[str, Any],
    rounding: str,
) -> None:
    """One tensor's update by the Triton kernel (lm_core.adamw_triton)."""
    from lm_core.adamw_triton import adamw_bf16_state_step

    adamw_bf16_state_step(
        param, grad, exp_avg, exp_avg_sq, step, **_kernel_hparams(group, rounding)
    )


def master_kernel_step(
    param: torch.Tensor,
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    group: dict[str, Any],
    rounding: str,
    grad_scale: torch.Tensor | None = None,
) -> None:
    """One held weight's update by the Triton kernel (`lm_core.lowp_weights`)."""
    from lm_core.adamw_triton import adamw_master_step

    hparams = _kernel_hparams(group, rounding)
    adamw_master_step(
        param, master, grad, exp_avg, exp_avg_sq, step, grad_scale=grad_scale, **hparams
    )


# ----------------------------------------------------------------------------- rounding


def hash32(x: torch.Tensor | int) -> torch.Tensor | int:
    """The kernel's "lowbias32" hash of uint32 values, held in int64 (or a Python int)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32  # int64 products wrap mod 2^64: the low 32 bits are right
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def stochastic_bits(shape: torch.Size, step: int, which: int, device: torch.device) -> torch.Tensor:
    """int64 tensor of `shape`: the 16 random bits added below the bf16 mantissa of each
    element (row-major index i) at `step` for moment `which` (0: exp_avg, 1: exp_avg_sq)."""
    key = hash32((2 * step + which) & _MASK32)
    idx = torch.arange(shape.numel(), dtype=torch.int64, device=device).view(shape)
    return hash32((idx & _MASK32) ^ key) & 0xFFFF


def round_to_bf16(x: torch.Tensor, rounding: str, step: int, which: int) -> torch.Tensor:
    """fp32 `x` rounded to bf16: half to even ("nearest"), or up with the probability of the
    dropped fraction ("stochastic", bits from `stochastic_bits`); NaN stays NaN."""
    if rounding == "nearest":
        return x.to(torch.bfloat16)
    bits = x.view(torch.int32).to(torch.int64)
    bits = (bits + stochastic_bits(x.shape, step, which, x.device)) & ~0xFFFF
    # low 16 bits now zero: the float32 -> bf16 conversion below is exact
    out = bits.to(torch.int32).view(torch.float32).to(torch.bfloat16)
    return torch.where(torch.isnan(x), x.to(torch.bfloat16), out)


def round_into(
    dst: list[torch.Tensor], src: list[torch.Tensor], steps: list[int], which: int, rounding: str
) -> None:
    """dst[i] <- round_to_bf16(src[i]) (the moments after a PyTorch-ops update)."""
    for d, s, t in zip(dst, src, steps):
        d.copy_(round_to_bf16(s, rounding, t, which))


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (AdamW is elementwise and a parameter's gradient and moments
    share its placement, so updating the shards in place updates the DTensors); other
    tensors as they are."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t
