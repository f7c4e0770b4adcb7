"""perf_tools.attention_features at tiny sizes on CPU: every case and provider runs, FLOPs
count the visible pairs, speedups divide the SDPA row."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from perf_tools import attention_features as af


def test_smoke_run_every_case(tmp_path):
    out, csv = tmp_path / "f.json", tmp_path / "f.csv"
    assert af.main(["--device", "cpu", "--json", str(out), "--csv", str(csv), "--quiet"]) == 0
    rows = json.loads(out.read_text())["rows"]
    providers = {(r["case"], r["provider"]) for r in rows}
    assert providers == {
        ("gqa", "ours"), ("gqa", "sdpa-enable_gqa"),
        ("varlen", "ours-varlen"), ("varlen", "ours-per-document"), ("varlen", "sdpa-padded"),
        ("window", "ours-window"), ("window", "ours-full-causal"),
        ("window", "sdpa-full-causal"), ("window", "sdpa-window-mask"),
        ("decode", "ours-split-kv"), ("decode", "ours-no-split"), ("decode", "sdpa"),
        ("kvcache", "ours"), ("kvcache", "sdpa-masked-cache"), ("kvcache", "sdpa-per-sequence"),
        ("kvcache", "ours-storing-the-token"), ("kvcache", "sdpa-index_put-then-masked"),
    }  # fmt: skip
    assert all(r["status"] == "ok" for r in rows), rows
    for r in rows:
        assert r["fwd_ms"] > 0
        assert (r.get("fwd_bwd_ms") is None) == (r["case"] in ("decode", "kvcache"))
        baseline = r["provider"] in (
            "sdpa-enable_gqa", "sdpa-padded", "sdpa-full-causal", "sdpa", "sdpa-masked-cache"
        )  # fmt: skip
        if baseline:
            assert r["speedup"] == pytest.approx(1.0)
    assert csv.read_text().startswith("case,shape,provider")


def test_a_run_stopped_part_way_keeps_the_shapes_it_finished(tmp_path, monkeypatch):
    """Rows are saved after each shape: a run stopped in its second shape keeps the first."""
    real, seen = af._run_case, []

    def stopped_on_the_second(case, cells, shape, cfg):
        seen.append(shape)
        if len(seen) > 1:
            raise KeyboardInterrupt
        return real(case, cells, shape, cfg)

    monkeypatch.setattr(af, "_run_case", stopped_on_the_second)
    out = tmp_path / "f.json"
    with pytest.raises(KeyboardInterrupt):
        af.main(["--device", "cpu", "gqa", "varlen", "--json", str(out), "--quiet"])
    saved = json.loads(out.read_text())
    assert saved["rows"]
    assert {r["shape"] for r in saved["rows"]} == {seen[0]}
    assert saved["meta"]["command"]


def test_kvcache_case_matches_sdpa_per_sequence():
    """The kvcache case's providers compute the same attention (the masked cache, the filled
    rows per sequence and ours), so the table compares equal work."""
    size = af.SIZES["kvcache"][1]
    cells, lens = af.kvcache_cells(size, torch.float32, torch.device("cpu"), torch.Generator())
    assert len(lens) == size["batch"]
    ours, masked, per_seq, ours_storing, sdpa_storing = (c.fwd for c in cells)
    with torch.no_grad():
        torch.testing.assert_close(ours(), masked(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours(), torch.cat(per_seq()), rtol=1e-5, atol=1e-5)
        # the storing steps write the same token into the same row and attend over it: equal
        # to each other and to the masked SDPA over the cache they wrote
        stored = ours_storing()
        torch.testing.assert_close(stored, sdpa_storing(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(stored, masked(), rtol=1e-5, atol=1e-5)


def test_useful_flops_count_visible_pairs():
    assert af.causal_pairs(5) == 15
    assert af.causal_pairs(5, 4) == 15  # a window as long as the sequence: full causal
    mask = torch.ones(9, 9).tril() * torch.ones(9, 9).triu(-3)  # window of 3 keys back
    assert af.causal_pairs(9, 3) == int(mask.sum())
    lens = af.document_lengths(100, 8, torch.Generator().manual_seed(0))
    assert len(lens) == 8
    assert sum(lens) == 100
    assert min(lens) >= 1


def test_split_kv_switch_restores_the_threshold():
    from flashattn_triton import configs

    before = configs.DECODE_MIN_KEYS
    with af._split_kv(False):
        assert configs.DECODE_MIN_KEYS > 2**40
    assert before == configs.DECODE_MIN_KEYS


def test_split_kv_switch_clears_remembered_calls(monkeypatch):
    """A remembered call replays the path its first call took, so switching the decode path
    off must clear the launch plans (else "ours-no-split" times the split kernels)."""
    from flashattn_triton import launch

    cleared = []
    monkeypatch.setattr(launch, "clear_plans", lambda: cleared.append(1))
    with af._split_kv(False):
        assert len(cleared) == 1
    assert len(cleared) == 2


def test_cell_setting_encloses_the_whole_measurement():
    inside, seen = [], []

    @contextlib.contextmanager
    def setting():
        inside.append(True)
        yield
        inside.pop()

    def fwd():
        seen.append(bool(inside))
        return torch.zeros(1)

    cell = af.Cell("x", fwd, fwd, 1.0, setting=setting)
    out = af._measure(cell, torch.device("cpu"), 1.0, 2.0)
    assert out["status"] == "ok"
    assert seen
    assert all(seen)  # forward and forward + backward timings, warm-up included
    assert not inside


def test_bad_case_names_the_choices(capsys):
    with pytest.raises(SystemExit):
        af.main(["--device", "cpu", "paged"])
    assert "gqa, varlen, window, decode" in capsys.readouterr().err


def test_config_rejects_bad_values_naming_the_field():
    cpu = torch.device("cpu")
    assert af.FeaturesConfig("cpu", cases=["gqa"]).cases == ("gqa",)
    for change, field in [
        ({"cases": ("paged",)}, "cases"),
        ({"cases": ()}, "cases"),
        ({"dtype": "fp8"}, "dtype"),
        ({"rep_ms": 0}, "rep_ms"),
        ({"warmup_ms": float("nan")}, "warmup_ms"),
    ]:
        with pytest.raises(ValueError, match=f"^{field}: "):
            af.FeaturesConfig(cpu, **change)


def test_config_from_args():
    parse = af.build_parser().parse_args
    cfg = af.config_from_args(parse(["--device", "cpu", "gqa", "decode", "gqa", "--no-mask"]))
    assert cfg.cases == ("gqa", "decode")  # each case once, in the order named
    assert not cfg.window_mask
    assert (cfg.rep_ms, cfg.warmup_ms) == (20.0, 5.0)  # the CPU smoke run: short timings
    assert af.config_from_args(parse(["--device", "cpu"])).cases == af.CASES


def test_config_refuses_a_bare_str_and_infinite_times():
    """A bare str is not a list of cases (not 'g', 'q', 'a'); a time must be finite."""
    assert af.FeaturesConfig(device="cpu", cases=["gqa"]).cases == ("gqa",)
    with pytest.raises(ValueError, match=r"^cases: expected a list or tuple"):
        af.FeaturesConfig(device="cpu", cases="gqa")
    with pytest.raises(ValueError, match=r"^warmup_ms: "):
        af.FeaturesConfig(device="cpu", warmup_ms=float("inf"))
