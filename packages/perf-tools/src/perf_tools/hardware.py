"""Datasheet peak rates per GPU part, for MFU. Every tool takes an override (`--peak-tflops`).

Dense (no sparsity) tensor-core rates from NVIDIA's datasheets. `fp32` means plain IEEE fp32
on CUDA cores (torch's default: TF32 off for matmuls); `tf32` applies when TF32 matmuls are
enabled. The part is read from the device name as torch reports it, word by word, never by
substring: an H100 PCIe ("NVIDIA H100 PCIe") has lower peaks than an H100 SXM ("NVIDIA H100
80GB HBM3"), and a GH200 is not an H200. A name that does not say which part it is (a bare
"NVIDIA H100") gets no peak, so no MFU is shown rather than a wrong one.
"""

from __future__ import annotations

import re

import torch

# part -> precision -> TFLOP/s, dense.
PEAKS: dict[str, dict[str, float]] = {
    "H100 SXM": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H100 PCIe": {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2},
    "H100 NVL": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    "H200 SXM": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H200 NVL": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    "GH200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "A100 SXM": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "A100 PCIe": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "L4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
}
_SXM_WORDS = {"sxm", "sxm4", "sxm5", "hbm3", "hbm3e"}


def part_for_name(name: str) -> str | None:
    """The PEAKS key of a device name as torch reports it ('NVIDIA H100 80GB HBM3' -> 'H100
    SXM', 'NVIDIA A100-PCIE-40GB' -> 'A100 PCIe'), or None when the name does not say."""
    words = [w for w in re.split(r"[\s\-_]+", name.lower()) if w and w != "nvidia"]
    if not words:
        return None
    model, rest = words[0], set(words[1:])
    form = "PCIe" if "pcie" in rest else "NVL" if "nvl" in rest else None
    if form is None and rest & _SXM_WORDS:
        form = "SXM"
    if model == "h100":
        return f"H100 {form}" if form else None  # a bare "H100" could be any of three
    if model == "h200":
        return "H200 NVL" if form == "NVL" else "H200 SXM"  # "NVIDIA H200" is the SXM part
    if model == "gh200":
        return "GH200"
    if model == "a100":
        return "A100 PCIe" if form == "PCIe" else "A100 SXM"  # same peaks either way
    if model == "l4":
        return "L4"
    return None


def device_key(device: torch.device | str | None = None) -> str | None:
    """The PEAKS key of the CUDA device ('H100 SXM', ...), or None if unknown / CPU."""
    if not torch.cuda.is_available():
        return None
    if device is not None and torch.device(device).type != "cuda":
        return None
    return part_for_name(torch.cuda.get_device_name(device))


def peak_tflops(precision: str, device: torch.device | str | None = None) -> float | None:
    """Peak TFLOP/s for `precision` ('bf16', 'fp16', 'tf32', 'fp32') on `device`, if known."""
    key = device_key(device)
    if key is None:
        return None
    if precision == "fp32" and torch.backends.cuda.matmul.allow_tf32:
        precision = "tf32"
    try:
        return PEAKS[key][precision]
    except KeyError:
        raise ValueError(
            f"precision: expected one of {sorted(PEAKS[key])}, got {precision!r}"
        ) from None


def mfu(flops: float, seconds: float, peak_tflops_value: float | None) -> float | None:
    """Model FLOPs utilization in [0, 1]: achieved FLOP/s over the peak (None if peak unknown)."""
    if peak_tflops_value is None or seconds <= 0:
        return None
    return flops / seconds / (peak_tflops_value * 1e12)
