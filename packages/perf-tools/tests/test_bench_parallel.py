"""perf_tools.bench's multi-GPU mode with data parallelism (`--ddp`) and `--compile` (gloo, 2
ranks, the tiny model): rows, the planner's "dp" prediction, compiled models that train as
the eager ones do, and the flags' checks.

CPU compilation with inductor takes ~50 s per graph on a cold cache (C++ builds), so these
tests compile with `--compile-backend aot_eager`: dynamo and AOTAutograd trace forward and
backward through the wrappers' hooks as inductor's would, without generating kernels. The
GPU test at the end compiles with inductor."""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path

import pytest
import torch

from perf_tools import _dist, bench, bench_dist, bench_wrap
from perf_tools.flops import formula_forward_flops

TINY = ["--size", "tiny", "--context", "16", "--batch", "2", "--quiet", "--device", "cpu"]
FAST = ["--warmup", "1", "--steps", "2"]
AOT = ["--compile-backend", "aot_eager"]
BENCH_DOC = Path(__file__).parents[1] / "docs" / "bench.md"


def _rows(path):
    return json.loads(path.read_text())["rows"]


def _tiny():
    from lm_core import MODEL_SIZES

    return MODEL_SIZES["tiny"]


# ----------------------------------------------------------------------------- rows


def test_ddp_rows_eager_and_compiled(tmp_path, capsys):
    """--ddp: a replicated model under torch DDP, --batch per rank; --compile both adds the
    whole model compiled (after wrapping), its compilation inside the warm-up."""
    out = tmp_path / "d.json"
    argv = [*TINY, *FAST, "--nprocs", "2", "--ddp", "--compile", "both", *AOT]
    assert bench.main([*argv, "--peak-tflops", "1", "--json", str(out)]) == 0
    eager, compiled = _rows(out)
    flops = 3 * formula_forward_flops(_tiny(), 4, 16)  # 2 ranks x 2 sequences of 16
    for r in (eager, compiled):
        assert r["status"] == "ok", r
        assert (r["nprocs"], r["fsdp"], r["ddp"], r["tp"], r["dp"], r["mesh"]) == (
            2,
            "none",
            "torch",
            1,
            2,
            "2x1",
        )
        assert (r["batch"], r["global_batch"]) == (2, 4)
        median_s = r["median_ms"] / 1e3
        assert r["tokens_per_s"] == pytest.approx(4 * 16 / median_s)
        assert r["gflop_per_step"] == pytest.approx(flops / 1e9)
        assert r["tflops"] == pytest.approx(flops / 2 / median_s / 1e12)
        assert r["sync_ms"] is None  # DDP all-reduces inside backward
        assert r["params_per_rank_M"] == pytest.approx(r["params_M"])  # replicated
        assert "pred_step_ms" not in r  # the planner has no CPU preset
        assert "gather_wait_ms" not in r
    assert (eager["compile"], compiled["compile"]) == (False, True)  # DDP: the whole model
    assert "compile_backend" not in eager
    assert compiled["compile_backend"] == "aot_eager"
    assert compiled["measured_compiles"] == 0  # compiled in the warm-up, not while timed
    assert compiled["first_step_s"] > eager["first_step_s"]  # the compilation
    header = next(line for line in capsys.readouterr().out.splitlines() if "median_ms" in line)
    for col in ("compile", "fsdp", "ddp", "tp", "dp"):
        assert f" {col} " in header, col
    assert "cuda_graph" not in header


def test_ddp_blocks_compiles_each_block_before_wrapping(tmp_path):
    """--ddp --compile blocks: the other DDP layout (each block compiled, then wrapped, no
    graph split at the gradient buckets) runs and says so in its row."""
    out = tmp_path / "b.json"
    argv = [*TINY, *FAST, "--nprocs", "2", "--ddp", "--compile", "blocks", *AOT]
    assert bench.main([*argv, "--json", str(out)]) == 0
    (row,) = _rows(out)
    assert (row["status"], row["ddp"], row["compile"]) == ("ok", "torch", "blocks")
    assert row["measured_compiles"] == 0


