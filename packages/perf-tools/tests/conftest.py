"""Shared test settings for perf-tools.

Tests run two pytest-xdist workers on a 2-core machine: one intra-op thread per worker keeps
CPU timings from oversubscribing the cores (which makes tiny ops 100x slower, not wrong).
"""

from __future__ import annotations

import contextlib
import importlib

import pytest
import torch

torch.set_num_threads(1)

# Triton fixes a @triton.jit function as interpreted or compiled when it is defined, from
# TRITON_INTERPRET at that moment. Some tests unset it (to check what runs without a GPU or
# the interpreter); had one of them been the first in a worker to import a kernel module
# (lm_core's shared `_triton_util` helpers, say), kernels defined later under the interpreter
# would call compiled helpers and fail ("Cannot call @triton.jit'd outside of the scope of a
# kernel"). So every kernel module is imported here, in the mode the session runs in.
for _name in (
    "lm_core._triton_util",
    "lm_core.tf32x3_triton",
    "lm_core.adamw_triton",
    "lm_core.swiglu_triton",
    "lm_core.rmsnorm_triton",
    "lm_core.fused_loss_triton",
    "lm_core.qkv_rope_triton",
    "flashattn_triton.kernels",
):
    with contextlib.suppress(Exception):  # not installed, or no Triton: nothing to define
        importlib.import_module(_name)


@pytest.fixture
def refused_before_ranks(capsys, monkeypatch):
    """check(argv, needles): `perf_tools.bench` exits with code 2 on `argv` (run as on a CPU)
    before any rank starts, and its error output holds every needle."""
    from perf_tools import _dist, bench

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)

    def no_ranks(*args, **kwargs):
        raise AssertionError("ranks started")

    monkeypatch.setattr(_dist, "run_ranks", no_ranks)

    def check(argv: list[str], needles: list[str]) -> None:
        with pytest.raises(SystemExit) as info:
            bench.main([*argv, "--device", "cpu", "--quiet"])
        assert info.value.code == 2
        err = capsys.readouterr().err
        for needle in needles:
            assert needle in err, (needle, err)

    return check
