"""perf_tools.bench's multi-GPU mode (gloo, 2 ranks, tiny model), the 8B config, the fused
loss and activation checkpointing in one process, and the flags' checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from perf_tools import bench, bench_dist
from perf_tools.flops import formula_forward_flops

TINY = ["--size", "tiny", "--context", "16", "--batch", "2", "--quiet"]
FAST = ["--warmup", "1", "--steps", "2"]
MULTI = ["--nprocs", "2", "--device", "cpu"]
# The 8B command of docs/bench.md: batch 2 across 2 GPUs = 1 sequence per rank.
CMD_8B = [
    *("--size", "8B", "--context", "32768", "--batch", "1", "--nprocs", "2", "--fsdp", "ours"),
    *("--precision", "bf16", "--mode", "train", "--fused-loss", "--activation-checkpointing"),
    *("1", "--attention", "sdpa", "--warmup", "1", "--steps", "3"),
]


def _rows(path):
    return json.loads(path.read_text())["rows"]


def _tiny():
    from lm_core import MODEL_SIZES

    return MODEL_SIZES["tiny"]


# ----------------------------------------------------------------------------- multi-GPU mode


def test_fsdp_ours_on_two_ranks_gives_the_columns(tmp_path):
    out = tmp_path / "d.json"
    argv = [*TINY, *FAST, *MULTI, "--fsdp", "ours", "--mode", "train", "fwd-bwd"]
    assert bench.main([*argv, "--peak-tflops", "1", "--json", str(out)]) == 0
    rows = _rows(out)
    assert [(r["mode"], r["fsdp"]) for r in rows] == [("train", "ours"), ("fwd-bwd", "ours")]
    cfg = _tiny()
    n_units = cfg.num_layers + 2  # embedding, blocks, head
    for r in rows:
        assert r["status"] == "ok", r
        assert (r["nprocs"], r["batch"], r["global_batch"]) == (2, 2, 4)
        for col in ("median_ms", "mean_ms", "fwd_ms", "bwd_ms", "sync_ms", "build_s"):
            assert r[col] > 0, col
        assert r["min_ms"] <= r["median_ms"] <= r["max_ms"]
        # FLOPs of the global batch (2 ranks x 2 sequences); MFU and TFLOP/s per GPU
        flops = 3 * formula_forward_flops(cfg, 4, 16)
        median_s = r["median_ms"] / 1e3
        assert r["gflop_per_step"] == pytest.approx(flops / 1e9)
        assert r["tokens_per_s"] == pytest.approx(4 * 16 / median_s)
        assert r["tflops"] == pytest.approx(flops / 2 / median_s / 1e12)
        assert r["mfu_pct"] == pytest.approx(100 * r["tflops"] / 1.0)
        assert r["peak_mem_gib"] is None  # no CUDA allocator on CPU
        # every all-gather waited for once: forward every unit, backward all but the head
        assert r["gathers"] == 2 * n_units - 1
        assert 0 <= r["units_waited"] <= r["gathers"]
        assert r["gather_wait_ms"] >= 0
        assert r["gather_wait_max_ms"] >= 0
        assert r["gather_wait_max_unit"].split()[1] in ("forward", "backward")
        assert r["act_ckpt"] == "none"
        assert r["act_ckpt_k"] == 0
    assert rows[0]["opt_ms"] > 0
    assert rows[1]["opt_ms"] is None  # fwd-bwd: no optimizer


def test_fsdp_torch_with_fused_loss_and_checkpointing(tmp_path):
    out = tmp_path / "d.json"
    argv = [*TINY, *FAST, *MULTI, "--fsdp", "torch", "--precision", "bf16", "--fused-loss"]
    assert bench.main([*argv, "--activation-checkpointing", "1", "--json", str(out)]) == 0
    (r,) = _rows(out)
    assert r["status"] == "ok", r
    assert (r["fsdp"], r["mode"], r["fused_loss"], r["act_ckpt"], r["act_ckpt_k"]) == (
        "torch",
        "train",
        True,
        1,
        1,
    )
    assert r["sync_ms"] is None  # torch reduces inside backward
    assert "gather_wait_ms" not in r  # measured for ours only


def test_fsdp_ours_with_fused_loss(tmp_path):
    """lm_core's head computes the fused loss inside its module call: FSDP gathers it."""
    out = tmp_path / "d.json"
    argv = [*TINY, *FAST, *MULTI, "--fsdp", "ours", "--precision", "bf16", "--fused-loss"]
    assert bench.main([*argv, "--activation-checkpointing", "optimal", "--json", str(out)]) == 0
    (r,) = _rows(out)
    assert r["status"] == "ok", r
    assert (r["fused_loss"], r["act_ckpt"], r["act_ckpt_k"]) == (True, "optimal", 1)
    assert r["gathers"] == 2 * (_tiny().num_layers + 2) - 1
    assert r["est_peak_mem_gib"] > 0


