"""Checkpoint faults (marked `faults`): a process killed (SIGKILL) while it saves, and bits
flipped anywhere in a saved file.

A kill leaves the previous checkpoint intact (its checksum verifies) and the next save removes
the orphaned temporary file: one deterministic case (killed after the data is written, before
the rename: the largest orphan) and kills at times the test does not control. A flipped bit is
either refused by `load_checkpoint` with an error naming the file, before the model or the
optimizer changes, or lands where it changes nothing that loads (zip padding, a timestamp), in
which case everything loaded equals what was saved. The random cases run once in CI and
FAULT_RUNS times under `nox -s faults`.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from lm_core import TransformerLM, get_config, load_checkpoint, read_checkpoint, save_checkpoint

pytestmark = pytest.mark.faults
posix_only = pytest.mark.skipif(os.name != "posix", reason="SIGKILL and pid checks are POSIX")
RUNS = int(os.environ.get("FAULT_RUNS", "1"))

BALLAST = 16 * 2**20  # fp32 elements: 64 MiB per save, so a save takes a while to kill in
CHILD = r"""
import os, signal, sys
import torch
from lm_core import TransformerLM, get_config, save_checkpoint

path, mode = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = TransformerLM(get_config("tiny"))
save_checkpoint(path, model, None, step=1)
extra = {"ballast": torch.ones(int(sys.argv[3]))}
if mode == "at-fsync":  # all bytes written, not yet renamed: die exactly there
    os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)
    save_checkpoint(path, model, None, step=2, extra=extra)
else:  # save over and over until killed from outside
    print("ready", flush=True)
    step = 2
    while True:
        save_checkpoint(path, model, None, step=step, extra=extra)
        step += 1
"""


def _child(path, mode: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path), mode, str(BALLAST)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def _temps(directory) -> list[str]:
    return sorted(f for f in os.listdir(directory) if f.endswith(".tmp"))


def _next_save_cleans_up(path) -> None:
    save_checkpoint(path, TransformerLM(get_config("tiny")), None, step=99)
    assert os.listdir(path.parent) == [path.name]


@posix_only
def test_kill_between_write_and_rename_keeps_the_old_checkpoint(tmp_path):
    path = tmp_path / "ckpt.pt"
    proc = _child(path, "at-fsync")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, err[-2000:]
    (orphan,) = _temps(tmp_path)
    assert (tmp_path / orphan).stat().st_size > BALLAST * 4  # the whole new payload
    model = TransformerLM(get_config("tiny"))
    assert load_checkpoint(path, model, restore_rng=False) == 1  # checksum verified
    torch.manual_seed(0)
    assert torch.equal(model.lm_head.weight, TransformerLM(get_config("tiny")).lm_head.weight)
    _next_save_cleans_up(path)


@posix_only
@pytest.mark.parametrize("repeat", range(RUNS))
def test_kill_at_any_moment_leaves_a_whole_checkpoint(tmp_path, repeat):
    path = tmp_path / "ckpt.pt"
    proc = _child(path, "loop")
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()[-2000:]
        time.sleep(0.1 + (0.37 * repeat + 0.25) % 1.2)  # a save takes ~0.3-0.6 s here
    finally:
        proc.kill()
        proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert len(_temps(tmp_path)) <= 1
    payload = read_checkpoint(path)  # the last complete save, old or new; checksum verified
    assert payload["step"] >= 1
    if payload["step"] > 1:
        assert payload["extra"]["ballast"].shape == (BALLAST,)
    _next_save_cleans_up(path)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A checkpoint of a trained tiny model with AdamW state, and what it holds."""
    torch.manual_seed(0)
    model = TransformerLM(get_config("tiny"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 100, (2, 8))).float().square().mean().backward()
    opt.step()
    path = tmp_path_factory.mktemp("flip") / "ckpt.pt"
    save_checkpoint(path, model, opt, step=3)
    return path.read_bytes(), model.state_dict(), opt.state_dict()


def _fresh():
    torch.manual_seed(1)
    model = TransformerLM(get_config("tiny"))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


@pytest.mark.parametrize("run", range(RUNS))
def test_flipped_bits_anywhere_are_refused_or_harmless(tmp_path, saved_run, run):
    raw, weights, opt_state = saved_run
    rng = random.Random(run)
    refused = 0
    for _ in range(25):  # 25 single-bit flips at random offsets of the whole file
        damaged = bytearray(raw)
        damaged[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        path = tmp_path / "damaged.pt"
        path.write_bytes(bytes(damaged))
        model, opt = _fresh()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        try:
            step, error = load_checkpoint(path, model, opt, restore_rng=False), ""
        except RuntimeError as e:
            step, error = None, str(e)
        if step is None:
            refused += 1
            assert "damaged.pt" in error, error
            for key, value in model.state_dict().items():
                assert torch.equal(value, before[key]), key
            assert not opt.state  # the optimizer was not touched either
            continue
        assert step == 3
        for key, value in model.state_dict().items():
            assert torch.equal(value, weights[key]), key
        for i, entry in opt.state_dict()["state"].items():
            for name, value in entry.items():
                assert torch.equal(value, opt_state["state"][i][name]), (i, name)
    assert refused >= 20  # nearly every byte of the file is tensor data or its index
