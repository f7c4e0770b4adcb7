"""perf_tools.attention at tiny sizes on CPU: tables, FLOPs, OOM cells, memory accounting."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from perf_tools import attention, attention_providers
from perf_tools.flops import attention_flops


def test_naive_sweep(tmp_path):
    out = tmp_path / "n.json"
    argv = ["naive", "--device", "cpu", "--providers", "naive", "--seq", "16", "32", "--d", "16"]
    argv += ["--passes", "2", "--warmup", "1", "--json", str(out), "--quiet"]
    assert attention.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["seq"], r["status"]) for r in rows] == [(16, "ok"), (32, "ok")]
    assert all(r["fwd_ms"] > 0 and r["bwd_ms"] > 0 for r in rows)
    assert rows[0]["predicted_mib_before_bwd"] == pytest.approx(
        attention.naive_saved_bytes(2, 16, 16, torch.float32, True) / 2**20
    )


def test_naive_compiled_runs(tmp_path):
    out = tmp_path / "n.json"
    argv = ["naive", "--device", "cpu", "--providers", "naive-compiled", "--seq", "16"]
    argv += ["--d", "16", "--passes", "1", "--warmup", "1", "--json", str(out), "--quiet"]
    assert attention.main(argv) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["status"] == "ok"
    assert row["provider"] == "naive-compiled"


def test_flash_sweep_columns_and_flops(tmp_path):
    out, png = tmp_path / "f.csv", tmp_path / "f.png"
    providers = ["naive", "flash-torch", "sdpa-math", "sdpa-cudnn"]
    argv = ["flash", "--device", "cpu", "--providers", *providers, "--seq", "16", "32"]
    argv += ["--d", "16", "--csv", str(out), "--json", str(tmp_path / "f.json")]
    argv += ["--plot", str(png), "--quiet"]
    assert attention.main(argv) == 0
    rows = json.loads((tmp_path / "f.json").read_text())["rows"]
    assert len(rows) == 2 * len(providers)
    for r in rows:
        if r["provider"] == "sdpa-cudnn":  # no cuDNN attention on CPU: a recorded cell
            assert r["status"].startswith("unsupported")
            continue
        assert r["status"] == "ok", r
        fb = attention_flops(1, 1, r["seq"], r["seq"], 16, True, "fwd_bwd")
        assert r["gflop_fwd_bwd"] == pytest.approx(fb / 1e9)
        assert r["fwd_bwd_tflops"] == pytest.approx(fb / (r["fwd_bwd_ms"] * 1e-3) / 1e12)
    naive = [r for r in rows if r["provider"] == "naive"]
    assert all(r["speedup_vs_naive"] == pytest.approx(1.0) for r in naive)
    assert png.exists()
    assert out.exists()


def test_flash_triton_under_interpreter(tmp_path):
    pytest.importorskip("flashattn_triton")
    out = tmp_path / "f.json"
    argv = ["flash", "--device", "cpu", "--providers", "flash-triton", "--seq", "16", "--d", "16"]
    argv += ["--json", str(out), "--quiet"]
    if os.environ.get("TRITON_INTERPRET") == "1":  # CI: triton was imported in interpreter mode
        assert attention.main(argv) == 0
    else:  # the interpreter is chosen when triton is imported: a fresh process with it set
        env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
        proc = subprocess.run(
            [sys.executable, "-m", "perf_tools.attention", *argv],
            capture_output=True, text=True, timeout=300, env=env,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["status"] == "ok", row


def test_flash_triton_skipped_without_gpu_or_interpreter(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(attention_providers.UnsupportedError, match="CUDA"):
        attention_providers.make_provider("flash-triton", torch.device("cpu"), torch.float32, True)


def test_flash_triton_asked_for_where_it_cannot_run_is_marked_not_replaced(
    tmp_path, monkeypatch, capsys
):
    # It used to be swapped for `naive` silently: the table said nothing of flash-triton.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    out = tmp_path / "f.json"
    argv = ["flash", "--device", "cpu", "--seq", "16", "--d", "16", "--json", str(out), "--quiet"]
    assert attention.main([*argv, "--providers", "flash-triton", "flash-torch"]) == 0
    assert "flash-triton cannot run here" in capsys.readouterr().err
    rows = json.loads(out.read_text())["rows"]
    assert [(r["provider"], r["status"][:11]) for r in rows] == [
        ("flash-triton", "unsupported"),
        ("flash-torch", "ok"),
    ]
    assert rows[0]["fwd_bwd_ms"] is None
    # nothing that was asked for can run: a non-zero exit, no row of another provider
    assert attention.main([*argv, "--providers", "flash-triton"]) == 1
    assert "no provider of flash can run on cpu" in capsys.readouterr().err
    (row,) = json.loads(out.read_text())["rows"]
    assert row["provider"] == "flash-triton"
    assert row["status"].startswith("unsupported")


def test_oom_cells_are_recorded_and_larger_ones_skipped(tmp_path, monkeypatch):
    real = attention_providers.make_provider

    def tight_memory(name, device, dtype, causal):
        fn = real(name, device, dtype, causal)

        def run(q, k, v):
            if q.shape[1] >= 32:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")
            return fn(q, k, v)

        return run

    monkeypatch.setattr(attention, "make_provider", tight_memory)
    out = tmp_path / "f.json"
    argv = ["flash", "--device", "cpu", "--providers", "naive", "--seq", "16", "32", "64"]
    assert attention.main([*argv, "--d", "16", "--json", str(out), "--quiet"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["status"] for r in rows] == ["ok", "OOM", "OOM (skipped: OOM at seq 32)"]
    assert rows[1]["fwd_ms"] is None


def test_naive_saved_bytes_formula():
    # fp32 causal: q, k, v, o + P (fp32) + bool mask
    assert attention.naive_saved_bytes(8, 1024, 64, torch.float32, True) == (
        4 * 8 * 1024 * 64 * 4 + 8 * 1024 * 1024 * 4 + 1024 * 1024
    )
    # bf16 causal keeps the fp32 P and its bf16 copy
    assert attention.naive_saved_bytes(1, 256, 16, torch.bfloat16, True) == (
        4 * 256 * 16 * 2 + 256 * 256 * 4 + 256 * 256 + 256 * 256 * 2
    )
    acc = attention.naive_accounting(8, 16384, 16, torch.float32, True)
    p = next(r for r in acc if r["tensor"].startswith("P = softmax"))
    assert p["mib"] == 8 * 16384 * 16384 * 4 / 2**20  # 8 GiB for one N x N fp32 matrix


def test_leaderboard_cpu_shape(tmp_path):
    out = tmp_path / "lb.json"
    argv = ["leaderboard", "--device", "cpu", "--providers", "naive", "--seq", "16", "--d", "16"]
    assert attention.main([*argv, "--json", str(out), "--quiet"]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["status"] == "ok"
    assert row["fwd_bwd_ms"] > 0
    assert row["fwd_ms"] is None


def test_configs_reject_bad_values_naming_the_field():
    """The typed configs check their own values (argparse's types guard the CLI; these guard
    a config built in code): the message starts with the field's name."""
    from perf_tools.attention_naive import NaiveConfig

    ok = {"device": "cpu", "batch": 1, "seq": [16], "d": [16], "dtypes": ["fp32"]}
    ok["providers"] = ["naive"]
    cfg = NaiveConfig(**ok)
    assert (cfg.device, cfg.seq, cfg.passes) == (torch.device("cpu"), (16,), 100)
    bad = [
        ({"batch": 0}, "batch"),
        ({"seq": [16, -1]}, "seq"),
        ({"d": []}, "d"),
        ({"dtypes": ["fp8"]}, "dtypes"),
        ({"providers": ["magic"]}, "providers"),
        ({"device": "tpu"}, "device"),
        ({"passes": 0}, "passes"),
        ({"warmup": -1}, "warmup"),
    ]
    for change, field in bad:
        with pytest.raises(ValueError, match=f"^{field}: "):
            NaiveConfig(**ok | change)
    for change, field in [({"rep_ms": 0.0}, "rep_ms"), ({"peak_tflops": -1.0}, "peak_tflops")]:
        with pytest.raises(ValueError, match=f"^{field}: "):
            attention.FlashConfig(**ok | change)
    with pytest.raises(ValueError, match=r"^causal: "):
        attention.FlashConfig(**ok | {"causal": False}, leaderboard=True)


