"""The decode benchmark at a tiny size on CPU: every provider gives a row, the CSV is written."""

from __future__ import annotations

import csv
import time

import pytest
import torch

from perf_tools import generate_bench


def test_cpu_smoke_rows_and_csv(tmp_path, capsys):
    out = tmp_path / "decode.csv"
    argv = [
        "--sizes",
        "tiny",
        "--batch-sizes",
        "1",
        "2",
        "--prompt-len",
        "4",
        "--new-tokens",
        "6",
        "--repeats",
        "1",
        "--providers",
        "eager",
        "cudagraph",
        "hf",
        "--csv",
        str(out),
        "--quiet",
    ]
    assert generate_bench.main(argv) == 0
    assert "greedy decode" in capsys.readouterr().out
    rows = list(csv.DictReader(out.open()))
    assert list(rows[0]) == generate_bench.COLUMNS
    cells = {(r["provider"], r["batch"]): r for r in rows}
    assert set(cells) == {(p, b) for p in ("eager", "cudagraph", "hf") for b in ("1", "2")}
    for batch in ("1", "2"):
        eager = cells["eager", batch]
        assert float(eager["tokens_per_s"]) > 0
        steps = int(eager["new_tokens"]) - 1
        expected = int(batch) * steps / (float(eager["ms_per_step"]) * steps / 1e3)
        assert float(eager["tokens_per_s"]) == pytest.approx(expected, rel=1e-6)
        assert cells["cudagraph", batch]["note"].startswith("skipped: CUDA graphs")
        hf = cells["hf", batch]
        if hf["note"]:  # transformers missing, or a decode within a busy CPU's noise
            assert hf["note"].startswith(("skipped: transformers is not installed", "not measured"))
            assert hf["tokens_per_s"] == ""
        else:
            assert float(hf["tokens_per_s"]) > 0


def test_hf_decode_within_the_noise_is_a_note_not_a_negative_rate(tmp_path, monkeypatch):
    """generate() of all the new tokens timed no slower than of one (noise on a busy
    machine): the row says so instead of reporting a negative decode time."""
    import types

    calls = []

    def generate(prompt, max_new_tokens, **kwargs):
        calls.append(max_new_tokens)
        # every call of 1 token stalls once: the prefill's median exceeds the whole run's
        if max_new_tokens == 1:
            time.sleep(0.02)
        return torch.zeros(prompt.shape[0], prompt.shape[1] + max_new_tokens, dtype=torch.long)

    model = types.SimpleNamespace(generate=generate)
    prompt = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(generate_bench.CellNotMeasuredError, match="within the noise"):
        generate_bench.time_hf(model, "hf", prompt, 6, repeats=3)
    assert calls == [6] + [1, 6] * 3  # a warm-up run, then the timed pairs
    row = generate_bench._row("tiny", 1, "hf", generate_bench.DecodeBenchConfig())
    generate_bench._measure(row, lambda: generate_bench.time_hf(model, "hf", prompt, 6, 1), "cpu")
    assert row["note"].startswith("not measured: generating 6 tokens took no longer than 1")
    assert row["tokens_per_s"] is None


def test_new_tokens_must_leave_a_decode_step(capsys):
    with pytest.raises(SystemExit):
        generate_bench.main(["--new-tokens", "1"])
    assert "--new-tokens" in capsys.readouterr().err


def test_a_failing_cell_is_an_error_row_and_exit_1(tmp_path, monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(generate_bench, "time_ours", broken)
    argv = [
        "--sizes",
        "tiny",
        "--batch-sizes",
        "1",
        "--new-tokens",
        "3",
        "--providers",
        "eager",
        "--csv",
        str(tmp_path / "d.csv"),
        "--quiet",
    ]
    assert generate_bench.main(argv) == 1
    (row,) = csv.DictReader((tmp_path / "d.csv").open())
    assert row["note"] == "error: RuntimeError: kernel exploded"
    assert "kernel exploded" in capsys.readouterr().err


def test_attention_backends_are_an_axis_of_our_rows(tmp_path):
    out = tmp_path / "decode.csv"
    argv = ["--sizes", "tiny", "--batch-sizes", "2", "--prompt-len", "4", "--new-tokens", "5"]
    argv += ["--repeats", "1", "--providers", "eager", "compile", "hf"]
    argv += ["--attention", "sdpa", "flash-triton", "--csv", str(out), "--quiet"]
    assert generate_bench.main(argv) == 0
    rows = list(csv.DictReader(out.open()))
    cells = {(r["provider"], r["attention"]) for r in rows}
    assert cells == {
        ("eager", "sdpa"), ("compile", "sdpa"), ("eager", "flash-triton"),
        ("compile", "flash-triton"), ("hf", "sdpa"),
    }  # fmt: skip
    for r in rows:
        if r["provider"] != "hf":
            assert float(r["tokens_per_s"]) > 0, r


def test_config_from_args_fills_defaults_and_names_a_bad_field():
    argv = ["--device", "cpu", "--attention", "sdpa,flash-triton", "sdpa"]
    cfg = generate_bench.config_from_args(generate_bench.build_parser().parse_args(argv))
    assert (cfg.sizes, cfg.batch_sizes, cfg.providers) == (
        ("small", "xl"), (1, 16), generate_bench.PROVIDERS,
    )  # fmt: skip
    assert cfg.attention == ("sdpa", "flash-triton")  # each backend once
    assert cfg.dtype == "fp32"  # the default off CUDA
    with pytest.raises(ValueError, match=r"^providers: expected some of .*'vllm'"):
        generate_bench.DecodeBenchConfig(device=torch.device("cpu"), providers=("vllm",))


def test_config_normalizes_device_and_sequences():
    """A device name becomes a torch.device (cpu or cuda only); lists become tuples, each value
    once (as the CLI's), so the frozen config hashes; a bare str or a bool is refused."""
    cfg = generate_bench.DecodeBenchConfig(
        sizes=["tiny"], batch_sizes=[1, 1], attention=["sdpa", "sdpa"], device="cpu"
    )
    assert (cfg.device, cfg.dtype) == (torch.device("cpu"), "fp32")
    assert (cfg.sizes, cfg.batch_sizes, cfg.attention) == (("tiny",), (1,), ("sdpa",))
    assert hash(cfg) == hash(generate_bench.DecodeBenchConfig(("tiny",), (1,), device="cpu"))
    bad = [
        ({"device": "meta"}, "device"),
        ({"sizes": "tiny"}, "sizes: expected a list or tuple"),
        ({"repeats": True}, "repeats"),
        ({"batch_sizes": (1.5,)}, "batch_sizes"),
    ]
    for change, start in bad:
        with pytest.raises(ValueError, match=f"^{start}"):
            generate_bench.DecodeBenchConfig(**{"device": "cpu"} | change)
