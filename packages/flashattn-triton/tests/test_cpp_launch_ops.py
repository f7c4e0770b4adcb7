"""The compiled graphs' opaque ops through the C++ entries (``Options.cpp_launch_compiled``):
``cpp_launch.op_forward`` / ``op_backward``, the launchers of ``ops.fwd_launch`` /
``bwd_launch``. The extension is compiled for real and driven with launch-free plans (no
GPU here), so these check the routing: which calls replay, which go to the Python launchers
and register, and which are kept away."""

from __future__ import annotations

import pytest
import torch

from flashattn_triton import cpp_launch, cpp_launch_counters, cpp_plans, launch, launch_backward
from flashattn_triton.options import Options, from_env, use_options


@pytest.fixture
def active(ext, monkeypatch):
    """The extension loaded and the op path on, with private registration state."""
    monkeypatch.setitem(cpp_launch._state, "module", ext)
    monkeypatch.setattr(cpp_launch, "ACTIVE", [True])  # (option changes rewrite these lists)
    monkeypatch.setattr(cpp_launch, "OPS_ACTIVE", [True])
    for name in ("_registered", "_bwd_refused"):
        monkeypatch.setattr(cpp_launch, name, set())
    monkeypatch.setattr(cpp_launch, "_n_refused", [0])
    return ext


def _qkv(n_k, shape=(1, 2, 8, 4)):
    """q and k, v with ``n_k`` keys: layouts of their own per test (the extension's index is
    shared by the module's tests)."""
    q = torch.randn(shape)
    k, v = (torch.randn(*shape[:2], n_k, shape[3]) for _ in range(2))
    return q, k, v


def test_option_default_on_and_env():
    assert Options().cpp_launch_compiled is True
    assert from_env({"FLASHATTN_TRITON_CPP_LAUNCH_COMPILED": "0"}).cpp_launch_compiled is False
    with pytest.raises(ValueError, match="FLASHATTN_TRITON_CPP_LAUNCH_COMPILED"):
        from_env({"FLASHATTN_TRITON_CPP_LAUNCH_COMPILED": "sometimes"})
    with pytest.raises(TypeError, match="cpp_launch_compiled"):
        Options(cpp_launch_compiled="yes")


def test_ops_active_follows_the_option(ext, monkeypatch, set_options):
    monkeypatch.setitem(cpp_launch._state, "module", ext)
    monkeypatch.setattr(cpp_launch, "ACTIVE", [False])
    monkeypatch.setattr(cpp_launch, "OPS_ACTIVE", [False])
    set_options(cpp_launch="auto", cpp_launch_compiled=False)
    assert cpp_launch.ACTIVE[0] is True
    assert cpp_launch.OPS_ACTIVE[0] is False
    set_options(cpp_launch_compiled=True)
    assert cpp_launch.OPS_ACTIVE[0] is True
    set_options(cpp_launch=False)
    assert cpp_launch.OPS_ACTIVE[0] is False


def test_registered_entries_replay_forward_and_backward(active, monkeypatch):
    ext = active
    q, k, v = _qkv(n_k=5)
    entry = ext.add_entry([], lambda *a: None)
    ext.index_entry(ext.fwd_key(q, k, v, True), entry)
    python_calls = []
    monkeypatch.setattr(launch, "forward", lambda *a: python_calls.append("fwd"))
    monkeypatch.setattr(launch, "backward", lambda *a: python_calls.append("bwd"))
    start = cpp_launch_counters()  # the public reading of the extension's counters
    assert start == {name: ext.counters()[name] for name in cpp_launch.COUNTERS}
    o, lse = cpp_launch.op_forward(q, k, v, True, 0.5)  # d = 4: the default scale is 0.5
    assert o.shape == q.shape
    assert o.stride() == q.stride()
    assert lse.shape == (1, 2, 8)
    assert lse.dtype == torch.float32
    do = torch.randn_like(q)
    ext.add_backward(entry, ext.layout_key(do), [], [2, 8], 16, False)
    dq, dk, dv = cpp_launch.op_backward(do, q, k, v, o, lse, True, 0.5)
    assert [t.shape for t in (dq, dk, dv)] == [q.shape, k.shape, v.shape]
    end = cpp_launch_counters()
    assert {name: end[name] - start[name] for name in end} == {
        "forward": 1,
        "backward": 1,
        "backward_fallback": 0,
    }
    assert python_calls == []
    # another scale, causal flag or window is not this entry: the Python launchers
    cpp_launch.op_forward(q, k, v, True, 0.3)
    cpp_launch.op_forward(q, k, v, False, 0.5)
    cpp_launch.op_forward(q, k, v, True, 0.5, 2, 0)
    assert python_calls == ["fwd", "fwd", "fwd"]
    assert ext.counters()["forward"] == end["forward"]