def test_config_from_args_fills_the_cpu_grid():
    parse = attention.build_parser().parse_args
    args = parse(["--seed", "3", "flash", "--device", "cpu", "--seq", "16,32", "--rep-ms", "500"])
    cfg = attention.config_from_args(args, "flash")
    assert isinstance(cfg, attention.FlashConfig)
    assert (cfg.batch, cfg.seq, cfg.d, cfg.dtypes, cfg.seed) == (1, (16, 32), (16,), ("fp32",), 3)
    assert cfg.causal
    assert cfg.rep_ms == 20.0  # tiny sizes off the GPU: short timings too
    naive = attention.config_from_args(parse(["naive", "--device", "cpu", "--no-causal"]), "naive")
    assert isinstance(naive, attention.NaiveConfig)
    assert (naive.passes, naive.warmup, naive.causal) == (3, 1, False)
    assert naive.providers == ("naive", "naive-compiled")
    lb = attention.config_from_args(parse(["leaderboard", "--device", "cpu"]), "leaderboard")
    assert lb.leaderboard
    assert lb.causal


def test_run_naive_takes_a_config():
    from perf_tools.attention_naive import NaiveConfig, run_naive

    cfg = NaiveConfig(
        device="cpu", batch=1, seq=[16], d=[16], dtypes=["fp32"], providers=["naive"],
        passes=1, warmup=0, quiet=True,
    )  # fmt: skip
    (row,) = run_naive(cfg)
    assert (row["status"], row["batch"], row["seq"], row["causal"]) == ("ok", 1, 16, True)


