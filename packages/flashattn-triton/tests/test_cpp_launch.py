"""The C++ launch path (``cpp_launch``, ``cpp_plans``, ``csrc/launch_replay.cpp``) on the CPU.

No kernel runs here: the extension is compiled for real and driven with plans that have no
launches, which exercises what the GPU path relies on (the autograd node, the backward's
hand-off to Python and its registration, the lookup by layouts, ``reset``), and the routing
in ``flash_attention`` is checked with a stand-in module. The GPU tests
(``test_cpp_launch_gpu.py``) hold the launches themselves to the Python path's results.
"""

from __future__ import annotations

import struct
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from flashattn_triton import cpp_launch, cpp_plans, flash_attention
from flashattn_triton.options import Options, from_env

# ---------------------------------------------------------------- options


def test_option_values_and_env():
    assert Options().cpp_launch == "auto"
    assert Options(cpp_launch=False).cpp_launch is False
    with pytest.raises(ValueError, match="cpp_launch"):
        Options(cpp_launch="sometimes")
    assert from_env({"FLASHATTN_TRITON_CPP_LAUNCH": "0"}).cpp_launch is False
    assert from_env({"FLASHATTN_TRITON_CPP_LAUNCH": "auto"}).cpp_launch == "auto"
    with pytest.raises(ValueError, match="FLASHATTN_TRITON_CPP_LAUNCH"):
        from_env({"FLASHATTN_TRITON_CPP_LAUNCH": "maybe"})


def test_status_off(set_options):
    set_options(cpp_launch=False)
    assert cpp_launch.status() == "off"


# ---------------------------------------------------------------- parameter packing


def test_supported_series():
    assert cpp_plans.supported("3.6.0")
    assert cpp_plans.supported("3.6.1")
    assert not cpp_plans.supported("3.5.1")
    assert not cpp_plans.supported("3.9.0")


def test_flat_types_expand_descriptors():
    sig = {"q": "*bf16", "desc": "tensordesc<bf16[64, 128]>", "n": "i32", "BLOCK": "constexpr"}
    with_meta = cpp_plans.flat_types(sig, [{"swizzle": 128}])
    assert with_meta == ["*bf16", "nvTmaDesc", "i32", "i32", "i64", "i64", "i32", "constexpr"]
    no_meta = cpp_plans.flat_types(sig, None)
    assert no_meta == [
        "*bf16",
        "*bf16",
        *(["i64"] * 4),
        "i1",
        "i32",
        "i32",
        "i64",
        "i64",
        "i32",
        "constexpr",
    ]
    with pytest.raises(TypeError, match="tuple"):
        cpp_plans.flat_types({"t": ("i32", "i32")}, None)


@pytest.mark.parametrize(
    ("ty", "value", "expected"),
    [
        ("*fp32", 0x1234, struct.pack("<Q", 0x1234)),
        ("*fp32", None, bytes(8)),
        ("i32", -3, struct.pack("<i", -3)),
        ("u64", 2**63, struct.pack("<Q", 2**63)),
        ("i1", 1, b"\x01"),
        ("fp32", 0.125, struct.pack("<f", 0.125)),
        ("fp16", 1.5, struct.pack("<e", 1.5)),
        ("bf16", 1.5, struct.pack("<f", 1.5)[2:]),
    ],
)
def test_pack(ty, value, expected):
    assert cpp_plans.pack(ty, value) == expected


def test_pack_and_tensormap_reject_unknown():
    with pytest.raises(TypeError, match="complex64"):
        cpp_plans.pack("complex64", 1)
    with pytest.raises(TypeError, match="PyCUtensorMap"):
        cpp_plans.tensormap_bytes(object())


def _step(signature, args, pointers, head_flags=(False, False), packed=(4, 1, 1024)):
    compiled = SimpleNamespace(
        src=SimpleNamespace(signature=signature),
        metadata=SimpleNamespace(),
        function=0xABC,
    )
    direct = SimpleNamespace(
        args=args,
        head=(*head_flags, None, None, packed, None, None, None),
        pointers=pointers,
        descriptors=[],
        expand=None,
    )
    return SimpleNamespace(compiled=compiled, direct=direct, grid=(3, 2, 1))


