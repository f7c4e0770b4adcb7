"""perf_tools.bench on CPU: every mode and precision, outputs, OOM and error handling, CLI."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from perf_tools import bench, cells, models
from perf_tools.flops import formula_forward_flops

TINY = ["--size", "tiny", "--context", "16", "--batch", "2", "--quiet"]
FAST = ["--warmup", "1", "--steps", "2"]


def _run(argv, capsys=None):
    rc = bench.main(argv)
    return rc


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_every_mode_and_precision_writes_csv_and_json(tmp_path):
    out_csv, out_json = tmp_path / "b.csv", tmp_path / "b.json"
    argv = [*TINY, *FAST, "--mode", "forward", "fwd-bwd", "train"]
    argv += ["--precision", "fp32,bf16", "--csv", str(out_csv), "--json", str(out_json)]
    assert bench.main(argv) == 0
    rows = _rows(out_csv)
    assert len(rows) == 6
    assert {(r["mode"], r["precision"]) for r in rows} == {
        (m, p) for m in ("forward", "fwd-bwd", "train") for p in ("fp32", "bf16")
    }
    for col in ("mean_ms", "std_ms", "median_ms", "tokens_per_s", "tflops", "peak_mem_gib",
                "warmup_s", "first_step_s", "gflop_per_step", "params_M", "status"):  # fmt: skip
        assert col in rows[0], col
    for r in rows:
        assert r["status"] == "ok"
        assert float(r["mean_ms"]) > 0
        assert float(r["median_ms"]) > 0
        assert r["peak_mem_gib"] == ""  # no CUDA allocator on CPU: reported as missing
    train = next(r for r in rows if r["mode"] == "train")
    assert float(train["opt_ms"]) > 0
    assert float(train["bwd_ms"]) > 0
    fwd = next(r for r in rows if r["mode"] == "forward")
    assert fwd["bwd_ms"] == ""
    assert fwd["opt_ms"] == ""
    payload = json.loads(out_json.read_text())
    assert payload["meta"]["torch"] == torch.__version__
    assert len(payload["rows"]) == 6


def test_derived_columns_follow_the_written_formula(tmp_path):
    out = tmp_path / "b.json"
    assert bench.main([*TINY, *FAST, "--mode", "train", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    from lm_core import MODEL_SIZES

    cfg = MODEL_SIZES["tiny"]
    flops = 3 * formula_forward_flops(cfg, 2, 16)  # train = forward + backward (2x)
    mean_s = row["mean_ms"] / 1e3
    assert row["gflop_per_step"] == pytest.approx(flops / 1e9)
    assert row["tflops"] == pytest.approx(flops / mean_s / 1e12)
    assert row["tokens_per_s"] == pytest.approx(2 * 16 / mean_s)
    assert row["mfu_pct"] is None  # no peak known for a CPU
    assert row["min_ms"] <= row["median_ms"] <= row["max_ms"]


def test_blas_choice_is_applied_and_recorded(tmp_path, monkeypatch, capsys):
    """--blas sets torch's CUDA BLAS library (where CUDA exists) and shows in rows and table."""
    chosen = []
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", chosen.append)
    out = tmp_path / "b.json"
    argv = [*TINY, *FAST, "--mode", "forward", "--device", "cpu", "--blas", "cublaslt"]
    assert bench.main([*argv, "--json", str(out)]) == 0
    assert chosen == ["cublaslt"]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["blas"] == "cublaslt"
    assert "blas" in capsys.readouterr().out
    assert bench.main([*TINY, *FAST, "--mode", "forward", "--json", str(out)]) == 0
    assert chosen == ["cublaslt"], "the default leaves torch's choice alone"
    assert json.loads(out.read_text())["rows"][0]["blas"] == "default"


def test_peak_override_gives_mfu(tmp_path):
    out = tmp_path / "b.json"
    assert bench.main([*TINY, *FAST, "--mode", "forward", "--peak-tflops", "2", "--json",
                       str(out)]) == 0  # fmt: skip
    (row,) = json.loads(out.read_text())["rows"]
    assert row["mfu_pct"] == pytest.approx(100 * row["tflops"] / 2)


