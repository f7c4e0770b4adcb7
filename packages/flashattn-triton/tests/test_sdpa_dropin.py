"""``scaled_dot_product_attention``, the drop-in for torch's SDPA: which calls take our
kernels, that every other call is torch's own, that the arguments mean the same on both, and
``sdpa_replaced``. The GPU test holds our path to torch's SDPA on the same inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from flashattn_testutil import assert_within_bf16

import flashattn_triton
from flashattn_triton import scaled_dot_product_attention, sdpa, sdpa_replaced


def _qkv(b=2, h=4, h_kv=4, n_q=8, n_k=8, d=16, dtype=torch.float32, device="cpu", grad=False):
    g = torch.Generator(device=device).manual_seed(n_q * 31 + n_k + h_kv)
    shapes = ((b, h, n_q, d), (b, h_kv, n_k, d), (b, h_kv, n_k, d))
    return [
        torch.randn(s, generator=g, device=device, dtype=dtype).requires_grad_(grad) for s in shapes
    ]


@pytest.fixture
def on_cuda(monkeypatch):
    """CPU tensors taken as the kernels' device, for ``runs_ours``'s decisions."""
    monkeypatch.setattr(sdpa, "_kernels_run_on", lambda t: True)


def test_exported():
    assert flashattn_triton.scaled_dot_product_attention is scaled_dot_product_attention
    assert sdpa.TORCH_SDPA is F.scaled_dot_product_attention  # (not replaced at import)


def test_plain_calls_run_ours(on_cuda):
    q, k, v = _qkv(dtype=torch.bfloat16)
    assert sdpa.runs_ours(q, k, v)
    assert sdpa.runs_ours(q, k, v, is_causal=True, scale=0.5)
    assert sdpa.runs_ours(q[0], k[0], v[0], is_causal=True)  # 3-D
    assert sdpa.runs_ours(*_qkv(h_kv=2, dtype=torch.bfloat16), enable_gqa=True)
    assert sdpa.runs_ours(*_qkv(n_q=4, dtype=torch.bfloat16))  # non-causal, L != S
    assert sdpa.runs_ours(q.half(), k.half(), v.half(), scale=1)


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"attn_mask": torch.ones(8, 8, dtype=torch.bool)}, "a mask"),
        ({"dropout_p": 0.1}, "dropout"),
        ({"is_causal": 1}, "a causal flag that is not a bool"),
        ({"scale": torch.tensor(0.5)}, "a tensor scale"),
        ({"scale": True}, "a bool scale"),
        ({"scale": 0.0}, "a zero scale (uniform weights in SDPA; refused by ours)"),
        ({"scale": -0.5}, "a negative scale"),
        ({"scale": float("nan")}, "a NaN scale"),
        ({"inputs": {"n_q": 4}, "is_causal": True}, "causal with L != S (top-left in SDPA)"),
        ({"inputs": {"h_kv": 2}}, "fewer k / v heads without enable_gqa"),
        ({"inputs": {"h_kv": 3}, "enable_gqa": True}, "k / v heads not dividing q's"),
        ({"inputs": {"dtype": torch.float32}}, "float32"),
        ({"inputs": {"d": 256}}, "head dim over 128"),
        ({"inputs": {"n_k": 0}}, "no keys"),
        ({"value_dim": 8}, "another value head dim"),
        ({"broadcast": True}, "broadcast batch dims"),
        ({"rank": 5}, "rank 5"),
    ],
)
def test_other_calls_are_torchs(on_cuda, change, why):
    change = dict(change)
    q, k, v = _qkv(**{"dtype": torch.bfloat16, **change.pop("inputs", {})})
    if change.pop("value_dim", None):
        v = v[..., :8]
    if change.pop("broadcast", None):
        k, v = k[:1], v[:1]
    rank = change.pop("rank", None)
    if rank:
        q, k, v = q[None], k[None], v[None]
    assert not sdpa.runs_ours(q, k, v, **change), why


def test_cpu_calls_are_torchs(monkeypatch):
    """Off CUDA every call is torch's SDPA with the arguments as given, bit for bit."""
    monkeypatch.setattr(sdpa, "flash_attention", None)  # would raise if called
    q, k, v = _qkv(n_q=6)
    mask = torch.rand(6, 8) > 0.3
    for kwargs in ({}, {"is_causal": True}, {"attn_mask": mask}, {"scale": 0.2}):
        assert torch.equal(
            scaled_dot_product_attention(q, k, v, **kwargs),
            F.scaled_dot_product_attention(q, k, v, **kwargs),
        )
    q, k, v = _qkv(h_kv=2)
    assert torch.equal(
        scaled_dot_product_attention(q, k, v, enable_gqa=True),
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
    )