def test_launch_description_layout():
    sig = {"Q": "*bf16", "n": "i32", "scale": "fp32", "B": "constexpr", "O": "*bf16"}
    step = _step(sig, [0x1000, 7, 0.5, 64, 0x2000], [(0, 0), (4, 3)], (True, False))
    d = cpp_plans.launch_description(step)
    # non-constexpr parameters 8-byte aligned, then two 8-byte scratch pointers
    assert d["offsets"] == [0, 8, 16, 24, 32, 40]
    assert d["pointers"] == [(0, 0), (24, 3)]  # byte offsets of the buffers' slots
    blob = d["blob"]
    assert struct.unpack_from("<Q", blob, 0)[0] == 0x1000
    assert struct.unpack_from("<i", blob, 8)[0] == 7
    assert struct.unpack_from("<f", blob, 16)[0] == 0.5
    assert struct.unpack_from("<Q", blob, 24)[0] == 0x2000
    assert blob[32:48] == bytes(16)
    assert (d["function"], d["grid"], d["num_warps"], d["shared"]) == (0xABC, [3, 2, 1], 4, 1024)
    assert d["coop"] is True
    assert d["pdl"] is False
    assert d["descs"] == []


def test_launch_description_refuses_mismatch():
    step = _step({"Q": "*bf16", "n": "i32"}, [0x1000], [(0, 0)])
    with pytest.raises(ValueError, match="2 parameter types for 1 arguments"):
        cpp_plans.launch_description(step)
    assert cpp_plans.describe(SimpleNamespace(steps=[step])) is None
    step.direct = None
    with pytest.raises(ValueError, match="no direct launch"):
        cpp_plans.launch_description(step)


# ---------------------------------------------------------------- the extension itself


# (``ext``: the compiled extension, a fixture of conftest.py)


def _qkv(requires_grad=(True, True, True), shape=(1, 2, 8, 4)):
    return [torch.randn(shape, requires_grad=r) for r in requires_grad]


def test_node_forward_backward_fallback_then_registered(ext):
    seen = []

    def fallback(entry, do, q, k, v, o, lse):
        seen.append((entry, do.shape, o.shape, lse.shape))
        ext.add_backward(entry, ext.layout_key(do), [], [2, 8], 16, False)
        return do * 2, k * 3, v * 4

    entry = ext.add_entry([], fallback)
    q, k, v = _qkv()
    o = ext.attention(q, k, v, entry)
    assert o.shape == q.shape
    assert o.stride() == q.stride()
    assert "FlashFn" in o.grad_fn.name()
    do = torch.ones_like(o)
    before = ext.counters()
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
    assert len(seen) == 1
    assert seen[0][3] == (1, 2, 8)
    assert torch.equal(dq, do * 2)
    assert torch.equal(dk, k * 3)
    assert torch.equal(dv, v * 4)
    # the same dO layout again: C++ runs the registered (launch-free) plan, no Python
    o = ext.attention(q, k, v, entry)
    grads = torch.autograd.grad(o, (q, k, v), do)
    assert len(seen) == 1
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    after = ext.counters()
    assert after["forward"] - before["forward"] == 1
    assert after["backward"] - before["backward"] == 1
    assert after["backward_fallback"] - before["backward_fallback"] == 1
    # another dO layout: Python again
    o = ext.attention(q, k, v, entry)
    torch.autograd.grad(o, (q, k, v), torch.ones(1, 8, 2, 4).transpose(1, 2))
    assert len(seen) == 2


def test_node_grads_only_where_required(ext):
    entry = ext.add_entry([], lambda e, do, q, k, v, o, lse: (do + 1, k + 1, v + 1))
    q, k, v = _qkv((False, True, False))
    o = ext.attention(q, k, v, entry)
    (dk,) = torch.autograd.grad(o, (k,), torch.ones_like(o))
    assert torch.equal(dk, k.detach() + 1)


