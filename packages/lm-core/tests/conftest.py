"""Shared fixtures: the tiny preset every test uses, and a guard for the annotation flag."""

from __future__ import annotations

import os

import pytest
import torch

from lm_core import available_backends, get_config, set_annotations


def runnable_backends() -> list[str]:
    """Attention backends importable here; flash-triton on CPU only under TRITON_INTERPRET=1."""
    names = available_backends()
    if "flash-triton" in names and not (
        torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
    ):
        names.remove("flash-triton")
    return names


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test taking a `backend` argument runs once per runnable attention backend."""
    if "backend" in metafunc.fixturenames:
        metafunc.parametrize("backend", runnable_backends())


@pytest.fixture
def tiny():
    """The tiny config (fp32 CPU tests); fresh each time since tests may override fields."""
    return get_config("tiny")


@pytest.fixture
def annotations_on():
    """Turn profiler annotations on for one test, restoring the default (off) afterwards."""
    set_annotations(True)
    try:
        yield
    finally:
        set_annotations(False)


@pytest.fixture(autouse=True)
def _deterministic_threads():
    # Two xdist workers share two cores: one intra-op thread each keeps runs fast and stable.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
