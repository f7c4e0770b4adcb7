"""What every JSON result records about the software and hardware that produced it."""

from __future__ import annotations

import importlib

import torch

from perf_tools import report


def test_versions_of_torch_stack_and_our_packages():
    meta = report.run_metadata()
    for key in ("date", "command", "commit", "python", "torch", "triton", "cuda", "cudnn"):
        assert key in meta
    for key in ("nccl", "driver", "device", "device_count"):
        assert key in meta
    assert meta["torch"] == torch.__version__
    assert meta["cuda"] == torch.version.cuda
    assert set(meta["packages"]) == set(report.PACKAGES)
    for dist, module in report.PACKAGES.items():
        assert meta["packages"][dist] == importlib.import_module(module).__version__, dist
    if not torch.cuda.is_available():
        assert meta["nccl"] is None
        assert meta["device_count"] == 0


def test_source_tree_version_when_not_installed(monkeypatch):
    def missing(dist):
        raise importlib.metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert (
        report._package_version("lm-core", "lm_core")
        == importlib.import_module("lm_core").__version__
    )
    assert report._package_version("no-such-dist", "no_such_module") is None


def test_driver_version_read_from_the_kernel_module(monkeypatch, tmp_path):
    text = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.15  Release Build\n"
    real = report.Path

    def fake_path(p):
        return tmp_path / "version" if p == "/proc/driver/nvidia/version" else real(p)

    (tmp_path / "version").write_text(text)
    monkeypatch.setattr(report, "Path", fake_path)
    assert report._driver_version() == "570.86.15"


def test_a_save_that_fails_leaves_the_previous_file(tmp_path, monkeypatch):
    """Results are replaced whole: a save stopped before its rename leaves the earlier file
    readable and no temporary beside it."""
    out, csv_out = tmp_path / "r.json", tmp_path / "r.csv"
    report.save_rows([{"a": 1}], csv_path=csv_out, json_path=out, meta={"m": 1})
    before = out.read_text(), csv_out.read_text()

    def stopped(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(report.os, "replace", stopped)
    for kwargs in ({"json_path": out, "meta": {"m": 2}}, {"csv_path": csv_out}):
        try:
            report.save_rows([{"a": 1}, {"a": 2}], **kwargs)
        except KeyboardInterrupt:
            pass
        else:
            raise AssertionError("the stopped save returned")
    assert (out.read_text(), csv_out.read_text()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.csv", "r.json"]
