"""The single-GPU tools on CUDA at tiny sizes (run by `nox -s gpu_tests` on the GPU machine)."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from perf_tools import attention, bench, profile

pytestmark = pytest.mark.gpu
TINY = ["--size", "tiny", "--context", "32", "--batch", "2", "--warmup", "1", "--steps", "2"]


def test_bench_cuda_every_mode_precision_and_compile(tmp_path):
    out = tmp_path / "b.json"
    argv = [*TINY, "--mode", "forward", "fwd-bwd", "train", "--precision", "fp32", "bf16"]
    assert bench.main([*argv, "--compile", "both", "--quiet", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 12
    for r in rows:
        assert r["status"] == "ok", r
        assert r["peak_mem_gib"] > 0
        assert r["fwd_ms"] > 0  # CUDA-event phase timing
        if torch.cuda.get_device_name(0).startswith("NVIDIA H"):
            assert r["mfu_pct"] is not None
            assert 0 < r["mfu_pct"] < 100


def test_cuda_graph_replays_match_eager_steps(tmp_path):
    """A graphed train step updates the weights exactly as the eager step does."""
    from lm_core import AdamW, cross_entropy
    from lm_core.graph_step import capture_cuda_graph
    from perf_tools.models import build_model, random_batch, resolve_config
    from perf_tools.steps import make_step

    config = resolve_config("tiny", context_length=32)
    device = torch.device("cuda")
    weights = []
    for graphed in (False, True):
        torch.manual_seed(0)
        model = build_model(config, device)
        opt = AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        x, y = random_batch(2, 32, config.vocab_size, device, seed=1)
        step = make_step(
            model,
            "train",
            inputs=x,
            targets=y,
            loss_fn=cross_entropy,
            precision="bf16",
            optimizer=opt,
            graph_safe=graphed,
        )
        if graphed:
            # 2 eager warm-up steps; capture records a step without running it
            step = capture_cuda_graph(step, warmup=2)
            calls = 4
        else:
            calls = 6
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
        weights.append([p.detach().clone() for p in model.parameters()])
    # One missed or repeated AdamW step moves weights by ~lr = 1e-2; kernels may differ in
    # summation order between capture and eager (SDPA's backward), far below that.
    torch.manual_seed(0)
    initial = list(build_model(config, device).parameters())
    for eager, graph, init in zip(*weights, initial):
        assert (eager - init).abs().max() > 1e-2
        torch.testing.assert_close(graph, eager, rtol=0, atol=1e-3)


def test_bench_cuda_graph_rows(tmp_path):
    out = tmp_path / "b.json"
    argv = [*TINY, "--mode", "forward", "train", "--cuda-graph", "both", "--quiet"]
    assert bench.main([*argv, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 8
    assert {r["cuda_graph"] for r in rows} == {False, True}
    for r in rows:
        assert r["status"] == "ok", r
        assert (r["fwd_ms"] is None) == r["cuda_graph"]  # no phase events inside a graph


def test_bench_blocks_compile_graph_and_optimizer_overlap(tmp_path):
    """The issue-28 sweep at tiny size: whole-model and per-block compile, eager launches and
    CUDA graphs, the optimizer after or during the backward: every row runs."""
    out = tmp_path / "b.json"
    argv = [*TINY, "--mode", "train", "--precision", "bf16", "--compile", "on", "blocks"]
    argv += ["--cuda-graph", "both", "--optimizer-overlap", "both", "--fused-loss"]
    assert bench.main([*argv, "--quiet", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 * 2 * 2
    assert {(r["compile"], r["cuda_graph"], r["opt_overlap"]) for r in rows} == {
        (c, g, o) for c in (True, "blocks") for g in (False, True) for o in (False, True)
    }
    for r in rows:
        assert r["status"] == "ok", r
        if not r["cuda_graph"]:
            assert r["opt_ms"] >= 0


def test_bench_peak_memory_grows_with_mode(tmp_path):
    out = tmp_path / "b.json"
    argv = [*TINY, "--mode", "forward", "train", "--precision", "fp32", "--quiet"]
    argv += ["--json", str(out)]
    assert bench.main(argv) == 0
    fwd, train = json.loads(out.read_text())["rows"]
    # train holds grads and two AdamW moments on top of the weights: > 3x forward's weights
    assert train["peak_mem_gib"] > fwd["peak_mem_gib"]


def test_memory_snapshot_and_nvtx(tmp_path):
    snap = tmp_path / "mem.pickle"
    argv = [*TINY, "--mode", "train", "--precision", "bf16", "--quiet", "--nvtx"]
    argv += ["--memory-snapshot", str(snap)]
    assert bench.main(argv) == 0
    data = pickle.loads(snap.read_bytes())
    assert "segments" in data
    assert "device_traces" in data


def test_compare_hf_on_cuda(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "b.json"
    argv = [*TINY, "--mode", "train", "--precision", "bf16", "--compare", "hf", "--quiet"]
    assert bench.main([*argv, "--json", str(out)]) == 0
    ours, hf = json.loads(out.read_text())["rows"]
    assert hf["status"] == "ok"
    assert ours["vs_hf"] > 0


def test_profile_cuda_kernels_and_ranges(tmp_path):
    argv = [*TINY, "--mode", "train", "--out", str(tmp_path), "--quiet"]
    assert profile.main(argv) == 0
    (cell,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    tables = json.loads((cell / "tables.json").read_text())
    assert tables["meta"]["unit"] == "kernel"
    names = {r["range"] for r in tables["ranges"]}
    assert {"forward", "backward", "optimizer", "attention/softmax"} <= names
    level0 = sum(r["share_pct"] for r in tables["ranges"] if r["level"] == 0)
    assert level0 == pytest.approx(100.0, abs=0.01)
    classes = {r["class"] for r in tables["kernels"]}
    assert "matmul" in classes  # cuBLAS kernels recognized by name
    # nearly all kernel time is attributed to a launching op inside the phases
    outside = sum(r["share_pct"] for r in tables["ranges"] if r["range"].startswith("(outside"))
    assert outside < 5
    # each kernel counted once: busy time cannot exceed the wall time of the profiled steps
    (summary,) = json.loads((tmp_path / "summary.json").read_text())["rows"]
    assert 0 < summary["busy_ms_per_step"] <= summary["wall_ms_per_step"]
    optimizer = next(r for r in tables["ranges"] if r["range"] == "optimizer")
    assert optimizer["items_per_step"] < 20  # fused AdamW: a few launches, not one per op


def test_attention_flash_cuda_tiny(tmp_path):
    out = tmp_path / "f.json"
    argv = ["flash", "--seq", "128", "256", "--d", "64", "--dtype", "bf16", "fp32", "--quiet"]
    argv += ["--providers", "flash-triton", "naive", "sdpa-flash", "sdpa-efficient"]
    assert attention.main([*argv, "--rep-ms", "20", "--warmup-ms", "5", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    for r in rows:
        if r["provider"] == "sdpa-flash" and r["dtype"] == "fp32":
            assert r["status"].startswith("unsupported"), r  # no fp32 flash kernel
        else:
            assert r["status"] == "ok", r
            assert r["fwd_bwd_ms"] > 0
            assert r["floor_fwd_bwd_ms"] > 0


def test_sweep_failed_capture_leaves_the_next_cells_unharmed():
    """A call that cannot be captured (it synchronizes) raises; the calling stream is
    current again and the next capture and replay work."""
    from perf_tools import attention_sweep as sweep

    cfg = sweep.SweepConfig(shapes=((1, 16),), device="cuda", rep_ms=5.0, warmup_ms=1.0)
    x = torch.zeros(16, device="cuda")
    calls = []

    def syncs() -> None:
        calls.append(1)
        x.add_(1.0)
        torch.cuda.synchronize()

    with pytest.raises(RuntimeError):
        sweep._graphed_ms(syncs, cfg)
    assert len(calls) == 2  # warm-up and capture
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    before = x.clone()
    assert sweep._graphed_ms(lambda: x.add_(1.0), cfg) > 0
    torch.cuda.synchronize()
    assert (x > before).all()  # the replays ran


def test_sweep_graphed_cell_of_leaves_used_on_the_default_stream():
    """The sweep's inputs are leaves first used on the default stream (its timed calls run
    there); the graphed cell still captures, on fresh leaves, and replays."""
    from perf_tools import attention_sweep as sweep

    cfg = sweep.SweepConfig(
        shapes=((2, 64),), device="cuda", rep_ms=5.0, warmup_ms=1.0, graphed=True
    )
    q, k, v, do = sweep._inputs(2, 64, 32, cfg, seed=0)
    torch.autograd.grad((q * k * v).sum(), (q, k, v))  # the leaves' nodes: default stream
    cell = sweep._cell(lambda a, b, c: a * b + c, q, k, v, do, cfg)
    assert cell["graphed_ms"] > 0
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
