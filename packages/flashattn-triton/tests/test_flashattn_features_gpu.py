"""GPU tests of grouped-query attention, sliding windows, lse, varlen and the split-KV decode
path at real sizes in bfloat16 / float16 (run with `nox -s gpu_tests`).

Tolerance: the error of o, dq, dk and dv against a float64 reference is at
most 2x that of PyTorch SDPA on the same inputs (+1e-4 where both are tiny); SDPA gets the
same attention as an explicit boolean mask, k/v expanded to q's heads. lse is checked
absolutely, |L - L_ref| < 1e-3 (1 + |L_ref|), as in test_flashattn_gpu.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from flashattn_testutil import offsets, reference_features, reference_varlen, rel_err

import flashattn_triton as fa
from flashattn_triton import launch

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


def _randn(*shape, dtype, g):
    return torch.randn(*shape, device=DEV, generator=g).to(dtype)


def _mask(n_q: int, n_k: int, causal: bool, window: tuple[int, int]) -> torch.Tensor:
    """(Nq, Nk) bool on the GPU from the documented rule (bottom-right aligned)."""
    left, right = window
    if causal:
        right = 0
    i = torch.arange(n_q, device=DEV)[:, None]
    j = torch.arange(n_k, device=DEV)[None, :]
    keep = torch.ones(n_q, n_k, dtype=torch.bool, device=DEV)
    if left >= 0:
        keep &= j >= i + n_k - n_q - left
    if right >= 0:
        keep &= j <= i + n_k - n_q + right
    return keep


def _sdpa(q, k, v, causal, window):
    group = q.shape[-3] // k.shape[-3]
    k, v = (t.repeat_interleave(group, dim=-3) for t in (k, v))
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=_mask(q.shape[-2], k.shape[-2], causal, window)
    )


def _grads(fn, q, k, v, do):
    qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = fn(qq, kk, vv)
    if isinstance(o, tuple):
        o = o[0]
    o.backward(do)
    return {"o": o.detach(), "dq": qq.grad, "dk": kk.grad, "dv": vv.grad}


def _assert_within_2x(ours, sdpa, ref):
    errs = {n: rel_err(ours[n], ref[n]) for n in ("o", "dq", "dk", "dv")}
    bound = {n: 2 * rel_err(sdpa[n], ref[n]) + 1e-4 for n in errs}
    for n in errs:
        assert torch.isfinite(ours[n]).all(), f"{n} has NaN/inf"
    bad = {n: (errs[n], bound[n]) for n in errs if not errs[n] <= bound[n]}
    assert not bad, f"errors above 2x SDPA's: {bad}"


def _check_lse(lse, ref_lse):
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isneginf(lse), ~fin)
    err = (lse[fin].double() - ref_lse[fin]).abs() / (1 + ref_lse[fin].abs())
    assert err.max().item() < 1e-3


def _check_dense(shape, causal, window, dtype, seed=0):
    b, h_q, h_kv, n_q, n_k, d = shape
    g = _gen(seed)
    q = _randn(b, h_q, n_q, d, dtype=dtype, g=g)
    k = _randn(b, h_kv, n_k, d, dtype=dtype, g=g)
    v = _randn(b, h_kv, n_k, d, dtype=dtype, g=g)
    do = _randn(b, h_q, n_q, d, dtype=dtype, g=g)
    ref = reference_features(q, k, v, do, causal, window)

    def ours(a, b_, c):
        return fa.flash_attention(a, b_, c, causal, window_size=window, return_lse=True)

    out = _grads(ours, q, k, v, do)
    _assert_within_2x(
        out, _grads(lambda a, b_, c: _sdpa(a, b_, c, causal, window), q, k, v, do), ref
    )
    _, lse = ours(q, k, v)
    _check_lse(lse, ref["lse"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("shape", "causal", "window"),
    [
        ((2, 32, 8, 1024, 1024, 128), True, (-1, -1)),  # GQA 4, the features table's head counts
        ((1, 16, 2, 2048, 2048, 128), True, (-1, -1)),  # GQA 8, Gluon dQ too (2048 keys)
        ((2, 6, 3, 999, 1500, 128), False, (-1, -1)),  # GQA 2, ragged, Nq < Nk
        ((1, 4, 1, 2500, 2100, 128), True, (-1, -1)),  # MQA, Nq > Nk: rows with no key
        ((2, 16, 1, 777, 777, 64), True, (-1, -1)),  # MQA, ragged length
        ((2, 8, 2, 600, 1000, 64), False, (-1, -1)),  # GQA, Nq < Nk
        ((2, 8, 8, 2048, 2048, 64), True, (256, -1)),  # sliding window
        ((1, 4, 4, 1500, 1500, 128), False, (100, 100)),  # two-sided window
        ((1, 32, 8, 2048, 2048, 128), True, (512, -1)),  # GQA + window
        ((2, 4, 4, 1000, 1000, 32), True, (4000, -1)),  # window beyond N
    ],
)
def test_gqa_and_windows(shape, causal, window, dtype):
    _check_dense(shape, causal, window, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("h_q", "h_kv", "d", "causal", "window"),
    [(16, 4, 128, True, (-1, -1)), (8, 8, 64, True, (128, -1)), (8, 2, 64, False, (-1, -1))],
)
def test_varlen(h_q, h_kv, d, causal, window, dtype):
    """8 sequences of random lengths (one of length 1) packed, against SDPA per sequence."""
    gen = torch.Generator().manual_seed(1)
    lens = [1, *torch.randint(1, 1200, (7,), generator=gen).tolist()]
    cu = offsets(lens)
    g = _gen(2)
    total = sum(lens)
    q = _randn(total, h_q, d, dtype=dtype, g=g)
    k = _randn(total, h_kv, d, dtype=dtype, g=g)
    v = _randn(total, h_kv, d, dtype=dtype, g=g)
    do = _randn(total, h_q, d, dtype=dtype, g=g)
    ref = reference_varlen(q, k, v, do, cu.tolist(), cu.tolist(), causal, window)
    cu_dev = cu.to(DEV)

    def ours(a, b, c):
        return fa.flash_attention_varlen(
            a, b, c, cu_dev, cu_dev, max(lens), max(lens), causal, window_size=window,
            return_lse=True,
        )  # fmt: skip

    def sdpa(a, b, c):
        outs = []
        for s in range(len(lens)):
            x, y = cu[s], cu[s + 1]
            o = _sdpa(*(t[x:y].transpose(0, 1) for t in (a, b, c)), causal, window)
            outs.append(o.transpose(0, 1))
        return torch.cat(outs)

    _assert_within_2x(_grads(ours, q, k, v, do), _grads(sdpa, q, k, v, do), ref)
    _check_lse(ours(q, k, v)[1], ref["lse"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("shape", "causal", "window"),
    [
        ((4, 32, 8, 1, 8192, 128), True, (-1, -1)),  # one token, GQA 4
        ((2, 32, 32, 4, 8000, 128), True, (-1, -1)),  # ragged cache length
        ((2, 16, 2, 16, 5000, 64), True, (1024, -1)),  # 16 queries, a window
        ((1, 8, 1, 2, 3000, 64), False, (-1, -1)),  # MQA, not causal
    ],
)
def test_decode_path(shape, causal, window, dtype, monkeypatch):
    """Few queries against a long cache run the split-KV kernels; errors within 2x SDPA's."""
    ran = []
    real = launch._decode
    monkeypatch.setattr(launch, "_decode", lambda *a: ran.append(1) or real(*a))
    _check_dense(shape, causal, window, dtype)
    assert ran, "the decode path did not run"