def test_counters_read_zero_before_the_extension_loads(monkeypatch):
    monkeypatch.setitem(cpp_launch._state, "module", None)
    assert cpp_launch_counters() == {"forward": 0, "backward": 0, "backward_fallback": 0}


def test_python_calls_register_then_replay(active, monkeypatch):
    ext = active
    q, k, v = _qkv(n_k=6)
    monkeypatch.setattr(cpp_launch, "call_key", lambda tensors, *flags: (len(tensors), *flags))
    monkeypatch.setattr(cpp_plans, "describe", lambda replay: [])
    monkeypatch.setitem(launch._CALLS, (3, False, 0.5, -1, -1), ("replay", ()))
    monkeypatch.setitem(
        launch_backward._CALLS, (6, False, 0.5, -1, -1), ("replay", (True, [2, 8], 16, False))
    )
    python_calls = []

    def fake_forward(q, k, v, causal, scale, left, right):
        python_calls.append("fwd")
        return torch.zeros_like(q), torch.zeros(q.shape[:-1])

    def fake_backward(do, q, k, v, o, lse, causal, scale, left, right):
        python_calls.append("bwd")
        return torch.ones_like(q), torch.ones_like(k), torch.ones_like(v)

    monkeypatch.setattr(launch, "forward", fake_forward)
    monkeypatch.setattr(launch, "backward", fake_backward)
    do = torch.randn_like(q)
    start = ext.counters()
    for _ in range(3):
        o, lse = cpp_launch.op_forward(q, k, v, False, 0.5)
        cpp_launch.op_backward(do, q, k, v, o, lse, False, 0.5)
    end = ext.counters()
    assert python_calls == ["fwd", "bwd"]  # the first call of each; then C++
    assert end["forward"] - start["forward"] == 2
    assert end["backward"] - start["backward"] == 2


def test_refused_layouts_stay_on_the_python_launchers(active):
    """CPU tensors have no call key: the first call marks the layout refused, later calls
    run the Python launchers without registering again; results match the Python path."""
    q, k, v = _qkv(n_k=7)
    o_ref, lse_ref = launch.forward(q, k, v, True, 0.5)
    for _ in range(2):
        o, lse = cpp_launch.op_forward(q, k, v, True, 0.5)
        torch.testing.assert_close(o, o_ref)
        torch.testing.assert_close(lse, lse_ref)
    assert cpp_launch._n_refused[0] == 1
    assert active.forward_if_known(q, k, v, True, -1, -1) is False


def test_off_calls_only_the_python_launchers(ext, monkeypatch):
    monkeypatch.setitem(cpp_launch._state, "module", ext)
    monkeypatch.setattr(cpp_launch, "OPS_ACTIVE", [False])
    q, k, v = _qkv(n_k=9)
    start = ext.counters()
    o, _ = cpp_launch.op_forward(q, k, v, True, 0.5)
    assert o.shape == q.shape
    assert ext.counters() == start
    assert ext.forward_if_known(q, k, v, True, -1, -1) is None  # not registered, not refused


