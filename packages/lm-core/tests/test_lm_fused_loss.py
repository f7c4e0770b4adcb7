"""The fused LM head + cross-entropy against cross_entropy of full logits: loss, dh and dW.

Both chunk steps run here: the PyTorch one always, the Triton kernel in Triton's interpreter
when TRITON_INTERPRET=1 (small fp32 shapes). Shapes are awkward on purpose: N = 37 rows is no
multiple of a chunk, V = 1000 no multiple of a vocab tile.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lm_core import TransformerLM, cross_entropy, fused_linear_cross_entropy, get_config
from lm_core.fused_loss import _fused_forward, _fused_lce_op, _triton_runnable, default_chunk_size

N, D, V = 37, 48, 1000


def _triton_ok() -> bool:
    return _triton_runnable(torch.device("cpu"))[0]


IMPLS = [
    "torch",
    pytest.param(
        "triton",
        marks=pytest.mark.skipif(
            not _triton_ok(), reason="Triton kernel needs TRITON_INTERPRET=1 and triton here"
        ),
    ),
]


def _data(n=N, d=D, v=V, dtype=torch.float32, scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = (torch.randn(n, d, generator=gen, dtype=torch.float64) * scale).to(dtype)
    w = (torch.randn(v, d, generator=gen, dtype=torch.float64) / d**0.5).to(dtype)
    t = torch.randint(0, v, (n,), generator=gen)
    return h.requires_grad_(), w.requires_grad_(), t


def _grads(loss_fn, h, w, t):
    loss = loss_fn(h, w, t)
    dh, dw = torch.autograd.grad(loss, (h, w))
    return loss.detach(), dh, dw


def _reference(h, w, t, ignore_index=-100):
    """float64 loss and gradients of F.cross_entropy on the full logits."""
    h64 = h.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    return _grads(
        lambda a, b, c: F.cross_entropy(a @ b.T, c, ignore_index=ignore_index), h64, w64, t
    )


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("chunk_size", [None, 16, 5, 37])
def test_matches_full_logits_fp32(impl, chunk_size):
    h, w, t = _data()
    ours = _grads(
        lambda a, b, c: fused_linear_cross_entropy(a, b, c, chunk_size=chunk_size, backend=impl),
        h,
        w,
        t,
    )
    same_precision = _grads(lambda a, b, c: cross_entropy(a @ b.T, c), h, w, t)
    ref = _reference(h, w, t)
    for name, a, b, r in zip(("loss", "dh", "dw"), ours, same_precision, ref):
        assert a.dtype == b.dtype == (torch.float32 if name == "loss" else h.dtype)
        # fp32 against fp64: within twice the error of the unfused fp32 path, plus fp32 eps
        err, err_torch = (a.double() - r).abs().max(), (b.double() - r).abs().max()
        assert err <= 2 * err_torch + 1e-6 * r.abs().max(), (name, err, err_torch)


def test_triton_kernel_with_small_vocab_tiles():
    """The kernel alone against the PyTorch chunk step: 16 or 8 vocab tiles per row (the last
    one ragged), or one tile wider than the row."""
    if not _triton_ok():
        pytest.skip("Triton kernel needs TRITON_INTERPRET=1 and triton here")
    from lm_core import fused_loss_triton

    h, w, t = _data()
    logits = (h @ w.T).detach()
    scale = torch.tensor(1.0 / N)
    for block_v in (64, 128, 1024):
        got = logits.clone()
        loss, lse = fused_loss_triton.ce_chunk(got, t, -100, scale, True, block_v=block_v)
        want = logits.clone()
        loss_ref, lse_ref = _ce_torch(want, t, scale)
        torch.testing.assert_close(lse, lse_ref, rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(loss, loss_ref, rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-8)


def _ce_torch(logits, t, scale):
    from lm_core.fused_loss import ce_chunk_torch

    return ce_chunk_torch(logits, t, -100, scale, True)


def test_float64_torch_backend():
    h, w, t = _data(dtype=torch.float64)
    ours = _grads(lambda a, b, c: fused_linear_cross_entropy(a, b, c, chunk_size=8), h, w, t)
    ref = _reference(h, w, t)
    assert ours[1].dtype == ours[2].dtype == torch.float64
    # the loss comes back in fp32 (like cross_entropy); gradients stay in fp64
    torch.testing.assert_close(ours[0].double(), ref[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ours[1], ref[1], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ours[2], ref[2], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("impl", IMPLS)
def test_ignore_index(impl):
    h, w, t = _data()
    t = t.clone()
    t[::3] = -100
    t[1] = 7  # any id counts as long as it is not ignore_index
    ours = _grads(
        lambda a, b, c: fused_linear_cross_entropy(a, b, c, chunk_size=16, backend=impl),
        h,
        w,
        t,
    )
    ref = _reference(h, w, t)
    for a, r in zip(ours, ref):
        torch.testing.assert_close(a.double(), r, rtol=1e-5, atol=1e-6)
    assert (ours[1][::3] == 0).all()  # ignored rows get no gradient
    t_other = t.clone()
    t_other[t_other == -100] = 5
    t_other[::3] = 5
    ours5 = fused_linear_cross_entropy(h, w, t_other, ignore_index=5, backend=impl)
    ref5 = F.cross_entropy((h @ w.T).double(), t_other, ignore_index=5)
    torch.testing.assert_close(ours5.double(), ref5, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_all_ignored_gives_zero_not_nan(impl):
    h, w, t = _data()
    t = torch.full_like(t, -100)
    loss, dh, dw = _grads(
        lambda a, b, c: fused_linear_cross_entropy(a, b, c, backend=impl), h, w, t
    )
    assert loss.item() == 0.0
    assert (dh == 0).all()
    assert (dw == 0).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_huge_logits_stay_finite(impl):
    # logits ~ 1e4: a naive exp overflows; the online log-sum-exp does not
    h, w, t = _data(scale=1.5e4 / 7)
    logits = h.detach() @ w.detach().T
    assert logits.abs().max() > 5e3
    assert not torch.isfinite(torch.exp(logits)).all()
    loss, dh, dw = _grads(
        lambda a, b, c: fused_linear_cross_entropy(a, b, c, chunk_size=16, backend=impl),
        h,
        w,
        t,
    )
    ref = _reference(h, w, t)
    assert torch.isfinite(loss)
    assert torch.isfinite(dh).all()
    assert torch.isfinite(dw).all()
    # fp32 logits of size 1e4 carry absolute rounding ~1e-3
    torch.testing.assert_close(loss.double(), ref[0], rtol=1e-5, atol=1e-2)
    torch.testing.assert_close(dh.double(), ref[1], rtol=1e-3, atol=1e-3 * ref[1].abs().max())
    torch.testing.assert_close(dw.double(), ref[2], rtol=1e-3, atol=1e-3 * ref[2].abs().max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(dtype):
    """16-bit h and W: fp32 loss, gradients in the input dtype, as accurate as the unfused
    16-bit path (logits rounded to 16 bits, softmax in fp32) against an fp64 reference."""
    h, w, t = _data(dtype=dtype)
    ours = _grads(lambda a, b, c: fused_linear_cross_entropy(a, b, c, chunk_size=16), h, w, t)
    unfused = _grads(lambda a, b, c: cross_entropy(a @ b.T, c), h, w, t)
    ref = _reference(h, w, t)
    assert ours[0].dtype == torch.float32
    assert ours[1].dtype == ours[2].dtype == dtype
    for a, b, r in zip(ours, unfused, ref):
        err, err_torch = (a.double() - r).abs().max(), (b.double() - r).abs().max()
        # dW: per-chunk 16-bit partial products summed in fp32 here (CPU has no fp32-output
        # GEMM for 16-bit inputs), one GEMM there
        assert err <= 2 * err_torch + 2e-3 * r.abs().max(), (err, err_torch)


def test_autocast_matches_autocast_linear():
    """fp32 h and W under bf16 autocast: computed in bf16 like F.linear, fp32 gradients."""
    h, w, t = _data()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = _grads(lambda a, b, c: fused_linear_cross_entropy(a, b, c, chunk_size=16), h, w, t)
        unfused = _grads(lambda a, b, c: cross_entropy(F.linear(a, b), c), h, w, t)
    assert ours[1].dtype == ours[2].dtype == torch.float32
    ref = _reference(h, w, t)
    for a, b, r in zip(ours, unfused, ref):
        err, err_torch = (a.double() - r).abs().max(), (b.double() - r).abs().max()
        assert err <= 2 * err_torch + 1e-6, (err, err_torch)


def test_incoming_gradient_scales_and_partial_requires_grad():
    h, w, t = _data()
    base = _grads(fused_linear_cross_entropy, h, w, t)
    (3.0 * fused_linear_cross_entropy(h, w, t)).backward()
    torch.testing.assert_close(h.grad, 3 * base[1])
    torch.testing.assert_close(w.grad, 3 * base[2])
    # only the weight needs a gradient (frozen input), then only the input
    (dw,) = torch.autograd.grad(fused_linear_cross_entropy(h.detach(), w, t), (w,))
    torch.testing.assert_close(dw, base[2])
    (dh,) = torch.autograd.grad(fused_linear_cross_entropy(h, w.detach(), t), (h,))
    torch.testing.assert_close(dh, base[1])
    with torch.no_grad():
        loss = fused_linear_cross_entropy(h, w, t)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, base[0])


def test_leading_dims_and_no_grad_path_compute_no_gradients():
    h, w, t = _data(n=24)
    loss3d = fused_linear_cross_entropy(h.view(2, 12, D), w, t.view(2, 12))
    torch.testing.assert_close(loss3d, fused_linear_cross_entropy(h, w, t))
    out = _fused_lce_op(h.detach(), w.detach(), t, -100, 8, torch.float32, False, False, "torch")
    assert out[1].numel() == 0
    assert out[2].numel() == 0


def test_second_backward_is_refused_clearly():
    h, w, t = _data()
    loss = fused_linear_cross_entropy(h, w, t)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


@pytest.mark.parametrize("impl", IMPLS)
def test_out_of_range_target_is_nan_where_unchecked(impl):
    """Off CPU the values are not checked (that would sync): the kernel yields NaN, not a
    plausible number. Called below the check, directly."""
    h, w, t = _data()
    t = t.clone()
    t[4] = V + 3
    loss, dh, _dw = _fused_forward(
        h.detach(), w.detach(), t, -100, 16, torch.float32, True, True, impl
    )
    assert torch.isnan(loss)
    assert torch.isnan(dh[4]).all()


def test_validation_names_the_argument():
    h, w, t = _data()
    f = fused_linear_cross_entropy
    with pytest.raises(ValueError, match=r"weight: expected shape \(V, 48\)"):
        f(h, w[:, :10], t)
    with pytest.raises(ValueError, match=r"targets: expected shape \(37,\)"):
        f(h, w, t[:5])
    with pytest.raises(TypeError, match="targets: expected an integer dtype"):
        f(h, w, t.float())
    with pytest.raises(TypeError, match=r"weight: expected dtype torch\.float32"):
        f(h, w.double(), t)
    with pytest.raises(TypeError, match="h: expected a floating tensor"):
        f(t, w, t)
    with pytest.raises(ValueError, match="must be on one device"):
        f(h, w.to("meta"), t)
    with pytest.raises(ValueError, match=r"targets: values must lie in \[0, V=1000\)"):
        f(h, w, torch.full_like(t, 1000))
    with pytest.raises(ValueError, match="targets: values"):
        f(h, w, torch.full_like(t, -1))
    with pytest.raises(ValueError, match="chunk_size"):
        f(h, w, t, chunk_size=0)
    with pytest.raises(ValueError, match="backend"):
        f(h, w, t, backend="cuda")
    with pytest.raises(TypeError, match="ignore_index"):
        f(h, w, t, ignore_index=1.5)
    with pytest.raises(TypeError, match="backend='triton' computes in"):
        f(h.double(), w.double(), t, backend="triton")


def test_triton_backend_on_cpu_without_interpreter_says_how_to_fix(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    h, w, t = _data()
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        fused_linear_cross_entropy(h, w, t, backend="triton")
    # "auto" falls back to the PyTorch chunk step
    fused_linear_cross_entropy(h, w, t, backend="auto").backward()


def test_default_chunk_size():
    assert default_chunk_size(37, 48, 1000) == 37  # at most N
    assert default_chunk_size(65536, 4096, 151936) == 1792  # ~N*D/V, multiple of 256
    assert default_chunk_size(10_000, 64, 256) == 2560
    assert default_chunk_size(0, 8, 8) == 1


def test_opcheck():
    """Schema, fake (meta) implementation, autograd registration and AOT dispatch agree."""
    h, w, t = _data(n=9, v=50)
    for need_dh, need_dw in ((True, True), (False, True)):
        args = (h, w, t, -100, 4, torch.float32, need_dh, need_dw, "torch")
        torch.library.opcheck(_fused_lce_op, args)


def test_compile_fullgraph_forward_backward():
    """No graph break: the loss is one custom op node; aot_eager also traces the backward."""
    h, w, t = _data()

    def fn(a, b, c):
        return fused_linear_cross_entropy(a, b, c, chunk_size=16) * 2

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    got = _grads(compiled, h, w, t)
    want = _grads(fn, h, w, t)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    torch._dynamo.reset()


def test_model_loss_equals_cross_entropy_of_logits():
    torch.manual_seed(0)
    model = TransformerLM(get_config("tiny"))
    ids = torch.randint(0, 256, (2, 17))
    x, y = ids[:, :-1], ids[:, 1:]
    fused = model(x, y)
    fused.backward()
    g_fused = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    plain = cross_entropy(model(x), y)
    plain.backward()
    torch.testing.assert_close(fused, plain, rtol=1e-6, atol=1e-6)
    for a, p in zip(g_fused, model.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="targets: expected shape"):
        model(x, y[:, :3])
    assert model(x).shape == (2, 16, 256)  # logits without targets, as before


def test_fused_loss_runs_inside_the_lm_head_module_call():
    # Wrappers that gather sharded weights in module hooks (zero_shard.FSDP, fully_shard on
    # the head) must see the head's weight used: the loss is computed in lm_head's call.
    from lm_core.model import LMHead

    model = TransformerLM(get_config("tiny"))
    assert isinstance(model.lm_head, LMHead)
    assert isinstance(model.lm_head, torch.nn.Linear)  # and a Linear, as before
    assert list(model.state_dict())[-2:] == ["ln_final.weight", "lm_head.weight"]
    calls = []
    model.lm_head.register_forward_pre_hook(lambda m, args: calls.append(len(args)))
    model.lm_head.register_forward_hook(lambda m, args, out: calls.append(tuple(out.shape)))
    ids = torch.randint(0, 256, (2, 9))
    loss = model(ids[:, :-1], ids[:, 1:])
    assert calls == [2, ()]  # (h, targets) in, the 0-dim loss out
    h = model.hidden_states(ids[:, :-1])
    torch.testing.assert_close(
        loss, fused_linear_cross_entropy(h, model.lm_head.weight, ids[:, 1:])
    )
    calls.clear()
    assert model(ids).shape == (2, 9, 256)
    assert calls == [2, (2, 9, 256)]  # (h, None) in, logits out
