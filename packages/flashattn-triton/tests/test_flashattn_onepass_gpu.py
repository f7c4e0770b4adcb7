"""GPU tests of the one-pass Gluon backward (``gluon_bwd``; Hopper, head dims 64 and 128).

The launcher takes it from ``gluon_bwd.MIN_KEYS`` keys (at d = 64 a multiple of it,
``gluon_bwd.enough_keys``); the accuracy tests lower that bound
so that small, awkward shapes run it too, and hold it to the bound of every other path: at
most 2x SDPA's error against a float64 reference (+1e-4), grouped-query heads against an
expanded reference with the split kernels' error as the yardstick.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from flashattn_testutil import reference_features, rel_err, run_fwd_bwd

from flashattn_triton import (
    flash_attention,
    gluon_bwd,
    gluon_dkdv,
    launch,
    launch_plans,
    use_options,
)

pytestmark = pytest.mark.gpu
DEV = "cuda"


@pytest.fixture
def onepass_runs(monkeypatch):
    """Skip off Hopper / without Gluon; count the one-pass launches (a list of their
    (B, H, N) shapes)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the one-pass backward needs a Hopper GPU")
    if not gluon_dkdv.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")
    runs = []
    real = gluon_bwd.launch_onepass

    def spy(q, *args, **kwargs):
        runs.append(tuple(q.shape[:3]))
        return real(q, *args, **kwargs)

    monkeypatch.setattr(gluon_bwd, "launch_onepass", spy)
    launch_plans.clear_plans()
    yield runs
    launch_plans.clear_plans()


def _inputs(b, h, h_kv, n_q, n_k, dtype, layout="bhnd", seed=0, d=128):
    g = torch.Generator(device=DEV).manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, device=DEV, generator=g).to(dtype)

    if layout == "bnhd":  # a model's (B, N, H, d) buffers seen as (B, H, N, d)
        q = rand(b, n_q, h, d).transpose(1, 2)
        k, v = (rand(b, n_k, h_kv, d).transpose(1, 2) for _ in range(2))
    else:
        q = rand(b, h, n_q, d)
        k, v = (rand(b, h_kv, n_k, d) for _ in range(2))
    return q, k, v, rand(b, h, n_q, d)


def _ours(q, k, v, do, causal):
    return run_fwd_bwd(lambda a, b, c, s: flash_attention(a, b, c, causal=s), q, k, v, do, causal)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("b", "h", "h_kv", "n_q", "n_k", "causal", "layout"),
    [
        (2, 4, 4, 1024, 1024, True, "bhnd"),
        (2, 3, 3, 999, 999, False, "bhnd"),  # ragged: not a multiple of 64 or 128
        (1, 2, 2, 384, 640, True, "bhnd"),  # bottom-right causal, n_q < n_k
        (1, 2, 2, 640, 384, True, "bhnd"),  # n_q > n_k: the first rows see no key
        (1, 2, 2, 130, 1500, False, "bhnd"),
        (1, 1, 1, 1, 1, True, "bhnd"),
        (2, 4, 4, 1024, 1024, True, "bnhd"),
    ],
)
def test_onepass_matches_float64(b, h, h_kv, n_q, n_k, causal, layout, dtype, d, monkeypatch,
                                 onepass_runs, set_options):  # fmt: skip
    monkeypatch.setattr(gluon_bwd, "MIN_KEYS", 1)
    monkeypatch.setattr(gluon_bwd, "D64_KEY_FACTOR", dict.fromkeys(gluon_bwd.D64_KEY_FACTOR, 1))
    set_options(backward="onepass")  # auto gives small causal grids at d = 64 the fused kernel
    q, k, v, do = _inputs(b, h, h_kv, n_q, n_k, dtype, layout, d=d)
    ours = _ours(q, k, v, do, causal)
    assert onepass_runs == [(b, h, n_q)]
    ref = reference_features(q, k, v, do, causal)
    qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
    o.backward(do)
    sdpa = {"dq": qq.grad, "dk": kk.grad, "dv": vv.grad}
    if causal and n_q != n_k:  # SDPA's causal mask is top-left aligned: split as yardstick
        with pytest.MonkeyPatch.context() as m:
            m.setattr(gluon_bwd, "MIN_KEYS", 1 << 40)
            launch_plans.clear_plans()
            sdpa = _ours(q, k, v, do, causal)
    for name in ("dq", "dk", "dv"):
        assert torch.isfinite(ours[name]).all(), name
        err, bound = rel_err(ours[name], ref[name]), 2 * rel_err(sdpa[name], ref[name]) + 1e-4
        assert err <= bound, f"{name}: {err:.3e} > {bound:.3e}"