def test_lookup_by_layouts_and_reset(ext):
    entry = ext.add_entry([], lambda *a: None)
    q, k, v = _qkv()
    ext.index_entry(ext.fwd_key(q, k, v, False), entry)
    assert ext.attention_if_known(q, k, v, False) is not None
    assert ext.attention_if_known(q, k, v, True) is None  # causal is part of the key
    assert ext.attention_if_known(q.detach()[:, :1], k, v, False) is None  # another shape
    assert ext.attention_if_known(q.bfloat16(), k, v, False) is None  # another dtype
    assert ext.attention_if_known(q, q, v, False) is None  # aliased inputs: Python's path
    t = torch.randn(1, 8, 2, 4).transpose(1, 2)  # same shape, other strides
    assert ext.attention_if_known(t, k, v, False) is None
    ext.reset()
    assert ext.attention_if_known(q, k, v, False) is None


def test_layout_key_names_dtype_strides_alignment(ext):
    t = torch.zeros(2, 3, 4)
    key = ext.layout_key(t)
    assert key.endswith(":2/12:3/4:4/1@-1")
    assert key.startswith(str(6) + "a")
    assert ext.layout_key(torch.zeros(13)[1:]).startswith("6u")  # 4 bytes off 16


# ---------------------------------------------------------------- routing in flash_attention


class _Recorder:
    """A stand-in extension: answers every lookup with ``answer`` and notes the calls."""

    def __init__(self, answer):
        self.answer, self.lookups = answer, []

    def attention_if_known(self, q, k, v, causal, left=-1, right=-1, scale=0.0, lse=False):
        self.lookups.append((causal, left, right, scale, *["lse"] * lse))
        return (self.answer, "lse") if lse else self.answer

    def forward_if_known(self, q, k, v, causal, left=-1, right=-1, scale=0.0):
        self.lookups.append(("no graph", causal, left, right, scale))
        return self.answer if self.answer is None or self.answer is False else (self.answer, None)

    def reset(self):
        pass

    def set_ops_serving(self, on):
        pass

    def serve_ops(self, namespace, dispatch_key, forward_fallback, backward_fallback):
        pass  # (a build into this stand-in serves the ops with ``cpp_launch_compiled`` on)


@pytest.fixture
def standin(monkeypatch):
    sentinel = torch.zeros(1)
    fake = _Recorder(sentinel)
    monkeypatch.setitem(cpp_launch._state, "module", fake)
    monkeypatch.setattr(cpp_launch, "ACTIVE", [True])
    return fake, sentinel


def test_plain_grad_calls_consult_the_extension(standin):
    fake, sentinel = standin
    q, k, v = _qkv()
    assert flash_attention(q, k, v, causal=True) is sentinel
    assert flash_attention(q, k, v, backend="triton") is sentinel
    assert flash_attention(q, k, v, causal=True, window_size=(2, 0)) is sentinel
    assert flash_attention(q, k, v, softmax_scale=0.3) is sentinel
    assert flash_attention(q, k, v, True, return_lse=True) == (sentinel, "lse")
    assert flash_attention(q, k, v, True, window_size=(2, 0), return_lse=True)[0] is sentinel
    assert fake.lookups == [
        (True, -1, -1, 0.0), (False, -1, -1, 0.0), (True, 2, 0, 0.0), (False, -1, -1, 0.3),
        (True, -1, -1, 0.0, "lse"), (True, 2, 0, 0.0, "lse"),
    ]  # fmt: skip


@pytest.mark.parametrize(("scale", "error"), [(-1.0, ValueError), (float("nan"), ValueError)])
def test_bad_scales_are_looked_up_and_still_raise(monkeypatch, scale, error):
    """A float scale is part of the lookup; an invalid one never has an entry (the Python
    path raised on it), so the Python path's check names it."""
    fake = _Recorder(None)
    monkeypatch.setitem(cpp_launch._state, "module", fake)
    monkeypatch.setattr(cpp_launch, "ACTIVE", [True])
    with pytest.raises(error, match="softmax_scale"):
        flash_attention(*_qkv(), softmax_scale=scale)
    assert len(fake.lookups) == 1


@pytest.mark.parametrize(
    "kwargs",
    [
        {"softmax_scale": 1},  # only floats are looked up (an int takes the Python path)
        {"window_size": [2, 0]},  # only tuples are looked up (lists take the Python path)
        {"backend": "torch"},
    ],
)
def test_other_calls_skip_the_extension(standin, kwargs):
    fake, sentinel = standin
    q, k, v = _qkv()
    out = flash_attention(q, k, v, **kwargs)
    assert out is not sentinel
    assert fake.lookups == []