def test_compiled_fsdp_rows_compile_each_block(tmp_path):
    """--compile with --fsdp torch and ours: each block compiled (the row says blocks); our
    FSDP still gathers every unit (its hooks run outside the compiled blocks)."""
    out = tmp_path / "c.json"
    argv = [*TINY, *FAST, "--nprocs", "2", "--fsdp", "torch", "ours", "--compile", *AOT]
    assert bench.main([*argv, "--json", str(out)]) == 0
    rows = _rows(out)
    assert [(r["fsdp"], r["ddp"], r["compile"]) for r in rows] == [
        ("torch", "none", "blocks"),
        ("ours", "none", "blocks"),
    ]
    for r in rows:
        assert r["status"] == "ok", r
        assert r["global_batch"] == 4
        assert r["measured_compiles"] == 0
        assert r["params_per_rank_M"] < r["params_M"]  # sharded
    assert rows[1]["gathers"] == 2 * (_tiny().num_layers + 2) - 1


# ----------------------------------------------------------------------------- correctness


def _losses(job: bench_wrap.DistJob, rank: int, world: int, steps: int = 3) -> list[float]:
    """Losses of `steps` AdamW steps of `job`'s model on this rank's batch (the same on the
    ranks of a TP group), as the bench's step runs them."""
    from lm_core import AdamW, cross_entropy
    from perf_tools.models import random_batch, resolve_config

    config = resolve_config(job.size, context_length=job.context)
    device = _dist.device_for(job.backend, rank)
    built = bench_wrap.build_and_wrap(job, config, rank=rank, world=world, device=device)
    opt = AdamW(list(built.runner.parameters()), lr=1e-2)
    x, y = random_batch(job.batch, job.context, config.vocab_size, device, rank // job.tp)
    out = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        logits = built.runner(x)  # (B, T, V)
        loss = cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        if built.sync is not None:
            built.sync()
        opt.step()
        full = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
        out.append(float(full))
    return out


LAYOUTS = [
    {"fsdp": "ours"},
    {"fsdp": "torch"},
    {"fsdp": "none", "ddp": "torch"},
    {"fsdp": "none", "tp": 2},
]


def _eager_and_compiled_worker(
    rank: int, world: int, backend: str = "gloo", compile_backend: str = "aot_eager"
) -> list[tuple[list[float], list[float]]]:
    torch.set_num_threads(1)
    from torch._dynamo.utils import counters

    out = []
    for layout in LAYOUTS:
        job = bench_wrap.DistJob(
            size="tiny",
            attention=None,
            precision="fp32",
            mode="train",
            context=16,
            batch=2,
            warmup=1,
            steps=2,
            overrides={},
            backend=backend,
            **layout,
        )
        eager = _losses(job, rank, world)
        value = True if job.ddp != "none" else "blocks"
        before = counters["stats"]["unique_graphs"]
        compiled_job = dataclasses.replace(job, compile=value, compile_backend=compile_backend)
        compiled = _losses(compiled_job, rank, world)
        assert counters["stats"]["unique_graphs"] > before, layout  # something was compiled
        torch._dynamo.reset()
        out.append((eager, compiled))
    return out


def _check_eager_and_compiled(backend: str, compile_backend: str, rel: float) -> None:
    from ddp_kit.launch import spawn

    args = (backend, compile_backend)
    per_rank = spawn(_eager_and_compiled_worker, 2, backend=backend, args=args, timeout_s=300)
    for rank, results in enumerate(per_rank):
        for layout, (eager, compiled) in zip(LAYOUTS, results):
            assert compiled == pytest.approx(eager, rel=rel, abs=1e-5), (rank, layout)
            assert eager[2] < eager[0], (rank, layout)  # it trains: the test can fail
    # the ranks train on different tokens except within the TP group
    assert per_rank[0][0][0][0] != per_rank[1][0][0][0]
    assert per_rank[0][3][0] == pytest.approx(per_rank[1][3][0])


def test_compiled_models_train_as_the_eager_ones():
    """Every layout's compiled model (ours and torch FSDP and TP block by block, DDP whole)
    gives the eager model's losses over 3 AdamW steps, on both ranks."""
    _check_eager_and_compiled("gloo", "aot_eager", rel=1e-4)


# ----------------------------------------------------------------------------- prediction


def _rank_result(rank: int) -> dict:
    from lm_core import MODEL_SIZES

    xl = dataclasses.replace(MODEL_SIZES["xl"], num_heads=20)
    return {
        "rank": rank,
        "samples": [0.2, 0.1, 0.3],
        "warmup_s": 1.0,
        "first_step_s": 0.5,
        "phases": {"forward": 30.0, "backward": 60.0},
        "peak_mem": 10 * 2**30,
        "peak_reserved": None,
        "waits": [],
        "params": 2_000_000_000,
        "local_params": 2_000_000_000,
        "build_s": 2.0,
        "act_ckpt_k": 0,
        "measured_compiles": rank,  # the row shows the larger
        "config": dataclasses.asdict(xl),
        "peak_tflops": 989.4,
        "gpu": "H100 SXM",
    }


def test_ddp_rows_get_the_planners_dp_prediction():
    """xl (20 heads), 2 x 512 tokens per rank on 2 H100s: DP all-reduces the fp32 gradients
    (DDP's buckets), 2 (N-1)/N x 4 P bytes over NVLink's 450 GB/s; the memory is unsharded."""
    job = bench_wrap.DistJob(
        size="xl",
        attention=None,
        precision="bf16",
        mode="train",
        context=512,
        fsdp="none",
        batch=2,
        warmup=1,
        steps=3,
        overrides={"num_heads": 20},
        backend="nccl",
        ddp="torch",
        compile=True,
    )
    row = bench_dist.aggregate(job, [_rank_result(0), _rank_result(1)])
    params = 2 * 10_000 * 1600 + 48 * (4 * 1600**2 + 3 * 1600 * 6400 + 2 * 1600) + 1600
    assert row["pred_comm_ms"] == pytest.approx(2 * 0.5 * params * 4 / 450e9 * 1e3)
    assert row["pred_step_ms"] == pytest.approx(max(row["pred_compute_ms"], row["pred_comm_ms"]))
    assert row["pred_mem_gib"] > 16 * params / 2**30  # weights, gradients, AdamW: unsharded
    assert row["tokens_per_s"] == pytest.approx(2 * 2 * 512 / 0.2)
    assert row["measured_compiles"] == 1
    fsdp = bench_dist.aggregate(
        dataclasses.replace(job, fsdp="torch", ddp="none"),
        [_rank_result(0), _rank_result(1)],
    )
    assert fsdp["pred_mem_gib"] < row["pred_mem_gib"] / 1.5  # the same run sharded
    assert fsdp["pred_compute_ms"] == pytest.approx(row["pred_compute_ms"])


# ----------------------------------------------------------------------------- flags


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["--ddp"], ["argument --ddp", "--nprocs"]),
        (["--nprocs", "2", "--ddp", "--tp", "2"], ["argument --ddp", "--tp 2 --fsdp torch"]),
        (["--nprocs", "2", "--ddp", "fully"], ["argument --ddp", "fully"]),
        (["--nprocs", "2", "--ddp", "--sequence-parallel"], ["argument --sequence-parallel"]),
        (
            ["--nprocs", "2", "--ddp", "--compile", "--warmup", "0"],
            ["argument --warmup", "--compile"],
        ),
        (
            ["--nprocs", "2", "--fsdp", "torch", "--compile", "--no-warmup"],
            ["argument --warmup", "--compile"],
        ),
        (
            ["--nprocs", "2", "--ddp", "--optimizer-overlap"],
            ["argument --optimizer-overlap", "(--ddp)"],
        ),
        (["--nprocs", "2", "--ddp", "--mode", "forward"], ["argument --ddp", "forward"]),
        (["--nprocs", "2", "--ddp", "--compile-backend", "tvm"], ["--compile-backend", "tvm"]),
    ],
)
def test_bad_flags_fail_before_any_rank_starts(argv, needles, refused_before_ranks):
    refused_before_ranks(argv, needles)


