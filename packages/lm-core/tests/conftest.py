"""Shared fixtures: the tiny preset every test uses, and a guard for the annotation flag."""

from __future__ import annotations

import pytest
import torch
from lm_test_backends import runnable_backends

from lm_core import get_config, set_annotations


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