@pytest.mark.parametrize(
    "case",
    [
        {"is_causal": True},
        {"scale": 0.3},
        {"is_causal": True, "scale": 2},
        {"inputs": {"n_q": 5}},
        {"inputs": {"h_kv": 2}, "enable_gqa": True, "is_causal": True},
        {"rank": 3, "is_causal": True},
    ],
)
def test_our_path_means_what_sdpa_means(monkeypatch, case):
    """The arguments ``runs_ours`` accepts mean the same to ``flash_attention`` as to SDPA
    (scale, causal, grouped heads, 3-D): our path forced on CPU float32 (the package's torch
    backend) against torch's SDPA, outputs and gradients."""
    case = dict(case)
    calls = []

    def counted(*args):
        calls.append(args)
        return flashattn_triton.flash_attention(*args)

    monkeypatch.setattr(sdpa, "runs_ours", lambda *a, **kw: True)
    monkeypatch.setattr(sdpa, "flash_attention", counted)
    q, k, v = _qkv(grad=True, **case.pop("inputs", {}))
    if case.pop("rank", None) == 3:
        q, k, v = (t.detach()[0].requires_grad_() for t in (q, k, v))
    do = torch.randn(q.shape)
    out = scaled_dot_product_attention(q, k, v, **case)
    ref = F.scaled_dot_product_attention(q, k, v, **case)
    assert len(calls) == 1
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    grads = torch.autograd.grad(out, (q, k, v), do)
    refs = torch.autograd.grad(ref, (q, k, v), do)
    for a, r in zip(grads, refs):
        torch.testing.assert_close(a, r, atol=5e-5, rtol=1e-4)


def test_sdpa_replaced_compiles_in_one_graph(monkeypatch):
    """dynamo traces the swap and the drop-in inside a compiled function (no graph break)."""
    monkeypatch.setattr(sdpa, "_kernels_run_on", lambda t: True)
    monkeypatch.setattr(sdpa, "DTYPES", (*sdpa.DTYPES, torch.float32))

    def attend(q, k, v):
        with sdpa_replaced():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True) * 2

    q, k, v = _qkv()
    out = torch.compile(attend, fullgraph=True, backend="eager")(q, k, v)
    torch.testing.assert_close(out, 2 * sdpa.TORCH_SDPA(q, k, v, is_causal=True))
    assert F.scaled_dot_product_attention is sdpa.TORCH_SDPA


def test_sdpa_replaced_restores_torchs():
    original = F.scaled_dot_product_attention
    with sdpa_replaced():
        assert F.scaled_dot_product_attention is scaled_dot_product_attention
        q, k, v = _qkv()
        # (CPU: torch's own underneath, not ours calling itself)
        assert torch.equal(F.scaled_dot_product_attention(q, k, v), original(q, k, v))
    assert F.scaled_dot_product_attention is original
    with pytest.raises(RuntimeError, match="inside"), sdpa_replaced():
        raise RuntimeError("inside")
    assert F.scaled_dot_product_attention is original


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("h", "h_kv", "n", "d", "causal"),
    [(8, 8, 1024, 64, True), (16, 4, 512, 128, True), (4, 4, 777, 64, False)],
)
def test_matches_torch_sdpa_on_gpu(monkeypatch, h, h_kv, n, d, causal):
    """On CUDA bf16 the drop-in runs our kernels (counted) and agrees with torch's SDPA,
    outputs and gradients, within bf16 rounding."""
    calls = []

    def counted(*args):
        calls.append(args)
        return flashattn_triton.flash_attention(*args)

    monkeypatch.setattr(sdpa, "flash_attention", counted)
    q, k, v = _qkv(2, h, h_kv, n, n, d, torch.bfloat16, "cuda", grad=True)
    do = torch.randn_like(q)
    kwargs = {"is_causal": causal, "enable_gqa": h != h_kv}
    for _ in range(3):  # later calls through the C++ launch path, where it is built
        out = scaled_dot_product_attention(q, k, v, **kwargs)
        grads = torch.autograd.grad(out, (q, k, v), do)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kwargs)
    refs = torch.autograd.grad(ref, (q, k, v), do.float())
    assert len(calls) == 3
    assert_within_bf16((out, *grads), (ref, *refs))


