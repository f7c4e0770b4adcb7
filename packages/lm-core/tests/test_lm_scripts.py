"""Console scripts: one per `python -m lm_core.<name>` entry, each pointing at a callable."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import pytest

import lm_core

# Entry modules another branch adds; their scripts are checked here as soon as they exist.
PENDING = {"lm_core.generate", "lm_core.tokenize"}


def _scripts() -> dict[str, str]:
    tomllib = pytest.importorskip("tomllib")
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    return tomllib.loads(pyproject.read_text())["project"]["scripts"]


def test_scripts_point_at_callables():
    scripts = _scripts()
    assert set(scripts) == {"lm-train", "lm-generate", "lm-tokenize", "lm-convert-checkpoint"}
    for script, target in scripts.items():
        module, _, func = target.partition(":")
        if module in PENDING and importlib.util.find_spec(module) is None:
            continue
        assert callable(getattr(importlib.import_module(module), func)), script


def test_every_runnable_module_has_a_script():
    root = Path(lm_core.__file__).parent
    runnable = {
        f"lm_core.{p.stem}" for p in root.glob("*.py") if '__name__ == "__main__"' in p.read_text()
    }
    targets = {t.partition(":")[0] for t in _scripts().values()}
    assert runnable <= targets


def test_lm_train_script_exits_zero(monkeypatch):
    """`main()` returns a TrainResult, which a console script would pass to sys.exit (exit
    status 1 and the object printed); the script's `cli()` returns None."""
    from lm_core import train

    monkeypatch.setattr(train, "main", lambda argv=None: object())
    assert train.cli() is None


def test_lm_train_script_frees_the_run_before_the_interpreter_exits(monkeypatch):
    """A wrapped model sits in reference cycles (torch's fully_shard: module and state hold
    each other through hooks) that keep its process group alive; `cli()` collects them, so
    the group is not destroyed during interpreter exit (where gloo's threads abort the
    process). Automatic collection is off here, as it may not run before a process exits."""
    import gc
    import weakref

    from lm_core import train

    refs = []

    class Run:
        pass

    def fake_main(argv=None):
        run = Run()
        run.me = run  # a cycle, like the model's hooks
        refs.append(weakref.ref(run))
        return run

    monkeypatch.setattr(train, "main", fake_main)
    was = gc.isenabled()
    gc.disable()
    try:
        train.cli()
        assert refs
        assert refs[0]() is None
    finally:
        if was:
            gc.enable()
