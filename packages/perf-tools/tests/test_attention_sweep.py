"""CPU checks of `python -m perf_tools.attention_sweep` (the GPU sweep itself runs on a GPU)."""

from __future__ import annotations

import json

import pytest
import torch

from perf_tools import attention_sweep as sweep


def test_cpu_run_writes_rows_and_marks_sdpa_unavailable(tmp_path, capsys):
    out = tmp_path / "s.json"
    rc = sweep.main(
        ["--shapes", "2x32", "--d", "16", "--causal", "yes", "--modes", "eager",
         "--device", "cpu", "--quiet", "--json", str(out), "--csv", str(tmp_path / "s.csv")]
    )  # fmt: skip
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 1
    row = rows[0]
    assert row["ours_ms"] > 0
    assert row["sdpa-flash_ms"] is None
    assert "GPU" in row["sdpa-flash_note"]
    assert "no row has both" in capsys.readouterr().out


def test_ratios_and_summary_pick_the_best_sdpa():
    row = {"mode": "eager", "causal": True, "d": 64, "heads": 8, "N": 8192}
    row.update({"ours_ms": 1.0, "sdpa-flash_ms": 2.0, "sdpa-cudnn_ms": 0.8})
    sweep._ratios(row, sweep.PROVIDERS)
    assert row["best_sdpa_ms"] == 0.8
    assert row["ours_vs_best"] == pytest.approx(1.25)
    assert not row["ours_wins"]
    text = sweep.summary([row])
    assert "0/1" in text
    assert "1.250" in text


def test_the_8b_shape_is_swept_at_d128_only():
    cfg = sweep.SweepConfig(shapes=sweep.SHAPES, device=torch.device("cpu"))
    assert (32, 32768) not in sweep._shapes_for(64, cfg)
    assert (32, 32768) in sweep._shapes_for(128, cfg)


def test_bad_arguments_are_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        sweep.main(["--shapes", "32by2048"])
    assert "HEADSxN" in capsys.readouterr().err
    with pytest.raises(ValueError, match="providers"):
        sweep.SweepConfig(shapes=((1, 8),), providers=("fa3",))


def test_autograd_threads_axis_times_each_setting(tmp_path, monkeypatch):
    """--autograd-threads on off: a row per setting, each timed with autograd's device
    threads switched as its label says (and torch's default restored afterwards)."""
    seen = []

    def fake_bench(fn, cfg):
        seen.append(torch._C._is_multithreading_enabled())
        return 1.0

    monkeypatch.setattr(sweep, "_bench", fake_bench)
    out = tmp_path / "s.json"
    rc = sweep.main(
        ["--shapes", "2x32", "--d", "16", "--causal", "yes", "--modes", "eager",
         "--device", "cpu", "--quiet", "--json", str(out), "--autograd-threads", "on", "off"]
    )  # fmt: skip
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["autograd_threads"] for r in rows] == ["on", "off"]
    assert seen == [True, False]
    assert torch._C._is_multithreading_enabled()
