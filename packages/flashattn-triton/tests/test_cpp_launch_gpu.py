"""GPU tests of the C++ launch path (``cpp_launch``): the same kernels as the Python path.

Each case runs a model-layout call (q a transposed (B, N, H, d) buffer) several times, with
two dO layouts, and holds the C++ path's outputs and gradients to the Python path's on the
same inputs (``_python_path``: the lookup switched off for the reference call, the entries
kept); the extension's counters show that the repeated calls, forward and
backward, ran in C++.
"""

from __future__ import annotations

import math

import pytest
import torch

from flashattn_triton import configs, cpp_launch, cpp_plans, flash_attention
from flashattn_triton.ops import NAMESPACE

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def ext():
    import triton

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if not cpp_plans.supported(triton.__version__):
        pytest.skip(f"the C++ launch path supports triton {cpp_plans.TRITON_SERIES}x only")
    cpp_launch.build()
    assert cpp_launch.status() == "ready"
    return cpp_launch._state["module"]


def _inputs(b, h, hkv, n, d, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def make(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)

    q = make(b, n, h, d).transpose(1, 2).requires_grad_()
    k, v = (make(b, hkv, n, d).requires_grad_() for _ in range(2))
    dos = [make(b, h, n, d), make(b, n, h, d).transpose(1, 2)]
    return q, k, v, dos


def _python_path(*args, **kwargs):
    """``flash_attention`` on the Python path: the C++ lookup off for this call (and nothing
    registered by it), the extension's entries kept."""
    was = cpp_launch.ACTIVE[0]
    cpp_launch.ACTIVE[0] = False
    try:
        return flash_attention(*args, **kwargs)
    finally:
        cpp_launch.ACTIVE[0] = was


def _close(a, r, what):
    assert a.shape == r.shape, what
    assert a.stride() == r.stride(), what
    err = (a.float() - r.float()).abs().max().item()
    assert err <= 1e-2 * r.float().abs().max().item() + 1e-3, (what, err)


CASES = [  # b, h, hkv, n, d, causal
    (2, 8, 8, 512, 64, True),
    (1, 4, 4, 1000, 128, False),
    (1, 16, 16, 2048, 128, True),
    (2, 8, 2, 1024, 128, True),
    (1, 4, 4, 4096, 64, False),
    (4, 12, 12, 1024, 64, True),
]


@pytest.mark.parametrize(("b", "h", "hkv", "n", "d", "causal"), CASES)
def test_matches_python_path(ext, b, h, hkv, n, d, causal):
    q, k, v, dos = _inputs(b, h, hkv, n, d, seed=n + d)
    before = ext.counters()
    for i in range(6):
        do = dos[i % 2]
        o = flash_attention(q, k, v, causal=causal)
        grads = torch.autograd.grad(o, (q, k, v), do)
        o_ref = _python_path(q, k, v, causal=causal)
        refs = torch.autograd.grad(o_ref, (q, k, v), do)
        assert torch.equal(o, o_ref), i
        for name, a, r in zip(("dq", "dk", "dv"), grads, refs):
            _close(a, r, (i, name))
    after = ext.counters()
    assert after["forward"] - before["forward"] == 5  # all but the first call
    # the first backward of each dO layout in Python, the other four in C++; query lengths
    # off a multiple of 256 pad the row statistics per call: their backward stays in Python
    # (the first call's backward is the Python Function's, not the node's)
    in_cpp = 3 if n % 256 == 0 else 0
    assert after["backward"] - before["backward"] == in_cpp
    assert after["backward_fallback"] - before["backward_fallback"] == 5 - in_cpp


def _four_calls_against_python(ext, q, k, v, do, **kwargs):
    """Four calls with ``kwargs``, each against the Python path on the same inputs: the last
    three forwards and the last two backwards (the first of dO's layout registers it) run in
    C++. The counters after."""
    before = ext.counters()
    for i in range(4):
        o = flash_attention(q, k, v, **kwargs)
        grads = torch.autograd.grad(o, (q, k, v), do)
        o_ref = _python_path(q, k, v, **kwargs)
        refs = torch.autograd.grad(o_ref, (q, k, v), do)
        assert torch.equal(o, o_ref), i
        for name, a, r in zip(("dq", "dk", "dv"), grads, refs):
            _close(a, r, (i, name))
    after = ext.counters()
    assert after["forward"] - before["forward"] == 3
    assert after["backward"] - before["backward"] == 2
    return after


@pytest.mark.parametrize(
    ("n", "d", "causal", "window"),
    [(1024, 64, True, (256, 0)), (2048, 128, True, (511, 0)), (512, 64, False, (64, 32))],
)
def test_windowed_calls_match_python_path(ext, n, d, causal, window):
    """A window is part of the key: repeated windowed calls run in C++, a call with another
    window does not reuse the entry, and all match the Python path."""
    q, k, v, dos = _inputs(2, 4, 4, n, d, seed=n + window[0])
    after = _four_calls_against_python(ext, q, k, v, dos[0], causal=causal, window_size=window)
    other = (window[0] + 1, window[1])
    o2 = flash_attention(q, k, v, causal=causal, window_size=other)
    o2_ref = _python_path(q, k, v, causal=causal, window_size=other)
    assert torch.equal(o2, o2_ref)
    assert ext.counters()["forward"] == after["forward"]  # a new window: the Python path


@pytest.mark.parametrize(("n", "d", "causal"), [(1024, 64, True), (512, 128, False)])
def test_explicit_scales_replay_in_cpp(ext, n, d, causal):
    """A float scale other than the default is part of the key: repeated calls with it run
    in C++ and match the Python path; another scale does not reuse the entry; the default
    given explicitly is the default's entry."""
    q, k, v, dos = _inputs(2, 4, 4, n, d, seed=n + d + 2)
    after = _four_calls_against_python(ext, q, k, v, dos[0], causal=causal, softmax_scale=0.1)
    o2 = flash_attention(q, k, v, causal=causal, softmax_scale=0.2)
    assert torch.equal(o2, _python_path(q, k, v, causal=causal, softmax_scale=0.2))
    assert ext.counters()["forward"] == after["forward"]  # a new scale: the Python path
    for _ in range(2):
        flash_attention(q, k, v, causal=causal)
    default = 1.0 / math.sqrt(d)
    flash_attention(q, k, v, causal=causal, softmax_scale=default)
    assert ext.counters()["forward"] == after["forward"] + 2


@pytest.mark.parametrize(
    ("h", "hkv", "n", "d", "causal"),
    [(16, 16, 2048, 64, True), (8, 2, 1024, 128, True), (32, 32, 512, 64, False)],
)
def test_3d_inputs_replay_in_cpp(ext, h, hkv, n, d, causal):
    """(H, N, d) inputs, as single-sequence code passes them (grouped k / v heads too): the
    C++ path replays them on the Python path's 4-D views and answers in 3-D."""
    g = torch.Generator(device="cuda").manual_seed(h + n + d)

    def make(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)

    q = make(h, n, d).requires_grad_()
    k, v = (make(hkv, n, d).requires_grad_() for _ in range(2))
    _four_calls_against_python(ext, q, k, v, make(h, n, d), causal=causal)
    with torch.no_grad():  # the 3-D forward without autograd, registered at its second call
        outs = [flash_attention(q, k, v, causal=causal) for _ in range(3)]
        ref = _python_path(q, k, v, causal=causal)
    for o in outs:
        assert torch.equal(o, ref)


# Shapes no other test in this file uses (an entry another test made would replay call 1
# too), multiples of ``configs.STATS_ROWS`` (the backward of padded statistics rows is not
# registered in C++).
@pytest.mark.parametrize(("n", "d", "window"), [(1280, 64, (-1, -1)), (768, 128, (255, 0))])
def test_lse_calls_replay_in_cpp(ext, n, d, window):
    """``return_lse=True``: the node's second output, the Python path's lse; the entry is
    the one calls without the lse use."""
    assert n % configs.STATS_ROWS == 0
    q, k, v, dos = _inputs(2, 4, 4, n, d, seed=n + d + 5)
    kwargs = {"causal": True, "window_size": window}
    before = ext.counters()
    for i in range(4):
        o, lse = flash_attention(q, k, v, return_lse=True, **kwargs)
        assert not lse.requires_grad
        grads = torch.autograd.grad(o, (q, k, v), dos[0])
        o_ref, lse_ref = _python_path(q, k, v, return_lse=True, **kwargs)
        refs = torch.autograd.grad(o_ref, (q, k, v), dos[0])
        assert torch.equal(o, o_ref), i
        assert torch.equal(lse, lse_ref), i
        for name, a, r in zip(("dq", "dk", "dv"), grads, refs):
            _close(a, r, (i, name))
    o = flash_attention(q, k, v, **kwargs)  # o alone: the same entry
    assert torch.equal(o, o_ref)
    with torch.no_grad():
        o, lse = flash_attention(q, k, v, return_lse=True, **kwargs)
    assert torch.equal(lse, lse_ref)
    after = ext.counters()
    assert after["forward"] - before["forward"] == 5
    assert after["backward"] - before["backward"] == 2


def test_calls_without_autograd_replay_the_forward(ext):
    """Evaluation under ``torch.no_grad``: a layout's second Python call registers it, later
    calls replay the forward from C++, with the Python path's output."""
    q, k, v, _ = _inputs(3, 4, 4, 768, 64, seed=9)
    before = ext.counters()
    with torch.no_grad():
        outs = [flash_attention(q, k, v, causal=True) for _ in range(4)]
        ref = _python_path(q, k, v, causal=True)
    after = ext.counters()
    assert after["forward"] - before["forward"] == 2
    assert after["backward"] == before["backward"]
    for i, o in enumerate(outs):
        assert o.grad_fn is None
        assert torch.equal(o, ref), i


def test_only_some_inputs_require_grad(ext):
    q, k, v, dos = _inputs(1, 4, 4, 512, 64, seed=1)
    k, v = k.detach(), v.detach()
    for _ in range(3):
        o = flash_attention(q, k, v, causal=True)
        (dq,) = torch.autograd.grad(o, (q,), dos[0])
    qr = q.detach().requires_grad_()
    o_ref = _python_path(qr, k, v, causal=True)
    (dq_ref,) = torch.autograd.grad(o_ref, (qr,), dos[0])
    _close(dq, dq_ref, "dq")


def test_refused_layouts_stay_on_the_python_path(ext):
    """float32 calls cannot be described: the index marks their layout refused after the
    first call, and the repeated calls run (correctly) on the Python path."""
    g = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = (
        torch.randn(1, 4, 256, 64, device="cuda", generator=g).requires_grad_() for _ in range(3)
    )
    do = torch.randn(1, 4, 256, 64, device="cuda", generator=g)
    before = ext.counters()
    for _ in range(3):
        o = flash_attention(q, k, v, causal=True)
        grads = torch.autograd.grad(o, (q, k, v), do)
    assert ext.counters() == before
    assert ext.attention_if_known(q, k, v, True) is False
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(qr, kr, vr, is_causal=True)
    refs = torch.autograd.grad(ref, (qr, kr, vr), do.double())
    for name, a, r in zip(("o", "dq", "dk", "dv"), (o, *grads), (ref, *refs)):
        _close(a, r.float().contiguous(), name)  # (SDPA's gradients have layouts of their own)


def test_deterministic_mode_takes_the_split_backward(ext):
    """A one-pass backward (dQ by atomics) registered in C++ is not replayed under torch's
    deterministic mode: the Python path runs the split kernels, bit for bit repeatable."""
    q, k, v, dos = _inputs(1, 16, 16, 4096, 128, seed=3)
    for _ in range(3):
        o = flash_attention(q, k, v, causal=True)
        torch.autograd.grad(o, (q, k, v), dos[0])
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        runs = []
        for _ in range(2):
            o = flash_attention(q, k, v, causal=True)
            runs.append(torch.autograd.grad(o, (q, k, v), dos[0]))
    finally:
        torch.use_deterministic_algorithms(was)
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_option_changes_drop_the_entries(ext, set_options):
    q, k, v, dos = _inputs(1, 4, 4, 1024, 64, seed=4)
    for _ in range(2):
        flash_attention(q, k, v, causal=True).backward(dos[0])
    before = ext.counters()["forward"]
    set_options(backward="split")  # plans keyed by the options: the C++ entries go too
    flash_attention(q, k, v, causal=True).backward(dos[0])
    assert ext.counters()["forward"] == before
    flash_attention(q, k, v, causal=True).backward(dos[0])
    assert ext.counters()["forward"] == before + 1
    set_options(cpp_launch=False)
    flash_attention(q, k, v, causal=True).backward(dos[0])
    assert ext.counters()["forward"] == before + 1
    assert cpp_launch.status() == "off"


def test_cuda_graph_capture(ext):
    """Forward and backward through the C++ path replay from a CUDA graph."""
    q, k, v, dos = _inputs(2, 8, 8, 512, 64, seed=5)
    for _ in range(3):
        torch.autograd.grad(flash_attention(q, k, v, causal=True), (q, k, v), dos[0])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = flash_attention(q, k, v, causal=True)
        grads = torch.autograd.grad(o, (q, k, v), dos[0])
    with torch.no_grad():
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
    graph.replay()
    o_ref = _python_path(q, k, v, causal=True)
    refs = torch.autograd.grad(o_ref, (q, k, v), dos[0])
    assert torch.equal(o, o_ref)
    for name, a, r in zip(("dq", "dk", "dv"), grads, refs):
        _close(a, r, name)


def test_activation_checkpointing(ext):
    """Under torch.utils.checkpoint (saved-tensor hooks, the forward run again in the
    backward) the C++ node gives the gradients of the plain call."""
    from torch.utils.checkpoint import checkpoint

    q, k, v, dos = _inputs(2, 8, 8, 512, 64, seed=6)
    for _ in range(2):
        torch.autograd.grad(flash_attention(q, k, v, causal=True), (q, k, v), dos[0])
    before = ext.counters()["forward"]
    o = checkpoint(
        lambda a, b, c: flash_attention(a, b, c, causal=True), q, k, v, use_reentrant=False
    )
    grads = torch.autograd.grad(o, (q, k, v), dos[0])
    assert ext.counters()["forward"] - before == 2  # the call and its recomputation
    o_ref = _python_path(q, k, v, causal=True)
    refs = torch.autograd.grad(o_ref, (q, k, v), dos[0])
    for name, a, r in zip(("dq", "dk", "dv"), grads, refs):
        _close(a, r, name)


@pytest.mark.parametrize(("n", "d", "causal"), [(1024, 64, True), (2048, 128, False)])
def test_compiled_opaque_ops_replay_in_cpp(ext, set_options, n, d, causal):
    """``cpp_launch_compiled``: a compiled graph's opaque ops (``traced_compile=False``)
    replay the C++ entries from their second call, and match the eager Python path."""
    set_options(traced_compile=False, cpp_launch_compiled=True)
    assert cpp_launch.OPS_ACTIVE[0]
    q, k, v, dos = _inputs(2, 8, 8, n, d, seed=n + d + 1)

    def step(q, k, v, do):
        o = flash_attention(q, k, v, causal=causal)
        return (o, *torch.autograd.grad(o, (q, k, v), do))

    torch._dynamo.reset()
    compiled = torch.compile(step)
    before = ext.counters()
    for i in range(4):
        outs = compiled(q, k, v, dos[0])
        o_ref = _python_path(q, k, v, causal=causal)
        refs = (o_ref, *torch.autograd.grad(o_ref, (q, k, v), dos[0]))
        for name, a, r in zip(("o", "dq", "dk", "dv"), outs, refs):
            _close(a, r, (i, name))
    after = ext.counters()
    assert after["forward"] - before["forward"] >= 3  # every call but the first
    assert after["backward"] - before["backward"] >= 3
    for op in ("fwd_launch", "bwd_launch"):  # the dispatcher reaches the replay in C++
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"{NAMESPACE}::{op}", "CUDA")