def test_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        attention.main(["flash", "--providers", "magic"])
    assert "--providers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        attention.main(["naive", "--seq", "0"])
    assert "--seq" in capsys.readouterr().err


@pytest.mark.gpu
def test_naive_memory_before_backward_matches_accounting(tmp_path):
    out = tmp_path / "n.json"
    argv = ["naive", "--device", "cuda", "--providers", "naive", "--seq", "1024", "4096"]
    argv += ["--d", "64", "--batch", "8", "--passes", "2", "--warmup", "1", "--json", str(out)]
    assert attention.main([*argv, "--quiet"]) == 0
    for r in json.loads(out.read_text())["rows"]:
        assert r["status"] == "ok"
        # allocator rounding only: within 2% of the tensor-by-tensor prediction
        assert math.isclose(r["mib_before_bwd"], r["predicted_mib_before_bwd"], rel_tol=0.02), r


@pytest.mark.parametrize("cmd", ["naive", "flash", "leaderboard"])
def test_common_options_before_or_after_the_subcommand(cmd, tmp_path):
    """`--csv x flash` and `flash --csv x` mean the same; an option given on neither side
    keeps its default (argparse used to reset the first form's value to None)."""
    from perf_tools.attention import build_parser

    before = build_parser().parse_args(["--csv", str(tmp_path / "a.csv"), "--quick", cmd])
    after = build_parser().parse_args([cmd, "--csv", str(tmp_path / "a.csv"), "--quick"])
    neither = build_parser().parse_args([cmd])
    for args in (before, after):
        assert args.csv == tmp_path / "a.csv"
        assert args.quick is True
    assert neither.csv is None
    assert neither.quick is False
    assert neither.seed == 0
    assert neither.device is None
    both = build_parser().parse_args(["--seed", "1", cmd, "--seed", "2"])
    assert both.seed == 2


def test_configs_refuse_bare_strs_infinite_times_and_hash():
    """A bare str is not a list of sizes (not '6', '4'); a time must be finite; lists are
    held as tuples, so the config hashes."""
    from perf_tools.attention_naive import NaiveConfig

    ok = {"device": "cpu", "batch": 1, "seq": [16], "d": [16], "dtypes": ["fp32"]}
    ok["providers"] = ["naive"]
    assert hash(NaiveConfig(**ok)) == hash(NaiveConfig(**ok))
    with pytest.raises(ValueError, match=r"^seq: expected a list or tuple"):
        NaiveConfig(**ok | {"seq": "64"})
    with pytest.raises(ValueError, match=r"^dtypes: expected a list or tuple"):
        NaiveConfig(**ok | {"dtypes": "fp32"})
    with pytest.raises(ValueError, match=r"^rep_ms: "):
        attention.FlashConfig(**ok, rep_ms=float("inf"))
