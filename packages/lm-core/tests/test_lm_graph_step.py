"""`--cuda-graph` on a CPU: the refusals, the static buffers, the device LR, and the graphed
step's logic with a runner that re-runs the step where a GPU would replay its graph.

A CUDA graph replays recorded kernels; `_Rerun` re-runs the recorded function instead, so
what `GraphedStep` adds around the capture (warm-up count, buffers refilled in place, the LR
written before each replay, static outputs, checkpoints) is checked here against the eager
trainer. The capture itself is checked on a GPU (`test_lm_graph_step_gpu.py`)."""

from __future__ import annotations

import functools

import pytest
import torch

import lm_core.graph_step as gs
import lm_core.trainer as trainer
from lm_core import AdamW, read_checkpoint
from lm_core.graph_step import DeviceLR, GraphedStep, StaticBatches, check_config
from lm_core.train import main
from lm_core.train_checks import resolve_config
from lm_core.train_config import ConfigError, KeyNames, TrainConfig

FAST = ["--size", "tiny", "--context-length", "32", "--batch-size", "4", "--no-progress"]
CPU = torch.device("cpu")


class _Rerun:
    """A `GraphRunner` for CPUs: eager calls run in place; "capture" returns the function,
    so each "replay" runs the step again on the static buffers and the device LR."""

    def __init__(self) -> None:
        self.eager_calls = 0
        self.captures = 0
        self.replays = 0

    def eager(self, fn):
        self.eager_calls += 1
        return fn()

    def capture(self, fn):
        self.captures += 1

        def replay():
            self.replays += 1
            fn()

        return replay


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--device", "cpu"], "--device cpu"),
        (["--ddp", "bucketed"], "--ddp bucketed"),
        (["--ddp", "torch", "--zero"], "--ddp torch"),
        (["--fsdp", "torch"], "--fsdp torch"),
        (["--tp", "2"], "--tp 2"),
        (["--pack-documents", "--eot-id", "0"], "--pack-documents"),
    ],
)
def test_combinations_that_cannot_be_captured_are_refused(flags, named, capsys):
    with pytest.raises(SystemExit) as exc:
        main([*FAST, "--cuda-graph", *flags])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--cuda-graph" in err
    assert named in err


def test_refusals_name_toml_keys_and_allow_single_gpu_options():
    config = TrainConfig.from_dict({"training": {"cuda_graph": True, "device": "cpu"}})
    with pytest.raises(ConfigError, match=r"training\.cuda_graph needs a CUDA device") as exc:
        resolve_config(config)
    assert exc.value.key == "training.cuda_graph"
    config = TrainConfig.from_dict({"training": {"cuda_graph": True}, "parallel": {"zero": True}})
    with pytest.raises(ConfigError, match=r"parallel\.zero = true"):
        check_config(config, KeyNames())
    # one-GPU options that the graph captures: accepted
    ok = TrainConfig.from_dict(
        {
            "training": {
                "cuda_graph": True,
                "device": "cuda",
                "compile": True,
                "bf16": True,
                "grad_accum_steps": 2,
                "fused_loss": True,
                "activation_checkpointing": "sqrt",
            }
        }
    )
    check_config(ok)
    check_config(TrainConfig())  # off: nothing to check


def test_the_option_round_trips_through_toml(tmp_path):
    config = TrainConfig.from_dict({"training": {"cuda_graph": True}})
    path = tmp_path / "run.toml"
    path.write_text(config.to_toml())
    assert "cuda_graph = true" in path.read_text()
    assert TrainConfig.from_toml(path).training.cuda_graph is True
    assert TrainConfig().training.cuda_graph is False


def test_without_a_gpu_the_run_is_refused_before_anything_is_built(monkeypatch):
    built = []
    monkeypatch.setattr(trainer, "TransformerLM", lambda *a, **k: built.append(1))
    with pytest.raises(ValueError, match=r"--cuda-graph \(training\.cuda_graph\) needs a CUDA"):
        main([*FAST, "--cuda-graph", "--steps", "2"])  # --device auto on a CPU machine
    assert built == []
    with pytest.raises(ValueError, match="needs a CUDA device; this run is on cpu"):
        gs.check_device(CPU)


