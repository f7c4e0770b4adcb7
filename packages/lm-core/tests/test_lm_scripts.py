"""Console scripts: one per `python -m lm_core.<name>` entry, each pointing at a callable."""

from __future__ import annotations

import importlib
import io
import os
import sys
from pathlib import Path

import pytest

import lm_core


def _scripts() -> dict[str, str]:
    tomllib = pytest.importorskip("tomllib")
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    return tomllib.loads(pyproject.read_text())["project"]["scripts"]


def test_scripts_point_at_callables():
    scripts = _scripts()
    assert set(scripts) == {"lm-train", "lm-generate", "lm-tokenize", "lm-convert-checkpoint"}
    for script, target in scripts.items():
        module, _, func = target.partition(":")
        assert callable(getattr(importlib.import_module(module), func)), script


def test_every_runnable_module_has_a_script():
    root = Path(lm_core.__file__).parent
    runnable = {
        f"lm_core.{p.stem}" for p in root.glob("*.py") if '__name__ == "__main__"' in p.read_text()
    }
    targets = {t.partition(":")[0] for t in _scripts().values()}
    assert runnable <= targets


def test_lm_train_script_exits_zero_without_freeing_the_run(monkeypatch):
    """`main()` returns a TrainResult, which a console script would pass to sys.exit (exit
    status 1 and the object printed); `cli()` flushes stdout and stderr and leaves through
    `os._exit(0)` with the run still referenced, so no process group's destructor runs (it
    can hang joining gloo's threads) and nothing is torn down at exit."""
    import weakref

    from lm_core import train

    class Run:
        pass

    class Stream(io.StringIO):
        flushed = False

        def flush(self):
            self.flushed = True

    class ExitCalledError(Exception):
        pass

    refs, exits = [], []
    out, err = Stream(), Stream()

    def fake_main(argv=None):
        run = Run()
        refs.append(weakref.ref(run))
        return run

    def fake_exit(code):
        exits.append((code, refs[0]() is not None, out.flushed, err.flushed))
        raise ExitCalledError

    monkeypatch.setattr(train, "main", fake_main)
    monkeypatch.setattr(os, "_exit", fake_exit)
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    with pytest.raises(ExitCalledError):
        train.cli()
    assert exits == [(0, True, True, True)]
