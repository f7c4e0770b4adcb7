"""The bench rows' account of flashattn_triton's C++ replays (``cpp_replays``) and of the
drop-in's calls: measured columns, per step, never part of a row's configuration."""

from __future__ import annotations

import json

from perf_tools import _compile, bench, isolated_runs


def test_replays_per_step_are_the_counters_difference(monkeypatch):
    after = {"forward": 130, "backward": 124, "backward_fallback": 4}
    monkeypatch.setattr(_compile, "cpp_launch_counters", lambda: after)
    before = {"forward": 10, "backward": 10, "backward_fallback": 0}
    assert _compile.cpp_replays_per_step(before, 10) == "12/11.4/0.4"
    assert _compile.cpp_replays_per_step({}, 10) is None  # no reading before the steps
    monkeypatch.setattr(_compile, "cpp_launch_counters", lambda: {})
    assert _compile.cpp_replays_per_step(before, 10) is None  # flashattn_triton missing


def test_cpu_rows_carry_no_replay_count(tmp_path):
    """On the CPU nothing replays from C++: flash-triton rows leave the column empty."""
    out = tmp_path / "b.json"
    argv = ["--size", "tiny", "--context", "16", "--batch", "2", "--quiet", "--warmup", "1"]
    argv += ["--steps", "1", "--mode", "train", "--attention", "flash-triton"]
    assert bench.main([*argv, "--json", str(out)]) == 0
    [row] = json.loads(out.read_text())["rows"]
    assert row["attention"] == "flash-triton"
    assert row.get("cpp_replays") is None


def test_call_counts_do_not_split_a_configuration():
    """Two runs of one configuration whose drop-in or replay counts differ are one
    configuration in the ``--isolate`` summary."""
    base = {"size": "small", "attention": "flash-triton", "status": "ok", "median_ms": 10.0}
    a = {**base, "dropin_calls": "12/12", "cpp_replays": "12/12/0"}
    b = {**base, "dropin_calls": "11/12", "cpp_replays": "12/11/1", "median_ms": 12.0}
    assert isolated_runs.config_of(a) == isolated_runs.config_of(b)
    [summary] = isolated_runs.median_over_runs([a, b], ["size", "attention"])
    assert summary["runs"] == 2