def _all_outputs(fn, q, k, v, do):
    out = _grads(fn, q, k, v, do)
    return [out[n] for n in ("o", "dq", "dk", "dv")]


@pytest.mark.parametrize(
    "case", ["gqa_window", "varlen", "varlen_two_offsets", "decode", "decode_window"]
)
def test_fast_launch_replays_features_exactly(case, set_options, monkeypatch):
    """The launch-plan replay gives bit-identical results to Triton's dispatch for every
    feature, and plans of different windows / lengths do not mix (each is in the key).
    Repeated calls take the remembered path (no plan key derived again), also where the
    backward's row statistics need padding and for packed sequences."""
    from flashattn_triton import launch_backward, launch_varlen

    g = _gen(3)
    dt = torch.bfloat16
    if case.startswith("varlen"):
        lens = [300, 1, 700, 129]
        cu = offsets(lens).to(DEV)
        # two offset tensors (five launch inputs instead of four), the keys' lengths other
        # than the queries'
        cu_k = offsets([310, 5, 650, 130]).to(DEV) if case == "varlen_two_offsets" else cu
        q = _randn(sum(lens), 8, 64, dtype=dt, g=g)
        n_k = int(cu_k[-1])
        k, v = (_randn(n_k, 2, 64, dtype=dt, g=g) for _ in range(2))
        do = torch.randn_like(q)

        def fn(a, b, c, w=(64, -1)):
            return fa.flash_attention_varlen(a, b, c, cu, cu_k, 700, 700, True, window_size=w)

    else:
        n_q = 1000 if case == "gqa_window" else 3
        q = _randn(2, 16, n_q, 128, dtype=dt, g=g)
        k, v = (_randn(2, 4, 4096, 128, dtype=dt, g=g) for _ in range(2))
        do = torch.randn_like(q)
        w0 = (-1, -1) if case == "decode" else (300, -1)

        def fn(a, b, c, w=w0):
            return fa.flash_attention(a, b, c, True, window_size=w)

    # The one-pass backward (the default from 2048 keys at d = 128 on Hopper) sums dQ in no
    # fixed order, so bit-equality needs the split kernels; its replays are checked in
    # test_flashattn_onepass_gpu.
    set_options(backward="split")
    set_options(fast_launch=False)
    want = _all_outputs(fn, q, k, v, do)
    other = _all_outputs(lambda *a: fn(*a, w=(5, 0)), q, k, v, do)
    set_options(fast_launch=True)
    planned = []
    for round in range(3):  # record, then replay
        if round == 1:  # every call from now on has been made once
            for module in (launch, launch_backward, launch_varlen):
                real = module._launch_planned
                monkeypatch.setattr(
                    module, "_launch_planned", lambda *a, _r=real: planned.append(1) or _r(*a)
                )
        got = _all_outputs(fn, q, k, v, do)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
        got = _all_outputs(lambda *a: fn(*a, w=(5, 0)), q, k, v, do)
        for a, b in zip(got, other):
            assert torch.equal(a, b)
    assert launch._PLANS.replays() > 0
    assert not planned, f"{len(planned)} repeated calls derived their plan key again"