def test_compiled_opaque_ops_call_the_op_launchers(active, monkeypatch, set_options):
    """Under torch.compile with ``traced_compile=False`` the graph's ops run
    ``op_forward`` / ``op_backward`` (looked up per call) and give the eager results."""
    from flashattn_triton import flash_attention

    set_options(traced_compile=False, cpp_launch_compiled=True)
    seen = []
    forward, backward = cpp_launch.op_forward, cpp_launch.op_backward
    monkeypatch.setattr(cpp_launch, "op_forward", lambda *a: seen.append("fwd") or forward(*a))
    monkeypatch.setattr(cpp_launch, "op_backward", lambda *a: seen.append("bwd") or backward(*a))
    q, k, v = (t.requires_grad_() for t in _qkv(n_k=8))

    def step(q, k, v):
        return flash_attention(q, k, v, causal=True, backend="triton").sum()

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    grads = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    refs = torch.autograd.grad(step(q, k, v), (q, k, v))
    assert seen == ["fwd", "bwd"]
    for g, r in zip(grads, refs):
        torch.testing.assert_close(g, r)


@pytest.mark.parametrize("enabled", [False, True])
def test_compiled_only_programs_start_the_build(monkeypatch, set_options, enabled):
    """A program whose calls are all compiled makes no eager call: with the option on, the
    opaque op starts the background build (on CUDA inputs only); with it off, nothing."""
    state = {"module": None, "status": "not built", "thread": None, "error": None}
    monkeypatch.setattr(cpp_launch, "_state", state)
    monkeypatch.setattr(cpp_launch, "ACTIVE", [False])
    monkeypatch.setattr(cpp_launch, "OPS_ACTIVE", [False])
    started = []
    monkeypatch.setattr(cpp_launch, "_compile_supported", lambda: started.append(1) or None)
    monkeypatch.setattr(launch, "forward", lambda *a: "python")
    set_options(cpp_launch="auto", cpp_launch_compiled=enabled)
    q, k, v = _qkv(n_k=4)
    assert cpp_launch.op_forward(q, k, v, True, 0.5) == "python"
    assert state["thread"] is None  # a CPU call: nothing to build for
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    cpp_launch.op_forward(q, k, v, True, 0.5)
    if state["thread"] is not None:
        state["thread"].join(10)
    assert started == ([1] if enabled else [])


def _fake_cuda(*shape: int) -> torch.Tensor:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.empty(*shape, device="cuda")


def test_auto_keeps_calls_on_the_opaque_ops_where_they_replay_from_cpp(monkeypatch, set_options):
    """``traced_compile="auto"`` traces small calls unless ``cpp_launch_compiled`` serves them
    from C++: then every call keeps the opaque op, unless the path is off, disallowed by the
    options, failed or unsupported; ``traced_compile=True`` still traces."""
    from flashattn_triton.autograd import _use_traced_ops

    monkeypatch.setattr(cpp_plans, "supported", lambda version: True)
    monkeypatch.setitem(cpp_launch._state, "status", "building")
    q = _fake_cuda(4, 12, 1024, 64)  # the small model's call: traced by plain ``auto``
    set_options(traced_compile="auto", cpp_launch="auto", cpp_launch_compiled=False)
    assert _use_traced_ops(True, q, q)
    set_options(cpp_launch_compiled=True)
    assert cpp_launch.serves_compiled()
    assert not _use_traced_ops(True, q, q)
    set_options(traced_compile=True)
    assert _use_traced_ops(True, q, q)
    set_options(traced_compile="auto")
    for off in ({"cpp_launch": False}, {"fast_launch": False}):
        with use_options(**off):
            assert not cpp_launch.serves_compiled()
            assert _use_traced_ops(True, q, q)
    monkeypatch.setitem(cpp_launch._state, "status", "failed: RuntimeError: no ninja")
    assert not cpp_launch.serves_compiled()
    assert _use_traced_ops(True, q, q)
    monkeypatch.setitem(cpp_launch._state, "status", "ready")
    monkeypatch.setattr(cpp_plans, "supported", lambda version: False)
    assert not cpp_launch.serves_compiled()


