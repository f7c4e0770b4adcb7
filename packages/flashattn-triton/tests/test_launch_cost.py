"""benchmarks/launch_cost.py (GPU): one short run times every launcher row, the packed-sequence
rows and the plan-key path included, and leaves the remembered calls switched back on."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.gpu
def test_launch_cost_runs(tmp_path, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    monkeypatch.syspath_prepend(str(BENCH))  # it imports its sibling host_cost
    spec = importlib.util.spec_from_file_location("launch_cost", BENCH / "launch_cost.py")
    lc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lc)
    from flashattn_triton import launch_varlen

    real = launch_varlen.call_key
    out = tmp_path / "lc.json"
    args = ["--shape", "2,4,384,64", "--docs", "3", "--calls", "5", "--repeats", "2"]
    args += ["--layers", "3"]
    assert lc.main([*args, "--json", str(out)]) == 0
    rows = {r["case"]: r for r in json.loads(out.read_text())["rows"]}
    ours = [name for name in rows if not name.startswith("SDPA")]
    for name in ours:
        assert rows[name]["us_per_call"] is not None, (name, rows[name].get("error"))
    assert {"varlen backward", "launch.backward, plan-key path"} <= set(rows)
    assert "launch.backward, 3 layers" in rows
    assert launch_varlen.call_key is real
    sys.modules.pop("host_cost", None)
