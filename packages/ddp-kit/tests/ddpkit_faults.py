"""Fault-injection cases for the ddp_kit wrappers, each run as a user's script would run.

`python ddpkit_faults.py CASE WRAPPER RANK WORLD STORE` is one rank: it joins a gloo group
through the file store STORE, trains a small model with WRAPPER, injects the fault of CASE,
prints one JSON line (what it saw) and ends through the interpreter's normal exit, without
`os._exit`, so an abort or a hang at exit shows. The exit cases run ddpkit_exit_script.py, a
top-level script as users write them. `run_case` starts the ranks and collects them.

Cases (rank 1 misbehaves at step 1 of 4 unless said otherwise):
  raise     rank 1 raises in forward and its process dies with the traceback
  stall     rank 1 stops for longer than the timeout (a hung rank), then tries to go on
  stall-pg  the same with the wrapper's timeout=None: the process group's timeout bounds it
  skip      rank 1 catches its exception and goes on to the next step (one step fewer), then
            leaves (destroy_process_group, exit); rank 0's last step has no partner
  unused    no fault: only rank 0 uses a branch, default arguments (find_unused_parameters off)
  uneven    rank 1 has 2 batches, rank 0 has 4, no Join: rank 1 does other work for longer
            than the timeout, then leaves; rank 0's third step has no partner
  join      the same uneven data inside torch's Join([model]): no fault, both finish
  join-stall  inside Join, rank 1 (2 batches) stalls at step 1 past the timeout while
            rank 0 (4) still trains
  join-stall-joined  inside Join, rank 0 (2 batches) has joined and rank 1 (4) stalls at
            step 3: rank 0 waits in Join's own count (torch's call), bounded by the process
            group's timeout (PG_SHORT_S)
  exit      no fault: a last step and logged metrics, destroy_process_group() with the
            wrapper alive, then a plain exit (ddpkit_exit_script.py)
  exit-no-destroy  the same without destroy_process_group()
  exit-unguarded   exit-no-destroy without the exit guard: a control run, not a test (it
            aborts in about half the runs)
A case prefixed "nccl-" runs on NCCL (rank r on cuda:r) instead of gloo.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

WRAPPERS = ("naive", "flat", "individual", "bucketed")
TIMEOUT_S = 3.0  # the wrappers' per-collective timeout in the fault cases
# uneven: the fault comes after two normal steps; 3 s tripped now and then in the first step on a
# loaded 2-core machine
UNEVEN_TIMEOUT_S = 6.0
CALM_TIMEOUT_S = 60.0  # in the cases without a fault (a busy machine must not trip them)
PG_TIMEOUT_S = 120.0  # the process group's own timeout (stall-pg: PG_SHORT_S)
PG_SHORT_S = 4.0
STEPS = 4
_T0 = time.monotonic()


@dataclass
class RankResult:
    """One rank's process: exit code, elapsed seconds, the JSON it printed, its stderr."""

    code: int | None  # None: killed after the deadline
    seconds: float
    report: dict
    stderr: str


