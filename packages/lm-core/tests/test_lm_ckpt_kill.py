"""A process killed (SIGKILL) while it saves a checkpoint: the previous checkpoint survives
intact (its checksum verifies) and the next save removes the orphaned temporary file.

One deterministic case (killed after the data is written, before the rename: the largest
orphan) and a kill at a time the test does not control, repeated
LM_CORE_KILL_REPEATS times (default 1; e.g. 20 for a longer fault run).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from lm_core import TransformerLM, get_config, load_checkpoint, read_checkpoint, save_checkpoint

pytestmark = pytest.mark.skipif(os.name != "posix", reason="SIGKILL and pid checks are POSIX")

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


@pytest.mark.parametrize("repeat", range(int(os.environ.get("LM_CORE_KILL_REPEATS", "1"))))
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
