"""Fault-injection cases for ShardedOptimizer and FSDP, each run as a user's script would run.

`python zs_faults.py CASE RANK WORLD STORE` is one rank: it joins a gloo group through the file
store STORE, trains a small model, injects the fault of CASE, prints one JSON line (what it
saw) and ends through the interpreter's normal exit, without `os._exit`, so an abort or a hang
at exit shows. The exit cases run zs_exit_script.py, a top-level script as users write them.
`run_case` starts the ranks and collects them.

Cases (rank 1 misbehaves at step 1 of 3):
  consolidate  rank 0 alone calls ShardedOptimizer.consolidate_state_dict (rank 1 goes on)
  fsdp-stall   under FSDP, rank 1 stops for longer than the timeout, then tries to go on
  fsdp-raise   under FSDP, rank 1 raises in forward and its process dies with the traceback
  exit         no fault: a last step and logged metrics, destroy_process_group() with a
               ShardedOptimizer and an FSDP alive, then a plain exit (zs_exit_script.py)
  exit-no-destroy  the same without destroy_process_group()
  exit-unguarded   exit-no-destroy without the exit guard: a control run, not a test
"""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

TIMEOUT_S = 3.0  # the wrappers' per-collective timeout in the fault cases
CALM_TIMEOUT_S = 60.0  # in the exit cases, without a fault (a busy machine must not trip it)
PG_TIMEOUT_S = 120.0  # the process group's own timeout
STEPS = 3


@dataclass
class RankResult:
    """One rank's process: exit code, elapsed seconds, the JSON it printed, its stderr."""

    code: int | None  # None: killed after the deadline
    seconds: float
    report: dict
    stderr: str


def run_case(case: str, world: int = 2, deadline_s: float = 90.0) -> list[RankResult]:
    """Start `world` ranks of `case` and wait for all (killing them after `deadline_s`)."""
    with tempfile.TemporaryDirectory(prefix="zs_faults_") as tmp:
        out = Path(tmp)
        procs, t0 = [], time.monotonic()
        name = "zs_exit_script.py" if case.startswith("exit") else "zs_faults.py"
        script = str(Path(__file__).with_name(name))
        for rank in range(world):
            args = [sys.executable, script, case, str(rank), str(world), str(out / "s")]
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
def model_class(torch):
    """The cases' model class: (B, 8) -> (B, 3), three blocks (FSDP units) and a head."""
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.Linear(8, 24)
            self.down = nn.Linear(24, 8)

        def forward(self, x):
            return x + self.down(torch.tanh(self.up(x)))  # (B, 8)

    class Net(nn.Module):
        """(B, 8) -> (B, 3): three blocks (FSDP units) and a head."""

        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Block() for _ in range(3))
            self.head = nn.Linear(8, 3)

        def forward(self, x):
            for block in self.layers:
                x = block(x)
            return self.head(x)

    return Net


def _rank_main(case: str, rank: int, world: int, store: str) -> dict:
    import torch
    import torch.distributed as dist

    from zero_shard import FSDP, CollectiveError, ShardedOptimizer

    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
    )
    net = model_class(torch)
    torch.manual_seed(rank)
    report: dict = {"rank": rank, "steps": 0}
    fsdp = FSDP(net(), timeout=TIMEOUT_S) if case != "consolidate" else None
    plain = net()
    opt = ShardedOptimizer(plain.parameters(), torch.optim.AdamW, lr=1e-2, timeout=TIMEOUT_S)
    fsdp_opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-2) if fsdp is not None else None
    try:
        for step in range(STEPS):
            gen = torch.Generator().manual_seed(100 * step + rank)
            x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 3, generator=gen)
            if rank == 1 and step == 1:
                if case == "fsdp-raise":
                    raise ValueError("injected fault on rank 1")
                if case == "fsdp-stall":
                    time.sleep(1.5 * TIMEOUT_S + 1)
            if fsdp is not None:
                torch.nn.functional.mse_loss(fsdp(x), y).backward()
                fsdp.finish_gradient_synchronization()
                fsdp_opt.step()
                fsdp_opt.zero_grad()
            torch.nn.functional.mse_loss(plain(x), y).backward()
            for p in plain.parameters():  # the user's own gradient averaging
                dist.all_reduce(p.grad)
                p.grad /= world
            opt.step()
            opt.zero_grad()
            if case == "consolidate" and step == 1 and rank == 0:
                opt.consolidate_state_dict(to=0)  # rank 1 does not join
            report["steps"] = step + 1
    except CollectiveError as exc:
        report["error"] = str(exc)
        return report  # the group is unusable now: end the process (plain exit)
    except RuntimeError as exc:  # a user collective that failed after a peer's timeout
        report["other_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        return report
    flat = torch.cat([p.detach().reshape(-1) for p in plain.parameters()])  # (P,)
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    report["ranks_equal"] = all(torch.equal(g, gathered[0]) for g in gathered)
    dist.destroy_process_group()
    return report


if __name__ == "__main__":
    case, rank, world, store = sys.argv[1:5]
    result = _rank_main(case, int(rank), int(world), store)
    if result:
        print(json.dumps(result), flush=True)
    # From here on the interpreter's plain exit: no os._exit.