def _oom_worker(rank: int, world: int, job, failing: tuple[int, ...]):
    """run_rank with a simulated OOM on the ranks in `failing` (module level: picklable)."""
    real = bench_dist._measure

    def measure(job, rank, device):
        if rank in failing:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80 GiB (test)")
        return real(job, rank, device)

    bench_dist._measure = measure
    return bench_dist.run_rank(rank, world, job)


def _job(**changes):
    base = {"size": "tiny", "attention": None, "precision": "fp32", "mode": "train"}
    base.update(context=16)
    base.update(fsdp="ours", batch=2, warmup=1, steps=2, overrides={}, backend="gloo")
    base.update(changes)
    return bench_dist.DistJob(**base)


def test_oom_on_every_rank_is_an_oom_row():
    out = bench_dist.spawn_cell(_job(), 2, 120.0, fn=_oom_worker_all)
    assert out["status"] == "OOM", out


def test_ranks_agree_on_oom_without_a_parent():
    """Under torchrun no parent watches: the ranks agree through the flag all-reduce."""
    from ddp_kit.launch import spawn

    assert spawn(_oom_worker_all, 2, args=(_job(),), timeout_s=120) == [
        {"rank": 0, "status": "OOM"},
        {"rank": 1, "status": "OOM"},
    ]


def _oom_worker_all(rank, world, job):
    return _oom_worker(rank, world, job, (0, 1))


def _oom_worker_rank1(rank, world, job):
    return _oom_worker(rank, world, job, (1,))


def test_oom_on_one_rank_is_an_oom_row_not_a_hang():
    """Rank 1 runs out before a collective that rank 0 is waiting in: the ranks cannot agree
    through the flag, but rank 1 tells the parent, which ends the cell as OOM at once."""
    import time

    t0 = time.monotonic()
    out = bench_dist.spawn_cell(_job(), 2, 300.0, fn=_oom_worker_rank1)
    assert out["status"] == "OOM", out
    assert "rank(s) [1]" in out["note"]
    assert time.monotonic() - t0 < 120, "ended by the report, not by the timeout"


def _tf32_worker(rank: int, world: int, job):
    out = bench_dist.run_rank(rank, world, job)
    return {"status": out.get("status"), "tf32": torch.backends.cuda.matmul.allow_tf32}


@pytest.mark.parametrize("tf32", [True, False])
def test_spawned_ranks_apply_the_tf32_flag(tf32):
    """The flag is per process: a spawned rank sets it from the job, not from its parent."""
    from ddp_kit.launch import spawn

    out = spawn(_tf32_worker, 2, args=(_job(tf32=tf32),), timeout_s=120)
    assert [r["tf32"] for r in out] == [tf32, tf32], out


