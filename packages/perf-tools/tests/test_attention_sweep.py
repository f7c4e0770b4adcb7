"""CPU checks of `python -m perf_tools.attention_sweep` (the GPU sweep itself runs on a GPU)."""

from __future__ import annotations

import json

import pytest
import torch

from perf_tools import attention_sweep as sweep


def test_cpu_run_writes_rows_and_marks_sdpa_unavailable(tmp_path, capsys):
    out = tmp_path / "s.json"
    rc = sweep.main(
        ["--shapes", "2x32", "--d", "16", "--causal", "yes", "--modes", "eager",
         "--device", "cpu", "--quiet", "--json", str(out), "--csv", str(tmp_path / "s.csv")]
    )  # fmt: skip
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 1
    row = rows[0]
    assert row["ours_ms"] > 0
    assert row["sdpa-flash_ms"] is None
    assert "GPU" in row["sdpa-flash_note"]
    assert "no row has both" in capsys.readouterr().out


def test_ratios_and_summary_pick_the_best_sdpa():
    row = {"mode": "eager", "causal": True, "d": 64, "heads": 8, "N": 8192}
    row.update({"ours_ms": 1.0, "sdpa-flash_ms": 2.0, "sdpa-cudnn_ms": 0.8})
    sweep.add_ratios(row, sweep.PROVIDERS)
    assert row["best_sdpa_ms"] == 0.8
    assert row["ours_vs_best"] == pytest.approx(1.25)
    assert not row["ours_wins"]
    text = sweep.summary([row])
    assert "0/1" in text
    assert "1.250" in text


def test_gpu_time_ratio_summary_and_plot_panel(tmp_path):
    """--graphed rows get ours / best SDPA of the GPU-only times too (the faster backend
    there may differ), a second summary line, and a second plot panel."""
    row = {"mode": "eager", "causal": False, "d": 128, "heads": 128, "N": 512}
    row.update({"ours_ms": 0.4, "sdpa-flash_ms": 0.3, "sdpa-cudnn_ms": 0.35})
    row.update(
        {"ours_graphed_ms": 0.2, "sdpa-flash_graphed_ms": 0.25, "sdpa-cudnn_graphed_ms": 0.22}
    )
    sweep.add_ratios(row, sweep.PROVIDERS)
    assert row["ours_vs_best"] == pytest.approx(0.4 / 0.3)
    assert row["ours_graphed_vs_best"] == pytest.approx(0.2 / 0.22)
    timed, graphed = sweep.summary([row]).splitlines()
    assert timed.startswith("ours <= best SDPA on 0/1")
    assert graphed.startswith("as GPU time alone, ours <= best SDPA on 1/1")
    assert "0.909" in graphed
    out = tmp_path / "p.png"
    sweep.plot([row], out)
    import matplotlib.image

    height, width = matplotlib.image.imread(out).shape[:2]
    assert width > 2.5 * height  # two 9 x 5 panels side by side
    untimed = {k: v for k, v in row.items() if "graphed" not in k}
    sweep.plot([untimed], out)
    height, width = matplotlib.image.imread(out).shape[:2]
    assert width < 2.5 * height
    assert len(sweep.summary([untimed]).splitlines()) == 1


