"""`python -m lm_core.train --cuda-graph` on CUDA against the eager trainer (run by
`nox -s gpu_tests` on the GPU machine; skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch

import lm_core.trainer as trainer
from lm_core import read_checkpoint
from lm_core.train import main

pytestmark = pytest.mark.gpu

FAST = ["--size", "tiny", "--context-length", "64", "--batch-size", "8", "--no-progress"]
# a constant LR exact in float32: the graph's LR tensor then holds the eager double exactly
EXACT_LR = ["--max-lr", str(2.0**-9), "--min-lr", str(2.0**-9)]


def _losses(result):
    return torch.tensor([h["loss"] for h in result.history])


def _assert_same_weights(a, b, rel):
    """Every weight tensor of `b` within `rel` of `a`'s in relative L2 norm. Per-element
    bounds would trip over AdamW's near-zero gradients (a tiny gradient change there can turn
    an update by about lr); a missed step, a stale batch or a stale LR moves whole tensors
    by far more than `rel`."""
    for key, value in a.model.state_dict().items():
        other = b.model.state_dict()[key]
        diff = torch.linalg.vector_norm((other - value).float())
        assert diff <= rel * torch.linalg.vector_norm(value.float()), (key, diff.item())


# (flags, relative tolerance): fp32 differs by the LR's float32 rounding only; under bf16 that
# rounding can flip a weight's bf16 cast, and the step's bf16 kernels amplify it a little
CASES = {
    "fp32": ([], 1e-5),
    "bf16-accum": (["--bf16", "--grad-accum-steps", "2"], 1e-3),
    "bf16-fused-ckpt": (["--bf16", "--fused-loss", "--activation-checkpointing", "1"], 1e-3),
    "bf16-compile-accum": (["--bf16", "--compile", "--grad-accum-steps", "2"], 1e-3),
    "fp32-flash-triton": (["--attention", "flash-triton"], 1e-4),
    # the bench's fast step: blocks compiled, AdamW on a side stream during the backward
    "bf16-blocks-overlap": (
        ["--bf16", "--compile-blocks", "--optimizer-overlap", "--grad-clip", "0"],
        1e-3,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_graphed_run_matches_eager(case):
    """12 steps, a new LR every step (warmup, cosine): the graphed run logs the same steps,
    LRs, losses and grad norms as the eager one and ends at the same weights, up to the
    float32 rounding of the LR that the captured AdamW reads from device memory. (A stale
    LR, batch or step moves the losses by percents within a few steps.)"""
    features, rel = CASES[case]
    common = [*FAST, "--log-every", "1", "--steps", "12", "--warmup-steps", "3"]
    common += ["--max-lr", "3e-3", *features]
    eager = main(common)
    graphed = main([*common, "--cuda-graph"])
    assert [h["step"] for h in graphed.history] == list(range(1, 13))
    assert [h["lr"] for h in graphed.history] == [h["lr"] for h in eager.history]
    torch.testing.assert_close(_losses(graphed), _losses(eager), rtol=rel, atol=0)
    if "grad_norm" in eager.history[0]:  # logged where clipping is on
        norms = [torch.tensor([h["grad_norm"] for h in r.history]) for r in (graphed, eager)]
        torch.testing.assert_close(*norms, rtol=10 * rel, atol=0)
    _assert_same_weights(eager, graphed, 5 * rel)
    assert graphed.optimizer.param_groups[0]["lr"] == eager.optimizer.param_groups[0]["lr"]


def test_graphed_run_is_the_eager_run_with_an_exact_lr():
    """fp32, naive attention, a constant LR exact in float32: the graph computes what the
    eager steps compute (bitwise on a CPU, `test_lm_graph_step.py`); here kernels may sum in
    another order on another stream, so to fp32 rounding."""
    common = [*FAST, "--log-every", "1", "--steps", "8", "--grad-accum-steps", "2", *EXACT_LR]
    common += ["--attention", "naive"]
    eager = main(common)
    graphed = main([*common, "--cuda-graph"])
    torch.testing.assert_close(_losses(graphed), _losses(eager), rtol=1e-6, atol=0)
    _assert_same_weights(eager, graphed, 1e-6)


def test_graphed_checkpoints_resume(tmp_path):
    """A graphed run stopped at step 5 and resumed (eager warm-up again, then a new capture)
    reproduces the uninterrupted graphed run; its checkpoint holds what the eager trainer's
    holds (float LRs, step counts, moments), so either path resumes the other. fp32 and an
    LR exact in float32: what remains is the kernels' rounding."""
    common = [*FAST, "--log-every", "1", "--cosine-steps", "10", *EXACT_LR]
    full = main([*common, "--steps", "10", "--cuda-graph", "--out-dir", str(tmp_path / "full")])
    first = main([*common, "--steps", "5", "--cuda-graph", "--out-dir", str(tmp_path / "a")])
    resume = ["--resume", str(tmp_path / "a" / "checkpoint.pt")]
    graphed = [*common, "--steps", "10", "--cuda-graph"]
    rest = main([*graphed, *resume, "--out-dir", str(tmp_path / "b")])
    assert rest.step == 10
    losses = _losses(first).tolist() + _losses(rest).tolist()
    torch.testing.assert_close(torch.tensor(losses), _losses(full), rtol=1e-5, atol=0)
    _assert_same_weights(full, rest, 1e-5)
    eager = main([*common, "--steps", "10", *resume, "--out-dir", str(tmp_path / "c")])
    torch.testing.assert_close(_losses(eager), _losses(rest), rtol=1e-5, atol=0)
    saved = read_checkpoint(tmp_path / "full" / "checkpoint.pt")
    assert saved["step"] == 10
    assert [g["lr"] for g in saved["optimizer"]["param_groups"]] == [2.0**-9]
    steps = {s["step"].item() for s in saved["optimizer"]["state"].values()}
    assert steps == {10.0}


