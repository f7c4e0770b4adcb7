"""perf_tools.bench --nprocs N --tp K: tensor parallel (and 2-D with --fsdp torch) rows on gloo
ranks with the tiny model, the flags' checks before any rank starts, and the planner's
prediction beside the measurement (`perf_tools.bench_predict`)."""

from __future__ import annotations

import csv
import dataclasses
import json
import shlex
from pathlib import Path

import pytest

from perf_tools import bench, bench_dist, bench_tp
from perf_tools.flops import formula_forward_flops

pytest.importorskip("torch.distributed.tensor.parallel")

TINY = ["--size", "tiny", "--context", "16", "--batch", "2", "--quiet", "--device", "cpu"]
FAST = ["--warmup", "1", "--steps", "2"]
BENCH_DOC = Path(__file__).parents[1] / "docs" / "bench.md"
# the CPU command of docs/bench.md
CPU_TP2 = [*TINY[:6], *FAST, "--nprocs", "2", "--tp", "2", "--device", "cpu"]


def _readme_tp_commands() -> list[list[str]]:
    """Every `python -m perf_tools.bench ... --tp ...` line of docs/bench.md, as argv."""
    out = []
    for line in BENCH_DOC.read_text().splitlines():
        if line.startswith("python -m perf_tools.bench ") and " --tp " in line:
            out.append(shlex.split(line)[3:])
    return out


def _tiny():
    from lm_core import MODEL_SIZES

    return MODEL_SIZES["tiny"]


