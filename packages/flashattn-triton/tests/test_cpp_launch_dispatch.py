"""The extension's kernels of the opaque ops (``cpp_launch.serve_ops``): with
``cpp_launch_compiled`` on, the dispatcher hands ``fwd_launch`` / ``bwd_launch`` calls to C++,
which replays known layouts and passes every other call to ``op_forward`` / ``op_backward``.

On CUDA that is the real ops' CUDA kernel. Here (no GPU) the same functions are registered
as the CPU kernels of a copy of the two schemas in a namespace of this module's own, and
driven with launch-free plans: the routing is checked, not the launches."""

from __future__ import annotations

import pytest
import torch

from flashattn_triton import cpp_launch
from flashattn_triton.ops import NAMESPACE

TEST_NS = "fa_cpp_dispatch_test"
_LIB = torch.library.Library(TEST_NS, "DEF")
for _name in ("fwd_launch", "bwd_launch"):
    _schema = getattr(torch.ops, NAMESPACE).__getattr__(_name).default._schema
    _LIB.define(_name + str(_schema).partition(_schema.name)[2])


def _python_kernel(*args):
    raise AssertionError("the CPU kernel from C++ was expected, not the Python one")


for _name in ("fwd_launch", "bwd_launch"):
    _LIB.impl(_name, _python_kernel, "CompositeExplicitAutograd")


@pytest.fixture
def served(ext, monkeypatch):
    """The test ops served by the extension on CPU; ``op_forward`` / ``op_backward``
    replaced by recorders (the kernels look them up per call)."""
    cpp_launch.serve_ops(ext, TEST_NS, "CPU")
    calls = []

    def fake_forward(q, k, v, causal, scale, left, right):
        calls.append(("fwd", causal, scale, left, right))
        return torch.zeros_like(q), torch.zeros(q.shape[:-1])

    def fake_backward(do, q, k, v, o, lse, causal, scale, left, right):
        calls.append(("bwd", causal, scale, left, right))
        return torch.ones_like(q), torch.ones_like(k), torch.ones_like(v)

    monkeypatch.setattr(cpp_launch, "op_forward", fake_forward)
    monkeypatch.setattr(cpp_launch, "op_backward", fake_backward)
    ext.set_ops_serving(True)
    yield ext, calls
    ext.set_ops_serving(cpp_launch.OPS_ACTIVE[0])


def _qkv(n_k, shape=(1, 2, 8, 4)):
    """Layouts of each test's own (the extension's index is shared by the whole run)."""
    q = torch.randn(shape)
    k, v = (torch.randn(*shape[:2], n_k, shape[3]) for _ in range(2))
    return q, k, v


def _ops():
    ns = getattr(torch.ops, TEST_NS)
    return ns.fwd_launch.default, ns.bwd_launch.default


def test_known_layouts_replay_from_the_dispatcher(served):
    ext, calls = served
    fwd, bwd = _ops()
    q, k, v = _qkv(n_k=11)
    entry = ext.add_entry([], lambda *a: None)
    ext.index_entry(ext.fwd_key(q, k, v, True), entry)
    do = torch.randn_like(q)
    ext.add_backward(entry, ext.layout_key(do), [], [2, 8], 16, False)
    start = ext.counters()
    o, lse = fwd(q, k, v, True, 0.5)  # d = 4: 0.5 is the default scale
    assert (o.shape, o.stride(), lse.shape, lse.dtype) == (
        q.shape, q.stride(), (1, 2, 8), torch.float32,
    )  # fmt: skip
    dq, dk, dv = bwd(do, q, k, v, o, lse, True, 0.5)
    assert [t.shape for t in (dq, dk, dv)] == [q.shape, k.shape, v.shape]
    end = ext.counters()
    assert (end["forward"] - start["forward"], end["backward"] - start["backward"]) == (1, 1)
    assert calls == []