def test_replayed_steps_do_not_wait_for_the_device():
    """After the capture, a step is two buffer copies, an LR fill and one replay: CUDA's
    sync debug mode raises on anything that makes the host wait for the device."""
    from lm_core.train import parse_args

    config = parse_args([*FAST, "--bf16", "--cuda-graph", "--grad-accum-steps", "2"])
    env = trainer.DistEnv(device=torch.device("cuda"))
    torch.manual_seed(0)
    model = trainer.TransformerLM(config.model_config).cuda()
    pm = trainer.wrap_model(model, "none", env)
    opt = trainer.AdamW(pm.parameters(), lr=1e-3, weight_decay=0.1)
    data = trainer.load_data(config)
    graph = trainer._graph_step(pm, opt, config, env)

    def batches():
        starts = trainer._step_starts(data.train, config, 2, data.generator)
        return [trainer._rank_batch(data.train, row, config, env)[:2] for row in starts]

    for _ in range(4):  # 3 eager warm-ups, then the capture and its first replay
        graph(batches(), 1e-3)
    assert graph.captured
    torch.cuda.synchronize()
    for i in range(3):
        step_batches = batches()
        torch.cuda.set_sync_debug_mode("error")
        try:
            loss, grad_norm = graph(step_batches, 1e-3 / (i + 1))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss).item()
    assert grad_norm.item() > 0


def test_node_priority_replay_is_torch_replay():
    """A tiny model's steps with the overlapped optimizer on its side stream, captured with
    node priorities (`CudaGraphs(node_priorities=True)`: the driver's launch) and without
    (torch's replay): the same losses and weights bit for bit (the priorities only order
    independent kernels), and the replay is a `PriorityGraph`."""
    from lm_core import OverlappedOptimizer, TransformerLM, get_config
    from lm_core.graph_priority import PriorityGraph
    from lm_core.graph_step import capture_cuda_graph

    runs = []
    for priorities in (True, False):
        torch.manual_seed(0)
        model = TransformerLM(get_config("tiny", context_length=32)).cuda()
        opt = OverlappedOptimizer(model, lr=1e-3, weight_decay=0.1)
        ids = torch.randint(0, model.config.vocab_size, (4, 33), device="cuda")
        loss = torch.zeros((), device="cuda")

        def step(model=model, opt=opt, ids=ids, loss=loss):
            out = model(ids[:, :-1], ids[:, 1:])
            out.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss.copy_(out.detach())

        replay = capture_cuda_graph(step, node_priorities=priorities)
        assert isinstance(replay, PriorityGraph) == priorities
        losses = []
        for _ in range(4):
            replay()
            losses.append(loss.clone())
        torch.cuda.synchronize()
        runs.append((torch.stack(losses), [p.detach().clone() for p in model.parameters()]))
    (loss_p, params_p), (loss_t, params_t) = runs
    assert torch.equal(loss_p, loss_t)
    assert len(set(loss_p.tolist())) == 4  # every replay stepped
    for a, b in zip(params_p, params_t):
        assert torch.equal(a, b)
