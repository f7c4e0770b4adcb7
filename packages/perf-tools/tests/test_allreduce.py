"""perf_tools.allreduce on CPU with gloo: rows, positive numbers, outputs, skips."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from perf_tools import allreduce


def test_gloo_two_ranks_writes_table_csv_json_plot(tmp_path, capsys):
    out_csv, out_json, png = tmp_path / "a.csv", tmp_path / "a.json", tmp_path / "a.png"
    argv = [
        "--backend",
        "gloo",
        "--nprocs",
        "2",
        "--sizes-mb",
        "0.01",
        "0.1",
        "--warmup",
        "1",
        "--iters",
        "3",
        "--quiet",
        "--csv",
        str(out_csv),
        "--json",
        str(out_json),
        "--plot",
        str(png),
    ]
    assert allreduce.main(argv) == 0
    with out_csv.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["nprocs"], float(r["size_MiB"])) for r in rows] == [("2", 0.01), ("2", 0.1)]
    for r in rows:
        assert r["status"] == "ok"
        assert r["backend"] == "gloo"
        assert r["iters"] == "3"
        for col in ("median_ms", "min_ms", "mean_ms", "algbw_GBps", "busbw_GBps"):
            assert float(r[col]) > 0, col
        # 2 ranks: the ring moves each byte once each way, bus bw equals algorithm bw
        assert float(r["busbw_GBps"]) == pytest.approx(float(r["algbw_GBps"]))
        assert float(r["min_ms"]) <= float(r["median_ms"])
    payload = json.loads(out_json.read_text())
    assert payload["meta"]["torch"] == torch.__version__
    assert len(payload["rows"]) == 2
    assert png.stat().st_size > 0
    assert "all-reduce" in capsys.readouterr().out


def test_bus_bandwidth_formula():
    # 4 ranks: busbw = algbw * 2 * 3 / 4
    row = {"algbw_GBps": 2.0}
    assert row["algbw_GBps"] * 2 * (4 - 1) / 4 == pytest.approx(3.0)


def test_nccl_counts_beyond_the_gpus_are_skipped_with_a_reason():
    reason = allreduce.skip_reason("nccl", torch.cuda.device_count() + 1)
    assert reason is not None
    assert "GPUs" in reason
    assert allreduce.skip_reason("gloo", 6) is None


def test_oversubscription_is_noted(monkeypatch):
    monkeypatch.setattr(allreduce.os, "cpu_count", lambda: 2)
    assert "oversubscribed" in allreduce.oversubscription_note("gloo", 6)
    assert allreduce.oversubscription_note("gloo", 2) == ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_nccl_without_gpus_is_a_clear_cli_error(capsys):
    with pytest.raises(SystemExit):
        allreduce.main(["--backend", "nccl"])
    assert "nccl needs CUDA" in capsys.readouterr().err


@pytest.mark.parametrize("bad", [["--nprocs", "0"], ["--sizes-mb", "-1"], ["--iters", "0"]])
def test_bad_flags_are_rejected(bad, capsys):
    with pytest.raises(SystemExit):
        allreduce.main(["--backend", "gloo", *bad])
    assert "argument" in capsys.readouterr().err


def test_config_from_args_fills_defaults_and_names_a_bad_field():
    argv = ["--backend", "gloo", "--sizes-mb", "1,10", "10", "--iters", "4"]
    cfg = allreduce.config_from_args(allreduce.build_parser().parse_args(argv))
    assert cfg == allreduce.AllReduceConfig(backends=("gloo",), sizes_mb=(1.0, 10.0), iters=4)
    assert cfg.nprocs == (2, 4, 6)
    with pytest.raises(ValueError, match=r"^iters: expected a positive integer"):
        allreduce.AllReduceConfig(backends=("gloo",), iters=0)


def test_config_holds_tuples_and_refuses_bools_and_bare_strs():
    """Lists are held as tuples (the frozen config hashes); a bool or a float is not a count,
    a bare str not a list of backends."""
    cfg = allreduce.AllReduceConfig(backends=["gloo"], nprocs=[1, 2], sizes_mb=[1.0])
    assert (cfg.backends, cfg.nprocs, cfg.sizes_mb) == (("gloo",), (1, 2), (1.0,))
    assert hash(cfg) == hash(allreduce.AllReduceConfig(("gloo",), (1, 2), (1.0,)))
    bad = [
        ({"iters": True}, "iters"),
        ({"warmup": 2.5}, "warmup"),
        ({"nprocs": [True]}, "nprocs"),
        ({"backends": "gloo"}, "backends: expected a list or tuple"),
    ]
    for change, start in bad:
        with pytest.raises(ValueError, match=f"^{start}"):
            allreduce.AllReduceConfig(**{"backends": ("gloo",)} | change)
