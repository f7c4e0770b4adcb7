"""benchmarks/step_breakdown.py: its parsing and aggregation (CPU), its refusal without a GPU,
and (GPU) one short run of every view."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest
import torch

PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "step_breakdown.py"


@pytest.fixture(scope="module")
def sb():
    spec = importlib.util.spec_from_file_location("step_breakdown", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_parse_smi_line(sb):
    s = sb.parse_smi_line("2026/11/24 03:07:21.133, 1725 MHz, 694.86 W, 57, 0x0000000000000004")
    assert (s["sm_mhz"], s["watts"], s["temp_c"], s["power_capped"]) == (1725, 694.86, 57, True)
    expect = time.mktime(time.strptime("2026/11/24 03:07:21", "%Y/%m/%d %H:%M:%S")) + 0.133
    assert s["t"] == pytest.approx(expect)
    idle = sb.parse_smi_line("2026/11/24 03:07:18.722, 1980 MHz, 137.17 W, 41, 0x0000000000000000")
    assert idle["power_capped"] is False
    # thermal slowdown alone (0x20) is not the software power cap
    hot = sb.parse_smi_line("2026/11/24 03:07:18.722, 1980 MHz, 137.17 W, 41, 0x0000000000000020")
    assert hot["power_capped"] is False
    for bad in ("", "garbage", "2026/11/24 03:07:18.722, [N/A], 1 W, 4, 0x0"):
        assert sb.parse_smi_line(bad) is None


def test_summarize_samples_window(sb):
    samples = [
        {"t": float(t), "sm_mhz": mhz, "watts": w, "temp_c": 50.0, "power_capped": cap}
        for t, mhz, w, cap in [(0, 1980, 100, False), (1, 1700, 700, True), (2, 1800, 690, True),
                               (3, 1600, 700, False), (4, 1980, 120, False)]
    ]  # fmt: skip
    s = sb.summarize_samples(samples, 1, 3)
    assert s == {"samples": 3, "sm_mhz": 1700, "watts": 700, "power_capped": pytest.approx(2 / 3)}
    assert sb.summarize_samples(samples, 10, 11) == {"samples": 0}


def test_aggregate_kernels(sb):
    events = [  # two steps: a (10 us) then b (30 us) with a 5 us gap, twice
        ("a", 0.0, 10.0), ("b", 15.0, 45.0), ("a", 50.0, 60.0), ("b", 65.0, 95.0),
    ]  # fmt: skip
    agg = sb.aggregate_kernels(events, steps=2)
    assert agg["span_us"] == pytest.approx(47.5)
    assert agg["busy_us"] == pytest.approx(40.0)
    assert [r["name"] for r in agg["kernels"]] == ["b", "a"]  # by total time
    assert agg["kernels"][0]["per_step"] == 1
    assert agg["kernels"][0]["mean_us"] == 30
    assert sb.aggregate_kernels([], 3)["kernels"] == []


def test_region_medians(sb):
    marks = []
    t = 0.0
    for fwd, bwd in ((1.0, 3.0), (1.2, 3.4), (1.1, 3.2)):
        marks += [("step<", t), ("fwd<", t + 0.01), ("fwd>", t + 0.01 + fwd)]
        t += 0.01 + fwd
        marks += [("bwd<", t + 0.05), ("bwd>", t + 0.05 + bwd), ("step>", t + 0.06 + bwd)]
        t += 0.06 + bwd + 0.5  # the flush between steps: not a gap of the step
    r = sb.region_medians(marks)
    assert r["fwd"] == pytest.approx(1.1)
    assert r["bwd"] == pytest.approx(3.2)
    assert r["step"] == pytest.approx(0.01 + 1.1 + 0.06 + 3.2)
    assert r["fwd>..bwd<"] == pytest.approx(0.05)
    assert "step>..step<" not in r
    assert "fwd<..fwd>" not in r


def test_needs_gpu_and_checks_args(sb, capsys, tmp_path):
    with pytest.raises(SystemExit):
        sb.main(["--steps", "0"])
    assert "--steps must be >= 1" in capsys.readouterr().err
    if not torch.cuda.is_available():
        out = tmp_path / "new" / "sb"
        assert sb.main(["--out", str(out)]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err
        # --out exists before any view runs: the power view writes its CSV there mid-run
        # (a folder created only at the end once lost that view).
        assert out.is_dir()


@pytest.mark.gpu
def test_step_breakdown_runs(sb, tmp_path, capsys):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    assert sb.main(["--n", "1024", "--heads", "2", "--steps", "3", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "attn_bwd_dkdv_kernel" in out or "dkdv" in out
    data = json.loads(next(tmp_path.glob("step_breakdown_*.json")).read_text())
    assert data["ours_kernels"]["busy_us"] > 0
    regions = set(data["ours_sustained"])
    assert {"forward", "fwd", "backward", "step"} <= regions
    assert regions & {"dkdv", "fused", "atomic"}, regions  # a backward kernel was timed
    assert data["sdpa_cudnn_sustained"]["step"] > 0
