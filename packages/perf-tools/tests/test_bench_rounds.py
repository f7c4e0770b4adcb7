"""perf_tools.bench --rounds: every row measured N times in one process, the models
interleaved and rebuilt per round, each round starting at another model, and the summary."""

from __future__ import annotations

import csv
import json
from types import SimpleNamespace

import pytest
import torch

from perf_tools import bench, cells, isolated_runs

TINY = ["--size", "tiny", "--context", "16", "--batch", "2", "--quiet"]
FAST = ["--warmup", "1", "--steps", "2"]


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_rounds_rebuild_and_interleave_the_models_in_this_process(tmp_path, capsys, monkeypatch):
    """--rounds 3 with two attentions: real tiny models, six measured cells in this process
    (each model built again per round), rows numbered by round, the rounds' order rotated,
    and a summary of the median over the three rounds, printed and saved in the JSON."""
    built = []
    build = cells._build_runner

    def counted(spec, *args, **kwargs):
        built.append(spec.attention)
        return build(spec, *args, **kwargs)

    monkeypatch.setattr(cells, "_build_runner", counted)
    out = tmp_path / "b.csv"
    argv = [*TINY, *FAST, "--mode", "train", "--attention", "sdpa", "naive"]
    saved = tmp_path / "b.json"
    assert bench.main([*argv, "--rounds", "3", "--csv", str(out), "--json", str(saved)]) == 0
    assert built == ["sdpa", "naive", "naive", "sdpa", "sdpa", "naive"]  # once per round
    rows = _rows(out)
    assert [(r["attention"], r["run"]) for r in rows] == [
        ("sdpa", "1"), ("naive", "1"), ("naive", "2"), ("sdpa", "2"), ("sdpa", "3"), ("naive", "3"),
    ]  # fmt: skip
    assert all(r["status"] == "ok" and float(r["median_ms"]) > 0 for r in rows)
    text = capsys.readouterr().out
    assert "median over 3 rounds in one process" in text
    summary = isolated_runs.median_over_runs(
        [{**r, "median_ms": float(r["median_ms"])} for r in rows], ["attention"]
    )
    assert sorted((s["attention"], s["runs"]) for s in summary) == [("naive", 3), ("sdpa", 3)]
    by = {s["attention"]: s for s in json.loads(saved.read_text())["summary"]}
    assert sorted(by) == ["naive", "sdpa"]
    assert by["sdpa"]["vs_sdpa"] is None
    assert by["naive"]["runs"] == 3
    assert by["naive"]["vs_sdpa"] == pytest.approx(
        by["naive"]["median_ms"] / by["sdpa"]["median_ms"], rel=1e-2
    )


def test_one_round_is_the_plain_sweep(tmp_path):
    out = tmp_path / "b.csv"
    assert bench.main([*TINY, *FAST, "--mode", "train", "--csv", str(out)]) == 0
    assert "run" not in _rows(out)[0]


def _group(attention, compile_):
    return ((attention, compile_), [SimpleNamespace(compile=compile_)])


def test_rotation_keeps_eager_models_before_compiled_ones():
    groups = [_group("a", False), _group("b", False), _group("c", False), _group("a", True)]
    order = [[key for key, _ in isolated_runs.rotated(groups, r)] for r in range(4)]
    assert order == [
        [("a", False), ("b", False), ("c", False), ("a", True)],
        [("b", False), ("c", False), ("a", False), ("a", True)],
        [("c", False), ("a", False), ("b", False), ("a", True)],
        [("a", False), ("b", False), ("c", False), ("a", True)],
    ]
    assert isolated_runs.rotated([], 1) == []


@pytest.mark.parametrize(
    "extra", [["--isolate", "2"], ["--memory-snapshot", "m.pickle"], ["--profile", "p"]]
)
def test_rounds_refuse_what_they_cannot_carry(extra, capsys):
    with pytest.raises(SystemExit) as info:
        bench.main([*TINY, "--rounds", "2", *extra])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--rounds" in err or "--memory-snapshot" in err


