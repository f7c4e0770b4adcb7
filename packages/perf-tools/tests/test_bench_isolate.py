"""perf_tools.bench --isolate: each model in fresh processes, rounds interleaved, the
summary over runs, and what isolation refuses."""

from __future__ import annotations

import csv

import pytest
import torch

from perf_tools import bench, cells, isolated_runs

TINY = ["--size", "tiny", "--context", "16", "--batch", "2", "--quiet"]
FAST = ["--warmup", "1", "--steps", "2"]


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_isolate_runs_each_model_in_a_fresh_process(tmp_path, monkeypatch):
    """--isolate: each model's rows (here: two attention backends) come from a spawned
    process (this process never builds a model: a patched builder here would fail them), and
    a model whose process fails gets error rows while the others still run."""

    def not_here(*a, **k):
        raise AssertionError("built in the parent process")

    monkeypatch.setattr(cells, "_model_cells", not_here)
    out = tmp_path / "b.csv"
    argv = [*TINY, *FAST, "--mode", "train", "fwd-bwd", "--attention", "sdpa", "naive"]
    assert bench.main([*argv, "--isolate", "--csv", str(out)]) == 0
    rows = _rows(out)
    assert [(r["attention"], r["mode"]) for r in rows] == [
        ("sdpa", "train"), ("sdpa", "fwd-bwd"), ("naive", "train"), ("naive", "fwd-bwd"),
    ]  # fmt: skip
    assert all(r["status"] == "ok" and float(r["median_ms"]) > 0 for r in rows)
    # each process's host speed, at its start and after its rows
    assert all(float(r["host_op_us"]) > 0 and float(r["host_op_start_us"]) > 0 for r in rows)

    monkeypatch.setattr(cells, "_cells_in_child", _child_that_fails)
    assert bench.main([*argv, "--isolate", "--csv", str(out)]) == 1
    rows = _rows(out)
    assert len(rows) == 4
    assert all(r["status"].startswith("error") for r in rows)


def test_isolate_rounds_interleave_the_models_and_summarize(tmp_path, monkeypatch, capsys):
    """--isolate 3: three rounds of one process per model, the models interleaved (A, B, A,
    B, ...), each row numbered by its round; a second table gives per configuration the
    median over the rounds that succeeded and the spread between the slowest and fastest."""
    calls = []
    times = {"sdpa": [10.0, 30.0, 12.0], "naive": [20.0, 21.0, 22.0]}

    def fake_cells(key, cells_, opts, sweep, n_cells):
        attention = key[2]
        calls.append(attention)
        run = sum(a == attention for a in calls) - 1
        status = "error: lost" if (attention, run) == ("naive", 2) else "ok"
        sweep.skip(len(cells_))
        return [
            {**cells.cell_row(c, {"model": key[0], "size": key[1]}, opts, {"status": status}),
             "median_ms": times[attention][run], "host_op_us": 7.0 + run}
            for c in cells_
        ]  # fmt: skip

    monkeypatch.setattr(cells, "_isolated_cells", fake_cells)
    out = tmp_path / "b.csv"
    argv = [*TINY, *FAST, "--mode", "train", "--attention", "sdpa", "naive"]
    assert bench.main([*argv, "--isolate", "3", "--csv", str(out)]) == 1  # one failed run
    assert calls == ["sdpa", "naive"] * 3
    rows = _rows(out)
    assert [(r["attention"], r["run"]) for r in rows] == [
        ("sdpa", "1"), ("naive", "1"), ("sdpa", "2"), ("naive", "2"), ("sdpa", "3"), ("naive", "3"),
    ]  # fmt: skip
    text = capsys.readouterr().out
    assert "median over 3 rounds" in text
    summary_lines = text[text.index("median over 3 rounds") :].splitlines()
    assert next(line for line in summary_lines if "runs" in line).count("median_ms") == 1
    summary = isolated_runs.median_over_runs(
        [{**r, "median_ms": float(r["median_ms"])} for r in rows], ["attention"]
    )
    by = {s["attention"]: s for s in summary}
    assert (by["sdpa"]["runs"], by["sdpa"]["median_ms"], by["sdpa"]["spread"]) == (3, 12.0, 3.0)
    assert (by["naive"]["runs"], by["naive"]["median_ms"]) == (2, 20.5)  # the failed run left out
    assert by["sdpa"]["median_host_op_us"] == 8.0


def test_isolate_count_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args([*TINY, "--isolate", "0"])
    assert "--isolate" in capsys.readouterr().err


def _child_that_fails(rank, world, key, cells_, opts, n_cells):
    raise RuntimeError("the model's process failed")


@pytest.mark.parametrize("flag", [["--memory-snapshot", "m.pickle"], ["--profile", "p"]])
def test_isolate_refuses_what_it_cannot_carry(flag, capsys):
    with pytest.raises(SystemExit) as info:
        bench.main([*TINY, "--isolate", *flag])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--isolate" in err or "--memory-snapshot" in err


def test_isolated_sweep_refuses_a_custom_measure():
    opts = cells.BenchOptions(
        device=torch.device("cpu"), batch=1, warmup=0, steps=1, overrides={}, isolate=True
    )
    with pytest.raises(ValueError, match="measure"):
        cells.run_sweep([], opts, measure=lambda *a, **k: {})