def test_remembered_varlen_calls_read_each_calls_offsets(set_options):
    """A remembered packed call with other offsets of the same number and longest length
    (the same call key) attends by the new offsets: bit-identical to Triton's dispatch."""
    g = _gen(5)
    dt = torch.bfloat16
    q = _randn(1130, 8, 64, dtype=dt, g=g)
    k, v = (_randn(1130, 2, 64, dtype=dt, g=g) for _ in range(2))
    do = torch.randn_like(q)
    first, second = offsets([300, 1, 700, 129]).to(DEV), offsets([700, 129, 1, 300]).to(DEV)

    def fn(cu):
        return lambda a, b, c: fa.flash_attention_varlen(a, b, c, cu, cu, 700, 700, True)

    set_options(fast_launch=False)
    want = _all_outputs(fn(second), q, k, v, do)
    set_options(fast_launch=True)
    for _ in range(2):  # record, then remembered
        _all_outputs(fn(first), q, k, v, do)
    got = _all_outputs(fn(second), q, k, v, do)
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, want):
        assert torch.equal(a, b), name


def test_gluon_kernels_run_for_gqa_not_windows(monkeypatch, set_options):
    """d = 128 on Hopper: grouped-query calls run both Gluon backward kernels (right, as
    test_gqa_and_windows checks); windowed ones, which the Gluon kernels lack, run none."""
    from flashattn_triton import gluon_dkdv, gluon_dq

    set_options(fast_launch=False)  # every call through the launchers (no replays)
    set_options(backward="split")  # (auto would take the one-pass kernel from 2048 keys)
    ran = []
    for mod, name in ((gluon_dkdv, "launch_dkdv"), (gluon_dq, "launch_dq")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, r=real, n=name, **k: ran.append(n) or r(*a, **k))
    g = _gen(4)
    q = _randn(1, 8, 2048, 128, dtype=torch.bfloat16, g=g).requires_grad_()
    k = _randn(1, 2, 2048, 128, dtype=torch.bfloat16, g=g).requires_grad_()
    v = _randn(1, 2, 2048, 128, dtype=torch.bfloat16, g=g).requires_grad_()
    fa.flash_attention(q, k, v, True).sum().backward()
    assert sorted(ran) == ["launch_dkdv", "launch_dq"], ran
    ran.clear()
    q2, k2, v2 = (
        _randn(1, 8, 2048, 128, dtype=torch.bfloat16, g=g).requires_grad_() for _ in range(3)
    )
    fa.flash_attention(q2, k2, v2, True, window_size=(256, -1)).sum().backward()
    assert not ran, ran
    assert torch.isfinite(k.grad).all()
    assert torch.isfinite(k2.grad).all()