def test_rounds_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args([*TINY, "--rounds", "0"])
    assert "--rounds" in capsys.readouterr().err


def test_rounds_sweep_counts_every_cell(monkeypatch):
    """run_sweep with opts.rounds: the custom measure runs once per cell per round."""
    seen = []

    def measure(model, runner, spec, config, opts, n_cells):
        seen.append(spec.attention)
        return {"status": "ok", "median_ms": 1.0}

    argv = [*TINY, *FAST, "--mode", "train", "--attention", "sdpa", "naive", "--rounds", "2"]
    args = bench.parse_args(argv)
    specs = bench.specs_from_args(args)
    opts = cells.BenchOptions(
        device=torch.device("cpu"), batch=2, warmup=1, steps=2, overrides={}, rounds=2,
        progress=False,
    )  # fmt: skip
    rows = cells.run_sweep(specs, opts, measure=measure)
    assert seen == ["sdpa", "naive", "naive", "sdpa"]
    assert [r["run"] for r in rows] == [1, 1, 2, 2]


@pytest.mark.parametrize(("rounds", "isolate"), [(0, 0), (-1, 0), (2, 2)])
def test_run_sweep_refuses_a_bad_round_count(rounds, isolate):
    """Options built in code get the CLI's checks: no round count below 1, and no
    in-process rounds on top of --isolate's rounds of processes (the error names the
    field)."""
    opts = cells.BenchOptions(
        device=torch.device("cpu"), batch=2, warmup=1, steps=2, overrides={}, rounds=rounds,
        isolate=isolate, progress=False,
    )  # fmt: skip
    specs = bench.specs_from_args(bench.parse_args([*TINY, *FAST]))
    with pytest.raises(ValueError, match=r"opts\.rounds"):
        cells.run_sweep(specs, opts)


def test_summary_ratio_to_sdpa_is_per_configuration():
    """vs_sdpa: a non-SDPA row's median over runs against the SDPA row of the same
    configuration (here the same compile setting), None for SDPA and for rows without one.
    Our rows carry the C++ path's state (``cpp_launch``, as bench's cells write it), which
    SDPA rows lack and which may change between runs: it names no configuration; compiled
    rows of ours also carry our compile options, which an SDPA row has none of."""

    def row(attention, compile_, run, ms):
        out = {"model": "lm_core", "attention": attention, "compile": compile_, "run": run,
               "status": "ok", "median_ms": ms}  # fmt: skip
        if attention == "flash-triton":
            out["cpp_launch"] = "building" if run == 1 else "ready"
            if compile_:  # how compiled graphs call our kernels, as bench's cells write it
                out.update(traced_compile="auto", cpp_launch_compiled="True")
        return out

    rows = [
        row("sdpa", False, 1, 20.0), row("flash-triton", False, 1, 15.0),
        row("sdpa", False, 2, 30.0), row("flash-triton", False, 2, 17.0),
        row("sdpa", True, 1, 10.0), row("flash-triton", True, 1, 12.0),
        row("naive", "blocks", 1, 50.0),
    ]  # fmt: skip
    summary = isolated_runs.median_over_runs(rows, ["attention", "compile"])
    by = {(s["attention"], s["compile"]): s["vs_sdpa"] for s in summary}
    assert by[("flash-triton", False)] == pytest.approx(16.0 / 25.0, abs=1e-3)
    assert by[("flash-triton", True)] == pytest.approx(1.2)
    assert by[("sdpa", False)] is None
    assert by[("naive", "blocks")] is None  # no SDPA row with that compile setting
    rounds = {(s["attention"], s["compile"]): s["vs_sdpa_rounds"] for s in summary}
    assert rounds[("flash-triton", False)] == "0.750/0.567"  # run by run, in run order
    assert rounds[("flash-triton", True)] == "1.200"
    assert rounds[("sdpa", False)] is None
    assert rounds[("naive", "blocks")] is None
    assert [s["runs"] for s in summary] == [2, 2, 1, 1, 1]  # both runs of ours in one row