def test_simulated_oom_is_recorded_and_the_sweep_goes_on(tmp_path, monkeypatch):
    real = cells.make_cell_step

    def flaky(model, runner, spec, *a, **k):
        if spec.mode == "fwd-bwd":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return real(model, runner, spec, *a, **k)

    monkeypatch.setattr(cells, "make_cell_step", flaky)
    out = tmp_path / "b.csv"
    argv = [*TINY, *FAST, "--mode", "forward", "fwd-bwd", "train", "--context", "8", "16"]
    assert bench.main([*argv, "--csv", str(out)]) == 0  # OOM is a result, not a failure
    rows = _rows(out)
    assert len(rows) == 6
    for r in rows:
        if r["mode"] == "fwd-bwd":
            assert r["status"] == "OOM"
            assert r["mean_ms"] == ""
        else:
            assert r["status"] == "ok"
            assert float(r["mean_ms"]) > 0


def test_a_sweep_stopped_part_way_keeps_the_models_it_finished(tmp_path, monkeypatch):
    """The CSV / JSON are saved after each model's cells: a run stopped in the second model
    (a time limit, Ctrl-C) leaves the first model's rows, with the run's metadata."""
    real = cells.make_cell_step

    def stopped_in_the_second_model(model, runner, spec, *a, **k):
        if spec.attention == "naive":
            raise KeyboardInterrupt
        return real(model, runner, spec, *a, **k)

    monkeypatch.setattr(cells, "make_cell_step", stopped_in_the_second_model)
    out = tmp_path / "b.json"
    argv = [*TINY, *FAST, "--mode", "forward", "--attention", "sdpa", "naive"]
    with pytest.raises(KeyboardInterrupt):
        bench.main([*argv, "--json", str(out), "--csv", str(tmp_path / "b.csv")])
    saved = json.loads(out.read_text())
    assert [(r["attention"], r["status"]) for r in saved["rows"]] == [("sdpa", "ok")]
    assert saved["meta"]["command"]
    assert len(_rows(tmp_path / "b.csv")) == 1