@pytest.mark.parametrize(
    ("window_size", "error"),
    [((-2, 0), ValueError), ((1.5, 0), TypeError), ((True, 0), TypeError), ((1, 2, 3), TypeError)],
)
def test_bad_windows_still_raise(standin, window_size, error):
    fake, _ = standin
    with pytest.raises(error, match="window_size"):
        flash_attention(*_qkv(), window_size=window_size)
    assert fake.lookups == []


def test_bad_return_lse_still_raises(standin):
    fake, _ = standin
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        flash_attention(*_qkv(), return_lse=1)
    assert fake.lookups == []


def test_bad_causal_still_raises(standin):
    fake, _ = standin
    with pytest.raises(TypeError, match="causal must be a bool"):
        flash_attention(*_qkv(), causal=1)
    assert fake.lookups == []


def test_calls_without_autograd_replay_the_forward_alone(standin):
    """Calls autograd does not record (no grad mode, or no input requiring grad) look up the
    forward without the node (evaluation, inference)."""
    fake, sentinel = standin
    q, k, v = _qkv()
    with torch.no_grad():
        assert flash_attention(q, k, v) is sentinel
    plain = _qkv((False, False, False))
    assert flash_attention(*plain, causal=True, window_size=(2, 0)) is sentinel
    assert flash_attention(*plain, return_lse=True) == (sentinel, None)  # (o, lse)
    assert fake.lookups == [
        ("no graph", False, -1, -1, 0.0), ("no graph", True, 2, 0, 0.0),
        ("no graph", False, -1, -1, 0.0),
    ]  # fmt: skip


def test_subclasses_skip_the_extension(standin):
    fake, _ = standin
    q, k, v = _qkv()

    class Sub(torch.Tensor):
        pass

    sub = q.detach().as_subclass(Sub).requires_grad_()
    flash_attention(sub, k, v)
    with torch.no_grad():
        flash_attention(sub, k, v)
    assert fake.lookups == []


def test_bad_inputs_get_the_python_paths_errors(standin):
    fake, _ = standin
    _, k, v = _qkv()
    with pytest.raises(TypeError, match=r"q must be a torch\.Tensor, got NoneType"):
        flash_attention(None, k, v)
    with pytest.raises(TypeError, match=r"k must be a torch\.Tensor, got list"):
        flash_attention(k, [1.0], v)
    assert fake.lookups == []


def test_refused_layouts_are_not_offered_to_learn(standin, monkeypatch):
    """A lookup answering False (a refused layout) runs the Python path and skips ``learn``;
    an unknown layout (None) is offered to it."""
    fake, _ = standin
    learned = []
    monkeypatch.setattr(cpp_launch, "learn", lambda *a: learned.append(a[3]))
    q, k, v = _qkv()
    fake.answer = False
    o = flash_attention(q, k, v, causal=True, backend="triton")
    assert o.shape == q.shape
    assert learned == []
    fake.answer = None
    flash_attention(q, k, v, causal=False, backend="triton")
    assert learned == [False]
    assert [lookup[0] for lookup in fake.lookups] == [True, False]


def test_refused_marks_are_bounded_and_reset(ext, monkeypatch):
    monkeypatch.setattr(cpp_launch, "_n_refused", [0])
    monkeypatch.setattr(cpp_launch, "MAX_ENTRIES", 1)  # at most 16 refused marks
    layouts = [_qkv(shape=(1, 2, n, 4)) for n in range(3, 21)]  # 18 layouts of their own
    for q, k, v in layouts:
        cpp_launch._refuse(ext, ext.fwd_key(q, k, v, False))
    first, last = layouts[0], layouts[-1]
    assert ext.attention_if_known(*first, False) is None  # dropped at the 17th mark
    assert ext.attention_if_known(*last, False) is False
    assert cpp_launch._n_refused[0] == 2
    ext.reset()
    assert ext.attention_if_known(*last, False) is None


def test_inactive_path_is_not_consulted(standin, monkeypatch):
    fake, _ = standin
    monkeypatch.setattr(cpp_launch, "ACTIVE", [False])
    q, k, v = _qkv()
    flash_attention(q, k, v)
    assert fake.lookups == []