def test_compiled_model_with_features():
    """torch.compile(fullgraph=True) of a layer using GQA, a window and varlen: one graph,
    the same results as eager."""

    def layer(q, k, v, cu):
        o = fa.flash_attention(q, k, v, True, window_size=(128, -1))
        packed = o[0].transpose(0, 1)
        kv = k[0].transpose(0, 1)
        return fa.flash_attention_varlen(packed, kv, kv.clone(), cu, cu, 512, 512, True)

    g = _gen(5)
    q = _randn(1, 8, 1024, 64, dtype=torch.bfloat16, g=g)
    k = _randn(1, 2, 1024, 64, dtype=torch.bfloat16, g=g)
    v = _randn(1, 2, 1024, 64, dtype=torch.bfloat16, g=g)
    cu = offsets([512, 512]).to(DEV)
    eager = layer(q, k, v, cu)
    compiled = torch.compile(layer, fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v, cu), eager, rtol=0, atol=0)


def _forward_error_within_2x(ours, sdpa, ref):
    err, bound = rel_err(ours, ref), 2 * rel_err(sdpa, ref) + 1e-4
    assert torch.isfinite(ours).all()
    assert err <= bound, f"error {err} above 2x SDPA's ({bound})"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("shape", "causal", "window"),
    [
        ((8, 32, 8, 1, 8192, 128), True, (-1, -1)),  # one token per step, GQA 4
        ((4, 32, 32, 4, 6000, 128), True, (-1, -1)),  # ragged cache rows
        ((4, 16, 2, 16, 5000, 64), True, (1024, -1)),  # a window per sequence
        ((2, 32, 8, 300, 4096, 128), True, (-1, -1)),  # a chunk of queries: forward kernel
        ((3, 8, 1, 64, 2000, 64), False, (-1, -1)),
    ],
)
def test_kvcache(shape, causal, window, dtype):
    """flash_attention_kvcache with a random filled length per sequence (one of them 0, one
    the whole cache) against SDPA on each sequence's filled part: o within 2x SDPA's error of
    float64, lse, and the same result when the lengths change in place (a CUDA graph's case)."""
    b, h_q, h_kv, n_q, s, d = shape
    g = _gen(7)
    q = _randn(b, h_q, n_q, d, dtype=dtype, g=g)
    k = _randn(b, h_kv, s, d, dtype=dtype, g=g)
    v = _randn(b, h_kv, s, d, dtype=dtype, g=g)
    gen = torch.Generator().manual_seed(3)
    lens = [0, s, *torch.randint(1, s, (b - 2,), generator=gen).tolist()][:b]
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    with torch.no_grad():
        o, lse = fa.flash_attention_kvcache(
            q, k, v, seqlens, causal, window_size=window, return_lse=True
        )
    for i, n in enumerate(lens):
        if n == 0:
            assert (o[i] == 0).all()
            assert torch.isneginf(lse[i]).all()
            continue
        kb, vb = k[i : i + 1, :, :n], v[i : i + 1, :, :n]
        ref = reference_features(
            q[i : i + 1], kb, vb, torch.zeros_like(q[i : i + 1]), causal, window
        )
        with torch.no_grad():
            sdpa = _sdpa(q[i : i + 1], kb, vb, causal, window)
        _forward_error_within_2x(o[i : i + 1], sdpa, ref["o"])
        _check_lse(lse[i : i + 1], ref["lse"])
    # The same tensor with other lengths: read at launch, so a replayed call sees them.
    seqlens.copy_(torch.tensor(lens[::-1], dtype=torch.int32))
    with torch.no_grad():
        again = fa.flash_attention_kvcache(q, k, v, seqlens, causal, window_size=window)
        want = fa.flash_attention_kvcache(q, k, v, lens[-1], causal, window_size=window)
    torch.testing.assert_close(again[0], want[0], rtol=0, atol=0)