def test_the_optimizer_must_be_the_fused_adamw():
    p = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(RuntimeError, match=r"needs lm_core\.AdamW, got SGD"):
        gs.check_optimizer(torch.optim.SGD(p, lr=0.1), CPU)
    with pytest.raises(RuntimeError, match="group 0 does not use the fused AdamW kernel"):
        gs.check_optimizer(AdamW(p, fused=False), CPU)
    gs.check_optimizer(AdamW(p, fused=True), CPU)  # the fused kernel: accepted


# ----------------------------------------------------------------------------- static state


def test_static_batches_are_refilled_in_place():
    buffers = StaticBatches(2, 3, 5, CPU)
    views = buffers.views()
    addresses = [(x.data_ptr(), y.data_ptr()) for x, y in views]
    for _ in range(2):
        batches = [(torch.randint(0, 99, (3, 5)), torch.randint(0, 99, (3, 5))) for _ in range(2)]
        buffers.fill(batches)
        for (x, y), (sx, sy) in zip(batches, buffers.views()):
            assert torch.equal(sx, x)
            assert torch.equal(sy, y)
        assert [(x.data_ptr(), y.data_ptr()) for x, y in buffers.views()] == addresses
    with pytest.raises(ValueError, match="expected 2 micro-batches, got 1"):
        buffers.fill(batches[:1])
    with pytest.raises(ValueError, match=r"batches\[1\] targets: expected shape \(3, 5\)"):
        buffers.fill([batches[0], (batches[1][0], torch.zeros(3, 4, dtype=torch.long))])
    with pytest.raises(ValueError, match="rows: expected a positive int"):
        StaticBatches(1, 0, 5, CPU)


def test_device_lr_is_written_in_place_and_groups_keep_the_float():
    p = [torch.nn.Parameter(torch.zeros(3))]
    opt = AdamW([{"params": p}, {"params": [torch.nn.Parameter(torch.zeros(2))]}], lr=0.5)
    lr = DeviceLR(opt, CPU)
    address = lr.tensor.data_ptr()
    for value in (1e-3, 2.5e-4):
        lr.set(value)
        assert lr.tensor.item() == pytest.approx(value, rel=1e-7)  # float32
        assert lr.tensor.data_ptr() == address
        assert lr.tensor.dtype == torch.float32
        assert lr.tensor.dim() == 0
    for group in opt.param_groups:
        group["lr"] = lr.tensor  # as during the capture
    lr.record(2.5e-4)
    assert [g["lr"] for g in opt.param_groups] == [2.5e-4, 2.5e-4]


# ----------------------------------------------------------------------------- the step