def test_learn_refuses_cpu_layouts(ext, monkeypatch):
    monkeypatch.setitem(cpp_launch._state, "module", ext)
    q, k, v = _qkv()
    cpp_launch.learn(q, k, v, False, 0.5)  # no call key off the GPU: never an entry
    assert ext.attention_if_known(q, k, v, False) is False  # marked refused in the index
    assert cpp_launch._n_refused[0] >= 1
    ext.reset()


# ---------------------------------------------------------------- building


@pytest.fixture
def fresh_state(monkeypatch):
    """A private build state (the module-level one is left as it was)."""
    state = {"module": None, "status": "not built", "thread": None, "error": None}
    monkeypatch.setattr(cpp_launch, "_state", state)
    monkeypatch.setattr(cpp_launch, "ACTIVE", [False])
    yield state
    if state["thread"] is not None:
        state["thread"].join(10)


def test_build_failure_is_reported(fresh_state, monkeypatch, set_options):
    def no_compiler():
        raise OSError("no c++ here")

    monkeypatch.setattr(cpp_launch, "_compile_supported", no_compiler)
    with pytest.raises(RuntimeError, match="no c\\+\\+ here"):
        cpp_launch.build()
    assert cpp_launch.status().startswith("failed: OSError")
    assert not cpp_launch.ACTIVE[0]


@pytest.mark.parametrize("timeout", [0, -1.0, "60", True, float("nan")])
def test_build_rejects_a_bad_timeout(fresh_state, timeout):
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        cpp_launch.build(timeout=timeout)
    assert fresh_state["thread"] is None  # nothing started


def test_build_timeout_names_the_lock(fresh_state, monkeypatch):
    release = threading.Event()
    monkeypatch.setattr(
        cpp_launch, "_compile_supported", lambda: release.wait(10) and _Recorder(None)
    )
    with pytest.raises(RuntimeError, match="stale 'lock'"):
        cpp_launch.build(timeout=0.05)
    assert cpp_launch.status() == "building"
    release.set()


def test_auto_builds_in_the_background_on_cuda_only(fresh_state, monkeypatch, set_options):
    started = []
    monkeypatch.setattr(cpp_launch, "_compile_supported", lambda: started.append(1) or None)
    set_options(cpp_launch="auto")
    q, k, v = _qkv()
    cpp_launch.after_python_call(q, k, v, False, 0.5)  # a CPU call: nothing to build for
    assert fresh_state["thread"] is None
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    cpp_launch.after_python_call(q, k, v, False, 0.5)
    fresh_state["thread"].join(10)
    deadline = time.time() + 10
    while not started and time.time() < deadline:
        time.sleep(0.01)
    assert started == [1]