def test_the_sweep_resolves_compile_per_layout(monkeypatch):
    """--compile both --ddp --fsdp ours torch: DDP eager and whole, FSDP eager and blocks;
    --compile on blocks gives DDP both and FSDP blocks once."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    base = [*TINY, "--nprocs", "2", "--ddp", "--fsdp", "ours", "torch", "--compile"]
    specs = bench.specs_from_args(bench.parse_args([*base, "both"]))
    assert [(s.fsdp, s.ddp, s.compile) for s in specs] == [
        ("none", "torch", False),
        ("none", "torch", True),
        ("ours", "none", False),
        ("ours", "none", "blocks"),
        ("torch", "none", False),
        ("torch", "none", "blocks"),
    ]
    specs = bench.specs_from_args(bench.parse_args([*base, "on", "blocks"]))
    assert [(s.fsdp, s.compile) for s in specs] == [
        ("none", True),
        ("none", "blocks"),
        ("ours", "blocks"),
        ("torch", "blocks"),
    ]
    assert specs[0].label().endswith("ddp-torch")


def _readme_parallel_commands() -> list[list[str]]:
    """docs/bench.md's `python -m perf_tools.bench ... --ddp ...` and `--compile` multi-GPU
    lines, as argv."""
    out = []
    for line in BENCH_DOC.read_text().splitlines():
        multi = line.startswith("python -m perf_tools.bench ") and " --nprocs " in line
        if multi and (" --ddp" in line or " --compile" in line):
            out.append(shlex.split(line, comments=True)[3:])
    return out


def test_readme_parallel_commands_parse(monkeypatch):
    """Every DDP / compiled multi-GPU command of docs/bench.md passes the flag checks (the GPU
    ones checked as on a CPU: nothing is built or spawned)."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    commands = _readme_parallel_commands()
    assert len(commands) >= 6
    for argv in commands:
        argv = [a for a in argv if a not in ("--device", "cpu")]
        args = bench.parse_args([*argv, "--device", "cpu"])
        assert bench.specs_from_args(args), argv


