"""perf_tools.profile on CPU: named ranges present, shares add up, files written."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from perf_tools import profile


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("prof")
    argv = ["--size", "tiny", "--context", "16", "--batch", "2", "--mode", "forward", "train"]
    argv += ["--warmup", "1", "--steps", "2", "--out", str(out), "--quiet"]
    assert profile.main(argv) == 0
    return out


def _tables(out, mode):
    (cell,) = [p for p in out.iterdir() if p.is_dir() and p.name.endswith(f"{mode}-ctx16")]
    return cell, json.loads((cell / "tables.json").read_text())


def test_train_step_has_every_range_and_shares_add_up(profiled):
    _cell, tables = _tables(profiled, "train")
    assert tables["meta"]["unit"] == "cpu op"
    ranges = {r["range"]: r for r in tables["ranges"]}
    for name in ("forward", "backward", "optimizer", "attention", "attention/scores",
                 "attention/softmax", "attention/weighted_sum", "ffn"):  # fmt: skip
        assert name in ranges, name
    # 2 layers: each sub-step range opens twice per step
    assert ranges["attention/softmax"]["occurrences_per_step"] == 2
    level0 = sum(r["share_pct"] for r in tables["ranges"] if r["level"] == 0)
    assert level0 == pytest.approx(100.0, abs=0.01)
    assert sum(r["share_pct"] for r in tables["kernels"]) == pytest.approx(100.0, abs=0.01)
    for scope in ("step", "forward", "backward", "optimizer"):
        shares = [r["share_of_scope_pct"] for r in tables["split"] if r["scope"] == scope]
        assert sum(shares) == pytest.approx(100.0, abs=0.01), scope
    # nested ranges cannot take more time than the range around them
    assert ranges["attention/softmax"]["ms_per_step"] <= ranges["attention"]["ms_per_step"]
    assert ranges["attention"]["ms_per_step"] <= ranges["forward"]["ms_per_step"]


def test_attention_substeps_have_flops(profiled):
    _, tables = _tables(profiled, "train")
    rows = {r["sub_step"]: r for r in tables["attention"]}
    assert set(rows) == {"attention/scores", "attention/softmax", "attention/weighted_sum"}
    # tiny: 2 layers, 4 heads, head dim 16, batch 2, context 16
    mm = 2 * 2 * 4 * 16 * 16 * 16 * 2
    assert rows["attention/scores"]["gflop_per_step"] == pytest.approx(mm / 1e9)
    assert rows["attention/scores"]["flops_vs_softmax"] == pytest.approx(16 * 2 / 5)


def test_forward_has_no_backward_range(profiled):
    _, tables = _tables(profiled, "forward")
    names = {r["range"] for r in tables["ranges"]}
    assert "forward" in names
    assert "backward" not in names
    assert "optimizer" not in names


def test_files_written(profiled):
    cell, _ = _tables(profiled, "train")
    for name in ("kernels.csv", "split.csv", "ranges.csv", "attention.csv", "tables.json"):
        assert (cell / name).stat().st_size > 0, name
    trace = json.loads(gzip.decompress((cell / "trace.json.gz").read_bytes()))
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"forward", "backward", "optimizer", "attention/softmax"} <= names
    summary = json.loads((profiled / "summary.json").read_text())["rows"]
    assert [r["status"] for r in summary] == ["ok", "ok"]
    assert all(0 < r["matmul_pct"] < 100 for r in summary)


def test_sdpa_backend_says_no_substeps(tmp_path, capsys):
    argv = ["--size", "tiny", "--context", "8", "--mode", "forward", "--attention", "sdpa"]
    argv += ["--warmup", "0", "--steps", "1", "--out", str(tmp_path), "--quiet", "--no-trace"]
    assert profile.main(argv) == 0
    assert "has no separate sub-steps" in capsys.readouterr().out
    assert not list(tmp_path.glob("*/trace.json.gz"))


def test_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        profile.main(["--steps", "0"])
    assert "--steps" in capsys.readouterr().err


def test_default_output_is_under_runs():
    """runs/ is git-ignored: a profile run from the repository root leaves the tree clean."""
    assert profile.build_parser().parse_args([]).out == Path("runs/profile")


def test_bench_profile_keeps_the_train_options(monkeypatch):
    """`bench --profile` profiles the cells bench would time: the optimizer's state dtype
    and held bf16 weights reach the profiled specs, through a typed config."""
    from perf_tools import bench

    got = []
    monkeypatch.setattr(profile, "main_from_bench", lambda cfg: got.append(cfg) or 0)
    argv = ["--size", "tiny", "--context", "16", "--mode", "train", "--precision", "bf16"]
    argv += ["--optimizer-state-dtype", "bf16", "--matmul-weights", "fp32", "bf16"]
    assert bench.main([*argv, "--warmup", "1", "--profile", "unused"]) == 0
    (cfg,) = got
    assert isinstance(cfg, profile.ProfileConfig)
    assert (cfg.out, cfg.warmup, cfg.steps) == (Path("unused"), 1, 3)  # bench's --profile default
    specs = profile._specs(cfg)
    assert [(s.opt_state, s.weights) for s in specs] == [("bf16", "fp32"), ("bf16", "bf16")]
    assert {s.attention for s in specs} == {"naive"}


def test_config_maps_flags_and_names_a_bad_field(tmp_path):
    argv = ["--size", "tiny", "--context", "32", "16", "--mode", "train", "--precision", "bf16"]
    argv += ["--compile", "--no-trace", "--top", "4", "--out", str(tmp_path), "--device", "cpu"]
    cfg = profile.config_from_args(profile.parse_args(argv))
    assert (cfg.sizes, cfg.contexts, cfg.modes, cfg.precisions) == (
        ("tiny",), (32, 16), ("train",), ("bf16",),
    )  # fmt: skip
    assert (cfg.compiles, cfg.trace, cfg.top, cfg.out) == ((True,), False, 4, tmp_path)
    assert [s.context for s in profile._specs(cfg)] == [16, 32]
    with pytest.raises(ValueError, match=r"^modes: "):
        profile.ProfileConfig(out=tmp_path, sizes=["tiny"], contexts=[16], modes=["backward"])
    with pytest.raises(ValueError, match=r"^steps: "):
        profile.ProfileConfig(out=tmp_path, sizes=["tiny"], contexts=[16], steps=0)
    with pytest.raises(ValueError, match=r"^compiles: "):
        profile.ProfileConfig(out=tmp_path, sizes=["tiny"], contexts=[16], compiles=[1])


def test_config_normalizes_device_and_refuses_bad_values(tmp_path):
    """A device name becomes a torch.device, cpu or cuda only; a bare str is not a list of
    sizes (not 't', 'i', 'n', 'y'); a bool is not an int."""
    ok = {"out": tmp_path, "sizes": ["tiny"], "contexts": [8]}
    cfg = profile.ProfileConfig(**ok, device="cpu")
    assert (cfg.device.type, cfg.sizes, cfg.contexts) == ("cpu", ("tiny",), (8,))
    bad = [
        ({"device": "meta"}, "device"),
        ({"sizes": "tiny"}, "sizes"),
        ({"modes": "train"}, "modes"),
        ({"seed": True}, "seed"),
    ]
    for change, field in bad:
        with pytest.raises(ValueError, match=f"^{field}: "):
            profile.ProfileConfig(**ok | change)
