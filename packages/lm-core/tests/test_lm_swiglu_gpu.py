"""The SwiGLU kernels on CUDA at the xl model's size (run by `nox -s gpu_tests`): against a
float64 reference within 2x the error of the plain bf16 / fp32 expression, inside a compiled
block with no graph break (the kernels appear in inductor's code), and the model's loss and
gradients against the plain expression's."""

from __future__ import annotations

import pytest
import torch

from lm_core import TransformerLM, get_config
from lm_core import swiglu as swiglu_module
from lm_core.swiglu import swiglu, swiglu_reference

pytestmark = pytest.mark.gpu

ROWS, F = 2048, 6400  # xl: batch 4 x 512 tokens, d_ff 6400


def _errors(h, dy, backend):
    """max |y - y64|, max |dh - dh64| of one backend against float64."""
    h64 = h.detach().double().requires_grad_()
    y64 = swiglu_reference(h64)
    (dh64,) = torch.autograd.grad(y64, h64, dy.double())
    hb = h.detach().requires_grad_()
    y = swiglu(hb, backend=backend)
    (dh,) = torch.autograd.grad(y, hb, dy)
    return (y.double() - y64).abs().max().item(), (dh.double() - dh64).abs().max().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernels_within_twice_the_plain_error(dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    h = (torch.randn(ROWS, 2 * F, device="cuda", generator=gen) * 2).to(dtype)
    dy = torch.randn(ROWS, F, device="cuda", generator=gen).to(dtype)
    ours = _errors(h, dy, "triton")
    plain = _errors(h, dy, "torch")
    floor = torch.finfo(dtype).eps
    for o, p in zip(ours, plain):
        assert o <= 2 * p + floor, (ours, plain)


def test_auto_uses_the_kernels_on_cuda():
    h = torch.randn(4, 2 * 96, device="cuda")
    assert swiglu_module._triton_runs("cuda")
    torch.testing.assert_close(swiglu(h), swiglu(h, backend="triton"), rtol=0, atol=0)


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
    assert "swiglu_fwd_kernel" in text
    assert "swiglu_bwd_kernel" in text
    torch.testing.assert_close(out, eager, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dx, eager_dx, rtol=1e-4, atol=1e-4)


def test_model_loss_and_grads_match_the_plain_expression(monkeypatch):
    torch.manual_seed(0)
    model = TransformerLM(get_config("small", context_length=128)).cuda()
    tokens = torch.randint(0, model.config.vocab_size, (4, 129), device="cuda")
    results = []
    for runs in (True, False):
        monkeypatch.setitem(swiglu_module._RUNNABLE, "cuda", runs)
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
