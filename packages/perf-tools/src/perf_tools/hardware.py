"""Datasheet peak rates per device, for MFU. Every tool takes an override (`--peak-tflops`).

Dense (no sparsity) tensor-core rates of the SXM parts. `fp32` means plain IEEE fp32 on CUDA
cores (torch's default: TF32 off for matmuls); `tf32` applies when TF32 matmuls are enabled.
"""

from __future__ import annotations

import torch

# TFLOP/s, dense.
_PEAKS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H100": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "L4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
}


def device_key(device: torch.device | str | None = None) -> str | None:
    """The table key of the current CUDA device ('H100', ...), or None if unknown / CPU."""
    if not torch.cuda.is_available():
        return None
    if device is not None and torch.device(device).type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key in _PEAKS:
        if key in name:
            return key
    return None


def peak_tflops(precision: str, device: torch.device | str | None = None) -> float | None:
    """Peak TFLOP/s for `precision` ('bf16', 'fp16', 'tf32', 'fp32') on `device`, if known."""
    key = device_key(device)
    if key is None:
        return None
    if precision == "fp32" and torch.backends.cuda.matmul.allow_tf32:
        precision = "tf32"
    try:
        return _PEAKS[key][precision]
    except KeyError:
        raise ValueError(
            f"precision: expected one of {sorted(_PEAKS[key])}, got {precision!r}"
        ) from None


def mfu(flops: float, seconds: float, peak_tflops_value: float | None) -> float | None:
    """Model FLOPs utilization in [0, 1]: achieved FLOP/s over the peak (None if peak unknown)."""
    if peak_tflops_value is None or seconds <= 0:
        return None
    return flops / seconds / (peak_tflops_value * 1e12)