def _assert_onepass_near_split(q, k, v, do, causal, monkeypatch, onepass_runs):
    """One one-pass launch (MIN_KEYS patched to 1 by the caller) whose dQ, dK, dV are within
    1.5x of the split kernels' error against float64 (expanded k, v)."""
    ours = _ours(q, k, v, do, causal)
    assert onepass_runs == [tuple(q.shape[:3])]
    monkeypatch.setattr(gluon_bwd, "MIN_KEYS", 1 << 40)
    launch_plans.clear_plans()
    split = _ours(q, k, v, do, causal)
    ref = reference_features(q, k, v, do, causal)
    for name in ("dq", "dk", "dv"):
        err, yard = rel_err(ours[name], ref[name]), rel_err(split[name], ref[name])
        assert err <= 1.5 * yard + 1e-4, f"{name}: {err:.3e} against split {yard:.3e}"


@pytest.mark.parametrize(
    ("h", "h_kv", "causal", "d"),
    [(8, 2, True, 128), (8, 1, False, 128), (4, 4, True, 128), (8, 2, False, 64), (6, 1, True, 64)],
)
def test_onepass_grouped_query_heads(h, h_kv, causal, d, monkeypatch, onepass_runs):
    """dK, dV summed over each group of q heads inside the kernel; within 1.5x of the split
    kernels' error against float64 (expanded k, v)."""
    monkeypatch.setattr(gluon_bwd, "MIN_KEYS", 1)
    q, k, v, do = _inputs(2, h, h_kv, 777, 777, torch.bfloat16, d=d)
    _assert_onepass_near_split(q, k, v, do, causal, monkeypatch, onepass_runs)


@pytest.mark.parametrize(("rule", "expected"), [(3, 4), (6, 8)])
def test_onepass_grouped_query_heads_in_head_groups(rule, expected, monkeypatch, onepass_runs):
    """The L2 rule's k/v head groups, rounded up to a power of two for grouped-query heads
    (3 -> 4 of 8 k/v heads: two whole groups; 6 -> 8: all of them), keep the split kernels'
    accuracy."""
    monkeypatch.setattr(gluon_bwd, "MIN_KEYS", 1)
    monkeypatch.setattr(
        gluon_bwd, "head_group_args", lambda t, bh, rows, d: {"head_group": min(rule, bh)}
    )
    q, k, v, do = _inputs(2, 16, 4, 777, 777, torch.bfloat16)
    assert gluon_bwd.head_group(q, k, True) == expected
    _assert_onepass_near_split(q, k, v, do, True, monkeypatch, onepass_runs)


def test_onepass_is_the_default_from_min_keys(onepass_runs, set_options):
    """``auto`` takes it from MIN_KEYS keys and not below; ``split`` never. At 16K tokens
    the gradients agree with the split kernels' (only the order of dQ's sums differs)."""
    n = gluon_bwd.MIN_KEYS
    q, k, v, do = _inputs(1, 2, 2, n, n, torch.bfloat16)
    ours = _ours(q, k, v, do, True)
    assert onepass_runs == [(1, 2, n)]
    set_options(backward="split")
    split = _ours(q, k, v, do, True)
    assert onepass_runs == [(1, 2, n)]
    assert torch.equal(ours["o"], split["o"])
    for name in ("dq", "dk", "dv"):
        assert rel_err(ours[name], split[name]) < 1e-2, name
    set_options(backward="auto")
    short = n // 4
    _ours(*_inputs(1, 2, 2, short, short, torch.bfloat16), True)
    assert onepass_runs == [(1, 2, n)]


