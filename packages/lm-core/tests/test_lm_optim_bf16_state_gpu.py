"""AdamW(state_dtype=torch.bfloat16) on CUDA: the Triton kernel against the PyTorch-ops update
on the same GPU, inside a CUDA graph, and the trainer's --cuda-graph with bf16 states (run by
`nox -s gpu_tests` on the GPU machine; skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch

from lm_core import AdamW
from lm_core import optim_lowp as lowp
from lm_core.graph_step import capture_cuda_graph
from lm_core.train import main

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")
BF16 = torch.bfloat16
KW = {"lr": 1e-2, "weight_decay": 0.1, "betas": (0.9, 0.95), "eps": 1e-8}
STEPS = 5
SHAPES = [(1000, 77), (4097,), (3, 5, 7)]  # block-multiple and ragged ends


def _params():
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g).cuda()) for s in SHAPES]


def _grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).cuda()


@pytest.mark.parametrize("rounding", lowp.ROUNDINGS)
def test_kernel_matches_the_pytorch_update_on_cuda(rounding):
    """fused=None takes the Triton kernel on CUDA, fused=False PyTorch ops: the fp32 math may
    contract differently (FMA), so a moment within an fp32 ulp of a rounding threshold may
    land one bf16 ulp apart: >= 99.9% equal, the rest within an ulp of the moment's scale
    (measured on an H200: up to 10 ulps of a moment near zero, by cancellation). A weight
    whose moments were an ulp apart moves by up to lr * 2^-7 more or less per step (the
    update's relative change), so weights: >= 99.9% within 1e-5, all within steps * lr * 2^-7."""
    runs = []
    for fused in (None, False):
        params = _params()
        opt = AdamW(params, fused=fused, state_dtype=BF16, state_rounding=rounding, **KW)
        for step in range(STEPS):
            _grads(params, step)
            opt.step()
        runs.append((params, opt))
    (pk, ok), (pt, ot) = runs
    assert ok.state[pk[0]]["step"].is_cuda  # the kernel's counts live on the device
    assert not ot.state[pt[0]]["step"].is_cuda
    for a, b in zip(pk, pt):
        diff = (a - b).abs()
        assert diff.max() <= STEPS * KW["lr"] * 2**-7, diff.max()
        assert (diff <= 1e-5 + 1e-5 * b.abs()).float().mean() >= 0.999
        for n in lowp.MOMENTS:
            x, y = ok.state[a][n].float(), ot.state[b][n].float()
            assert (x == y).float().mean() >= 0.999, n
            # bounded by a bf16 ulp of the values it came from, not of the result: where
            # beta * m and (1 - beta) * g nearly cancel, one ulp of m is many of the sum
            bound = 2**-7 * (y.abs() + y.abs().mean())
            assert ((x - y).abs() <= bound).all(), (n, (x - y).abs().max())


def test_captured_update_replays_the_eager_one_bitwise():
    """The kernel reads step and LR from device memory: a CUDA graph of one update, replayed,
    gives the eager updates' results bit for bit (a baked-in step or LR would not)."""
    for a, b in zip(_six_updates(graphed=False), _six_updates(graphed=True)):
        assert torch.equal(a, b)


def _six_updates(graphed: bool) -> list[torch.Tensor]:
    """Six updates with a new LR and gradients each; the last four replayed from a graph."""
    params = _params()
    opt = AdamW(params, state_dtype=BF16, **KW)
    lr = torch.tensor(KW["lr"], device="cuda")
    grads = [torch.zeros_like(p) for p in params]
    for p, g in zip(params, grads):
        p.grad = g

    def step():
        opt.param_groups[0]["lr"] = lr
        opt.step()

    replay = None
    for i in range(6):
        lr.fill_(KW["lr"] * (1 + i) / 6)
        g = torch.Generator().manual_seed(100 + i)
        for p, buf in zip(params, grads):
            buf.copy_(torch.randn(p.shape, generator=g))
        if graphed and i >= 2:
            if replay is None:
                replay = _capture_after_rewind(step, opt, params)
            replay()
        else:
            step()
    torch.cuda.synchronize()
    return [p.detach().clone() for p in params]


def _capture_after_rewind(step, opt, params):
    """Capture `step` (warm-up 1); the warm-up call is an update too, so restore the
    parameters, moments and counts it changed before returning the replay."""
    saved = [p.detach().clone() for p in params]
    state = {p: {k: v.clone() for k, v in opt.state[p].items()} for p in params}
    replay = capture_cuda_graph(step, warmup=1)
    with torch.no_grad():
        for p, s in zip(params, saved):
            p.copy_(s)
            for k, v in state[p].items():
                opt.state[p][k].copy_(v)
    return replay


def test_trainer_cuda_graph_with_bf16_states():
    """--cuda-graph --optimizer-state-dtype bf16: captured (the kernel is accepted), and the
    logged losses follow the eager bf16-state run's."""
    common = ["--size", "tiny", "--context-length", "64", "--batch-size", "8", "--no-progress"]
    common += ["--log-every", "1", "--steps", "10", "--optimizer-state-dtype", "bf16"]
    eager = main(common)
    graphed = main([*common, "--cuda-graph"])
    assert {s["exp_avg"].dtype for s in graphed.optimizer.state.values()} == {BF16}
    losses = [torch.tensor([h["loss"] for h in r.history]) for r in (eager, graphed)]
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-4, atol=0)
