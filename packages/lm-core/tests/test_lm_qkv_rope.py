"""The q/k/v split with RoPE (`lm_core.qkv_rope`): the Triton kernels in Triton's interpreter
against a float64 reference (q, k, v and dqkv), at awkward sizes (a head dim that is not a
power of two, grouped-query heads, one token, strided gradients, outputs left out of the
loss); the plain path is the model's RoPE; errors name the argument."""

from __future__ import annotations

import pytest
import torch

from lm_core.model import RotaryEmbedding
from lm_core.qkv_rope import _why_not, split_rotate, split_rotate_reference

INTERPRETER = pytest.mark.skipif(
    bool(_why_not("cpu")), reason="the kernels need TRITON_INTERPRET=1 and triton here"
)


def _tables(head_dim, context=16):
    rope = RotaryEmbedding(head_dim, context, 10000.0)
    return rope.cos, rope.sin


@INTERPRETER
@pytest.mark.parametrize(
    ("b", "t", "n_q", "n_kv", "d"), [(2, 5, 3, 3, 8), (1, 1, 4, 1, 80), (2, 3, 6, 2, 16)]
)
def test_kernels_match_float64(b, t, n_q, n_kv, d):
    gen = torch.Generator().manual_seed(b * 100 + t * 10 + d)
    cos, sin = _tables(d)
    qkv = torch.randn(b, t, n_q + 2 * n_kv, d, generator=gen, requires_grad=True)
    outs = split_rotate(qkv, cos, sin, n_q, n_kv, backend="triton")
    grads_out = [torch.randn(o.shape, generator=gen) for o in outs]
    # strided incoming gradients, as attention's transposed ones are
    grads_out = [g.transpose(1, 2).contiguous().transpose(1, 2) for g in grads_out]
    (dqkv,) = torch.autograd.grad(outs, qkv, grads_out)
    q64 = qkv.detach().double().requires_grad_()
    ref = split_rotate_reference(q64, cos.double(), sin.double(), n_q, n_kv)
    (dref,) = torch.autograd.grad(ref, q64, [g.double() for g in grads_out])
    for o, r in zip(outs, ref):
        assert o.shape == r.shape
        torch.testing.assert_close(o.double(), r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dqkv.double(), dref, rtol=1e-5, atol=1e-5)


@INTERPRETER
def test_outputs_left_out_of_the_loss_get_zero_gradients():
    cos, sin = _tables(8)
    qkv = torch.randn(1, 4, 4, 8, requires_grad=True)  # n_q 2, n_kv 1
    q = split_rotate(qkv, cos, sin, 2, 1, backend="triton")[0]
    (dqkv,) = torch.autograd.grad(q.sum(), qkv)
    q64 = qkv.detach().double().requires_grad_()
    (dref,) = torch.autograd.grad(split_rotate_reference(q64, cos, sin, 2, 1)[0].sum(), q64)
    torch.testing.assert_close(dqkv.double(), dref, rtol=1e-5, atol=1e-5)
    assert dqkv[:, :, 2:].abs().max() == 0


@INTERPRETER
def test_kernels_take_a_strided_qkv():
    cos, sin = _tables(8)
    base = torch.randn(2, 3, 5, 8, 2)
    qkv = base[..., 0]  # last stride 2: copied first
    outs = split_rotate(qkv, cos, sin, 3, 1, backend="triton")
    for o, r in zip(outs, split_rotate_reference(qkv, cos, sin, 3, 1)):
        torch.testing.assert_close(o, r, rtol=1e-6, atol=1e-6)


def test_plain_path_is_the_models_rope():
    cos, sin = _tables(16)
    rope = RotaryEmbedding(16, 16, 10000.0)
    qkv = torch.randn(2, 7, 8, 16)
    q, k, v = split_rotate(qkv, cos, sin, 4, 2)  # CPU "auto": the plain ops
    qk = rope(qkv[:, :, :6])
    assert torch.equal(q, qk[:, :, :4])
    assert torch.equal(k, qk[:, :, 4:])
    assert torch.equal(v, qkv[:, :, 6:])