@pytest.mark.parametrize(
    ("window", "scale", "n_k"), [((-1, -1), 0.5, 7), ((3, 0), 0.5, 6), ((-1, -1), 0.3, 5)]
)
def test_learn_registers_forward_then_backward(ext, monkeypatch, window, scale, n_k):
    """The Python glue end to end on the real extension: ``learn`` gives a call's layouts an
    entry (from the launchers' remembered call), the next call is found in C++, its first
    backward goes to the launchers' backward and registers the dO layout, the next runs in
    C++. Launch-free plans stand in for the recorded launches (no GPU here). The window and a
    scale other than the default (0.5 at d = 4) are part of the key."""
    from flashattn_triton import launch, launch_backward

    monkeypatch.setitem(cpp_launch._state, "module", ext)
    for name in ("_registered", "_bwd_refused"):
        monkeypatch.setattr(cpp_launch, name, set())
    monkeypatch.setattr(cpp_launch, "_n_refused", [0])
    monkeypatch.setattr(cpp_launch, "call_key", lambda tensors, *flags: (len(tensors), *flags))
    monkeypatch.setattr(cpp_plans, "describe", lambda replay: [])
    monkeypatch.setitem(launch._CALLS, (3, True, scale, *window), ("replay", ()))
    monkeypatch.setitem(
        launch_backward._CALLS, (6, True, scale, *window), ("replay", (True, [2, 8], 16, False))
    )
    python_backwards = []

    def fake_backward(do, q, k, v, o, lse, causal, scale, *window):
        python_backwards.append((causal, scale, *window))
        return torch.ones_like(q), torch.ones_like(k), torch.ones_like(v)

    monkeypatch.setattr(launch_backward, "backward", fake_backward)
    q, k, v = _qkv(shape=(1, 2, 8, 4))
    # (n_k: layouts of their own, no other test's entry)
    k = k.detach()[:, :, :n_k].requires_grad_()
    v = v.detach()[:, :, :n_k].requires_grad_()
    assert ext.attention_if_known(q, k, v, True, *window, scale) is None
    monkeypatch.setattr(cpp_launch, "MAX_ENTRIES", 0)  # full: no new entry
    cpp_launch.learn(q, k, v, True, scale, *window)
    assert ext.attention_if_known(q, k, v, True, *window, scale) is None
    monkeypatch.setattr(cpp_launch, "MAX_ENTRIES", 1)
    cpp_launch.learn(q, k, v, True, scale, *window)
    if window != (-1, -1):  # the window is part of the key
        assert ext.attention_if_known(q, k, v, True) is None
        assert ext.attention_if_known(q, k, v, True, 4, 0) is None
    if scale != 0.5:  # so is a scale other than the default
        assert ext.attention_if_known(q, k, v, True, *window) is None
        assert ext.attention_if_known(q, k, v, True, *window, 0.25) is None
    else:  # the default given explicitly is the default's entry
        assert ext.attention_if_known(q, k, v, True, *window, 0.5) is not None
    start = ext.counters()
    do = torch.randn(1, 2, 8, 4)
    for _ in range(3):
        o = ext.attention_if_known(q, k, v, True, *window, scale)
        assert o is not None
        grads = torch.autograd.grad(o, (q, k, v), do)
    end = ext.counters()
    # only the first backward of this dO layout, with the call's window
    assert python_backwards == [(True, scale, *window)]
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert end["forward"] - start["forward"] == 3
    assert end["backward"] - start["backward"] == 2
    assert end["backward_fallback"] - start["backward_fallback"] == 1


def test_calls_without_autograd_register_at_their_second_sighting(ext, monkeypatch):
    """A call autograd does not record is only noted the first time its call key is seen (a
    loop over ever new shapes fills no entries); the second registers its layouts, whose
    entry then serves calls with and without autograd."""
    from flashattn_triton import launch

    monkeypatch.setitem(cpp_launch._state, "module", ext)
    for name in ("_registered", "_bwd_refused", "_seen_once"):
        monkeypatch.setattr(cpp_launch, name, set())
    monkeypatch.setattr(cpp_launch, "_n_refused", [0])
    monkeypatch.setattr(cpp_launch, "call_key", lambda tensors, *flags: (len(tensors), *flags))
    monkeypatch.setattr(cpp_plans, "describe", lambda replay: [])
    monkeypatch.setitem(launch._CALLS, (3, False, 0.5, -1, -1), ("replay", ()))
    q, k, v = (t.detach() for t in _qkv(shape=(1, 2, 8, 4)))
    k, v = k[:, :, :4], v[:, :, :4]  # (a layout of its own)
    cpp_launch.learn(q, k, v, False, 0.5)
    assert ext.forward_if_known(q, k, v, False) is None  # noted only
    cpp_launch.learn(q, k, v, False, 0.5)
    start = ext.counters()["forward"]
    o, lse = ext.forward_if_known(q, k, v, False)
    assert o.shape == q.shape
    assert lse.shape == (1, 2, 8)
    assert ext.counters()["forward"] - start == 1
    assert ext.attention_if_known(q.clone().requires_grad_(), k, v, False) is not None


def test_first_sightings_are_bounded(monkeypatch):
    monkeypatch.setattr(cpp_launch, "_seen_once", set())
    monkeypatch.setattr(cpp_launch, "MAX_ENTRIES", 2)
    assert [cpp_launch._first_sighting((i,)) for i in range(8)] == [True] * 8
    assert cpp_launch._first_sighting((7,)) is False  # seen: the second sighting
    assert cpp_launch._first_sighting((9,)) is True  # 8 = 4 x MAX_ENTRIES noted: cleared
    assert cpp_launch._seen_once == {(9,)}
    assert cpp_launch._first_sighting(None) is False  # no key: on to ``_register``
