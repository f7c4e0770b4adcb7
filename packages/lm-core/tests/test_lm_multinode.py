"""Multi-node training as torchrun runs it: two node agents on this host (`--nnodes 2`, c10d
rendezvous on localhost, gloo) launch `python -m lm_core.train`, and the job trains as one
process on the whole batch does (the references of `lm_dist_reference`).

Every worker of a one-process-per-node job has LOCAL_RANK 0, so these runs also prove that
the trainer shards data by the global rank (else both nodes would read the same rows and the
weights would differ) and writes logs, metrics and checkpoints from global rank 0 only (else
both agents would print the steps and the metrics file would hold each step twice). The
device choice by LOCAL_RANK needs GPUs; `test_device_follows_local_rank_and_rank_the_group`
checks it against a simulated CUDA machine.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
from lm_dist_reference import BASE, assert_same_weights, single_process

from lm_core import read_checkpoint
from lm_core.distributed import setup_distributed

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")

AGENT_TIMEOUT_S = 180  # the whole job, both agents; ~10 s on two idle cores

# mode -> (workers per node agent, trainer flags); world size = 2 x workers
MODES = {
    # two workers per node: local ranks 0, 1 on each node, global ranks 0..3
    "ddp-2x2": (2, ["--ddp", "bucketed", "--bucket-size-mb", "0.05"]),
    "zero": (1, ["--ddp", "torch", "--zero"]),
    "fsdp-ours": (1, ["--fsdp", "ours"]),
    "fsdp-torch": (1, ["--fsdp", "torch"]),
}


@pytest.fixture(scope="module")
def reference() -> tuple[dict[str, torch.Tensor], list[float]]:
    return single_process([])


@pytest.mark.parametrize("mode", list(MODES))
def test_two_node_agents_train_as_one_process(mode, reference, tmp_path):
    nproc, flags = MODES[mode]
    out_dir = tmp_path / "run"
    train = ["-m", "lm_core.train", *BASE, *flags, "--out-dir", str(out_dir)]
    outputs = _two_node_job(train, nproc)
    # one global rank 0 between the two agents: it alone prints, logs and checkpoints
    printing = [i for i, text in enumerate(outputs) if "step=4 " in text]
    assert len(printing) == 1, _tails(outputs, f"{mode}: agents printing the steps: {printing}")
    lines = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3, 4], mode  # each step logged once
    ref_weights, ref_losses = reference
    # the logged loss is the mean over every rank's rows: the global batch's loss
    assert [x["loss"] for x in lines] == pytest.approx(ref_losses, rel=1e-5), mode
    payload = read_checkpoint(out_dir / "checkpoint.pt")
    assert payload["step"] == 4
    assert_same_weights(payload["model"], ref_weights, mode)


def test_device_follows_local_rank_and_rank_the_group(monkeypatch):
    """Global rank 3 of 4 (two workers on each of two 8-GPU nodes), LOCAL_RANK 1: the device is
    cuda:1 (not cuda:3, where RANK modulo the GPUs would put it), while the rank, its rows of
    the batch and rank-0 duties follow the group's rank 3."""
    for name, value in {"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    calls: dict[str, object] = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.setdefault("device", d))
    monkeypatch.setattr(dist, "is_initialized", lambda: "backend" in calls)
    monkeypatch.setattr(dist, "init_process_group", lambda b: calls.setdefault("backend", b))
    monkeypatch.setattr(dist, "get_world_size", lambda: 4)
    monkeypatch.setattr(dist, "get_rank", lambda: 3)  # what the group says, not LOCAL_RANK
    env = setup_distributed("torch")
    assert env.device == torch.device("cuda", 1) == calls["device"]
    assert calls["backend"] == "nccl"
    assert (env.rank, env.local_rank, env.world_size, env.is_main) == (3, 1, 4, False)
    assert env.rows(8) == slice(6, 8)  # global rank 3's quarter of the batch


# --------------------------------------------------------------------------- the launcher


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_node_job(command: list[str], nproc: int) -> list[str]:
    """Run `torchrun --nnodes 2 --nproc-per-node nproc ... command` as two node agents on this
    host; returns each agent's output (stdout + stderr). Fails, showing both agents' output
    tails, when an agent exits non-zero or the job outlives AGENT_TIMEOUT_S."""
    port = _free_port()
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2"]
    agent += ["--nproc-per-node", str(nproc), "--rdzv-backend", "c10d"]
    agent += ["--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"multinode-{port}"]
    agent += ["--rdzv-conf", "join_timeout=60", "--max-restarts", "0", *command]
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    env["OMP_NUM_THREADS"] = "1"
    # files, not pipes: an agent never stalls on a full pipe while the other is awaited
    logs = [tempfile.TemporaryFile() for _ in range(2)]  # noqa: SIM115 - closed below
    # each agent in a session of its own: on timeout it is killed with its workers
    procs = [
        subprocess.Popen(
            agent, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        for log in logs
    ]
    deadline = time.monotonic() + AGENT_TIMEOUT_S
    timed_out = False
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            timed_out = True
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read().decode(errors="replace"))
        log.close()
    codes = [proc.returncode for proc in procs]
    if timed_out or any(codes):
        why = f"timed out after {AGENT_TIMEOUT_S} s" if timed_out else f"exit codes {codes}"
        pytest.fail(_tails(outputs, f"two-node torchrun job {why}"))
    return outputs


# set by a launcher around pytest itself (a test run under torchrun): the agents set their own
_LAUNCHER_VARS = {
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
}


def _tails(outputs: list[str], headline: str, chars: int = 3000) -> str:
    parts = [headline]
    for i, text in enumerate(outputs):
        parts.append(f"--- node agent {i} (last {chars} characters) ---\n{text[-chars:]}")
    return "\n".join(parts)
