"""Held bf16 linear weights with fp32 masters (lm_core.lowp_weights) on CUDA: the master
kernel against the PyTorch-ops update, a held model's training against fp32 weights under
autocast, and the update inside a CUDA graph (run by `nox -s gpu_tests`; skipped elsewhere)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from lm_core import AdamW, TransformerLM, get_config
from lm_core import lowp_weights as lw
from lm_core.graph_step import capture_cuda_graph, check_optimizer

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")
BF16 = torch.bfloat16
KW = {"lr": 1e-2, "weight_decay": 0.1, "betas": (0.9, 0.95), "eps": 1e-8}
SHAPES = [(1000, 77), (4097,), (3, 5, 7)]


def _held_params():
    g = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(s, generator=g).cuda()) for s in SHAPES]
    lw.hold_in_bf16(params)
    return params


@pytest.mark.parametrize("state_dtype", [torch.float32, BF16])
def test_master_kernel_matches_the_pytorch_update_on_cuda(state_dtype):
    """fused=None: the Triton kernel; fused=False: PyTorch ops. Masters agree to fp32
    rounding (the kernel may contract to FMAs), each weight is its master rounded to nearest,
    and the kernel's step counts live on the device."""
    runs = []
    for fused in (None, False):
        params = _held_params()
        opt = AdamW(params, fused=fused, state_dtype=state_dtype, state_rounding="nearest", **KW)
        for step in range(5):
            g = torch.Generator().manual_seed(100 + step)
            for p in params:
                p.grad = torch.randn(p.shape, generator=g).to(device="cuda", dtype=BF16)
            opt.step()
        runs.append((params, opt))
    (pk, ok), (pt, ot) = runs
    assert ok.state[pk[0]]["step"].is_cuda
    assert not ot.state[pt[0]]["step"].is_cuda
    for a, b in zip(pk, pt):
        wa, wb = ok.state[a]["master"], ot.state[b]["master"]
        assert wa.dtype == torch.float32
        assert ok.state[a]["exp_avg"].dtype == state_dtype
        # bf16 moments may land an ulp apart (FMA contraction, see the bf16-state GPU test)
        tol = 5 * KW["lr"] * 2**-7 if state_dtype == BF16 else 1e-5
        torch.testing.assert_close(wa, wb, rtol=0, atol=tol)
        assert torch.equal(a, wa.to(BF16))
        assert torch.equal(b, wb.to(BF16))


def _model(held: bool) -> TransformerLM:
    torch.manual_seed(0)
    config = dataclasses.replace(get_config("tiny"), d_model=128, num_heads=4, d_ff=384)
    model = TransformerLM(config).cuda()
    if held:
        lw.hold_in_bf16(lw.matmul_weights(model))
    return model


def test_held_model_trains_as_fp32_weights_under_autocast():
    """First loss bit for bit; later losses within what the two AdamW kernels' fp32
    rounding moves (a held weight can round one bf16 ulp the other way)."""
    losses = []
    for held in (False, True):
        model = _model(held)
        opt = AdamW(model.parameters(), **KW)
        gen = torch.Generator().manual_seed(1)
        run = []
        for _ in range(6):
            ids = torch.randint(0, 256, (4, 65), generator=gen).cuda()
            with torch.autocast("cuda", dtype=BF16):
                loss = model(ids[:, :-1], ids[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
            run.append(loss.detach().float())
        losses.append(torch.stack(run))
    assert torch.equal(losses[0][0], losses[1][0])
    torch.testing.assert_close(losses[1], losses[0], rtol=2e-3, atol=0)


def test_captured_update_replays_the_eager_one_bitwise():
    """The master kernel reads step and LR on the device: replays of one captured update
    give the eager updates bit for bit."""
    results = []
    for graphed in (False, True):
        params = _held_params()
        opt = AdamW(params, **KW)
        lr = torch.tensor(KW["lr"], device="cuda")
        grads = [torch.zeros_like(p) for p in params]
        for p, g in zip(params, grads):
            p.grad = g

        def step(opt=opt, lr=lr):
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
                    check_optimizer(opt, torch.device("cuda"))  # the kernel is accepted
                    saved = [p.detach().clone() for p in params]
                    state = {p: {k: v.clone() for k, v in opt.state[p].items()} for p in params}
                    replay = capture_cuda_graph(step, warmup=1)
                    with torch.no_grad():  # undo the warm-up update
                        for p, s in zip(params, saved):
                            p.copy_(s)
                            for k, v in state[p].items():
                                opt.state[p][k].copy_(v)
                replay()
            else:
                step()
        torch.cuda.synchronize()
        results.append([opt.state[p]["master"].clone() for p in params])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_trainer_cuda_graph_with_bf16_weights():
    """`lm_core.train --compile --cuda-graph --bf16-weights`: captured (the master kernel is
    accepted), its losses follow the eager held run's and the plain bf16 run's."""
    from lm_core.train import main

    common = ["--size", "tiny", "--context-length", "64", "--batch-size", "8", "--no-progress"]
    common += ["--log-every", "1", "--steps", "10", "--bf16"]
    plain = main(common)
    eager = main([*common, "--bf16-weights"])
    graphed = main([*common, "--bf16-weights", "--compile", "--cuda-graph"])
    assert any("master" in s for s in graphed.optimizer.state.values())
    losses = [torch.tensor([h["loss"] for h in r.history]) for r in (plain, eager, graphed)]
    torch.testing.assert_close(losses[1], losses[0], rtol=2e-3, atol=0)
    torch.testing.assert_close(losses[2], losses[1], rtol=2e-3, atol=0)
