"""Sharded (DCP) checkpoint directories under faults (marked `faults`): a process killed
(SIGKILL) while it saves, and damaged or missing files.

A save writes the new directory beside the old one and swaps it in only when complete
(`lm_core.dcp_io`). Killed while the shards are written: the old checkpoint is untouched;
killed between the two renames of the swap: the complete new one is read; at a moment the
test does not control: one whole checkpoint, old or new. Each time the next save puts things
in place and removes the leftovers. Damaged files are refused naming the checkpoint and the
file, before the model changes. The random case runs once in CI and FAULT_RUNS times under
`nox -s faults`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

from lm_core.dcp_checkpoint import load_dcp_checkpoint, read_dcp_meta, save_dcp_checkpoint

pytestmark = pytest.mark.faults
posix_only = pytest.mark.skipif(os.name != "posix", reason="SIGKILL and pid checks are POSIX")
RUNS = int(os.environ.get("FAULT_RUNS", "1"))
WIDTH = 2048  # a 16 MiB weight: a save takes a while to kill in

CHILD = r"""
import os, signal, sys
import torch
from torch import nn
from lm_core.dcp_checkpoint import save_dcp_checkpoint

path, mode, width = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.manual_seed(0)
model = nn.Linear(width, width, bias=False)
save_dcp_checkpoint(path, model, None, step=1)
die = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
if mode == "writing":  # DCP fsyncs each shard file once written: die at the first
    os.fsync = die
elif mode == "swapping":  # the old one moved aside, the new one not yet in place
    rename = os.rename
    def swap(src, dst):
        if str(src).endswith(".tmp") and os.path.basename(dst) == os.path.basename(path):
            die()
        rename(src, dst)
    os.rename = swap
else:  # save over and over until killed from outside
    print("ready", flush=True)
step = 2
while True:
    with torch.no_grad():
        model.weight.fill_(step)
    save_dcp_checkpoint(path, model, None, step=step)
    step += 1
"""


def _child(path, mode: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path), mode, str(WIDTH)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def _loaded_step(path) -> int:
    model = nn.Linear(WIDTH, WIDTH, bias=False)
    step = load_dcp_checkpoint(path, model, restore_rng=False)["step"]  # checksums verified
    if step == 1:
        torch.manual_seed(0)
        expected = nn.Linear(WIDTH, WIDTH, bias=False).weight
        assert torch.equal(model.weight, expected)
    else:
        assert bool((model.weight == step).all())
    return step


def _next_save_cleans_up(path) -> None:
    model = nn.Linear(WIDTH, WIDTH, bias=False)
    with torch.no_grad():
        model.weight.fill_(99)
    save_dcp_checkpoint(path, model, None, step=99)
    assert os.listdir(path.parent) == [path.name]
    assert _loaded_step(path) == 99


@posix_only
@pytest.mark.parametrize(("mode", "step"), [("writing", 1), ("swapping", 2)])
def test_killed_save_keeps_a_whole_checkpoint(tmp_path, mode, step):
    path = tmp_path / "ckpt.dcp"
    proc = _child(path, mode)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, err[-2000:]
    leftovers = sorted(f for f in os.listdir(tmp_path) if f != path.name)
    assert leftovers, "the killed save left its directories"
    # writing: the old directory is in place; swapping: only the complete new one and the
    # old one beside it, and a load reads the new one
    assert path.is_dir() == (mode == "writing")
    assert _loaded_step(path) == step
    _next_save_cleans_up(path)


@posix_only
@pytest.mark.parametrize("repeat", range(RUNS))
def test_killed_at_any_moment_leaves_a_whole_checkpoint(tmp_path, repeat):
    path = tmp_path / "ckpt.dcp"
    proc = _child(path, "loop")
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()[-2000:]
        time.sleep(0.1 + (0.37 * repeat + 0.25) % 1.2)  # a save takes ~0.2-0.5 s here
    finally:
        proc.kill()
        proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert _loaded_step(path) >= 1
    _next_save_cleans_up(path)


@pytest.fixture
def saved(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    path = tmp_path / "ckpt.dcp"
    save_dcp_checkpoint(path, model, None, step=3)
    return path


def _untouched_after_failed_load(path, match: str, exc: type = RuntimeError) -> None:
    torch.manual_seed(1)
    model = nn.Linear(8, 8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(exc, match=match):
        load_dcp_checkpoint(path, model, restore_rng=False)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_a_flipped_bit_in_a_shard_file_is_refused(saved):
    # one file per writer thread (lm_core.dcp_io.io_threads): damage the largest
    shard = max(saved.glob("*.distcp"), key=lambda f: f.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    _untouched_after_failed_load(saved, f"{saved} is corrupt: its file {shard.name} does not")


def test_a_missing_file_is_refused(saved):
    (saved / ".metadata").unlink()
    _untouched_after_failed_load(saved, f"{saved} is incomplete: its file .metadata is missing")


def test_a_damaged_or_missing_manifest_is_refused(saved):
    meta = saved / "lm_core_meta.pt"
    data = bytearray(meta.read_bytes())
    data[-200] ^= 0x01
    meta.write_bytes(bytes(data))
    _untouched_after_failed_load(saved, f"checkpoint {saved} is corrupt: lm_core_meta.pt")
    meta.unlink()
    _untouched_after_failed_load(saved, f"checkpoint {saved} is not a complete lm_core sharded")


def test_a_missing_checkpoint_names_the_path(tmp_path):
    _untouched_after_failed_load(tmp_path / "nothing.dcp", "checkpoint not found: ", OSError)
    file = tmp_path / "model.pt"
    file.write_bytes(b"x")
    with pytest.raises(RuntimeError, match=f"checkpoint {file} is a file, not a sharded"):
        read_dcp_meta(file)


def test_another_model_is_refused_before_loading(saved):
    model = nn.Linear(8, 4)
    with pytest.raises(ValueError, match=rf"checkpoint {saved}: parameter weight has shape"):
        load_dcp_checkpoint(saved, model, restore_rng=False)
    with pytest.raises(ValueError, match=f"checkpoint {saved} does not match the model: missing"):
        load_dcp_checkpoint(saved, nn.Linear(8, 8, bias=False), restore_rng=False)


def test_checksums_hashed_in_threads_keep_the_files_order(tmp_path, monkeypatch):
    """sha256_files hashes several files at once (a thread pool): the digests are hashlib's,
    in the order of the paths; io_threads shares the host's cores among its ranks."""
    import hashlib

    from lm_core.dcp_io import io_threads, sha256_files

    paths = []
    for i in range(5):
        paths.append(tmp_path / f"f{i}")
        paths[-1].write_bytes(bytes([i]) * (1000 * (i + 1)))
    expected = [hashlib.sha256(p.read_bytes()).hexdigest() for p in paths]
    assert sha256_files(paths, 4) == expected
    assert sha256_files(paths, 1) == expected
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1000000")
    assert io_threads() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert 1 <= io_threads() <= 8
    monkeypatch.setenv("LM_CORE_CHECKPOINT_THREADS", "12")
    assert io_threads() == 12
    monkeypatch.setenv("LM_CORE_CHECKPOINT_THREADS", "0")
    with pytest.raises(ValueError, match="LM_CORE_CHECKPOINT_THREADS"):
        io_threads()