def test_onepass_at_d64_from_its_key_bound(onepass_runs):
    """At d = 64 ``auto`` takes it from ``enough_keys`` (a few heads, non-causal: twice
    MIN_KEYS) and not below; gradients agree with the split kernels'."""
    n = 2 * gluon_bwd.MIN_KEYS
    short = _inputs(1, 2, 2, n // 2, n // 2, torch.bfloat16, d=64)
    _ours(*short, False)
    assert onepass_runs == []
    q, k, v, do = _inputs(1, 2, 2, n, n, torch.bfloat16, d=64)
    ours = _ours(q, k, v, do, False)
    assert onepass_runs == [(1, 2, n)]
    with use_options(backward="split"):
        split = _ours(q, k, v, do, False)
    assert onepass_runs == [(1, 2, n)]
    for name in ("dq", "dk", "dv"):
        assert rel_err(ours[name], split[name]) < 1e-2, name


def test_onepass_outputs_fully_written(monkeypatch, onepass_runs):
    """Every element of dq, dk, dv is written (NaN-filled outputs, ragged lengths)."""
    monkeypatch.setattr(gluon_bwd, "MIN_KEYS", 1)
    real = launch.out_like
    from flashattn_triton import launch_backward

    monkeypatch.setattr(
        launch_backward, "out_like", lambda t, dtype=None: real(t, dtype).fill_(float("nan"))
    )
    q, k, v, do = _inputs(2, 3, 3, 257, 257, torch.bfloat16)
    out = _ours(q, k, v, do, True)
    assert onepass_runs
    for name in ("dq", "dk", "dv"):
        assert not torch.isnan(out[name]).any(), name


@pytest.mark.parametrize(("h", "h_kv"), [(4, 4), (4, 2)])
def test_onepass_calls_replay(h, h_kv, monkeypatch, onepass_runs):
    """Repeated one-pass backwards replay the first call's launches (the zeroed float32 dQ
    buffer is one of the plan's buffers): no launch through Triton's dispatch from the
    second call on, dk and dv equal to the first call's, dq up to the order of its sums."""
    from flashattn_triton import fastlaunch

    monkeypatch.setattr(gluon_bwd, "MIN_KEYS", 1)
    q, k, v, do = _inputs(2, h, h_kv, 1000, 1000, torch.bfloat16)
    first = _ours(q, k, v, do, True)
    jit = []
    real = fastlaunch.launch
    monkeypatch.setattr(fastlaunch, "launch", lambda *a, **kw: jit.append(1) or real(*a, **kw))
    for _ in range(3):
        again = _ours(q, k, v, do, True)
        assert torch.equal(again["dk"], first["dk"])
        assert torch.equal(again["dv"], first["dv"])
        assert rel_err(again["dq"], first["dq"]) < 5e-3
    torch.cuda.synchronize()
    assert not jit, f"{len(jit)} launches went through Triton's dispatch"
    assert onepass_runs == [(2, h, 1000)]


def test_deterministic_mode_leaves_a_replayed_onepass_plan(monkeypatch, onepass_runs):
    """A call whose one-pass launches are remembered runs the split kernels once torch's
    deterministic mode is on: gradients bit-equal to ``backward="split"``'s."""
    monkeypatch.setattr(gluon_bwd, "MIN_KEYS", 1)
    q, k, v, do = _inputs(1, 4, 4, 777, 777, torch.bfloat16)
    with use_options(backward="split"):  # (not causal: no small-grid tiles in either plan)
        split = _ours(q, k, v, do, False)
    for _ in range(2):
        _ours(q, k, v, do, False)
    assert onepass_runs == [(1, 4, 777)]
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        for _ in range(2):
            det = _ours(q, k, v, do, False)
            for name in ("dq", "dk", "dv"):
                assert torch.equal(det[name], split[name]), name
    finally:
        torch.use_deterministic_algorithms(was)