def test_oom_while_building_marks_every_cell_of_that_model(tmp_path, monkeypatch):
    def no_room(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(cells, "_build", no_room)
    out = tmp_path / "b.csv"
    assert bench.main([*TINY, *FAST, "--mode", "forward", "train", "--csv", str(out)]) == 0
    assert [r["status"] for r in _rows(out)] == ["OOM", "OOM"]


def test_other_errors_are_recorded_and_fail_the_run(tmp_path, monkeypatch):
    real = cells.make_cell_step

    def broken(model, runner, spec, *a, **k):
        if spec.mode == "forward":
            raise RuntimeError("boom")
        return real(model, runner, spec, *a, **k)

    monkeypatch.setattr(cells, "make_cell_step", broken)
    out = tmp_path / "b.csv"
    assert bench.main([*TINY, *FAST, "--mode", "forward", "train", "--csv", str(out)]) == 1
    rows = _rows(out)
    assert rows[0]["status"] == "error: RuntimeError: boom"
    assert rows[1]["status"] == "ok"


def test_custom_dims_and_no_warmup(tmp_path):
    out = tmp_path / "b.json"
    argv = ["--d-model", "32", "--num-layers", "1", "--num-heads", "2", "--vocab-size", "50"]
    argv += ["--context", "8", "--mode", "forward", "--no-warmup", "--steps", "2", "--quiet"]
    assert bench.main([*argv, "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["size"] == "custom"
    assert (row["d_model"], row["num_layers"], row["d_ff"], row["vocab_size"]) == (32, 1, 128, 50)
    assert row["warmup_steps"] == 0
    assert row["first_step_s"] is None


def test_preset_overrides_apply(tmp_path):
    out = tmp_path / "b.json"
    argv = [*TINY, *FAST, "--mode", "forward", "--num-layers", "1", "--attention", "naive"]
    assert bench.main([*argv, "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["num_layers"] == 1
    assert row["attention"] == "naive"


def test_plot_is_written(tmp_path):
    png = tmp_path / "b.png"
    argv = [*TINY, *FAST, "--mode", "forward", "--context", "8", "16", "--plot", str(png)]
    assert bench.main(argv) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_hf_skips_cleanly_without_transformers(tmp_path, monkeypatch):
    from perf_tools import hf_baseline

    monkeypatch.setattr(hf_baseline, "available", lambda: (False, "transformers is not installed"))
    out = tmp_path / "b.csv"
    assert bench.main([*TINY, *FAST, "--mode", "forward", "--compare", "hf", "--csv",
                       str(out)]) == 0  # fmt: skip
    rows = _rows(out)
    assert [r["model"] for r in rows] == ["lm_core", "hf-llama"]
    assert rows[0]["status"] == "ok"
    assert rows[1]["status"].startswith("skipped: transformers is not installed")


def test_compare_hf_side_by_side(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "b.json"
    assert bench.main([*TINY, *FAST, "--mode", "train", "--compare", "hf", "--json",
                       str(out)]) == 0  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    ours, hf = rows
    assert hf["model"] == "hf-llama"
    assert hf["status"] == "ok"
    # same dims -> same parameter count (both untied, no biases) and the same FLOPs
    assert hf["params_M"] == pytest.approx(ours["params_M"])
    assert hf["gflop_per_step"] == pytest.approx(ours["gflop_per_step"])
    assert ours["vs_hf"] == pytest.approx(hf["mean_ms"] / ours["mean_ms"])


def test_compare_hf_with_the_sdpa_dropin(tmp_path, monkeypatch):
    """With --attention flash-triton, HF is timed with SDPA and with flashattn_triton's SDPA
    drop-in in place (its cells only); each of ours is compared with HF's same attention."""
    pytest.importorskip("transformers")
    from flashattn_triton import sdpa

    calls = []

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return sdpa.TORCH_SDPA(*args, **kwargs)

    monkeypatch.setattr(sdpa, "scaled_dot_product_attention", counted)
    out = tmp_path / "b.json"
    argv = [*TINY, *FAST, "--mode", "train", "--compare", "hf", "--json", str(out)]
    assert bench.main([*argv, "--attention", "sdpa"]) == 0
    assert calls == []  # no flash-triton cell: the drop-in never in place
    assert bench.main([*argv, "--attention", "sdpa", "flash-triton"]) == 0
    assert calls  # HF's attention went through the drop-in
    rows = json.loads(out.read_text())["rows"]
    cells = {(r["model"], r["attention"]): r for r in rows}
    assert set(cells) == {
        ("lm_core", "sdpa"), ("lm_core", "flash-triton"), ("hf-llama", "sdpa"),
        ("hf-llama", "flash-triton"),
    }  # fmt: skip
    for attention in ("sdpa", "flash-triton"):
        ours, hf = cells["lm_core", attention], cells["hf-llama", attention]
        assert hf["status"] == "ok"
        assert ours["vs_hf"] == pytest.approx(hf["mean_ms"] / ours["mean_ms"])
    # the real drop-in counts its calls per step: on the CPU both of tiny's layers are torch's
    monkeypatch.undo()
    assert bench.main([*argv, "--attention", "flash-triton"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["model"], r["attention"], r.get("dropin_calls")) for r in rows} == {
        ("lm_core", "flash-triton", None), ("hf-llama", "sdpa", None),
        ("hf-llama", "flash-triton", "0/2"),
    }  # fmt: skip


def test_profile_alias_writes_tables(tmp_path):
    argv = [*TINY, "--mode", "forward", "--warmup", "0", "--steps", "1", "--profile", str(tmp_path)]
    assert bench.main(argv) == 0
    assert (tmp_path / "summary.csv").exists()
    (cell,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert "naive" in cell.name  # profile defaults to the naive backend
    assert (cell / "ranges.csv").exists()
    assert (cell / "kernels.csv").exists()


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--size", "huge"], "--size"),
        (["--steps", "0"], "--steps"),
        (["--steps", "-3"], "--steps"),
        (["--warmup", "-1"], "--warmup"),
        (["--batch", "0"], "--batch"),
        (["--context", "abc"], "--context"),
        (["--mode", "sideways"], "--mode"),
        (["--precision", "fp8"], "--precision"),
        (["--attention", "magic"], "--attention"),
        (["--peak-tflops", "0"], "--peak-tflops"),
        (["--size", "custom", "--d-model", "64"], "--num-layers"),
        (["--size", "tiny", "--d-model", "30", "--num-heads", "4"], "--num-heads"),
        (["--nvtx"], "--nvtx"),
        (["--memory-snapshot", "m.pickle"], "--memory-snapshot"),
        (["--cuda-graph"], "--cuda-graph"),
        (["--cuda-graph", "sometimes"], "--cuda-graph"),
    ],
)
def test_bad_arguments_name_the_flag(argv, flag, capsys):
    if torch.cuda.is_available() and argv in (["--nvtx"], ["--cuda-graph"]):
        pytest.skip("valid on a GPU machine")
    if torch.cuda.is_available() and flag == "--memory-snapshot":
        pytest.skip("valid on a GPU machine")
    with pytest.raises(SystemExit) as info:
        bench.main(argv)
    assert info.value.code == 2
    assert flag in capsys.readouterr().err


def test_specs_cover_the_cartesian_product():
    argv = ["--size", "tiny", "small", "--context", "16,32", "--mode", "forward", "train"]
    args = bench.parse_args([*argv, "--precision", "fp32", "bf16", "--compile", "both"])
    specs = bench.specs_from_args(args)
    assert len(specs) == 2 * 2 * 2 * 2 * 2
    assert len(set(specs)) == len(specs)
    # cells of one model are contiguous, so a model is built once
    keys = [s.model_key for s in specs]
    assert len(dict.fromkeys(keys)) == len([k for i, k in enumerate(keys)
                                                if i == 0 or keys[i - 1] != k])  # fmt: skip
    # every eager cell runs before any compiled one, HF's too
    args = bench.parse_args([*argv, "--compile", "both", "--compare", "hf"])
    specs = bench.specs_from_args(args)
    compiled = [s.compile is not False for s in specs]
    assert compiled == sorted(compiled)
    assert {s.impl for s in specs if not s.compile} == {"lm_core", "hf-llama"}


def test_cpu_default_is_small(capsys):
    if torch.cuda.is_available():
        pytest.skip("GPU default differs")
    args = bench.parse_args([])
    assert args.sizes == ["tiny"]
    assert args.precisions == ["fp32"]
    assert (args.warmup, args.steps, args.batch) == (5, 10, 4)


def test_compiled_cells_get_enough_recompiles():
    from perf_tools._compile import RECOMPILE_LIMIT, allow_recompiles

    allow_recompiles()
    cfg = torch._dynamo.config
    limits = [getattr(cfg, n) for n in ("recompile_limit", "cache_size_limit") if hasattr(cfg, n)]
    assert limits
    assert all(v >= RECOMPILE_LIMIT for v in limits)


def test_matmul_axis_builds_one_model_per_backend(tmp_path):
    """--matmul is a sweep axis of lm_core rows: each backend gets its own model (config field
    set), a `matmul` column, and on CPU both compute the same loss (the tf32x3 product falls
    back to, or in the interpreter equals, a float32 product)."""
    argv = [*TINY, *FAST, "--mode", "fwd-bwd", "--matmul", "default", "tf32x3"]
    specs = bench.specs_from_args(bench.parse_args(argv))
    assert [s.matmul for s in specs] == ["default", "tf32x3"]
    assert len({s.model_key for s in specs}) == 2
    out = tmp_path / "m.csv"
    assert bench.main([*argv, "--csv", str(out)]) == 0
    rows = _rows(out)
    assert [r["matmul"] for r in rows] == ["default", "tf32x3"]
    assert all(r["status"] == "ok" for r in rows)


def test_matmul_choices_are_lm_cores():
    from lm_core.config import MATMUL_BACKENDS

    assert bench.MATMULS == MATMUL_BACKENDS


def test_matmul_rejects_unknown_and_multi_gpu_mode(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args([*TINY, "--matmul", "fp64"])
    assert "--matmul" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.parse_args([*TINY, "--matmul", "tf32x3", "--nprocs", "2", "--fsdp", "ours"])
    assert "multi-GPU mode runs the default matmul only" in capsys.readouterr().err


def test_title_names_mfu_only_when_the_table_has_it():
    opts = bench.BenchOptions(device=torch.device("cpu"), batch=2, warmup=1, steps=2, overrides={})
    cpu_rows = [{"status": "ok", "mfu_pct": None}]
    assert "MFU" not in bench._title(opts, cpu_rows)
    assert "MFU" in bench._title(opts, [{"status": "ok", "mfu_pct": 12.0}])
    opts.nprocs = 2
    assert "MFU" not in bench._title(opts, cpu_rows)


def test_compile_choices_make_the_sweep_axis():
    def compiles(*flag):
        return bench.parse_args([*TINY, *flag]).compiles

    assert compiles() == [False]
    assert compiles("--compile") == [True]
    assert compiles("--compile", "both") == [False, True]
    assert compiles("--compile", "off", "on", "blocks") == [False, True, "blocks"]
    assert compiles("--compile", "blocks,on") == ["blocks", True]
    specs = bench.specs_from_args(bench.parse_args([*TINY, "--compile", "on", "blocks"]))
    assert len({s.model_key for s in specs}) == 2  # one model per compile mode
    assert {s.label().split("-ctx16-")[-1] for s in specs} >= {"compiled", "compiled-blocks"}


def test_optimizer_overlap_rows_train_only_and_leave_no_hooks(tmp_path, monkeypatch):
    """--optimizer-overlap both: a train row with each optimizer on one shared model; other
    modes get one row. After the overlapped cell the model's backward steps nothing."""
    argv = [*TINY, *FAST, "--mode", "fwd-bwd", "train", "--optimizer-overlap", "both"]
    specs = bench.specs_from_args(bench.parse_args(argv))
    assert [(s.mode, s.overlap) for s in specs] == [
        ("fwd-bwd", False),
        ("train", False),
        ("train", True),
    ]
    assert specs[2].label().endswith("-opt-overlap")
    after = []
    real = cells.measure_cell

    def measure(model, runner, spec, *args, **kwargs):
        row = real(model, runner, spec, *args, **kwargs)
        before = [p.detach().clone() for p in model.parameters()]
        model(torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))).backward()
        after.append(all(p.grad is not None for p in model.parameters()))  # no hook took them
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        return row

    monkeypatch.setattr(cells, "measure_cell", measure)
    out = tmp_path / "o.csv"
    assert bench.main([*argv, "--fused-loss", "--csv", str(out)]) == 0
    rows = _rows(out)
    assert [r["opt_overlap"] for r in rows] == ["False", "False", "True"]
    assert all(r["status"] == "ok" for r in rows)
    assert float(rows[2]["opt_ms"]) >= 0
    assert after == [True, True, True]


def test_optimizer_overlap_needs_train_and_one_process(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args([*TINY, "--mode", "forward", "--optimizer-overlap"])
    assert "--optimizer-overlap" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.parse_args([*TINY, "--optimizer-overlap", "--nprocs", "2", "--fsdp", "ours"])
    assert "argument --optimizer-overlap: not available" in capsys.readouterr().err


def test_optimizer_state_dtype_is_a_sweep_axis_of_train_rows(tmp_path, capsys):
    """--optimizer-state-dtype fp32 bf16: two train rows of lm_core, whose AdamW keeps its
    moments in that dtype; other modes get one row; refused without train rows and in the
    multi-GPU mode."""
    argv = [*TINY, *FAST, "--mode", "fwd-bwd", "train", "--optimizer-state-dtype", "fp32,bf16"]
    specs = bench.specs_from_args(bench.parse_args(argv))
    assert [(s.mode, s.opt_state) for s in specs] == [
        ("fwd-bwd", "fp32"),
        ("train", "fp32"),
        ("train", "bf16"),
    ]
    assert specs[2].label().endswith("-opt-state-bf16")
    model = torch.nn.Linear(2, 2)
    opt = cells._optimizer(specs[2], model, torch.device("cpu"))
    assert opt.state_dtype == torch.bfloat16
    out = tmp_path / "s.csv"
    assert bench.main([*argv, "--csv", str(out)]) == 0
    rows = _rows(out)
    assert [r["opt_state"] for r in rows] == ["fp32", "fp32", "bf16"]
    assert all(r["status"] == "ok" for r in rows)
    assert "opt_state" in capsys.readouterr().out  # a column of the table once bf16 is in
    with pytest.raises(SystemExit):
        bench.parse_args([*TINY, "--mode", "forward", "--optimizer-state-dtype", "bf16"])
    assert "--optimizer-state-dtype" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.parse_args(
            [*TINY, "--optimizer-state-dtype", "bf16", "--nprocs", "2", "--fsdp", "ours"]
        )
    assert "argument --optimizer-state-dtype: not available" in capsys.readouterr().err


def test_autograd_threads_is_an_axis_of_rows_with_a_backward(tmp_path, monkeypatch, capsys):
    """--autograd-threads on off: a row per setting for fwd-bwd and train (forward rows one),
    each timed with autograd's device threads switched as its label says; refused for
    forward-only runs and in the multi-GPU mode."""
    argv = [*TINY, *FAST, "--mode", "forward", "fwd-bwd", "--autograd-threads", "on", "off"]
    specs = bench.specs_from_args(bench.parse_args(argv))
    assert [(s.mode, s.autograd_threads) for s in specs] == [
        ("forward", True),
        ("fwd-bwd", True),
        ("fwd-bwd", False),
    ]
    assert specs[2].label().endswith("-autograd-threads-off")
    seen = []
    real = cells.timing.time_steps

    def spy(*a, **kw):
        seen.append(torch._C._is_multithreading_enabled())
        return real(*a, **kw)

    monkeypatch.setattr(cells.timing, "time_steps", spy)
    out = tmp_path / "s.csv"
    assert bench.main([*argv, "--csv", str(out)]) == 0
    assert [r["autograd_threads"] for r in _rows(out)] == ["on", "on", "off"]
    assert seen == [True, True, False]
    assert torch._C._is_multithreading_enabled()
    capsys.readouterr()
    with pytest.raises(SystemExit):
        bench.parse_args([*TINY, "--mode", "forward", "--autograd-threads", "off"])
    assert "--autograd-threads" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.parse_args([*TINY, "--autograd-threads", "off", "--nprocs", "2", "--fsdp", "ours"])
    assert "argument --autograd-threads: not available" in capsys.readouterr().err


def test_matmul_weights_is_a_sweep_axis_of_bf16_train_rows(tmp_path, capsys):
    """--matmul-weights fp32 bf16: two bf16 train rows of lm_core, two models (the held one
    has bf16 linear weights and AdamW keeps their fp32 masters); refused without a bf16
    train row and in the multi-GPU mode."""
    argv = [*TINY, *FAST, "--mode", "train", "--precision", "bf16"]
    argv += ["--matmul-weights", "fp32", "bf16"]
    specs = bench.specs_from_args(bench.parse_args(argv))
    assert [s.weights for s in specs] == ["fp32", "bf16"]
    assert specs[0].model_key != specs[1].model_key
    assert specs[1].label().endswith("-weights-bf16")
    config = models.resolve_config("tiny", context_length=16)
    model = cells._build(specs[1], config, torch.device("cpu"))
    held = [p for p in model.parameters() if p.dtype == torch.bfloat16]
    assert len(held) == 4 * config.num_layers
    out = tmp_path / "w.csv"
    assert bench.main([*argv, "--csv", str(out)]) == 0
    rows = _rows(out)
    assert [r["weights"] for r in rows] == ["fp32", "bf16"]
    assert all(r["status"] == "ok" for r in rows)
    assert "weights" in capsys.readouterr().out
    for bad in (["--precision", "fp32"], ["--mode", "forward", "--precision", "bf16"]):
        with pytest.raises(SystemExit):
            bench.parse_args([*TINY, *bad, "--matmul-weights", "bf16"])
        assert "argument --matmul-weights" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.parse_args(
            [*TINY, "--precision", "bf16", "--matmul-weights", "bf16", "--nprocs", "2",
             "--fsdp", "ours"]
        )  # fmt: skip
    assert "argument --matmul-weights: not available" in capsys.readouterr().err