def test_other_calls_go_to_the_python_launchers(served):
    """Unknown layouts, another scale / causal flag / window, and a dO layout without a
    plan reach ``op_forward`` / ``op_backward`` with the arguments as given."""
    ext, calls = served
    fwd, bwd = _ops()
    q, k, v = _qkv(n_k=12)
    o, lse = fwd(q, k, v, False, 0.5, 3, 1)  # unknown: the Python launcher's result
    assert torch.equal(o, torch.zeros_like(q))
    entry = ext.add_entry([], lambda *a: None)
    ext.index_entry(ext.fwd_key(q, k, v, True), entry)
    start = ext.counters()
    fwd(q, k, v, True, 0.3)
    fwd(q, k, v, True, 0.5, 2, 0)
    o, lse = fwd(q, k, v, True, 0.5)  # known: C++
    dq, _, _ = bwd(torch.randn_like(q), q, k, v, o, lse, True, 0.5)  # no plan for this dO
    assert torch.equal(dq, torch.ones_like(q))
    assert calls == [
        ("fwd", False, 0.5, 3, 1), ("fwd", True, 0.3, -1, -1), ("fwd", True, 0.5, 2, 0),
        ("bwd", True, 0.5, -1, -1),
    ]  # fmt: skip
    assert ext.counters()["forward"] - start["forward"] == 1


def test_serving_off_hands_every_call_to_python(served):
    ext, calls = served
    fwd, _ = _ops()
    q, k, v = _qkv(n_k=13)
    ext.index_entry(ext.fwd_key(q, k, v, True), ext.add_entry([], lambda *a: None))
    ext.set_ops_serving(False)
    start = ext.counters()
    fwd(q, k, v, True, 0.5)
    assert calls == [("fwd", True, 0.5, -1, -1)]
    assert ext.counters() == start


def test_python_errors_come_back_as_errors(served, monkeypatch):
    """An exception in the Python launcher reaches the caller (not a crash in C++)."""
    fwd, _ = _ops()

    def broken(*args):
        raise ValueError("softmax_scale must be positive")

    monkeypatch.setattr(cpp_launch, "op_forward", broken)
    with pytest.raises(Exception, match="softmax_scale must be positive"):
        fwd(*_qkv(n_k=14), True, -1.0)


def test_the_option_registers_the_cuda_kernels_and_switches_them(ext, monkeypatch, set_options):
    """``cpp_launch_compiled`` taking effect registers the real ops' CUDA kernels (once);
    turning it off again makes them hand every call to Python."""
    monkeypatch.setitem(cpp_launch._state, "module", ext)
    monkeypatch.setattr(cpp_launch, "ACTIVE", [False])
    monkeypatch.setattr(cpp_launch, "OPS_ACTIVE", [False])
    registered = []
    monkeypatch.setattr(ext, "serve_ops", lambda *a: registered.append(a[:2]), raising=False)
    served = []
    monkeypatch.setattr(ext, "set_ops_serving", served.append, raising=False)
    monkeypatch.setattr(cpp_launch, "_ops_served", set())
    set_options(cpp_launch="auto", cpp_launch_compiled=True)
    set_options(cpp_launch_compiled=False)
    set_options(cpp_launch_compiled=True)
    assert registered == [(NAMESPACE, "CUDA")]
    assert served[-3:] == [True, False, True]


def test_a_failed_registration_keeps_the_python_kernel(ext, monkeypatch, caplog):
    """If the dispatcher refuses the C++ kernels, the ops keep their Python kernel (which
    replays too): a warning, no exception, and no second attempt."""
    attempts = []

    def refuse(*args):
        attempts.append(args[:2])
        raise RuntimeError("schema mismatch")

    monkeypatch.setattr(ext, "serve_ops", refuse, raising=False)
    monkeypatch.setattr(cpp_launch, "_ops_served", set())
    for _ in range(2):
        cpp_launch.serve_ops(ext, "fa_cpp_dispatch_nowhere", "CUDA")
    assert attempts == [("fa_cpp_dispatch_nowhere", "CUDA")]
    assert "not registered (schema mismatch)" in caplog.text


def test_refused_and_unknown_layouts_go_to_python(served):
    """A layout marked refused, and a backward whose forward has no entry, reach the
    Python launchers too."""
    ext, calls = served
    fwd, bwd = _ops()
    q, k, v = _qkv(n_k=15)
    ext.refuse(ext.fwd_key(q, k, v, True))
    o, lse = fwd(q, k, v, True, 0.5)
    bwd(torch.randn_like(q), q, k, v, o, lse, True, 0.5)
    assert calls == [("fwd", True, 0.5, -1, -1), ("bwd", True, 0.5, -1, -1)]
