"""`python -m perf_tools.train_loop` on CPU: the three rows, the rates from the metrics log
against a hand computation, and the flag errors."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from perf_tools import train_loop

TINY = ["--size", "tiny", "--context", "32", "--batch", "2", "--device", "cpu", "--quiet"]


def test_three_rows_from_a_real_run_and_the_bench(tmp_path, capsys):
    out = tmp_path / "t.json"
    argv = [*TINY, "--steps", "6", "--log-every", "2", "--bench-steps", "2"]
    assert train_loop.main([*argv, "--out-dir", str(tmp_path / "run"), "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["what"] for r in rows] == [train_loop.BENCH, train_loop.LOGGED, train_loop.WALL]
    assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 for r in rows)
    assert rows[0]["vs_bench"] == 1.0
    for r in rows[1:]:
        assert r["steps"] == 4  # the windows after the first: steps 3..6
        assert r["vs_bench"] == pytest.approx(r["tokens_per_s"] / rows[0]["tokens_per_s"])
        assert r["ms_per_step"] == pytest.approx(1e3 * 2 * 32 / r["tokens_per_s"])
    # the trainer really ran: its log and its checkpoint (saved at step 3 and at the end)
    logged = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in logged] == [2, 4, 6]
    assert (tmp_path / "run" / "checkpoint.pt").is_file()
    assert "bench step" in capsys.readouterr().out  # the table


def test_rates_weight_windows_by_their_steps():
    history = [
        {"step": 10, "tokens_per_s": 1.0, "elapsed_s": 50.0},  # compilation: not counted
        {"step": 20, "tokens_per_s": 100.0, "elapsed_s": 52.0},  # 10 steps x 10 tokens: 1 s
        {"step": 25, "tokens_per_s": 25.0, "elapsed_s": 60.0},  # 5 steps x 10 tokens: 2 s
    ]
    rates = train_loop.loop_rates(history, tokens_per_step=10)
    assert rates["steps"] == 15
    assert rates["logged"] == pytest.approx(150 / 3.0)
    assert rates["wall"] == pytest.approx(150 / 10.0)  # a save between: 10 s of wall clock
    with pytest.raises(ValueError, match="at least 2 log records"):
        train_loop.loop_rates(history[:1], 10)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--cuda-graph"], "argument --cuda-graph: CUDA graphs need a CUDA device"),
        (["--steps", "3", "--log-every", "2"], "argument --steps: 3 steps give fewer than 2"),
        (["--size", "huge"], "argument --size: expected one of"),
        (["--grad-clip", "-1"], "argument --grad-clip: expected >= 0"),
    ],
)
def test_bad_flags_name_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        train_loop.parse_args([*TINY, *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_config_maps_flags_and_names_a_bad_field(tmp_path):
    argv = [*TINY, "--steps", "8", "--log-every", "2", "--bf16-weights", "--precision", "bf16"]
    cfg = train_loop.config_from_args(train_loop.parse_args([*argv, "--out-dir", str(tmp_path)]))
    assert (cfg.size, cfg.context, cfg.batch, cfg.device.type) == ("tiny", 32, 2, "cpu")
    assert (cfg.steps, cfg.log_every, cfg.ckpt_every, cfg.bench_steps) == (8, 2, 4, 3)
    assert (cfg.precision, cfg.bf16_weights, cfg.out_dir) == ("bf16", True, tmp_path)
    tc = train_loop.train_config(cfg, tmp_path)
    assert (tc.training.steps, tc.training.bf16_weights, tc.checkpoint.every) == (8, True, 4)
    for bad, field in (
        ({"grad_clip": -1.0}, "grad_clip"),
        ({"log_every": 5}, "steps"),  # 8 steps: fewer than 2 windows of 5
        ({"precision": "fp32"}, "bf16_weights"),
        ({"batch": 0}, "batch"),
    ):
        with pytest.raises(ValueError, match=rf"^{field}: "):
            dataclasses.replace(cfg, **bad)  # __post_init__ checks the copy


def test_sigterm_removes_the_temporary_checkpoint_folder(tmp_path):
    """A run stopped by SIGTERM (`timeout`, a scheduler) leaves no checkpoint folder behind:
    at xl each holds ~22 GB, and orphans filled the disk for the next run."""
    argv = [*TINY, "--steps", "100000", "--log-every", "2", "--ckpt-every", "2"]
    env = {**os.environ, "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "perf_tools.train_loop", *argv],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob("train_loop-*/checkpoint.pt")):  # training, and saving
            assert proc.poll() is None, proc.stderr.read()[-2000:]
            assert time.monotonic() < deadline, "no checkpoint within 120 s"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        assert code == 128 + signal.SIGTERM, (code, proc.stderr.read()[-3000:])
    finally:
        proc.kill()
        proc.wait()
    assert not list(tmp_path.glob("train_loop-*")), list(tmp_path.iterdir())


def test_config_normalizes_device_and_refuses_bad_values():
    """A device name becomes a torch.device, cpu or cuda only; a bool is not an int; the
    config (no dict in it) hashes."""
    cfg = train_loop.config_from_args(train_loop.parse_args(TINY))
    named = dataclasses.replace(cfg, device="cpu")
    assert named.device == cfg.device == torch.device("cpu")
    assert hash(named) == hash(dataclasses.replace(named))
    for change, field in [({"device": "meta"}, "device"), ({"seed": True}, "seed")]:
        with pytest.raises(ValueError, match=f"^{field}: "):
            dataclasses.replace(cfg, **change)