def test_runs_under_torchrun(tmp_path):
    out = tmp_path / "t.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += ["-m", "perf_tools.bench", *TINY, *FAST, "--device", "cpu", "--fsdp", "ours"]
    cmd += ["--json", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    (r,) = _rows(out)
    assert (r["status"], r["nprocs"], r["fsdp"], r["global_batch"]) == ("ok", 2, "ours", 4)
    assert r["median_ms"] > 0


# ----------------------------------------------------------------------------- one process


def test_fused_loss_and_checkpointing_single_process(tmp_path):
    out = tmp_path / "b.json"
    argv = [*TINY, *FAST, "--mode", "forward", "fwd-bwd", "train", "--fused-loss"]
    assert bench.main([*argv, "--activation-checkpointing", "1", "--json", str(out)]) == 0
    rows = _rows(out)
    assert len(rows) == 3
    for r in rows:
        assert r["status"] == "ok", r
        assert (r["fused_loss"], r["act_ckpt"], r["act_ckpt_k"]) == (True, 1, 1)
        assert r["median_ms"] > 0
        assert "nprocs" not in r  # one process: unchanged rows


@pytest.mark.parametrize(("policy", "precision"), [("optimal", "fp32"), ("optimal", "bf16")])
def test_optimal_checkpointing_uses_the_precision_ratio(tmp_path, policy, precision):
    from lm_core.activation_ckpt import block_activation_ratio, resolve_group_size

    out = tmp_path / "b.json"
    argv = [*TINY, *FAST, "--mode", "fwd-bwd", "--num-layers", "6", "--precision", precision]
    assert bench.main([*argv, "--activation-checkpointing", policy, "--json", str(out)]) == 0
    (r,) = _rows(out)
    cfg = _tiny()
    ratio = block_activation_ratio(cfg, autocast=precision == "bf16")
    assert r["act_ckpt_k"] == resolve_group_size(policy, 6, ratio) >= 1


def test_make_step_without_loss_fn_asks_the_model_for_the_loss():
    from perf_tools.steps import make_step

    calls = []

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(()))

        def forward(self, x, targets=None):
            calls.append(targets is not None)
            return (self.w * x.float()).mean()

    model = Model()
    x = torch.zeros(2, 4, dtype=torch.long)
    synced = []
    for mode in ("forward", "fwd-bwd"):
        step = make_step(
            model,
            mode,
            inputs=x,
            targets=x,
            loss_fn=None,
            precision="fp32",
            sync=lambda: synced.append(1),
        )
        step()
    assert calls == [True, True]
    assert synced == [1]  # after backward only
    assert model.w.grad is not None


# ----------------------------------------------------------------------------- the 8B config


def test_8b_command_resolves_without_building():
    from lm_core import get_config
    from perf_tools.flops import step_flops
    from perf_tools.models import resolve_config

    args = bench.parse_args([*CMD_8B, "--device", "cpu"])
    (spec,) = bench.specs_from_args(args)
    assert (spec.size, spec.fsdp, spec.mode, spec.context) == ("8B", "ours", "train", 32768)
    assert (args.nprocs, args.batch, args.fused_loss, args.activation_checkpointing) == (
        2,
        1,
        True,
        1,
    )
    cfg = resolve_config("8B", context_length=32768, attention="flash-triton")
    assert cfg == get_config("8B", attention="flash-triton")
    # By hand: B = 2 sequences (global), T = 32,768, L = 34, d = 4096, f = 11,008, V = 151,936.
    # dense: 2 B T (L (4 d^2 + 3 d f) + d V) = 131,072 * (34 * 202,375,168 + 622,329,856)
    dense = 131_072 * (6_880_755_712 + 622_329_856)
    assert dense == 983_444_431_568_896
    attention = 4 * 2 * 34 * 32_768**2 * 4096  # Q K^T and P V over the full T x T
    assert attention == 1_196_268_651_020_288
    assert step_flops(cfg, 2, 32768, "train") == 3 * (dense + attention) == 6_539_139_247_767_552


def test_readme_has_the_8b_command():
    from pathlib import Path

    doc = (Path(__file__).parents[1] / "docs" / "bench.md").read_text()
    assert "python -m perf_tools.bench " + " ".join(CMD_8B) in doc


def test_8b_memory_estimate_per_gpu():
    """docs/bench.md's numbers: bf16 compute, 2 ranks, 1 x 32,768 tokens each, groups of 1."""
    from lm_core import MODEL_SIZES

    est = bench_dist.fsdp_memory_estimate(
        MODEL_SIZES["8B"], world=2, batch=1, context=32768, group_size=1
    )
    sharded = 8_125_698_048 - (2 * 4096 * 34 + 4096)  # all but the norms
    assert est["params"] == 4 * sharded / 2 + 4 * (2 * 4096 * 34 + 4096)
    a = 32768 * 4096 * 2  # one block input, bf16
    assert est["activations"] == (33 + 19.75 + 2) * a  # 33 stored inputs, the last block, norm
    head = 151_936 * 4096 * (2 + 4 + 2) + 1024 * 151_936 * 2 + a
    assert est["head"] == head
    gb = 1e9
    assert round(est["params"] / gb, 2) == 16.25
    assert round(est["optim"] / gb, 2) == 32.50
    assert round(est["activations"] / gb, 2) == 14.70
    assert round(est["head"] / gb, 2) == 5.56
    assert round(est["peak"] / gb, 2) == 69.01
    assert round(est["upper_bound"] / gb, 2) == 85.26
    assert est["upper_bound"] < 141e9 * 0.65  # an H200 holds it with room to spare