def _local_params(tp: int, dp: int) -> int:
    """Parameter elements per rank of the tiny model: TP splits the blocks' matrices, the
    embedding, the LM head and the norms stay whole; fully_shard splits everything dp ways."""
    c = _tiny()
    d, f, v, n = c.d_model, c.d_ff, c.vocab_size, c.num_layers
    per_rank = 2 * v * d + n * ((4 * d * d + 3 * d * f) // tp + 2 * d) + d
    return per_rank // dp


def _rows(path):
    return json.loads(path.read_text())["rows"]


# ----------------------------------------------------------------------------- rows


def test_tp2_on_two_ranks_writes_a_row(tmp_path):
    """The CPU command of docs/bench.md, with output files."""
    assert CPU_TP2 in _readme_tp_commands()
    out, table = tmp_path / "t.json", tmp_path / "t.csv"
    argv = [*CPU_TP2, "--quiet", "--peak-tflops", "1"]
    assert bench.main([*argv, "--json", str(out), "--csv", str(table)]) == 0
    (r,) = _rows(out)
    assert r["status"] == "ok", r
    assert (r["nprocs"], r["tp"], r["dp"], r["mesh"], r["fsdp"]) == (2, 2, 1, "1x2", "none")
    assert r["seq_parallel"] is False
    # both ranks of the one TP group train on the same 2 sequences: the global batch is 2
    assert (r["batch"], r["global_batch"]) == (2, 2)
    median_s = r["median_ms"] / 1e3
    assert r["tokens_per_s"] == pytest.approx(2 * 16 / median_s)
    flops = 3 * formula_forward_flops(_tiny(), 2, 16)
    assert r["gflop_per_step"] == pytest.approx(flops / 1e9)
    assert r["tflops"] == pytest.approx(flops / 2 / median_s / 1e12)
    assert r["min_ms"] <= r["median_ms"] <= r["max_ms"]
    for col in ("fwd_ms", "bwd_ms", "opt_ms"):
        assert r[col] > 0, col
    # the blocks are split over the 2 ranks (DTensor shards), the rest replicated
    assert r["params_per_rank_M"] * 1e6 == pytest.approx(_local_params(2, 1))
    assert r["params_per_rank_M"] < r["params_M"]
    assert r["peak_mem_gib"] is None  # no CUDA allocator on CPU
    assert "pred_step_ms" not in r  # the planner has no CPU preset
    (c,) = list(csv.DictReader(table.open()))
    assert (c["tp"], c["dp"], c["mesh"]) == ("2", "1", "1x2")


def test_sequence_parallel_bf16_fused_loss_checkpointed(tmp_path):
    out = tmp_path / "s.json"
    argv = [*TINY, *FAST, "--nprocs", "2", "--tp", "2", "--sequence-parallel"]
    argv += ["--precision", "bf16", "--fused-loss", "--activation-checkpointing", "1"]
    assert bench.main([*argv, "--json", str(out)]) == 0
    (r,) = _rows(out)
    assert r["status"] == "ok", r
    assert (r["tp"], r["seq_parallel"], r["precision"], r["fused_loss"]) == (2, True, "bf16", True)
    assert (r["act_ckpt"], r["act_ckpt_k"]) == (1, 1)  # checkpointed after TP (lm_core order)
    assert r["sync_ms"] > 0  # the norms' partial gradients summed over the TP group
    assert r["params_per_rank_M"] * 1e6 == pytest.approx(_local_params(2, 1))


def test_compiled_tp_row_compiles_each_block(tmp_path):
    """--compile with --tp: each block compiled in place after TP and checkpointing (lm_core's
    engine, torchtitan's order); aot_eager traces as inductor would, without CPU kernel builds
    (test_bench_parallel.py says why)."""
    out = tmp_path / "c.json"
    argv = [*TINY, *FAST, "--nprocs", "2", "--tp", "2", "--compile", "--activation-checkpointing"]
    assert bench.main([*argv, "1", "--compile-backend", "aot_eager", "--json", str(out)]) == 0
    (r,) = _rows(out)
    assert r["status"] == "ok", r
    assert (r["tp"], r["compile"], r["compile_backend"], r["act_ckpt_k"]) == (
        2,
        "blocks",
        "aot_eager",
        1,
    )
    assert r["measured_compiles"] == 0  # the warm-up step compiled
    assert r["params_per_rank_M"] * 1e6 == pytest.approx(_local_params(2, 1))


@pytest.mark.slow  # 4 ranks on 2 cores: 12-20 s
def test_2d_mesh_on_four_ranks(tmp_path):
    """--nprocs 4 --tp 2 --fsdp torch: 2 data-parallel groups of 2 TP ranks."""
    out = tmp_path / "m.json"
    argv = [*TINY, *FAST, "--nprocs", "4", "--tp", "2", "--fsdp", "torch"]
    assert bench.main([*argv, "--json", str(out)]) == 0
    (r,) = _rows(out)
    assert r["status"] == "ok", r
    assert (r["nprocs"], r["tp"], r["dp"], r["mesh"], r["fsdp"]) == (4, 2, 2, "2x2", "torch")
    assert r["global_batch"] == 4
    assert r["tokens_per_s"] == pytest.approx(4 * 16 / (r["median_ms"] / 1e3))
    assert r["params_per_rank_M"] * 1e6 == pytest.approx(_local_params(2, 2))


def test_fsdp_rows_record_their_layout():
    """Rows without --tp say tp 1, dp N, so TP and FSDP rows sit in one table."""
    import torch

    from perf_tools.cells import BenchOptions, BenchSpec, cell_row

    cpu = torch.device("cpu")
    opts = BenchOptions(device=cpu, batch=2, warmup=1, steps=2, overrides={}, nprocs=2)
    spec = BenchSpec("lm_core", "tiny", None, False, "fp32", "train", 16, fsdp="ours")
    row = cell_row(spec, {}, opts, {})
    assert (row["tp"], row["dp"], row["mesh"], row["global_batch"]) == (1, 2, "2x1", 4)


# ----------------------------------------------------------------------------- flags


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["--nprocs", "2", "--tp", "3"], ["argument --tp", "K=3 must divide --nprocs 2"]),
        (
            ["--size", "xl", "--nprocs", "2", "--tp", "2"],
            ["argument --tp", "num_heads=25", "--num-heads 20", "small"],
        ),
        (
            ["--nprocs", "2", "--tp", "2", "--fsdp", "ours"],
            ["argument --fsdp", "--tp 2", "--fsdp torch"],
        ),
        (["--nprocs", "4", "--tp", "2"], ["argument --tp", "--fsdp torch"]),
        (["--tp", "2"], ["argument --tp", "--nprocs"]),
        (["--sequence-parallel"], ["argument --sequence-parallel", "--tp"]),
        (
            ["--nprocs", "2", "--fsdp", "torch", "--sequence-parallel"],
            ["argument --sequence-parallel"],
        ),
        (
            ["--nprocs", "2", "--tp", "2", "--sequence-parallel", "--context", "15"],
            ["argument --tp", "sequence length 15"],
        ),
        (["--nprocs", "2", "--tp", "2", "--d-ff", "129"], ["d_ff=129", "--d-ff 128"]),
        (
            ["--nprocs", "2", "--tp", "2", "--optimizer-overlap"],
            ["argument --optimizer-overlap", "(--tp)"],
        ),
        (["--nprocs", "2", "--tp", "2", "--mode", "forward"], ["argument --tp", "forward"]),
        (["--nprocs", "2", "--tp", "0"], ["argument --tp"]),
    ],
)
def test_bad_tp_flags_fail_before_any_rank_starts(argv, needles, refused_before_ranks):
    refused_before_ranks(argv, needles)


