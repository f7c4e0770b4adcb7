"""Fault injection (see ddpkit_faults.py): a rank that raises, stalls or skips a step, ranks
that use different parameters, and exits with the wrapper alive. Every rank must end with a
clear error or a right result: no hang, no abort, nothing silently wrong.

Each case runs in fresh processes that exit like a user's script. CI runs each case once (the
exit cases twice); `nox -s faults` sets FAULT_RUNS=20 and runs each case 20 times in a
row, cycling through the four wrappers.
"""

from __future__ import annotations

import os

import pytest
from ddpkit_faults import TIMEOUT_S, UNEVEN_TIMEOUT_S, WRAPPERS, RankResult, run_case

CASES = [
    "raise",
    "stall",
    "stall-pg",
    "skip",
    "unused",
    "uneven",
    "join",
    "join-stall",
    "join-stall-joined",
    "exit",
    "exit-no-destroy",
]


def _runs(case: str) -> int:
    if "FAULT_RUNS" in os.environ:
        return int(os.environ["FAULT_RUNS"])
    return 2 if case.startswith("exit") else 1


PARAMS = [
    pytest.param(case, run, id=f"{case}-{run}") for case in CASES for run in range(_runs(case))
]


def _no_hang_no_abort(results: list[RankResult]) -> None:
    for rank, r in enumerate(results):
        assert r.code is not None, f"rank {rank} hung (killed after the deadline):\n{r.stderr}"
        assert r.code >= 0, f"rank {rank} died of signal {-r.code}:\n{r.stderr[-2000:]}"
        assert "terminate called" not in r.stderr, f"rank {rank} aborted:\n{r.stderr[-2000:]}"


def _names_the_collective(report: dict, rank: int) -> None:
    error = report.get("error", "")
    assert f"rank {rank} of 2" in error, report
    assert "all_reduce of gradient bucket" in error, report


@pytest.mark.faults
@pytest.mark.parametrize(("case", "run"), PARAMS)
def test_fault(case: str, run: int) -> None:
    wrapper = WRAPPERS[run % len(WRAPPERS)]
    results = run_case(case, wrapper)
    _no_hang_no_abort(results)
    r0, r1 = (r.report for r in results)
    if case == "raise":
        assert results[1].code == 1
        assert "injected fault on rank 1" in results[1].stderr
        _names_the_collective(r0, 0)
    elif case in ("stall", "stall-pg"):
        for rank, report in enumerate((r0, r1)):
            _names_the_collective(report, rank)
        bound = f"timeout {TIMEOUT_S:g} s" if case == "stall" else "the process group's timeout"
        assert bound in r0["error"], r0
    elif case in ("skip", "uneven"):  # rank 1 ran fewer steps: rank 0's next has no partner
        _names_the_collective(r0, 0)
        bound = UNEVEN_TIMEOUT_S if case == "uneven" else TIMEOUT_S
        assert f"timeout {bound:g} s" in r0["error"], r0
        assert results[1].code == 0
        assert "error" not in r1, r1
        if case == "uneven":
            assert (r0["steps"], r1["steps"]) == (2, 2), (r0, r1)
    elif case == "join-stall":  # rank 0 still trains: its own (bounded) calls time out
        for rank, report in enumerate((r0, r1)):
            assert f"rank {rank} of 2" in report.get("error", ""), report
            assert "all_reduce" in report["error"], report
        assert f"timeout {TIMEOUT_S:g} s" in r0["error"], r0
    elif case == "join-stall-joined":  # rank 0 waits in Join's count: the group's timeout
        assert r0["steps"] == 2, r0
        assert "Timed out" in r0["torch_error"], r0
        assert "rank 1 of 2" in r1.get("error", ""), r1
    else:  # unused, join, exit, exit-no-destroy: no fault: the right result, a clean exit
        for rank, r in enumerate(results):
            assert r.code == 0, f"rank {rank} exited with {r.code}:\n{r.stderr[-3000:]}"
        for report in (r0, r1):
            assert report.get("ranks_equal"), report
            if case == "join":  # rank 1 ran out after 2 of rank 0's 4 steps
                assert report["steps"] == (4 if report["rank"] == 0 else 2), report
            if case == "unused":  # rank 1 never used the branch: it gets the average anyway
                assert report["branch_grad"], report


@pytest.mark.nccl
def test_nccl_stall_raises_on_the_waiting_rank() -> None:
    """On NCCL an explicit timeout bounds the host's wait: rank 0 raises, naming the call."""
    results = run_case("nccl-stall", "bucketed", deadline_s=120.0)
    for rank, r in enumerate(results):
        assert r.code is not None, f"rank {rank} hung (killed after the deadline):\n{r.stderr}"
    _names_the_collective(results[0].report, 0)