# ----------------------------------------------------------------------------- flags


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--fsdp", "ours"], "--fsdp"),  # no --nprocs
        (["--nprocs", "2"], "--nprocs"),  # no --fsdp
        (["--nprocs", "0", "--fsdp", "ours"], "--nprocs"),
        (["--nprocs", "-1", "--fsdp", "ours"], "--nprocs"),
        (["--nprocs", "2", "--fsdp", "fully"], "--fsdp"),
        (["--nprocs", "2", "--fsdp", "ours", "--mode", "forward"], "--fsdp"),
        (["--nprocs", "2", "--fsdp", "ours", "--compile", "--warmup", "0"], "--warmup"),
        (["--nprocs", "2", "--fsdp", "ours", "--cuda-graph"], "--cuda-graph"),
        (["--nprocs", "2", "--fsdp", "ours", "--compare", "hf"], "--compare"),
        (["--nprocs", "2", "--fsdp", "ours", "--timeout-s", "0"], "--timeout-s"),
        (["--activation-checkpointing", "0"], "--activation-checkpointing"),
        (["--activation-checkpointing", "often"], "--activation-checkpointing"),
    ],
)
def test_bad_multi_gpu_flags_name_the_flag(argv, flag, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as info:
        bench.main([*argv, "--device", "cpu"])
    assert info.value.code == 2
    assert flag in capsys.readouterr().err


def test_fsdp_torch_where_torch_lacks_fully_shard(capsys, monkeypatch):
    def missing():
        raise ImportError("torch 2.3 has no torch.distributed.fsdp.fully_shard (torch >= 2.4)")

    import lm_core.fsdp

    monkeypatch.setattr(lm_core.fsdp, "torch_fsdp_api", missing)
    with pytest.raises(SystemExit):
        bench.main([*MULTI, "--fsdp", "torch"])
    err = capsys.readouterr().err
    assert "argument --fsdp" in err
    assert "--fsdp ours" in err


def test_nccl_ranks_need_gpus(capsys):
    if not torch.cuda.is_available():
        pytest.skip("checks a CUDA machine's GPU count")
    n = torch.cuda.device_count() + 1
    with pytest.raises(SystemExit):
        bench.main(["--nprocs", str(n), "--fsdp", "ours", "--device", "cuda"])
    assert "--nprocs" in capsys.readouterr().err


# ----------------------------------------------------------------------------- 2 GPUs


@pytest.mark.nccl
def test_two_gpus_tiny_ours_and_torch(tmp_path):
    out = tmp_path / "g.json"
    argv = ["--size", "tiny", "--context", "64", "--batch", "2", "--quiet", *FAST]
    argv += ["--nprocs", "2", "--fsdp", "ours", "torch", "--precision", "bf16"]
    assert bench.main([*argv, "--activation-checkpointing", "1", "--json", str(out)]) == 0
    rows = _rows(out)
    assert [r["fsdp"] for r in rows] == ["ours", "torch"]
    for r in rows:
        assert r["status"] == "ok", r
        assert r["device"] == "nccl: 2 x cuda"
        assert r["peak_mem_gib"] > 0
        assert r["peak_reserved_gib"] >= r["peak_mem_gib"]
        assert r["fwd_ms"] > 0  # CUDA-event phases
        if torch.cuda.get_device_name(0).startswith("NVIDIA H"):
            assert 0 < r["mfu_pct"] < 100
    ours = rows[0]
    assert ours["gathers"] == 2 * (2 + 2) - 1
    assert 0 <= ours["units_waited"] <= ours["gathers"]
    assert ours["gather_wait_ms"] >= 0


@pytest.mark.nccl
def test_two_gpus_fused_loss(tmp_path):
    out = tmp_path / "g.json"
    argv = ["--size", "tiny", "--context", "64", "--batch", "2", "--quiet", *FAST]
    argv += ["--nprocs", "2", "--fsdp", "torch", "ours", "--precision", "bf16", "--fused-loss"]
    assert bench.main([*argv, "--json", str(out)]) == 0
    torch_row, ours = _rows(out)
    assert torch_row["status"] == "ok", torch_row
    assert ours["status"] == "ok", ours
    assert ours["est_peak_mem_gib"] > 0