def test_errors_name_the_argument():
    cos, sin = _tables(8)
    with pytest.raises(ValueError, match="qkv: expected"):
        split_rotate(torch.randn(1, 2, 5, 8), cos, sin, 2, 2)
    with pytest.raises(ValueError, match="n_q, n_kv"):
        split_rotate(torch.randn(1, 2, 4, 8), cos, sin, 4, 0)
    with pytest.raises(ValueError, match="cos, sin"):
        split_rotate(torch.randn(1, 20, 4, 8), cos, sin, 2, 1)
    with pytest.raises(ValueError, match="backend must be"):
        split_rotate(torch.randn(1, 2, 4, 8), cos, sin, 2, 1, backend="gpu")
    with pytest.raises(TypeError, match="float32 tables"):
        split_rotate(torch.randn(1, 2, 4, 8), cos.double(), sin.double(), 2, 1, backend="triton")


@INTERPRETER
def _counted(fn, key, launches):
    def call(*args):
        launches[key] = launches.get(key, 0) + 1
        return fn(*args)

    return call


def test_model_with_both_kernel_pairs_matches_the_plain_ops(monkeypatch):
    """The model's integration of the q/k/v RoPE, SwiGLU and RMSNorm kernels (CPU,
    interpreter): loss and every gradient against the plain ops, grouped-query heads
    included; every kernel pair is counted as launched."""
    import importlib

    from lm_core import TransformerLM, get_config
    from lm_core import qkv_rope as qkv_rope_module
    from lm_core import rmsnorm as rmsnorm_module
    from lm_core import swiglu as swiglu_module

    launches = {}
    for name in ("qkv_rope_triton", "swiglu_triton", "rmsnorm_triton"):
        kernels = importlib.import_module(f"lm_core.{name}")
        for step in ("forward", "backward"):
            monkeypatch.setattr(
                kernels, step, _counted(getattr(kernels, step), f"{name}.{step}", launches)
            )
    torch.manual_seed(0)
    config = get_config("tiny", context_length=16, num_kv_heads=2)
    model = TransformerLM(config)
    tokens = torch.randint(0, config.vocab_size, (2, 17))
    results = []
    for kernels in (True, False):
        monkeypatch.setitem(qkv_rope_module._RUNNABLE, "cpu", kernels)
        monkeypatch.setitem(swiglu_module._RUNNABLE, "cpu", kernels)
        monkeypatch.setitem(rmsnorm_module._RUNNABLE, "cpu", kernels)
        model.zero_grad(set_to_none=True)
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        if kernels:  # per block one pair for q/k/v, SwiGLU, each norm; the final norm
            layers = config.num_layers
            assert launches == {
                **{f"{m}_triton.{step}": layers for m in ("qkv_rope", "swiglu")
                   for step in ("forward", "backward")},
                **{f"rmsnorm_triton.{step}": 2 * layers + 1 for step in ("forward", "backward")},
            }  # fmt: skip
    (loss_k, grads_k), (loss_t, grads_t) = results
    torch.testing.assert_close(loss_k, loss_t, rtol=1e-5, atol=1e-6)
    for gk, gt in zip(grads_k, grads_t):
        torch.testing.assert_close(gk, gt, rtol=1e-4, atol=1e-6)


def test_dispatch_traces_without_a_graph_break():
    """The "auto" gates (`_triton_util.auto_gate`) are constants to dynamo: the model's
    attention inputs and activation compile as one graph (eager backend: no code generation)."""
    from lm_core.swiglu import swiglu

    cos, sin = _tables(8)

    def step(qkv, h):
        q, k, v = split_rotate(qkv, cos, sin, 2, 1)
        return q.sum() + k.sum() + v.sum() + swiglu(h).sum()

    qkv, h = torch.randn(1, 3, 4, 8), torch.randn(3, 8)
    compiled = torch.compile(step, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(qkv, h), step(qkv, h))
