"""The experiment scripts under packages/perf-tools/scripts still run (CPU dry runs)."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def test_fp32_gemm_dry_run_checks_every_triton_variant():
    """Tiny products in every layout through the Triton GEMM (interpreter on a CPU) against
    float64; the script exits non-zero when a variant errs or exceeds 1e-5."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "fp32_gemm.py"), "--dry-run"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = proc.stdout
    for variant in ("triton-ieee", "triton-tf32x3", "triton-tf32x3-kahan", "triton-tf32x3-kmajor"):
        for layout in ("nt", "nn", "tn"):
            assert f'"layout": "{layout}", "count": 1, "variant": "{variant}"' in out
    assert "dry run: ok" in out


def test_checkpoint_timing_runs_on_two_cpu_ranks(tmp_path):
    """The sharded-against-single-file checkpoint timing under torchrun on gloo: both saves
    land, the sharded one loads and is deleted before the single file is written (so a disk
    that holds one copy of the state holds the run), and rank 0 prints one JSON row."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--standalone", str(SCRIPTS / "checkpoint_timing.py"), str(tmp_path),
        "--size", "tiny", "--fsdp", "ours", "--steps", "1", "--synthetic", "random",
        "--batch-size", "2", "--context-length", "8", "--device", "cpu", "--no-progress",
        "--out-dir", str(tmp_path / "run"), "--ckpt-every", "1000",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 1, proc.stdout[-2000:]
    row = json.loads(rows[0])
    for key in ("dcp_save_s", "full_save_s", "dcp_load_s", "dcp_gib", "file_gib"):
        assert row[key] > 0, row
    assert (tmp_path / "ck.pt").is_file()
    assert not (tmp_path / "ck.dcp").exists()


def test_checkpoint_timing_refuses_an_out_dir_with_checkpoints(tmp_path):
    """It writes and deletes OUT/ck.dcp and OUT/ck.pt: a folder that already holds either is
    refused before anything starts, and the file is left as it was."""
    (tmp_path / "ck.pt").write_bytes(b"mine")
    cmd = [sys.executable, str(SCRIPTS / "checkpoint_timing.py"), str(tmp_path), "--size", "tiny"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "ck.pt exists" in proc.stderr
    assert (tmp_path / "ck.pt").read_bytes() == b"mine"


@pytest.mark.parametrize("fsdp", ["ours", "torch"])
def test_init_memory_rows_per_rank(fsdp):
    """The sharded-build memory script on two gloo ranks: one row per rank, the build named."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(SCRIPTS / "init_memory.py"), "--size", "tiny", "--fsdp", fsdp, "--build", "meta",
        "--device", "cpu",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["rank"] for r in rows] == [0, 1], proc.stdout[-2000:]
    for r in rows:
        assert r["build"] == "meta"
        assert r["fsdp"] == fsdp
        assert r["peak_rss_gib"] > 0


def test_fsdp_options_times_every_variant():
    """Accumulation without sync and reshard_after_forward=False, timed on two gloo ranks:
    one row per variant, in order, each with the options its wrapper was really built with
    (a name once ran the opposite reshard setting)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(SCRIPTS / "fsdp_options.py"), "--size", "tiny", "--fsdp", "ours", "--device", "cpu",
        "--context", "16", "--accum", "2", "--warmup", "0", "--steps", "1",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["variant"] for r in rows] == [
        "sync", "no_sync", "keep_gathered", "keep_gathered_no_sync"
    ], proc.stdout[-2000:]  # fmt: skip
    assert all(r["median_ms"] > 0 for r in rows)
    assert rows[0]["tokens_per_step"] == 2 * 16 * 2 * 2
    assert [r["reshard_after_forward"] for r in rows] == [True, True, False, False]
    assert [r["no_sync"] for r in rows] == [False, True, False, True]


def test_optimizer_state_accuracy_dry_run(tmp_path):
    """The bf16-optimizer-state accuracy script on a few steps of a very small model: its CSV
    has every step and variant, its JSON the differences from fp32, and the plot is written."""
    pytest.importorskip("tokenizers")
    pytest.importorskip("matplotlib")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    cmd = [
        sys.executable, str(SCRIPTS / "optimizer_state_accuracy.py"), "--out", str(tmp_path),
        "--steps", "4", "--eval-every", "2", "--batch", "2", "--context", "16", "--d-model", "16",
        "--layers", "1", "--heads", "2", "--d-ff", "32", "--vocab", "300", "--val-batches", "1",
        "--variants", "fp32", "bf16-stochastic",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    stem = tmp_path / "optimizer_state_accuracy"
    with open(stem.with_suffix(".csv")) as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [0, 1, 2, 3, 4]
    assert rows[4]["bf16-stochastic_train"]
    assert rows[2]["fp32_val"]
    assert not rows[1]["fp32_val"]  # evaluations every 2 steps
    summary = json.loads(stem.with_suffix(".json").read_text())["summary"]
    assert summary["fp32"]["final_val_minus_fp32"] == 0.0
    assert abs(summary["bf16-stochastic"]["final_val_minus_fp32"]) < 0.05
    assert stem.with_suffix(".png").stat().st_size > 0


def _gpu_suite(sections: str, out: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "SECTIONS": sections, "OUT": str(out), "PYTHON": "false"}
    return subprocess.run(
        ["bash", str(SCRIPTS / "gpu_suite.sh")], capture_output=True, text=True, env=env,
        timeout=60,
    )  # fmt: skip


def test_gpu_suite_refuses_an_unknown_section_before_running_anything(tmp_path):
    """A misspelt section fails at once, naming SECTIONS, the bad name and the known ones,
    rather than running nothing and reporting success; nothing is written to $OUT."""
    out = tmp_path / "out"
    proc = _gpu_suite("bench benchround", out)
    assert proc.returncode == 2
    assert "SECTIONS: unknown section 'benchround'" in proc.stderr
    assert " benchrounds " in proc.stderr  # the known names follow
    assert not out.exists()


def test_gpu_suite_documents_every_section():
    """Every section the script runs (`want NAME`) is described in its header."""
    text = (SCRIPTS / "gpu_suite.sh").read_text()
    header = text[: text.index("set -uo pipefail")]
    described = set(re.findall(r"^#   ([a-z0-9_]+)", header, flags=re.M))  # names at column 4
    ran = set(re.findall(r"\bwant ([a-z0-9_]+)", text))
    assert ran
    assert ran <= described, sorted(ran - described)
