"""Every perf_tools module imports and every command answers --help (public exports)."""

from __future__ import annotations

import importlib
import os
import pkgutil
import runpy
import subprocess
import sys
import warnings
from pathlib import Path

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
def test_help(name, monkeypatch, capsys):
    """`python -m perf_tools.<name> --help`, run in-process (runpy) to spare a torch import."""
    monkeypatch.setattr(sys, "argv", [f"perf_tools.{name}", "--help"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "found in sys.modules" from runpy
        with pytest.raises(SystemExit) as info:
            runpy.run_module(f"perf_tools.{name}", run_name="__main__")
    assert info.value.code in (0, None)
    assert "usage" in capsys.readouterr().out.lower()


def test_main_command_help_in_a_fresh_interpreter():
    proc = subprocess.run(
        [sys.executable, "-m", "perf_tools.bench", "--help"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert proc.returncode == 0, proc.stderr
    assert "python -m perf_tools.bench" in proc.stdout


def test_version():
    assert perf_tools.__version__ == "0.1.0"


def _scripts() -> dict[str, str]:
    tomllib = pytest.importorskip("tomllib")
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    return tomllib.loads(pyproject.read_text())["project"]["scripts"]


def test_every_command_is_a_console_script():
    """`perf-<name>` for every `python -m perf_tools.<name>`, pointing at a callable."""
    scripts = _scripts()
    assert set(scripts) == {"perf-" + name.replace("_", "-") for name in perf_tools.COMMANDS}
    for script, target in scripts.items():
        module, _, func = target.partition(":")
        assert callable(getattr(importlib.import_module(module), func)), script


def test_every_runnable_module_is_a_command():
    root = Path(perf_tools.__file__).parent
    runnable = {p.stem for p in root.glob("*.py") if '__name__ == "__main__"' in p.read_text()}
    assert runnable == set(perf_tools.COMMANDS)