def test_readme_tp_commands_parse(monkeypatch):
    """Every --tp command of docs/bench.md passes the flag checks (heads, batch, mesh); the GPU
    ones checked as on a CPU (nothing is built or spawned)."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    commands = _readme_tp_commands()
    assert len(commands) >= 4
    for argv in commands:
        argv = [a for a in argv if a not in ("--device", "cpu")]
        args = bench.parse_args([*argv, "--device", "cpu"])
        assert args.tp == 2, argv
        assert bench.specs_from_args(args), argv


def test_heads_advice_names_shapes_that_split():
    from lm_core import MODEL_SIZES
    from lm_core.parallel import check_tensor_parallel

    xl = MODEL_SIZES["xl"]
    advice = bench_tp.heads_advice(xl, 2)
    assert "--num-heads 20 (head dim 80" in advice
    check_tensor_parallel(dataclasses.replace(xl, num_heads=20), 2)  # the advice works
    assert "xl" not in advice.split("splits 2 ways:")[1]
    assert bench_tp.heads_advice(xl, 8).startswith("; use --num-heads 40 (head dim 40")
    assert bench_tp.heads_advice(MODEL_SIZES["small"], 2) == ""  # nothing to advise


# ----------------------------------------------------------------------------- predictions


def _xl_dims():
    from lm_core import MODEL_SIZES

    return dataclasses.replace(MODEL_SIZES["xl"], num_heads=20)


def _pred(nprocs, tp, **kw):
    from perf_tools.bench_predict import planner_columns

    args = {"batch": 4, "context": 512, "precision": "bf16", "act_ckpt": "none"}
    args.update(gpu="H100 SXM", peak_tflops=None)
    args.update(kw)
    return planner_columns(_xl_dims(), nprocs=nprocs, tp=tp, **args)


def test_planner_prediction_of_tp2_and_fsdp2_by_hand():
    """xl (d 1600, 48 blocks), 4 x 512 tokens per data-parallel group, H100 NVLink 450 GB/s:
    TP=2 all-reduces 4 (B T D) bf16 activations per block, each (2-1)/2 x 2 x S / W; FSDP=2
    gathers the bf16 weights twice and reduce-scatters the gradients, each (2-1)/2 P b / W."""
    w = 450e9
    tp = _pred(2, 2)
    act = 4 * 512 * 1600 * 2
    assert tp["pred_comm_ms"] == pytest.approx(4 * 48 * act / w * 1e3)
    params = 2 * 10_000 * 1600 + 48 * (4 * 1600**2 + 3 * 1600 * 6400 + 2 * 1600) + 1600
    fsdp = _pred(2, 1, batch=2)  # the same global batch: 2 sequences per rank
    assert fsdp["pred_comm_ms"] == pytest.approx(3 * 0.5 * params * 2 / w * 1e3)
    # the same model FLOPs over 2 GPUs at the peak either way
    assert tp["pred_compute_ms"] == pytest.approx(fsdp["pred_compute_ms"])
    for p in (tp, fsdp):
        assert p["pred_step_ms"] == pytest.approx(max(p["pred_compute_ms"], p["pred_comm_ms"]))
        assert p["pred_serial_ms"] == pytest.approx(p["pred_compute_ms"] + p["pred_comm_ms"])
    # fp32 master weights, gradients and AdamW moments: 16 bytes per parameter over 2 ranks
    assert fsdp["pred_mem_gib"] > 16 * params / 2 / 2**30
    assert _pred(2, 2, gpu=None) == {}  # CPU: no preset
    assert _pred(2, 2, gpu="L4") == {}  # a GPU the planner does not know


def test_planner_prediction_follows_the_layout():
    from perf_tools.accounting import Dtypes, ModelDims
    from perf_tools.plan_model import HARDWARE, Layout, Workload, predict

    c = _xl_dims()
    dims = ModelDims("bench", c.d_model, c.d_ff, c.num_layers, c.vocab_size, c.num_heads)
    hw = HARDWARE["H100"]
    for nprocs, tp, layout in [
        (2, 1, Layout("fsdp", 2, 1)),
        (2, 2, Layout("tp", 1, 2)),
        (4, 2, Layout("fsdp x tp", 2, 2)),
    ]:
        dp = nprocs // tp
        want = predict(layout, Workload(dims, 4 * dp * 512, 512, Dtypes()), hw, 4, False)
        got = _pred(nprocs, tp)
        assert got["pred_step_ms"] == pytest.approx(want["step_overlap_ms"]), layout
        assert got["pred_mem_gib"] == pytest.approx(want["total_GB"] * 1e9 / 2**30)
    # the row's peak FLOP/s (fp32 here) replaces the preset's bf16 one; checkpointing adds a
    # forward (4/3 the compute)
    slow = _pred(2, 2, precision="fp32", peak_tflops=66.9)
    assert slow["pred_compute_ms"] == pytest.approx(_pred(2, 2)["pred_compute_ms"] * 989.4 / 66.9)
    ckpt = _pred(2, 2, act_ckpt=1)
    assert ckpt["pred_compute_ms"] == pytest.approx(_pred(2, 2)["pred_compute_ms"] * 4 / 3)
    assert ckpt["pred_mem_gib"] < _pred(2, 2)["pred_mem_gib"]


def _rank_result(rank: int, gpu: str | None) -> dict:
    return {
        "rank": rank,
        "samples": [0.2, 0.1, 0.3],
        "warmup_s": 1.0,
        "first_step_s": 0.5,
        "phases": {"forward": 30.0, "backward": 60.0},
        "peak_mem": 10 * 2**30 + rank,
        "peak_reserved": None,
        "waits": [],
        "params": 2_000_000_000,
        "local_params": 1_000_000_000 + rank,
        "build_s": 2.0,
        "act_ckpt_k": 0,
        "config": dataclasses.asdict(_xl_dims()),
        "peak_tflops": 989.4,
        "gpu": gpu,
    }


def test_aggregate_puts_the_prediction_beside_the_measurement():
    job = bench_dist.DistJob(
        size="xl",
        attention=None,
        precision="bf16",
        mode="train",
        context=512,
        fsdp="none",
        batch=4,
        warmup=1,
        steps=3,
        overrides={"num_heads": 20},
        backend="nccl",
        tp=2,
    )
    row = bench_dist.aggregate(job, [_rank_result(0, "H100 SXM"), _rank_result(1, "H100 SXM")])
    assert row["median_ms"] == pytest.approx(200.0)
    assert row["tokens_per_s"] == pytest.approx(4 * 512 / 0.2)  # one data-parallel group
    assert row["peak_mem_gib"] == pytest.approx((10 * 2**30 + 1) / 2**30)  # the larger rank
    assert row["params_per_rank_M"] == pytest.approx(1000.000001)
    assert row["pred_step_ms"] == pytest.approx(_pred(2, 2)["pred_step_ms"])
    assert row["pred_mem_gib"] == pytest.approx(_pred(2, 2)["pred_mem_gib"])
    fwd_bwd = bench_dist.aggregate(
        dataclasses.replace(job, mode="fwd-bwd"), [_rank_result(0, "H100 SXM")] * 2
    )
    assert "pred_step_ms" not in fwd_bwd  # the planner predicts training steps


# ----------------------------------------------------------------------------- 2 GPUs


@pytest.mark.nccl
def test_two_gpus_tp2_beside_fsdp2(tmp_path):
    """The same global batch (2 x 64 tokens) as TP=2 and as FSDP=2 over NCCL, bf16."""
    import torch

    from perf_tools import hardware

    base = ["--size", "tiny", "--context", "64", "--quiet", *FAST, "--device", "cuda"]
    base += ["--nprocs", "2", "--precision", "bf16"]
    tp_out, fsdp_out = tmp_path / "tp.json", tmp_path / "fsdp.json"
    assert bench.main([*base, "--batch", "2", "--tp", "2", "--json", str(tp_out)]) == 0
    assert bench.main([*base, "--batch", "1", "--fsdp", "torch", "--json", str(fsdp_out)]) == 0
    (tp,), (fsdp,) = _rows(tp_out), _rows(fsdp_out)
    assert (tp["tp"], tp["dp"], fsdp["tp"], fsdp["dp"]) == (2, 1, 1, 2)
    known = hardware.device_key(torch.device("cuda", 0)) in ("H100 SXM", "H200 SXM")
    for r in (tp, fsdp):
        assert r["status"] == "ok", r
        assert r["device"] == "nccl: 2 x cuda"
        assert r["global_batch"] == 2
        assert r["peak_mem_gib"] > 0
        assert r["fwd_ms"] > 0  # CUDA-event phases
        if known:
            assert r["pred_step_ms"] > 0
            assert r["pred_mem_gib"] > 0


def test_compiled_flash_triton_rows_record_the_compiled_launch_options():
    """Compiled rows with flash-triton say how its compiled graphs call the kernels
    (flashattn_triton's `traced_compile` and `cpp_launch_compiled`); eager rows and other
    attentions do not."""
    import torch

    from perf_tools.cells import BenchOptions, BenchSpec, cell_row

    flash = pytest.importorskip("flashattn_triton")
    opts = BenchOptions(device=torch.device("cpu"), batch=2, warmup=1, steps=2, overrides={})

    def row(attention: str, compiled: bool | str) -> dict:
        spec = BenchSpec("lm_core", "tiny", attention, compiled, "fp32", "train", 16)
        return cell_row(spec, {}, opts, {})

    with flash.use_options(traced_compile="auto"):
        assert row("flash-triton", True)["traced_compile"] == "auto"
        assert row("flash-triton", "blocks")["traced_compile"] == "auto"
        assert "traced_compile" not in row("flash-triton", False)
        assert "traced_compile" not in row("sdpa", True)
    with flash.use_options(traced_compile=False, cpp_launch_compiled=True):
        r = row("flash-triton", True)
        assert r["traced_compile"] is False
        assert r["cpp_launch_compiled"] is True
        assert "cpp_launch_compiled" not in row("flash-triton", False)
    assert row("flash-triton", True)["traced_compile"] is flash.get_options().traced_compile


def test_eager_flash_triton_rows_on_a_gpu_record_the_cpp_launch_status(monkeypatch):
    """Eager flash-triton rows on a GPU say whether calls replayed from flashattn_triton's
    C++ launch path; so do compiled rows whose opaque ops may replay through it
    (`cpp_launch_compiled`); CPU rows, other compiled rows and other attentions do not."""
    import torch

    flash = pytest.importorskip("flashattn_triton")
    from perf_tools import cells
    from perf_tools.cells import BenchOptions, BenchSpec, cell_row

    monkeypatch.setattr(cells, "cpp_launch_status", lambda: "ready")

    def row(attention: str, compiled: bool, device: str) -> dict:
        opts = BenchOptions(device=torch.device(device), batch=2, warmup=1, steps=2, overrides={})
        spec = BenchSpec("lm_core", "tiny", attention, compiled, "fp32", "train", 16)
        return cell_row(spec, {}, opts, {})

    assert row("flash-triton", False, "cuda")["cpp_launch"] == "ready"
    assert "cpp_launch" not in row("flash-triton", False, "cpu")
    with flash.use_options(cpp_launch_compiled=False):
        assert "cpp_launch" not in row("flash-triton", True, "cuda")
    with flash.use_options(cpp_launch_compiled=True):
        assert row("flash-triton", True, "cuda")["cpp_launch"] == "ready"
    assert "cpp_launch" not in row("sdpa", False, "cuda")