def test_replot_prints_and_plots_an_earlier_run_without_timing(tmp_path, monkeypatch, capsys):
    row = {"mode": "eager", "causal": True, "d": 64, "heads": 8, "N": 8192}
    row.update({"ours_ms": 1.0, "sdpa-flash_ms": 2.0, "sdpa-cudnn_ms": 0.8})
    row.update({"ours_graphed_ms": 0.5, "sdpa-cudnn_graphed_ms": 0.6})
    earlier = tmp_path / "earlier.json"
    earlier.write_text(
        json.dumps({"meta": {"device": "NVIDIA H100", "commit": "abc"}, "rows": [row]})
    )
    monkeypatch.setattr(sweep, "run_sweep", lambda *a, **k: pytest.fail("replot timed"))
    png, out = tmp_path / "p.png", tmp_path / "again.json"
    assert sweep.main(["--replot", str(earlier), "--plot", str(png), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "NVIDIA H100" in printed
    assert "as GPU time alone, ours <= best SDPA on 1/1" in printed
    assert png.stat().st_size > 0
    again = json.loads(out.read_text())
    assert again["meta"]["commit"] == "abc"
    assert again["rows"][0]["ours_graphed_vs_best"] == pytest.approx(0.5 / 0.6)
    for bad in ("[1, 2]", '{"rows": [{"mode": "eager"}]}', "{not json"):
        (tmp_path / "bad.json").write_text(bad)
        with pytest.raises(SystemExit, match="--replot: cannot read sweep rows"):
            sweep.main(["--replot", str(tmp_path / "bad.json")])


def test_host_column_times_back_to_back_calls(tmp_path, monkeypatch):
    """--host: each provider's host us per call (fewer back-to-back calls for long ones),
    ours over the best SDPA's, a summary line and a plot panel of its own."""
    calls = []
    monkeypatch.setattr(sweep, "_bench", lambda fn, cfg: 80.0)  # an 80 ms call
    real_host_us = sweep._host_us

    def counting_host_us(fn, ms, cfg):
        calls.append(ms)
        return real_host_us(lambda: (fn(), calls.append("call")), ms, cfg)

    monkeypatch.setattr(sweep, "_host_us", counting_host_us)
    out = tmp_path / "s.json"
    rc = sweep.main(
        ["--shapes", "2x32", "--d", "16", "--causal", "yes", "--modes", "eager",
         "--device", "cpu", "--quiet", "--host", "--json", str(out)]
    )  # fmt: skip
    assert rc == 0
    [row] = json.loads(out.read_text())["rows"]
    assert row["ours_host_us"] > 0
    assert calls[0] == 80.0
    # 50 ms of queued work at most per sample: 3 calls (the floor) per sample, 5 samples
    assert calls.count("call") == sweep.HOST_MIN_CALLS * sweep.HOST_SAMPLES
    row.update({"sdpa-flash_host_us": 2 * row["ours_host_us"], "sdpa-flash_ms": 1.0})
    sweep.add_ratios(row, sweep.PROVIDERS)
    assert row["ours_host_vs_best"] == pytest.approx(0.5)
    assert "as host time to issue a call, ours <= best SDPA on 1/1" in sweep.summary([row])
    png = tmp_path / "p.png"
    sweep.plot([row], png)
    import matplotlib.image

    height, width = matplotlib.image.imread(png).shape[:2]
    assert width > 2.5 * height  # the timed panel and the host panel


def test_the_8b_shape_is_swept_at_d128_only():
    cfg = sweep.SweepConfig(shapes=sweep.SHAPES, device=torch.device("cpu"))
    assert (32, 32768) not in sweep._shapes_for(64, cfg)
    assert (32, 32768) in sweep._shapes_for(128, cfg)


def test_bad_arguments_are_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        sweep.main(["--shapes", "32by2048"])
    assert "HEADSxN" in capsys.readouterr().err
    with pytest.raises(ValueError, match="providers"):
        sweep.SweepConfig(shapes=((1, 8),), providers=("fa3",))


def test_autograd_threads_axis_times_each_setting(tmp_path, monkeypatch):
    """--autograd-threads on off: a row per setting, each timed with autograd's device
    threads switched as its label says (and torch's default restored afterwards)."""
    seen = []

    def fake_bench(fn, cfg):
        seen.append(torch._C._is_multithreading_enabled())
        return 1.0

    monkeypatch.setattr(sweep, "_bench", fake_bench)
    out = tmp_path / "s.json"
    rc = sweep.main(
        ["--shapes", "2x32", "--d", "16", "--causal", "yes", "--modes", "eager",
         "--device", "cpu", "--quiet", "--json", str(out), "--autograd-threads", "on", "off"]
    )  # fmt: skip
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["autograd_threads"] for r in rows] == ["on", "off"]
    assert seen == [True, False]
    assert torch._C._is_multithreading_enabled()


def test_a_sweep_stopped_part_way_keeps_its_finished_rows(tmp_path, monkeypatch):
    """The CSV / JSON are rewritten after each row: a run killed on its second row (a
    timeout, Ctrl-C) leaves the first row saved, with the run's metadata."""
    calls = []

    def fake_bench(fn, cfg):
        calls.append(fn)
        if len(calls) > 1:
            raise KeyboardInterrupt
        return 1.0

    monkeypatch.setattr(sweep, "_bench", fake_bench)
    out, csv_out = tmp_path / "s.json", tmp_path / "s.csv"
    with pytest.raises(KeyboardInterrupt):
        sweep.main(
            ["--shapes", "2x32", "4x32", "--d", "16", "--causal", "yes", "--modes", "eager",
             "--device", "cpu", "--quiet", "--json", str(out), "--csv", str(csv_out)]
        )  # fmt: skip
    saved = json.loads(out.read_text())
    assert [(r["heads"], r["N"]) for r in saved["rows"]] == [(2, 32)]
    assert saved["meta"]["command"]
    assert csv_out.read_text().count("\n") == 2  # header and the finished row
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.csv", "s.json"]  # no temporaries


def _fake_providers(monkeypatch, times: dict, fail: dict | None = None) -> list[str]:
    """Every provider runs here and is timed from `times` (an iterator each); `fail` maps a
    provider to the round from which its timing raises. Returns the timing order."""
    order: list[str] = []

    def fake_cell(attn, q, k, v, do, cfg):
        if fail and attn in fail and sum(p == attn for p in order) >= fail[attn]:
            raise RuntimeError("No available kernel. Aborting execution.")
        order.append(attn)
        return {"ms": next(times[attn])}

    monkeypatch.setattr(sweep, "_attention", lambda p, causal, compiled: p)
    monkeypatch.setattr(sweep, "_runs_here", lambda p, device: None)
    monkeypatch.setattr(sweep, "_cell", fake_cell)
    return order


def _one_row_config(rounds: int) -> sweep.SweepConfig:
    return sweep.SweepConfig(
        shapes=((2, 32),), head_dims=(16,), causal=(True,), modes=("eager",),
        device=torch.device("cpu"), dtype=torch.float32, rounds=rounds, quiet=True,
    )  # fmt: skip


def test_rounds_interleave_providers_and_report_medians(monkeypatch):
    times = {
        "ours": iter([1.0, 3.0, 2.0]),
        "sdpa-flash": iter([2.0, 2.0, 2.0]),
        "sdpa-cudnn": iter([4.0, 1.0, 4.0]),
    }
    order = _fake_providers(monkeypatch, times)
    [row] = sweep.run_sweep(_one_row_config(rounds=3))
    assert order == [
        "ours", "sdpa-flash", "sdpa-cudnn",
        "sdpa-flash", "sdpa-cudnn", "ours",
        "sdpa-cudnn", "ours", "sdpa-flash",
    ]  # fmt: skip
    assert (row["ours_ms"], row["sdpa-flash_ms"], row["sdpa-cudnn_ms"]) == (2.0, 2.0, 4.0)
    assert row["ours_vs_best"] == pytest.approx(1.0)
    # per round: 1 / min(2, 4), 3 / min(2, 1), 2 / min(2, 4)
    assert row["ours_vs_best_min"] == pytest.approx(0.5)
    assert row["ours_vs_best_max"] == pytest.approx(3.0)
    assert row["ours_vs_best_rounds"] == "0.500/3.000/1.000"  # round order, not sorted


def test_a_provider_failing_in_a_later_round_is_reported_not_half_counted(monkeypatch):
    times = {p: iter([1.0, 1.0, 1.0]) for p in sweep.PROVIDERS}
    order = _fake_providers(monkeypatch, times, fail={"sdpa-cudnn": 1})
    [row] = sweep.run_sweep(_one_row_config(rounds=3))
    assert order.count("sdpa-cudnn") == 1  # not retried once it failed
    assert row["sdpa-cudnn_ms"] is None
    assert "No available kernel" in row["sdpa-cudnn_note"]
    assert row["best_sdpa_ms"] == 1.0  # flash alone
    assert row["ours_vs_best_min"] == row["ours_vs_best_max"] == pytest.approx(1.0)


def test_one_round_adds_no_range_and_rounds_must_be_positive(monkeypatch):
    _fake_providers(monkeypatch, {p: iter([1.0]) for p in sweep.PROVIDERS})
    [row] = sweep.run_sweep(_one_row_config(rounds=1))
    assert "ours_vs_best_min" not in row
    assert "ours_vs_best_rounds" not in row
    with pytest.raises(ValueError, match="rounds"):
        _one_row_config(rounds=0)


def test_batch_sizes_the_inputs_and_labels_the_rows(tmp_path, monkeypatch):
    """--batch B: q, k, v of (B, heads, N, d), a batch column, BxHEADSxN in the summary;
    the default keeps batch 1 and no column."""
    shapes = []
    monkeypatch.setattr(sweep, "_bench", lambda fn, cfg: 1.0)
    real = sweep._inputs

    def inputs(heads, n, d, cfg, seed):
        out = real(heads, n, d, cfg, seed)
        shapes.append(tuple(out[0].shape))
        return out

    monkeypatch.setattr(sweep, "_inputs", inputs)
    out = tmp_path / "s.json"
    args = ["--shapes", "2x32", "--d", "16", "--causal", "yes", "--modes", "eager",
            "--device", "cpu", "--quiet", "--providers", "ours"]  # fmt: skip
    assert sweep.main([*args, "--batch", "3", "--json", str(out)]) == 0
    assert (3, 2, 32, 16) in shapes
    (row,) = json.loads(out.read_text())["rows"]
    assert row["batch"] == 3
    assert sweep.shape_label(row) == "3x2x32"
    assert sweep.main([*args, "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert "batch" not in row
    assert sweep.shape_label(row) == "2x32"
    with pytest.raises(ValueError, match="batch"):
        sweep.SweepConfig(shapes=((1, 8),), batch=0)


def test_config_normalizes_device_and_sequences():
    """A device name becomes a torch.device (cpu or cuda only); lists are held as tuples, so
    the config hashes; a bare str or a bool is refused."""
    cfg = sweep.SweepConfig(shapes=[[1, 8]], head_dims=[16], device="cpu")
    assert (cfg.device, cfg.shapes, cfg.head_dims) == (torch.device("cpu"), ((1, 8),), (16,))
    assert hash(cfg) == hash(sweep.SweepConfig(shapes=((1, 8),), head_dims=(16,), device="cpu"))
    bad = [
        ({"device": "meta"}, "device"),
        ({"providers": "ours"}, "providers: expected a list or tuple"),
        ({"rounds": True}, "rounds"),
    ]
    for change, start in bad:
        with pytest.raises(ValueError, match=f"^{start}"):
            sweep.SweepConfig(**{"shapes": ((1, 8),), "device": "cpu"} | change)


@pytest.mark.parametrize("value", ["inf", "nan", "0", "-1", "x"])
def test_time_flags_refuse_what_no_timing_can_use(value, capsys):
    """--rep-ms / --warmup-ms (every command's positive numbers, `_cli.positive_float`): a
    value that is not a positive finite number is an argparse error naming the flag."""
    with pytest.raises(SystemExit) as exc:
        sweep.build_parser().parse_args(["--rep-ms", value])
    assert exc.value.code == 2
    assert (
        f"argument --rep-ms: expected a positive number, got {value!r}" in capsys.readouterr().err
    )


def test_compiled_providers_use_static_shapes(monkeypatch):
    """Each shape compiles for itself (dynamic=False), as a model's fixed shapes do: with
    automatic dynamic shapes every shape after a group's first would be traced symbolically,
    and flashattn_triton's traced compiled graphs (static sizes only) would not be measured."""
    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append(kw) or fn)
    for provider in sweep.PROVIDERS:
        sweep._attention(provider, True, compiled=True)
    assert len(seen) == len(sweep.PROVIDERS)
    assert all(kw.get("dynamic") is False for kw in seen), seen


@pytest.mark.parametrize("cpp_compiled", [False, True])
def test_compiled_rows_record_the_compiled_launch_options(monkeypatch, cpp_compiled):
    """Compiled rows record how compiled graphs call our kernels, and the C++ path's status
    only where its opaque ops may replay through it; eager rows record the status."""
    times = {p: iter([1.0, 1.0]) for p in sweep.PROVIDERS}
    _fake_providers(monkeypatch, times)
    options = {"traced_compile": True, "cpp_launch_compiled": cpp_compiled}
    monkeypatch.setattr(sweep, "compiled_launch_options", lambda: dict(options))
    monkeypatch.setattr(sweep, "ready_cpp_launch", lambda: "ready")
    cfg = sweep.SweepConfig(
        shapes=((2, 32),), head_dims=(16,), causal=(True,), modes=("eager", "compiled"),
        device=torch.device("cuda"), dtype=torch.float32, quiet=True,
    )  # fmt: skip
    monkeypatch.setattr(sweep, "_inputs", lambda *a, **k: (None,) * 4)
    eager, compiled = sweep.run_sweep(cfg)
    assert compiled["traced_compile"] is True
    assert compiled["cpp_launch_compiled"] is cpp_compiled
    assert ("cpp_launch" in compiled) is cpp_compiled
    assert eager["cpp_launch"] == "ready"
    assert "traced_compile" not in eager


def test_kernels_are_recorded_for_each_provider_that_ran(monkeypatch):
    """--kernels: after a row's timings, one profiled call per provider that ran, under the
    autograd-thread setting it was timed with; none for a provider that failed."""
    _fake_providers(monkeypatch, {p: iter([1.0]) for p in sweep.PROVIDERS}, fail={"sdpa-cudnn": 0})
    profiled = []

    def fake_profile(fn):
        profiled.append(torch.autograd.is_multithreading_enabled())
        return f"kernel_{len(profiled)} + copy"

    monkeypatch.setattr(sweep, "profile_kernels", fake_profile)
    cfg = _one_row_config(rounds=1)
    object.__setattr__(cfg, "kernels", True)  # CPU stands in for the GPU it needs
    object.__setattr__(cfg, "autograd_threads", (False,))
    [row] = sweep.run_sweep(cfg)
    assert row["ours_kernels"] == "kernel_1 + copy"
    assert row["sdpa-flash_kernels"] == "kernel_2 + copy"
    assert "sdpa-cudnn_kernels" not in row
    assert profiled == [False, False]
    assert torch.autograd.is_multithreading_enabled()  # torch's default restored
    line = sweep._kernels_line(row, "eager 2x32", sweep.PROVIDERS)
    assert line == "eager 2x32 | ours: kernel_1 + copy | sdpa-flash: kernel_2 + copy"


def test_kernels_need_a_gpu(capsys):
    with pytest.raises(ValueError, match="kernels"):
        sweep.SweepConfig(shapes=((1, 8),), device=torch.device("cpu"), kernels=True)
    with pytest.raises(SystemExit, match="--kernels"):
        sweep.main(["--kernels", "--device", "cpu", "--shapes", "2x32", "--quiet"])


def test_a_failing_profiler_leaves_a_note(monkeypatch):
    import torch.profiler

    class Broken:
        def __init__(self, *a, **kw):
            pass

        def __enter__(self):
            raise RuntimeError("CUPTI unavailable\nmore")

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.profiler, "profile", Broken)
    assert sweep.profile_kernels(lambda: None) == "(profiler failed: CUPTI unavailable)"


def test_graph_captures_get_fresh_leaves():
    """The graphed cell's call detaches q, k, v into new leaves (their gradient nodes belong
    to the capture's stream); the timed call uses the inputs as they are."""
    cfg = sweep.SweepConfig(shapes=((2, 8),), device="cpu")
    q, k, v, do = sweep._inputs(2, 8, 4, cfg, seed=0)
    seen = []

    def attn(a, b, c):
        seen.append((a, b, c))
        return a * b + c

    sweep._fwd_bwd(attn, q, k, v, do)()
    sweep._fwd_bwd(attn, q, k, v, do, fresh_leaves=True)()
    plain, fresh = seen
    assert all(x is y for x, y in zip(plain, (q, k, v), strict=True))
    for leaf, t in zip(fresh, (q, k, v), strict=True):
        assert leaf is not t
        assert leaf.is_leaf
        assert leaf.requires_grad
        assert leaf.data_ptr() == t.data_ptr()  # a view of the same memory, not a copy
    assert q.grad is None  # torch.autograd.grad returns the gradients, accumulating none


def test_eager_rows_record_the_cpp_launch_status(monkeypatch):
    """Eager rows on a GPU say whether ours ran through flashattn_triton's C++ launch path,
    readied once before the first row."""
    times = {p: iter([1.0]) for p in sweep.PROVIDERS}
    _fake_providers(monkeypatch, times)
    readied = []
    monkeypatch.setattr(sweep, "ready_cpp_launch", lambda: readied.append(1) or "ready")
    cfg = sweep.SweepConfig(
        shapes=((2, 32),), head_dims=(16,), causal=(True,), modes=("eager",),
        device=torch.device("cuda"), dtype=torch.float32, quiet=True,
    )  # fmt: skip
    monkeypatch.setattr(sweep, "_inputs", lambda *a, **k: (None,) * 4)
    readings = iter(
        [
            {"forward": 10, "backward": 10, "backward_fallback": 2},  # before the row
            {"forward": 16, "backward": 15, "backward_fallback": 3},  # after its timings
        ]
    )
    monkeypatch.setattr(sweep, "cpp_launch_counters", lambda: next(readings))
    [row] = sweep.run_sweep(cfg)
    assert row["cpp_launch"] == "ready"
    assert readied == [1]
    # the row's replays from C++: the difference of the readings around its timings
    assert (row["ours_cpp_forward"], row["ours_cpp_backward"]) == (6, 5)
    assert row["ours_cpp_backward_fallback"] == 1
    assert next(readings, None) is None  # read once before and once after the row


def test_ready_cpp_launch_builds_and_reports_a_failure_once(monkeypatch, capsys):
    import flashattn_triton
    from perf_tools import _compile

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    state = {"status": "not built", "builds": 0}

    def build():
        state["builds"] += 1
        state["status"] = "failed: OSError: no compiler"
        raise RuntimeError("no compiler")

    monkeypatch.setattr(flashattn_triton, "build_cpp_launch", build)
    monkeypatch.setattr(flashattn_triton, "cpp_launch_status", lambda: state["status"])
    monkeypatch.setattr(_compile, "_CPP_NOTED", set())
    assert _compile.ready_cpp_launch() == "failed: OSError: no compiler"
    assert _compile.ready_cpp_launch() == "failed: OSError: no compiler"
    assert state["builds"] == 1
    assert capsys.readouterr().out.count("C++ launch path is not used") == 1
    state["status"] = "off"
    assert _compile.ready_cpp_launch() == "off"
    assert state["builds"] == 1


def test_cpp_launch_counters_read_flashattn_triton_or_nothing(monkeypatch):
    """The package's counters where it is installed, an empty reading where it is not."""
    import sys

    import flashattn_triton
    from perf_tools import _compile

    reading = {"forward": 3, "backward": 2, "backward_fallback": 1}
    monkeypatch.setattr(flashattn_triton, "cpp_launch_counters", lambda: reading)
    assert _compile.cpp_launch_counters() == reading
    monkeypatch.setitem(sys.modules, "flashattn_triton", None)  # import fails
    assert _compile.cpp_launch_counters() == {}
