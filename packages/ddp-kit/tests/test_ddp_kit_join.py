"""Uneven inputs: every wrapper inside torch's `Join`, against a single-process reference,
over 2 processes (gloo here, NCCL under `nox -s nccl_tests`); scenarios in ddpkit_join.py.

Without Join the same uneven loop fails with CollectiveError after the timeout: the fault
suite's `uneven` case (tests/ddpkit_faults.py) checks that in separate processes.
"""

from __future__ import annotations

import pytest
from ddpkit_join import join_cases, run_join

from ddp_kit.launch import spawn

NAMES = list(join_cases())
OTHER = [
    "flat-throw-on-early-termination",
    "individual-throw-on-early-termination",
    "divide-flag-not-bool",
    "sync-buffers-inside-join",
    "join-between-backward-and-finish",
    "wrapper-not-first-joinable",
]
BACKENDS = [
    pytest.param("gloo", id="gloo"),
    pytest.param("nccl", id="nccl", marks=pytest.mark.nccl),
]


@pytest.fixture(scope="module", params=BACKENDS)
def results(request: pytest.FixtureRequest) -> list[dict]:
    backend = request.param
    return spawn(
        run_join, 2, backend=backend, args=(backend, NAMES), timeout_s=300, collective_timeout_s=60
    )


@pytest.mark.parametrize("name", NAMES)
def test_uneven_inputs_match_reference(results: list[dict], name: str) -> None:
    """No hang; gradients match the reference in every step a rank trains; afterwards both
    ranks hold the reference's weights (bit-identical) and the last averaged gradient."""
    for rank, per_rank in enumerate(results):
        assert per_rank[name] == [], f"rank {rank}: " + "; ".join(per_rank[name])


@pytest.mark.parametrize("name", OTHER)
def test_join_errors_are_clear(results: list[dict], name: str) -> None:
    """throw_on_early_termination raises on both ranks and leaves the wrapper usable; misuse
    raises a clear error on every rank."""
    for rank, per_rank in enumerate(results):
        assert per_rank[name] in ([], ""), f"rank {rank}: {per_rank[name]}"