def _setup(accum: int, clip: float):
    """A tiny model, fused AdamW (tensor LR: what the graph needs), and the trainer's pieces."""
    flags = [*FAST, "--grad-accum-steps", str(accum), "--grad-clip", str(clip)]
    from lm_core.train import parse_args

    config = parse_args(flags)
    env = trainer.DistEnv()
    torch.manual_seed(0)
    model = trainer.TransformerLM(config.model_config)
    pm = trainer.wrap_model(model, "none", env)
    opt = AdamW(pm.parameters(), lr=1.0, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    return config, env, pm, opt, trainer.load_data(config)


@pytest.mark.parametrize(("accum", "clip"), [(1, 1.0), (2, 0.0)])
def test_graphed_step_follows_the_eager_trainer_bitwise(accum, clip):
    """Eight steps, three of them eager warm-ups, a new LR every step (exact in float32, as
    the graph's LR tensor is): losses, grad norms, weights and optimizer state equal the eager
    trainer's bit for bit; the warm-ups, the capture and the replays happen once each."""
    lrs = [(8 - i) * 2.0**-10 for i in range(8)]
    ref = _setup(accum, clip)
    config, env, pm, opt, data = _setup(accum, clip)
    runner = _Rerun()
    seq, rows = config.model.context_length, config.training.batch_size

    def step(batches, lr):
        micro = [(x, y, None) for x, y in batches]
        return trainer._step_on(micro, pm, opt, config, env, lr, autocast_cache=False)

    graph = GraphedStep(step, opt, micro_steps=accum, rows=rows, seq=seq, device=CPU, runner=runner)
    outputs = []
    for i, lr in enumerate(lrs):
        want_loss, want_norm = trainer.train_step(*ref[2:4], ref[4], ref[0], ref[1], lr)
        loss, norm = trainer.train_step(pm, opt, data, config, env, lr, graph)
        assert torch.equal(loss, want_loss), i
        assert (norm is None) == (want_norm is None) == (clip == 0)
        if norm is not None:
            assert torch.equal(norm, want_norm), i
        outputs.append((loss, norm))
        assert [g["lr"] for g in opt.param_groups] == [lr]  # a float, as eager leaves it
    assert (runner.eager_calls, runner.captures, runner.replays) == (3, 1, 5)
    assert graph.captured
    assert all(o[0] is graph.loss for o in outputs[3:])  # static outputs, rewritten in place
    for key, value in ref[2].model.state_dict().items():
        assert torch.equal(value, pm.model.state_dict()[key]), key
    want, got = ref[3].state_dict(), opt.state_dict()
    assert want["param_groups"] == got["param_groups"]
    for i, state in want["state"].items():
        for name, value in state.items():
            assert torch.equal(value, got["state"][i][name]), (i, name)


def test_a_stale_learning_rate_would_be_seen():
    """The check above can fail: a graph whose LR tensor is not rewritten drifts from eager."""
    ref = _setup(1, 1.0)
    config, env, pm, opt, data = _setup(1, 1.0)

    def step(batches, lr):
        return trainer._step_on([(x, y, None) for x, y in batches], pm, opt, config, env, lr)

    graph = GraphedStep(step, opt, micro_steps=1, rows=4, seq=32, device=CPU, runner=_Rerun())
    graph.lr.set = lambda lr: None  # never written: stays 0 after the capture
    for lr in [2.0**-8] * 5:
        want, _ = trainer.train_step(*ref[2:4], ref[4], ref[0], ref[1], lr)
        got, _ = trainer.train_step(pm, opt, data, config, env, lr, graph)
    assert not torch.equal(want, got)


def test_warmup_must_leave_an_eager_step():
    with pytest.raises(ValueError, match="warmup: expected at least 1 eager step"):
        GraphedStep(
            lambda b, lr: None,
            AdamW([torch.zeros(1)]),
            micro_steps=1,
            rows=1,
            seq=1,
            device=CPU,
            warmup=0,
            runner=_Rerun(),
        )


# ----------------------------------------------------------------------------- the trainer


@pytest.fixture
def rerun_trainer(monkeypatch):
    """The trainer with `--cuda-graph` on a CPU: the re-running runner, and a fused AdamW
    (the CPU default is the foreach one, which cannot read a tensor LR)."""
    monkeypatch.setattr(trainer, "check_device", lambda device: None)
    monkeypatch.setattr(trainer, "AdamW", functools.partial(AdamW, fused=True))
    runners: list[_Rerun] = []

    def make_runner(device, node_priorities=False):
        assert node_priorities  # the trainer's step replays with node priorities
        runners.append(_Rerun())
        return runners[-1]

    monkeypatch.setattr(gs, "CudaGraphs", make_runner)
    monkeypatch.setattr(gs, "check_device", lambda device: None)
    return runners


def test_trainer_graph_run_logs_checkpoints_and_resumes_as_eager(tmp_path, rerun_trainer):
    """Same steps, logged losses, checkpoint (weights, optimizer state, float LRs) as the
    eager trainer with the same optimizer; a graphed run resumed from a graphed run's
    checkpoint continues it exactly. A constant LR exact in float32 keeps it bitwise."""
    common = [*FAST, "--log-every", "1", "--grad-accum-steps", "2", "--cosine-steps", "10"]
    common += ["--max-lr", str(2.0**-8), "--min-lr", str(2.0**-8)]
    eager = main([*common, "--steps", "10", "--out-dir", str(tmp_path / "eager")])
    assert rerun_trainer == []
    graphed = main([*common, "--steps", "10", "--cuda-graph", "--out-dir", str(tmp_path / "g")])
    assert (rerun_trainer[0].eager_calls, rerun_trainer[0].replays) == (3, 7)
    assert graphed.step == eager.step == 10
    losses = [h["loss"] for h in eager.history]
    assert [h["loss"] for h in graphed.history] == losses
    assert [h["grad_norm"] for h in graphed.history] == [h["grad_norm"] for h in eager.history]
    want, got = (read_checkpoint(tmp_path / d / "checkpoint.pt") for d in ("eager", "g"))
    assert got["step"] == 10
    for key, value in want["model"].items():
        assert torch.equal(value, got["model"][key]), key
    assert want["optimizer"]["param_groups"] == got["optimizer"]["param_groups"]
    for i, state in want["optimizer"]["state"].items():
        for name, value in state.items():
            assert torch.equal(value, got["optimizer"]["state"][i][name]), (i, name)
    first = main([*common, "--steps", "5", "--cuda-graph", "--out-dir", str(tmp_path / "a")])
    resume = ["--resume", str(tmp_path / "a" / "checkpoint.pt")]
    graphed_10 = [*common, "--steps", "10", "--cuda-graph"]
    rest = main([*graphed_10, *resume, "--out-dir", str(tmp_path / "b")])
    assert [h["loss"] for h in first.history + rest.history] == losses
    for key, value in eager.model.state_dict().items():
        assert torch.equal(value, rest.model.state_dict()[key]), key


def test_trainer_graph_run_with_a_cosine_schedule(rerun_trainer):
    """Warmup and cosine decay: the graph's float32 LR differs from the eager double by one
    rounding, so the runs agree to float32 rounding, not bitwise."""
    common = [*FAST, "--log-every", "1", "--steps", "8", "--warmup-steps", "2"]
    eager = main([*common, "--max-lr", "3e-3"])
    graphed = main([*common, "--max-lr", "3e-3", "--cuda-graph"])
    assert [h["lr"] for h in graphed.history] == [h["lr"] for h in eager.history]
    torch.testing.assert_close(
        torch.tensor([h["loss"] for h in graphed.history]),
        torch.tensor([h["loss"] for h in eager.history]),
        rtol=1e-5,
        atol=0,
    )


class _FusedAdamW(AdamW):
    """lm_core's AdamW with fused=True as a class (OverlappedOptimizer takes a class)."""

    def __init__(self, params, **kwargs) -> None:
        super().__init__(params, fused=True, **kwargs)


def test_trainer_graph_run_with_the_overlapped_optimizer(rerun_trainer, monkeypatch):
    """--cuda-graph with --optimizer-overlap (the bench's fast step in the trainer): every
    unit's AdamW reads the graph's LR tensor, and the run is the eager overlapped run bit
    for bit (an LR exact in float32), accumulation included."""
    monkeypatch.setattr(trainer, "AdamW", _FusedAdamW)
    common = [*FAST, "--log-every", "1", "--steps", "8", "--grad-accum-steps", "2"]
    common += ["--max-lr", str(2.0**-8), "--min-lr", str(2.0**-8), "--grad-clip", "0"]
    common += ["--optimizer-overlap"]
    eager = main(common)
    graphed = main([*common, "--cuda-graph"])
    assert (rerun_trainer[0].eager_calls, rerun_trainer[0].replays) == (3, 5)
    assert [h["loss"] for h in graphed.history] == [h["loss"] for h in eager.history]
    for key, value in eager.model.state_dict().items():
        assert torch.equal(value, graphed.model.state_dict()[key]), key


def test_graph_runner_compiles_flash_attention_for_cuda_graphs(monkeypatch):
    """`CudaGraphs` warms up and captures inside flashattn_triton's `for_cuda_graphs()` when
    the model has imported it (its compiled calls then keep the opaque ops, which suit a
    replay), and inside nothing when it has not (lm_core does not import it for this)."""
    import sys
    import types

    entered = []

    class _Hint:
        def __enter__(self):
            entered.append(True)

        def __exit__(self, *exc):
            entered.append(False)

    fake = types.ModuleType("flashattn_triton")
    fake.for_cuda_graphs = _Hint
    monkeypatch.setitem(sys.modules, "flashattn_triton", fake)
    with gs._compiling_for_graphs():
        assert entered == [True]
    assert entered == [True, False]

    monkeypatch.delitem(sys.modules, "flashattn_triton")
    with gs._compiling_for_graphs():
        pass
    assert entered == [True, False]
    assert "flashattn_triton" not in sys.modules

    flash = pytest.importorskip("flashattn_triton")
    from flashattn_triton import traced_ops

    with gs._compiling_for_graphs():
        assert traced_ops._graph_blocks == 1
    assert traced_ops._graph_blocks == 0
    assert flash.for_cuda_graphs is traced_ops.for_cuda_graphs