def test_kvcache_decode_step_in_a_cuda_graph():
    """A decode step captured once and replayed with the lengths advanced in place gives
    what eager calls give, bit for bit."""
    g = _gen(8)
    q = _randn(4, 32, 1, 128, dtype=torch.bfloat16, g=g)
    k = _randn(4, 8, 4096, 128, dtype=torch.bfloat16, g=g)
    v = _randn(4, 8, 4096, 128, dtype=torch.bfloat16, g=g)
    seqlens = torch.tensor([100, 2000, 4096, 1], dtype=torch.int32, device=DEV)
    with torch.no_grad():
        fa.flash_attention_kvcache(q, k, v, seqlens, True)  # warm-up: compile, launch plan
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fa.flash_attention_kvcache(q, k, v, seqlens, True)
        for step in range(3):
            seqlens.copy_(torch.tensor([101 + step, 2001 + step, 4000 + step, 2 + step]))
            graph.replay()
            want = fa.flash_attention_kvcache(q, k, v, seqlens, True)
            torch.testing.assert_close(out, want, rtol=0, atol=0)


@pytest.mark.parametrize("n_new", [1, 300])
def test_kvcache_append_in_a_cuda_graph(n_new):
    """New rows passed with the call (k=, v=) are stored at each sequence's length and
    attended: the same result and cache, bit for bit, as storing them first and counting
    them in the lengths; and a captured step replays with the lengths advanced in place."""
    g = _gen(9)
    b, h_q, h_kv, s, d = 4, 32, 8, 4096, 128
    q = _randn(b, h_q, n_new, d, dtype=torch.bfloat16, g=g)
    k = _randn(b, h_kv, s, d, dtype=torch.bfloat16, g=g)
    v = _randn(b, h_kv, s, d, dtype=torch.bfloat16, g=g)
    k_new = _randn(b, h_kv, n_new, d, dtype=torch.bfloat16, g=g)
    v_new = _randn(b, h_kv, n_new, d, dtype=torch.bfloat16, g=g)
    lens = [0, 1000, s - n_new, 7]
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    k_ref, v_ref = k.clone(), v.clone()
    for i, n in enumerate(lens):
        k_ref[i, :, n : n + n_new], v_ref[i, :, n : n + n_new] = k_new[i], v_new[i]
    with torch.no_grad():
        got = fa.flash_attention_kvcache(q, k, v, seqlens, True, k=k_new, v=v_new)
        want = fa.flash_attention_kvcache(q, k_ref, v_ref, seqlens + n_new, True)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.equal(k, k_ref)
    assert torch.equal(v, v_ref)
    with torch.no_grad():
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fa.flash_attention_kvcache(q, k, v, seqlens, True, k=k_new, v=v_new)
        seqlens.copy_(torch.tensor([5, 2000, 100, 9]))
        graph.replay()
        for i, n in enumerate([5, 2000, 100, 9]):
            k_ref[i, :, n : n + n_new], v_ref[i, :, n : n + n_new] = k_new[i], v_new[i]
        want = fa.flash_attention_kvcache(q, k_ref, v_ref, seqlens + n_new, True)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert torch.equal(k, k_ref)
