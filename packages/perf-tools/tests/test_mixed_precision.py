"""Mixed-precision experiments against independent numpy arithmetic and autocast facts."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from perf_tools import mixed_precision as mp


def _numpy_sum(acc, add, n=1000, value=0.01):
    s = acc(0)
    x = add(value)
    for _ in range(n):
        s = acc(s + acc(x))
    return float(s)


def test_accumulation_matches_numpy(tmp_path):
    out = tmp_path / "acc.json"
    assert mp.main(["accumulate", "--json", str(out)]) == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["fp32 += fp32"]["result"] == pytest.approx(
        _numpy_sum(np.float32, np.float32), abs=0
    )
    assert rows["fp16 += fp16"]["result"] == _numpy_sum(np.float16, np.float16)
    assert rows["fp32 += fp16"]["result"] == pytest.approx(_numpy_sum(np.float32, np.float16))
    assert rows["fp32 += fp16.to(fp32)"]["result"] == rows["fp32 += fp16"]["result"]
    # the lesson: an fp16 accumulator loses ~0.5%, fp32 accumulation keeps 1e-4 or better
    assert rows["fp16 += fp16"]["rel_error"] > 1e-3
    assert rows["fp32 += fp32"]["rel_error"] < 1e-4
    assert sum(r["handout"] for r in rows.values()) == 4


def test_toy_dtypes_cpu_bf16():
    rows = {r["component"]: r["dtype"] for r in mp.toy_dtypes(torch.device("cpu"), torch.bfloat16)}
    assert rows["parameters (inside autocast)"] == "float32"  # autocast never casts parameters
    assert rows["fc1 output"] == "bfloat16"  # linear runs in the autocast dtype
    assert rows["logits (fc2 output)"] == "bfloat16"
    assert rows["loss (cross_entropy)"] == "float32"  # cross_entropy autocasts to fp32
    assert rows["gradients"] == "float32"  # gradients take the parameters' dtype


def test_toy_dtypes_cli_reports_device(tmp_path):
    out = tmp_path / "d.csv"
    assert mp.main(["toy-dtypes", "--device", "cpu", "--csv", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("device,autocast,component,dtype")
    assert text.count("\ncpu,") == 12  # 6 components x (fp16, bf16)


@pytest.mark.gpu
def test_toy_dtypes_cuda_fp16_layernorm_in_fp32():
    rows = {r["component"]: r["dtype"] for r in mp.toy_dtypes(torch.device("cuda"), torch.float16)}
    assert rows["fc1 output"] == "float16"
    assert rows["layer-norm output"] == "float32"  # CUDA autocast runs layer_norm in fp32
    assert rows["gradients"] == "float32"


def test_bare_command_runs_both_experiments(tmp_path, capsys):
    out = tmp_path / "mp.json"
    assert mp.main(["--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "added 1000 times" in printed
    assert "dtypes inside torch.autocast" in printed
    acc = json.loads((tmp_path / "mp-accumulate.json").read_text())["rows"]
    dtypes = json.loads((tmp_path / "mp-toy-dtypes.json").read_text())["rows"]
    assert len(acc) == len(mp.VARIANTS)
    assert {r["autocast"] for r in dtypes} == {"float16", "bfloat16"}


def test_output_flag_before_the_subcommand_is_kept(tmp_path):
    out = tmp_path / "acc.csv"
    assert mp.main(["--csv", str(out), "accumulate", "--n", "10"]) == 0
    assert out.read_text().startswith("variant,")
