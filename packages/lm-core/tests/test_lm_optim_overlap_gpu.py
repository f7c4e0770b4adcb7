"""OverlappedOptimizer on CUDA: the side stream, its events, and capture in one CUDA graph
(run by `nox -s gpu_tests` on the GPU machine; skipped elsewhere).

The overlapped step runs the same fused AdamW kernel per unit as the plain step runs over
all parameters, on gradients the same kernels produced: the parameters agree bitwise.
"""

from __future__ import annotations

import pytest
import torch

from lm_core import AdamW, OverlappedOptimizer, TransformerLM, compile_blocks, get_config

pytestmark = pytest.mark.gpu
KW = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def _model(layers=3):
    torch.manual_seed(0)
    # naive attention: matmuls and a softmax, deterministic from run to run
    return TransformerLM(get_config("tiny", num_layers=layers, attention="naive")).cuda()


def _groups(model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


def _batches(n, batch=4, seq=32):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (batch, seq + 1), generator=g).cuda() for _ in range(n)]


def _step_fn(model, opt, ids, accum=1):
    """One bf16 train step on the fixed tensor `ids` (accum micro-batches of its rows)."""
    overlapped = isinstance(opt, OverlappedOptimizer)

    def step():
        for p in model.parameters():
            p.grad = None
        for micro, rows in enumerate(ids.chunk(accum)):
            last = micro == accum - 1
            with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
                loss = model(rows[:, :-1], rows[:, 1:]) / accum
            if overlapped and not last:
                with opt.no_step():
                    loss.backward()
            else:
                loss.backward()
        opt.step()

    return step


def _train(overlapped, *, blocks=False, graph=False, accum=1, steps=4, side_stream=True):
    model = _model()
    if overlapped:
        opt = OverlappedOptimizer(model, _groups(model), side_stream=side_stream, **KW)
    else:
        opt = AdamW(_groups(model), **KW)
    if blocks:
        compile_blocks(model, dynamic=False)
    batches = _batches(steps)
    ids = batches[0].clone()  # a graph reads one fixed input tensor
    step = _step_fn(model, opt, ids, accum)
    if graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()  # warm-up (optimizer state, compiled kernels), then capture
        torch.cuda.current_stream().wait_stream(side)
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            step()
        ids.copy_(batches[1])
        for b in batches[2:]:
            cuda_graph.replay()
            ids.copy_(b)
        cuda_graph.replay()
    else:
        for b in batches:
            ids.copy_(b)
            step()
    torch.cuda.synchronize()
    return [p.detach().clone() for p in model.parameters()]


def _assert_same(a, b):
    for x, y in zip(a, b):
        assert torch.equal(x, y), (x - y).abs().max()


@pytest.mark.parametrize(("accum", "side_stream"), [(1, True), (2, True), (1, False)])
def test_eager_overlap_is_bitwise_the_plain_step(accum, side_stream):
    ref = _train(False, accum=accum)
    got = _train(True, accum=accum, side_stream=side_stream)
    _assert_same(got, ref)
    init = list(_model().parameters())
    assert all(not torch.equal(a, b) for a, b in zip(got, init))


def test_units_run_on_the_side_stream_during_the_backward():
    model = _model()
    opt = OverlappedOptimizer(model, **KW)
    (ids,) = _batches(1)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    assert opt._forked  # the units stepped on the side stream, not yet joined
    assert all(p.grad is None for p in model.parameters())  # released as they stepped
    opt.step()
    assert not opt._forked
    torch.cuda.synchronize()
    assert all(s["step"].item() == 1 for s in opt.state.values())
    assert all(s["step"].device.type == "cuda" for s in opt.state.values())  # capturable


def test_compiled_blocks_and_cuda_graph_match_the_plain_step():
    """Blocks compiled one by one, the whole step (forward, backward with the side stream's
    fork and join, optimizer) captured in one CUDA graph and replayed."""
    ref = _train(False, blocks=True, graph=True)
    got = _train(True, blocks=True, graph=True)
    _assert_same(got, ref)


def test_accumulation_in_a_cuda_graph():
    ref = _train(False, graph=True, accum=2)
    got = _train(True, graph=True, accum=2)
    _assert_same(got, ref)