@pytest.mark.parametrize("ninja", [True, False])
@pytest.mark.parametrize("compiler", ["c++", None])
def test_before_any_build_the_opaque_ops_are_kept_only_with_a_toolchain(
    monkeypatch, request, set_options, ninja, compiler
):
    """A graph traced before the first build keeps the opaque ops only where the build can
    work (ninja and the C++ compiler present); without them ``auto`` traces as before, and
    a build already running or done needs no check."""
    import torch.utils.cpp_extension as cpp_extension

    from flashattn_triton.autograd import _use_traced_ops

    monkeypatch.setattr(cpp_plans, "supported", lambda version: True)
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: ninja)
    monkeypatch.setenv("CXX", "my-c++")
    looked_up = []
    monkeypatch.setattr(cpp_launch.shutil, "which", lambda name: looked_up.append(name) or compiler)
    set_options(traced_compile="auto", cpp_launch="auto", cpp_launch_compiled=True)
    q = _fake_cuda(4, 12, 1024, 64)
    monkeypatch.setitem(cpp_launch._state, "status", "not built")
    cpp_launch._toolchain_present.cache_clear()
    request.addfinalizer(cpp_launch._toolchain_present.cache_clear)
    present = ninja and compiler is not None
    assert cpp_launch.serves_compiled() is present
    assert _use_traced_ops(True, q, q) is not present
    # $CXX, as torch's extension builder reads it (looked up once ninja is there), once
    assert looked_up == (["my-c++"] if ninja else [])
    for status in ("building", "ready"):
        monkeypatch.setitem(cpp_launch._state, "status", status)
        assert cpp_launch.serves_compiled()


def test_serves_compiled_traces_without_a_break(monkeypatch, set_options):
    """Read while torch.compile traces: no graph break; the options are guarded (a change
    recompiles), the build's status is a constant (no recompile when it changes)."""
    monkeypatch.setattr(cpp_plans, "supported", lambda version: True)
    monkeypatch.setitem(cpp_launch._state, "status", "building")
    set_options(cpp_launch="auto", cpp_launch_compiled=True)
    torch._dynamo.reset()
    fn = torch.compile(
        lambda x: x + 1 if cpp_launch.serves_compiled() else x - 1, fullgraph=True, backend="eager"
    )
    x = torch.zeros(2)
    assert fn(x).tolist() == [1.0, 1.0]
    monkeypatch.setitem(cpp_launch._state, "status", "failed: RuntimeError: no ninja")
    assert fn(x).tolist() == [1.0, 1.0]
    set_options(cpp_launch_compiled=False)
    assert fn(x).tolist() == [-1.0, -1.0]
    torch._dynamo.reset()


def test_a_scale_other_than_the_default_has_entries_of_its_own(active, monkeypatch):
    """The ops pass the scale; one other than the default 1/sqrt(d) is part of the key, so an
    entry learned at it replays only at it."""
    ext = active
    q, k, v = _qkv(n_k=10)
    entry = ext.add_entry([], lambda *a: None)
    ext.index_entry(ext.fwd_key(q, k, v, True, -1, -1, 0.3), entry)
    python_calls = []
    monkeypatch.setattr(launch, "forward", lambda *a: python_calls.append(a[4]))
    start = ext.counters()["forward"]
    o, _ = cpp_launch.op_forward(q, k, v, True, 0.3)
    assert o.shape == q.shape
    assert ext.counters()["forward"] - start == 1
    cpp_launch.op_forward(q, k, v, True, 0.5)  # the default (d = 4): not this entry
    cpp_launch.op_forward(q, k, v, True, 0.25)
    assert python_calls == [0.5, 0.25]
    assert ext.fwd_key(q, k, v, True, -1, -1, 0.5) == ext.fwd_key(q, k, v, True)
