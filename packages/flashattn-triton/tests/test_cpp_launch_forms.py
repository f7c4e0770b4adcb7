"""Call forms on the C++ launch path beyond 4-D calls for o alone: 3-D inputs and the lse
(CPU, launch-free plans; see ``test_cpp_launch.py``).

The plans launch on the 4-D views the Python path makes of 3-D inputs (``autograd.as_bhnd``),
so the extension keys 3-D calls by those views, runs the node on them and hands results back
in the caller's rank. With ``return_lse`` the node returns the lse as a second output, not
differentiable. No kernel runs here; ``test_cpp_launch_gpu.py`` holds the launches to the
Python path's results.
"""

from __future__ import annotations

import pytest
import torch

from flashattn_triton import cpp_launch, cpp_plans
from flashattn_triton.autograd import as_bhnd

# (q, k / v) shapes: plain (B, N, d) calls, and (H, N, d) with grouped k / v heads
SHAPES = {"plain": ((3, 8, 4), (3, 8, 4)), "grouped": ((4, 8, 4), (2, 8, 4))}


def _inputs(name: str, requires_grad: bool = True):
    q_shape, kv_shape = SHAPES[name]
    q = torch.randn(q_shape, requires_grad=requires_grad)
    k, v = (torch.randn(kv_shape, requires_grad=requires_grad) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("name", SHAPES)
def test_views_are_the_python_paths(name):
    q, k, v = _inputs(name)
    gqa = q.shape[:-2] != k.shape[:-2]
    views = cpp_launch._as_launched(q, k, v)
    for view, t in zip(views, (q, k, v)):
        expected = as_bhnd(t, gqa)
        assert view.shape == expected.shape
        assert view.stride() == expected.stride()
    assert cpp_launch._as_launched(q[0], k[0], v[0]) is None  # 2-D: the Python path only
    assert cpp_launch._as_launched(q, k[None], v[None]) is None  # mixed ranks


@pytest.mark.parametrize("name", SHAPES)
def test_node_takes_3d_inputs_in_their_rank(ext, name):
    """The node runs on the 4-D views (what the fallback sees) and answers in 3-D: the output,
    the gradients and, without autograd, the lse."""
    seen = []

    def fallback(entry, do, q, k, v, o, lse):
        seen.append(tuple(t.dim() for t in (do, q, k, v, o, lse)))
        ext.add_backward(entry, ext.layout_key(do), [], [1, 8], 16, False)
        return do * 2, k * 3, v * 4

    entry = ext.add_entry([], fallback)
    q, k, v = _inputs(name)
    views = [t.detach() for t in cpp_launch._as_launched(q, k, v)]
    ext.index_entry(ext.fwd_key(*views, True), entry)
    start = ext.counters()
    do = torch.randn(q.shape)
    grads = []
    for _ in range(2):  # the Python fallback registers dO's layout; the second replays
        o = ext.attention_if_known(q, k, v, True)
        assert o.shape == q.shape
        assert o.stride() == q.stride()
        grads.append(torch.autograd.grad(o, (q, k, v), do))
        assert [g.shape for g in grads[-1]] == [q.shape, k.shape, v.shape]
    assert seen == [(4, 4, 4, 4, 4, 3)]  # the fallback ran on the 4-D views
    dq, dk, dv = grads[0]  # (the second call's replay is launch-free: no values)
    assert torch.equal(dq, do * 2)
    assert torch.equal(dk, k.detach() * 3)
    assert torch.equal(dv, v.detach() * 4)
    end = ext.counters()
    assert end["forward"] - start["forward"] == 2
    assert end["backward"] - start["backward"] == 1
    assert end["backward_fallback"] - start["backward_fallback"] == 1
    # the 4-D views of the same layouts are the same entry, answered in 4-D
    assert ext.attention_if_known(*views, True).shape == views[0].shape
    with torch.no_grad():
        o, lse = ext.forward_if_known(q, k, v, True)
    assert o.shape == q.shape
    assert lse.shape == q.shape[:-1]
    # another rank, or mixed ranks: not found, the Python path
    assert ext.attention_if_known(q[0], k[0], v[0], True) is None
    assert ext.attention_if_known(q, k[None], v[None], True) is None


def test_learn_registers_3d_calls(ext, monkeypatch):
    """``learn`` keys a 3-D call by the launchers' 4-D views (their remembered call), and the
    next 3-D call with those layouts is found in C++."""
    from flashattn_triton import launch

    monkeypatch.setitem(cpp_launch._state, "module", ext)
    for name in ("_registered", "_bwd_refused", "_seen_once"):
        monkeypatch.setattr(cpp_launch, name, set())
    monkeypatch.setattr(cpp_launch, "_n_refused", [0])
    dims = []

    def call_key(tensors, *flags):
        dims.append(tuple(t.dim() for t in tensors))
        return (len(tensors), *flags)

    monkeypatch.setattr(cpp_launch, "call_key", call_key)
    monkeypatch.setattr(cpp_plans, "describe", lambda replay: [])
    monkeypatch.setitem(launch._CALLS, (3, False, 0.25, -1, -1), ("replay", ()))
    q, k, v = _inputs("plain")
    k, v = (t.detach()[:, :5].requires_grad_() for t in (k, v))  # (a layout of its own)
    assert ext.attention_if_known(q, k, v, False, -1, -1, 0.25) is None
    cpp_launch.learn(q, k, v, False, 0.25)
    assert dims == [(4, 4, 4)]
    o = ext.attention_if_known(q, k, v, False, -1, -1, 0.25)
    assert o is not None
    assert o.shape == q.shape


@pytest.mark.parametrize("name", [None, *SHAPES])
def test_node_returns_the_lse_on_request(ext, name):
    """``return_lse``: (o, lse) from the node, lse in the Python path's shape (q's without
    its last dim) and not differentiable; the backward takes o's gradient alone."""
    q, k, v = _inputs(name) if name else (torch.randn(2, 3, 8, 4).requires_grad_() for _ in "qkv")
    entry = ext.add_entry([], lambda e, do, q, k, v, o, lse: (do + 1, k + 1, v + 1))
    views = [t.detach() for t in cpp_launch._as_launched(q, k, v)]
    ext.index_entry(ext.fwd_key(*views, False), entry)
    o, lse = ext.attention_if_known(q, k, v, False, return_lse=True)
    assert o.shape == q.shape
    assert lse.shape == q.shape[:-1]
    assert lse.dtype == torch.float32
    assert o.requires_grad
    assert not lse.requires_grad
    do = torch.randn(o.shape)
    dq, dk = torch.autograd.grad(o, (q, k), do)
    assert torch.equal(dq, do + 1)
    assert torch.equal(dk, k.detach() + 1)
    assert ext.attention_if_known(q, k, v, False).shape == q.shape  # o alone, as before
