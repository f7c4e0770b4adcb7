"""Shared test settings for perf-tools.

Tests run two pytest-xdist workers on a 2-core machine: one intra-op thread per worker keeps
CPU timings from oversubscribing the cores (which makes tiny ops 100x slower, not wrong).
"""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)


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