def run_case(case: str, wrapper: str, world: int = 2, deadline_s: float = 90.0) -> list[RankResult]:
    """Start `world` ranks of `case` and wait for all (killing them after `deadline_s`)."""
    with tempfile.TemporaryDirectory(prefix="ddpkit_faults_") as tmp:
        out = Path(tmp)
        procs, t0 = [], time.monotonic()
        name = "ddpkit_exit_script.py" if case.startswith("exit") else "ddpkit_faults.py"
        script = str(Path(__file__).with_name(name))
        for rank in range(world):
            args = [sys.executable, script, case, wrapper, str(rank), str(world), str(out / "s")]
            stdout = (out / f"out{rank}").open("w")
            stderr = (out / f"err{rank}").open("w")
            procs.append((subprocess.Popen(args, stdout=stdout, stderr=stderr), stdout, stderr))
        results = []
        for rank, (proc, stdout, stderr) in enumerate(procs):
            try:
                code: int | None = proc.wait(timeout=max(0.1, t0 + deadline_s - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                code = None
            seconds = time.monotonic() - t0
            stdout.close()
            stderr.close()
            lines = (out / f"out{rank}").read_text().strip().splitlines()
            report = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}
            results.append(RankResult(code, seconds, report, (out / f"err{rank}").read_text()))
        return results


# ----- inside a rank ------------------------------------------------------------------------
def make_model(torch, with_branch: bool):
    """The cases' model: (B, 6) -> (B, 3), with a branch that forward can skip."""
    from torch import nn

    class Net(nn.Module):
        """(B, 6) -> (B, 3); `branch` runs only when forward gets use_branch=True."""

        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Linear(6, 32)
            self.branch = nn.Linear(32, 32)
            self.fc2 = nn.Linear(32, 32)
            self.head = nn.Linear(32, 3)

        def forward(self, x, use_branch: bool = True):
            h = torch.tanh(self.fc1(x))  # (B, 32)
            if with_branch and use_branch:
                h = h + self.branch(h)
            return self.head(torch.tanh(self.fc2(h)))  # (B, 3)

    return Net()


def make_wrapper(ddp_kit, kind: str, model, timeout):
    """The ddp_kit wrapper `kind` ("naive", "flat", "individual", "bucketed") of `model`."""
    cls = {
        "naive": ddp_kit.NaiveDDP,
        "flat": ddp_kit.FlatDDP,
        "individual": ddp_kit.DDPIndividualParameters,
        "bucketed": ddp_kit.DDPBucketed,
    }[kind]
    if kind == "bucketed":
        return cls(model, bucket_size_mb=0.002, timeout=timeout)  # several buckets
    return cls(model, timeout=timeout)


def _steps(case: str, rank: int) -> int:
    """Batches of `rank` in `case` (uneven in the uneven and join cases)."""
    if case in ("uneven", "join", "join-stall"):
        return STEPS if rank == 0 else STEPS - 2
    if case == "join-stall-joined":
        return STEPS - 2 if rank == 0 else STEPS
    return STEPS


def _stall_s(case: str, rank: int, step: int) -> float:
    """How long rank `rank` stops before `step` (longer than the bound it must trip)."""
    if rank != 1:
        return 0.0
    if case in ("stall", "join-stall") and step == 1:
        return 1.5 * TIMEOUT_S + 1
    if case == "stall-pg" and step == 1:
        return 1.5 * PG_SHORT_S + 1
    if case == "join-stall-joined" and step == 3:
        return 1.5 * PG_SHORT_S + 1
    return 0.0


def _rank_main(case: str, kind: str, rank: int, world: int, store: str) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms import Join

    import ddp_kit

    backend = "nccl" if case.startswith("nccl-") else "gloo"
    case = case.removeprefix("nccl-")
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    pg_timeout = PG_SHORT_S if case in ("stall-pg", "join-stall-joined") else PG_TIMEOUT_S
    dist.init_process_group(
        backend,
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=pg_timeout),
    )
    torch.manual_seed(rank)  # different initial weights: the wrapper broadcasts rank 0's
    model = make_model(torch, with_branch=True).to(device)
    calm = case in ("unused", "join")
    timeout = None if case == "stall-pg" else CALM_TIMEOUT_S if calm else TIMEOUT_S
    if case == "uneven":
        timeout = UNEVEN_TIMEOUT_S
    ddp = make_wrapper(ddp_kit, kind, model, timeout)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    report: dict = {"rank": rank, "steps": 0}
    step, steps = 0, _steps(case, rank)
    joined = Join([ddp]) if case.startswith("join") else contextlib.nullcontext()
    try:
        with joined:
            while step < steps:
                gen = torch.Generator().manual_seed(100 * step + rank)
                x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
                x, y = x.to(device), y.to(device)
                time.sleep(_stall_s(case, rank, step))
                if rank == 1 and step == 1:
                    if case == "raise":
                        raise ValueError("injected fault on rank 1")
                    if case == "skip":
                        step += 1  # "caught" an exception: this step is lost on rank 1 only
                        continue
                use_branch = rank == 0 if case == "unused" else True
                loss = torch.nn.functional.mse_loss(ddp(x, use_branch=use_branch), y)
                opt.zero_grad()
                loss.backward()
                ddp.finish_gradient_synchronization()
                opt.step()
                step += 1
                report["steps"] = step
    except ddp_kit.CollectiveError as exc:
        report["error"] = str(exc)
        report["seconds"] = round(time.monotonic() - _T0, 2)
        return report  # the group is unusable now: end the process (plain exit)
    except RuntimeError as exc:  # torch's own calls (Join's count) raise plain RuntimeError
        report["torch_error"] = str(exc).splitlines()[0]
        report["seconds"] = round(time.monotonic() - _T0, 2)
        return report
    if case == "uneven" and rank == 1:
        time.sleep(UNEVEN_TIMEOUT_S + 2)  # other work after the loop, past rank 0's timeout
    if case in ("skip", "uneven"):
        dist.destroy_process_group()
        return report
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])  # (P,)
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    report["ranks_equal"] = all(torch.equal(g, gathered[0]) for g in gathered)
    report["finite"] = bool(torch.isfinite(flat).all())
    if case == "unused":
        report["branch_grad"] = model.branch.weight.grad is not None
    dist.destroy_process_group()
    return report


if __name__ == "__main__":
    case, kind, rank, world, store = sys.argv[1:6]
    result = _rank_main(case, kind, int(rank), int(world), store)
    print(json.dumps(result), flush=True)
    # From here on the interpreter's plain exit: no os._exit.
