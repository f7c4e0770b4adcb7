"""perf_tools.ddp on CPU with gloo (tiny model, 2 ranks), and its overhead model."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys

import pytest

from perf_tools import _dist, ddp, ddp_model

FAST = [
    "--size",
    "tiny",
    "--context",
    "16",
    "--batch",
    "2",
    "--warmup",
    "1",
    "--iters",
    "2",
    "--bucket-sizes-mb",
    "0.01",
    "1",
    "--probe-sizes-mb",
    "0.01",
    "0.1",
    "--quiet",
]


def test_every_scheme_has_a_row_with_positive_times(tmp_path, capsys):
    out_csv, out_json, png = tmp_path / "d.csv", tmp_path / "d.json", tmp_path / "d.png"
    argv = [*FAST, "--csv", str(out_csv), "--json", str(out_json), "--plot", str(png)]
    assert ddp.main(argv) == 0
    with out_csv.open(newline="") as f:
        rows = list(csv.DictReader(f))
    got = [(r["wrapper"], r["bucket_MiB"]) for r in rows]
    assert got == [
        ("none", ""),
        ("naive", ""),
        ("flat", ""),
        ("individual", ""),
        ("bucketed", "0.01"),
        ("bucketed", "1.0"),
        ("none", ""),
        ("torch", "25.0"),
    ]
    for r in rows:
        assert r["status"] == "ok"
        for col in ("step_ms", "fwd_ms", "bwd_ms", "opt_ms"):
            assert float(r[col]) > 0, (r["wrapper"], col)
        if r["wrapper"] not in ("none", "torch"):
            assert float(r["sync_ms"]) > 0
            assert float(r["model_ms"]) > 0
            assert int(r["n_buckets"]) >= 1
    by_kind = {(r["wrapper"], r["bucket_MiB"]): r for r in rows}
    assert int(by_kind[("flat", "")]["n_buckets"]) == 1
    assert int(by_kind[("bucketed", "1.0")]["n_buckets"]) == 1  # tiny: 0.4 MiB of gradients
    assert int(by_kind[("bucketed", "0.01")]["n_buckets"]) > 1
    meta = json.loads(out_json.read_text())["meta"]
    assert meta["model"]["grad_bytes"] > 0
    assert meta["model"]["probe"]["o_s"] >= 0
    assert png.stat().st_size > 0
    out = capsys.readouterr().out
    assert "data-parallel step" in out
    assert "all-reduce fit" in out


def test_reduce_dtype_sends_half_the_bytes(tmp_path, capsys):
    """--reduce-dtype bf16: every wrapper runs with it, the model prices half the bytes, and
    torch DDP (whose compress hooks need NCCL) is left out on gloo with a note."""
    out_json = tmp_path / "d.json"
    argv = [*FAST, "--wrappers", "flat", "bucketed", "torch", "--reduce-dtype", "bf16"]
    assert ddp.main([*argv, "--no-probe", "--json", str(out_json)]) == 0
    data = json.loads(out_json.read_text())
    assert [r["wrapper"] for r in data["rows"]] == ["none", "flat", "bucketed", "bucketed", "none"]
    assert all(r["status"] == "ok" for r in data["rows"])
    assert data["meta"]["model"]["reduce_dtype"] == "bf16"
    captured = capsys.readouterr()
    assert "left out on gloo" in captured.err
    assert "sent in bf16" in captured.out
    info = {"grad_bytes": 4 * ddp.MIB, "world": 2, "size": "t", "batch_per_rank": 1}
    lines = ddp.summary_lines({**info, "context": 1, "reduce_dtype": "bf16"})
    assert "sent in bf16: 2.0 MiB per step" in lines


def test_handout_model_matches_the_closed_form():
    s, o, w = 8e9, 30e-6, 300e9
    for n in (1, 4, 32, 300):
        equal = [s / n] * n
        assert ddp_model.handout_overhead_s(equal, o, w, overlap=True) == pytest.approx(
            s / (n * w) + n * o
        )
        assert ddp_model.handout_overhead_s(equal, o, w, overlap=False) == pytest.approx(
            n * o + s / w
        )


def test_optimal_bucket_minimizes_the_model():
    s, o, w = 8e9, 30e-6, 300e9
    b_star = ddp_model.optimal_bucket_bytes(s, o, w)
    n_star = s / b_star
    best = min(range(1, 5000), key=lambda n: s / (n * w) + n * o)
    assert abs(best - n_star) <= 1
    assert ddp_model.min_overhead_s(s, o, w) == pytest.approx(s / (n_star * w) + n_star * o)


def test_pipeline_model_limits():
    s, o, w = 1e9, 1e-5, 100e9  # 10 ms to send everything
    buckets = [s / 10] * 10
    hidden = ddp_model.pipeline_overhead_s(buckets, o, w, backward_s=1.0, overlap=True)
    assert hidden == pytest.approx(o + s / 10 / w)  # long backward: only the last bucket shows
    exposed = ddp_model.pipeline_overhead_s(buckets, o, w, backward_s=1e-4, overlap=True)
    assert exposed == pytest.approx(10 * o + s / w - 1e-4 * (1 - 1 / 10), rel=1e-6)


def test_fit_recovers_latency_and_bandwidth():
    sizes = [2**20, 2**23, 2**26, 2**28]
    o, w = _dist.fit_latency_bandwidth(sizes, [40e-6 + b / 250e9 for b in sizes])
    assert o == pytest.approx(40e-6, rel=1e-6)
    assert w == pytest.approx(250e9, rel=1e-6)
    assert math.isinf(_dist.fit_latency_bandwidth([1, 2], [1.0, 1.0])[1])


def test_runs_under_torchrun(tmp_path):
    out_json = tmp_path / "t.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "perf_tools.ddp",
        *FAST,
        "--wrappers",
        "bucketed",
        "--no-probe",
        "--bucket-sizes-mb",
        "1",
        "--json",
        str(out_json),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = json.loads(out_json.read_text())["rows"]
    assert [r["wrapper"] for r in rows] == ["none", "bucketed", "none"]
    assert all(r["status"] == "ok" and r["step_ms"] > 0 for r in rows)


def test_bad_flags_are_rejected(capsys):
    with pytest.raises(SystemExit):
        ddp.main(["--size", "nope"])
    assert "--size" in capsys.readouterr().err
