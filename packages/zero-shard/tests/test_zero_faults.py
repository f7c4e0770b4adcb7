"""Fault injection (see zs_faults.py): a collective made by one rank only, a rank that stalls
or raises under FSDP, and an exit with the wrappers alive. Every rank must end with a clear
error or a right result: no hang, no abort.

Each case runs in fresh processes that exit like a user's script. CI runs each case once (the
exit cases twice); `nox -s faults` sets FAULT_RUNS=20 and runs each case 20 times in a row.
"""

from __future__ import annotations

import os

import pytest
from zs_faults import RankResult, run_case

CASES = ["consolidate", "fsdp-stall", "fsdp-raise", "exit", "exit-no-destroy"]


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


@pytest.mark.faults
@pytest.mark.parametrize(("case", "run"), PARAMS)
def test_fault(case: str, run: int) -> None:
    results = run_case(case)
    _no_hang_no_abort(results)
    r0, r1 = (r.report for r in results)
    if case == "consolidate":  # rank 0 waits for state rank 1 never sends: bounded, named
        assert "ShardedOptimizer: rank 0 of 2: receive of the optimizer state" in r0["error"]
        assert "error" in r1 or "other_error" in r1, r1  # its next call fails too
    elif case == "fsdp-stall":
        for rank, report in enumerate((r0, r1)):
            assert f"FSDP: rank {rank} of 2: all-gather of unit" in report.get("error", ""), report
    elif case == "fsdp-raise":
        assert results[1].code == 1
        assert "injected fault on rank 1" in results[1].stderr
        assert "FSDP: rank 0 of 2:" in r0.get("error", ""), r0
    else:  # exit, exit-no-destroy: no fault, so the right result and a clean exit
        for rank, r in enumerate(results):
            assert r.code == 0, f"rank {rank} exited with {r.code}:\n{r.stderr[-3000:]}"
        for report in (r0, r1):
            assert report.get("ranks_equal"), report
