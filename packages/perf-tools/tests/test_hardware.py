"""Peak FLOP/s by GPU part: device names matched word by word, not by substring."""

from __future__ import annotations

import pytest
import torch

from perf_tools import hardware


@pytest.mark.parametrize(
    ("name", "part"),
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100 SXM5 80GB", "H100 SXM"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H100 NVL", "H100 NVL"),
        ("NVIDIA H100", None),  # could be any of the three
        ("NVIDIA H200", "H200 SXM"),
        ("NVIDIA H200 NVL", "H200 NVL"),
        ("NVIDIA GH200 480GB", "GH200"),
        ("NVIDIA A100-SXM4-80GB", "A100 SXM"),
        ("NVIDIA A100-SXM4-40GB", "A100 SXM"),
        ("NVIDIA A100-PCIE-40GB", "A100 PCIe"),
        ("NVIDIA A100 80GB PCIe", "A100 PCIe"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA L40S", None),
        ("NVIDIA GeForce RTX 4090", None),
        ("", None),
    ],
)
def test_part_for_name(name, part):
    assert hardware.part_for_name(name) == part


def test_pcie_is_not_given_sxm_peaks(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    tf32 = torch.backends.cuda.matmul.allow_tf32  # not monkeypatch-able (a module property)
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        assert hardware.peak_tflops("bf16") == 756.5
        assert hardware.peak_tflops("fp32") == 51.2
        torch.backends.cuda.matmul.allow_tf32 = True
        assert hardware.peak_tflops("fp32") == 378.0
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert hardware.peak_tflops("bf16") == 989.4
    assert hardware.peak_tflops("bf16", "cpu") is None


def test_every_part_has_every_precision():
    for part, peaks in hardware.PEAKS.items():
        assert set(peaks) == {"bf16", "fp16", "tf32", "fp32"}, part
        assert peaks["bf16"] == peaks["fp16"] > peaks["tf32"] > peaks["fp32"], part
