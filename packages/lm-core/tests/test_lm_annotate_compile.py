"""Profiler annotations, and torch.compile without graph breaks."""

from __future__ import annotations

import pytest
import torch
from lm_test_backends import runnable_backends

from lm_core import TransformerLM, annotate, annotations_enabled, get_config, set_annotations
from lm_core.attention import naive_attention


def _profiled_names(fn) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events()}


def test_annotations_off_by_default_and_emit_when_on(annotations_on):
    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    names = _profiled_names(lambda: naive_attention(q, k, v))
    for name in ("attention/scores", "attention/softmax", "attention/weighted_sum"):
        assert name in names
    set_annotations(False)
    assert not annotations_enabled()
    names = _profiled_names(lambda: naive_attention(q, k, v))
    assert "attention/scores" not in names


def test_block_ranges(annotations_on):
    model = TransformerLM(get_config("tiny"))
    ids = torch.randint(0, 256, (1, 8))
    names = _profiled_names(lambda: model(ids))
    assert {"attention", "ffn"} <= names


def test_annotate_rejects_non_bool():
    with pytest.raises(TypeError, match="bool"):
        set_annotations(1)
    with annotate("anything"):  # default: a no-op context
        pass


def test_default_off_annotations_leave_no_trace_in_the_graph():
    """A capturing backend records the FX graph dynamo builds (fullgraph=True fails on any
    graph break); with annotations off (the default) it holds no profiler ops."""
    torch.manual_seed(0)
    model = TransformerLM(get_config("tiny", attention="naive"))
    ids = torch.randint(0, 256, (2, 16))
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(model, fullgraph=True, backend=capture)(ids)
    assert len(graphs) == 1
    targets = [str(n.target) for n in graphs[0].graph.nodes]
    assert not any("profiler" in t or "record_function" in t for t in targets)
    torch.testing.assert_close(out, model(ids))
    torch._dynamo.reset()


@pytest.mark.parametrize("attn", ["sdpa", "flash-triton"])
def test_compile_fullgraph_forward_backward(attn):
    """No graph break in forward or backward for the default backend and the Triton kernel
    (naive: forward in the test above): aot_eager traces both through AOTAutograd; inductor
    codegen is covered by the slow test below. About 10 s each on 2 CPU cores."""
    if attn not in runnable_backends():
        pytest.skip(f"attention backend {attn!r} cannot run here")
    torch.manual_seed(0)
    model = TransformerLM(get_config("tiny", attention=attn))
    ids = torch.randint(0, 256, (2, 16))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    compiled(ids).float().logsumexp(-1).mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(ids).float().logsumexp(-1).mean().backward()
    for a, b in zip(grads, (p.grad for p in model.parameters())):
        # same ops, traced: equal up to fp32 reassociation in decomposed ops
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()


@pytest.mark.slow
def test_inductor_compile_matches_eager():
    """Full inductor compile (about a minute on 2 CPU cores: C++ codegen)."""
    torch.manual_seed(1)
    model = TransformerLM(get_config("tiny"))
    ids = torch.randint(0, 256, (2, 16))
    torch._dynamo.reset()
    out = torch.compile(model, fullgraph=True)(ids)
    # inductor fuses and reorders fp32 reductions: agreement to ~1e-5 relative
    torch.testing.assert_close(out, model(ids), rtol=1e-4, atol=1e-4)
    torch._dynamo.reset()
