"""The q/k/v split with RoPE on CUDA at real sizes (run by `nox -s gpu_tests`): against a
float64 reference within 2x the error of the plain ops, inside a compiled block with no graph
break (the kernels appear in inductor's code), and the model's loss and gradients against
the plain path's."""

from __future__ import annotations

import pytest
import torch

from lm_core import TransformerLM, get_config
from lm_core import qkv_rope as qkv_rope_module
from lm_core.model import RotaryEmbedding
from lm_core.qkv_rope import split_rotate, split_rotate_reference

pytestmark = pytest.mark.gpu

SHAPES = [  # (B, T, n_q, n_kv, Dh): xl, 2.7B (Dh 80), 8B-like grouped-query heads
    (4, 512, 25, 25, 64),
    (4, 512, 32, 32, 80),
    (1, 2048, 32, 8, 128),
]


def _errors(qkv, cos, sin, n_q, n_kv, grads, backend):
    x = qkv.detach().requires_grad_()
    outs = split_rotate(x, cos, sin, n_q, n_kv, backend=backend)
    (dx,) = torch.autograd.grad(outs, x, grads)
    x64 = qkv.detach().double().requires_grad_()
    ref = split_rotate_reference(x64, cos.double(), sin.double(), n_q, n_kv)
    (d64,) = torch.autograd.grad(ref, x64, [g.double() for g in grads])
    out_err = max((o.double() - r).abs().max().item() for o, r in zip(outs, ref))
    return out_err, (dx.double() - d64).abs().max().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernels_within_twice_the_plain_error(shape, dtype):
    b, t, n_q, n_kv, d = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    rope = RotaryEmbedding(d, t, 10000.0).cuda()
    qkv = torch.randn(b, t, n_q + 2 * n_kv, d, device="cuda", generator=gen).to(dtype)
    # the attention's gradients arrive transposed: (B, heads, T, Dh) memory
    grads = [
        torch.randn(b, h, t, d, device="cuda", generator=gen).to(dtype).transpose(1, 2)
        for h in (n_q, n_kv, n_kv)
    ]
    ours = _errors(qkv, rope.cos, rope.sin, n_q, n_kv, grads, "triton")
    plain = _errors(qkv, rope.cos, rope.sin, n_q, n_kv, grads, "torch")
    floor = torch.finfo(dtype).eps
    for o, p in zip(ours, plain):
        assert o <= 2 * p + floor, (ours, plain)


def test_compiled_block_has_no_graph_break_and_runs_the_kernels():
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    model = TransformerLM(get_config("small", context_length=64)).cuda()
    block = model.layers[0]
    x = torch.randn(2, 64, model.config.d_model, device="cuda", requires_grad=True)
    eager = block(x)
    (eager_dx,) = torch.autograd.grad(eager.sum(), x)
    compiled = torch.compile(block, fullgraph=True)

    def step():
        out = compiled(x)
        (dx,) = torch.autograd.grad(out.sum(), x)
        return out, dx

    (out, dx), code = run_and_get_code(step)
    text = "\n".join(code)
    assert "qkv_rope_fwd_kernel" in text
    assert "qkv_rope_bwd_kernel" in text
    torch.testing.assert_close(out, eager, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dx, eager_dx, rtol=1e-4, atol=1e-4)


def test_model_loss_and_grads_match_the_plain_path(monkeypatch):
    torch.manual_seed(0)
    model = TransformerLM(get_config("small", context_length=128)).cuda()
    tokens = torch.randint(0, model.config.vocab_size, (4, 129), device="cuda")
    results = []
    for runs in (True, False):
        monkeypatch.setitem(qkv_rope_module._RUNNABLE, "cuda", runs)
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (loss_k, grads_k), (loss_t, grads_t) = results
    torch.testing.assert_close(loss_k, loss_t, rtol=2e-3, atol=2e-3)
    for gk, gt in zip(grads_k, grads_t):
        scale = gt.abs().max().item() + 1e-6
        assert (gk - gt).abs().max().item() <= 0.05 * scale
