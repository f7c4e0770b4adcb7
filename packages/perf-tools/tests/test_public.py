"""Every perf_tools module imports and every command answers --help (public exports)."""

from __future__ import annotations

import importlib
import os
import pkgutil
import subprocess
import sys

import pytest

import perf_tools

MODULES = sorted(m.name for m in pkgutil.iter_modules(perf_tools.__path__))
COMMANDS = sorted(set(perf_tools.COMMANDS) & set(MODULES))


def test_commands_listed_exist():
    for name in ("bench", "profile", "attention", "mixed_precision"):
        assert name in perf_tools.COMMANDS
        assert name in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_module_imports(name):
    importlib.import_module(f"perf_tools.{name}")


@pytest.mark.parametrize("name", COMMANDS)
def test_help(name):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "")}
    proc = subprocess.run(
        [sys.executable, "-m", f"perf_tools.{name}", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"perf_tools.{name}" in proc.stdout or "usage" in proc.stdout


def test_version():
    assert perf_tools.__version__ == "0.1.0"