# ----------------------------------------------------------------------------- 2 GPUs


@pytest.mark.nccl
def test_two_gpus_inductor_compiled_models_train_as_the_eager_ones():
    """The same with inductor's kernels on 2 GPUs (fp32; fused kernels round differently)."""
    _check_eager_and_compiled("nccl", "inductor", rel=1e-3)


@pytest.mark.nccl
def test_two_gpus_ddp_fsdp_tp_compiled_with_inductor(tmp_path):
    """DP, FSDP and TP at the same global batch (2 x 64 tokens), bf16, eager and compiled
    with inductor: every row ok, no graph compiled while timed."""
    base = ["--size", "tiny", "--context", "64", "--quiet", "--device", "cuda", *FAST]
    base += ["--nprocs", "2", "--precision", "bf16", "--compile", "both"]
    dp_out, tp_out = tmp_path / "dp.json", tmp_path / "tp.json"
    dp_argv = [*base, "--batch", "1", "--ddp", "--fsdp", "torch", "ours"]
    assert bench.main([*dp_argv, "--json", str(dp_out)]) == 0
    assert bench.main([*base, "--batch", "2", "--tp", "2", "--json", str(tp_out)]) == 0
    rows = _rows(dp_out) + _rows(tp_out)
    assert len(rows) == 8
    for r in rows:
        assert r["status"] == "ok", r
        assert r["global_batch"] == 2
        assert r["peak_mem_gib"] > 0
        if r["compile"]:
            assert r["compile_backend"] == "inductor"
            assert r["measured_compiles"] == 0, r