def test_autocast_calls_take_the_autocast_dtype(on_cuda, monkeypatch):
    """Under autocast SDPA runs in the autocast dtype; so does the drop-in: float32 q and k
    with a bf16 v (a float32 model's RoPE under bf16 autocast) take our path in bf16, and
    the gradients reach the float32 inputs in float32. Without autocast the same call is
    torch's (float32 is not ours)."""
    calls = []

    def recorded(q, k, v, causal, scale):
        calls.append((q.dtype, k.dtype, v.dtype))
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)

    monkeypatch.setattr(sdpa, "flash_attention", recorded)
    q, k, v = _qkv(grad=True)
    v_bf16 = v.detach().bfloat16().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = scaled_dot_product_attention(q, k, v_bf16, is_causal=True)
        ref = F.scaled_dot_product_attention(q, k, v_bf16, is_causal=True)
    assert calls == [(torch.bfloat16,) * 3]
    assert out.dtype == ref.dtype == torch.bfloat16
    assert torch.equal(out, ref)
    dq, dv = torch.autograd.grad(out.float().sum(), (q, v_bf16))
    assert (dq.dtype, dv.dtype) == (torch.float32, torch.bfloat16)
    scaled_dot_product_attention(q, k, v, is_causal=True)
    assert len(calls) == 1


def test_blocks_count_their_calls(on_cuda, monkeypatch):
    """``sdpa_replaced()`` yields the block's counts: eager calls that ran ours and calls
    that went to torch; a nested block's calls count in the outer block too."""
    monkeypatch.setattr(sdpa, "flash_attention", lambda q, k, v, causal, scale: q)
    q, k, v = _qkv(dtype=torch.bfloat16)
    with sdpa_replaced() as outer:
        F.scaled_dot_product_attention(q, k, v)
        with sdpa_replaced() as inner:
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
            F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, attn_mask=None, scale=0.5)
            F.scaled_dot_product_attention(q.float(), k.float(), v.float())  # torch's
        assert (inner.ours, inner.torch) == (2, 1)
        F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(8, 8, dtype=torch.bool))
    assert (outer.ours, outer.torch) == (3, 2)
    assert sdpa._OPEN == []
    scaled_dot_product_attention(q, k, v)  # outside any block: counted nowhere
    assert (outer.ours, outer.torch) == (3, 2)


def test_counting_compiles_in_one_graph(on_cuda, monkeypatch):
    """Counting adds no graph break; a compiled graph's calls are not counted."""
    monkeypatch.setattr(sdpa, "DTYPES", (*sdpa.DTYPES, torch.float32))

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True) * 2

    q, k, v = _qkv()
    compiled = torch.compile(attend, fullgraph=True, backend="eager")
    with sdpa_replaced() as calls:
        for _ in range(2):
            out = compiled(q, k, v)
        attend(q, k, v)
    torch.testing.assert_close(out, 2 * sdpa.TORCH_SDPA(q, k, v, is_causal=True))
    assert (calls.ours, calls.torch) == (1, 0)


@pytest.mark.gpu
def test_autocast_calls_run_ours_on_gpu(monkeypatch):
    """CUDA autocast, float32 q and k with a bf16 v (a float32 model's RoPE): our kernels in
    bf16, counted, against torch's SDPA under the same autocast."""
    q, k, v = _qkv(2, 8, 8, 512, 512, 64, torch.float32, "cuda", grad=True)
    v = v.detach().bfloat16().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16), sdpa_replaced() as calls:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        ref = sdpa.TORCH_SDPA(q, k, v, is_causal=True)
    assert (calls.ours, calls.torch) == (1, 0)
    assert out.dtype == ref.dtype == torch.bfloat16
    grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    refs = torch.autograd.grad(ref.float().sum(), (q, k, v))
    assert [a.dtype for a in (out, *grads)] == [r.dtype for r in (ref, *refs)]
    assert_within_bf16((out, *grads), (ref, *refs))
