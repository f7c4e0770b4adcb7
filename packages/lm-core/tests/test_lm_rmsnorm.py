"""RMSNorm with the residual add (`lm_core.rmsnorm`): the Triton kernels in Triton's
interpreter against a float64 reference (forward, the sum, and the gradients of x, the
residual and the weight) at awkward widths and mixed dtypes; gradients through one output
only; strided and empty inputs; the model's norms (`RMSNorm`, `add_forward`) and the
backend rules and errors."""

from __future__ import annotations

import os

import pytest
import torch

from lm_core._triton_util import why_kernels_cannot_run
from lm_core.rmsnorm import _MAX_D, rms_norm, rms_norm_reference

INTERPRETER = pytest.mark.skipif(
    bool(why_kernels_cannot_run("cpu", "rmsnorm_triton")),
    reason="the kernels need TRITON_INTERPRET=1 and triton here",
)
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def _run(x, r, w, out_dtype, dy, ds, backend):
    """(y, s, dx, dr, dw) of one call of `rms_norm`; s and dr None without r."""
    leaves = [t.detach().requires_grad_() for t in (x, w) + (() if r is None else (r,))]
    rb = leaves[2] if r is not None else None
    res = rms_norm(leaves[0], leaves[1], 1e-5, residual=rb, out_dtype=out_dtype, backend=backend)
    y, s = (res, None) if r is None else (res[1], res[0])
    outs, grads_out = [y], [dy.to(y.dtype)]
    if s is not None:
        outs.append(s)
        grads_out.append(ds.to(s.dtype))
    grads = torch.autograd.grad(outs, leaves, grads_out)
    return y, s, grads[0], grads[2] if r is not None else None, grads[1]


def _reference(s, w, dy, ds):
    """float64 (y, gradient reaching s, dw) of the norm at the rows s as a call stored them
    (interpreted Triton truncates to bf16 where CUDA rounds to nearest)."""
    s64 = s.detach().double().requires_grad_()
    w64 = w.double().requires_grad_()
    y = rms_norm_reference(s64, w64, 1e-5)
    d_s, dw = torch.autograd.grad(y, (s64, w64), dy.double())
    return y, d_s if ds is None else d_s + ds.double(), dw


CASES = [  # (rows shape, D, x dtype, residual dtype or None, out_dtype)
    ((3, 5), 100, F32, None, None),
    ((1,), 1, F32, F32, None),
    ((2, 3), 129, F32, F32, None),
    ((7,), 64, F32, BF16, BF16),  # the model under bf16 autocast: fp32 stream, bf16 branch
    ((4,), 33, BF16, F32, F32),
    ((2, 2), 48, F16, BF16, F16),  # both differ from the float32 sum
    ((5,), 17, BF16, None, F32),
    ((6,), 80, BF16, BF16, F32),  # a bf16 sum, normalized as rounded
]


@INTERPRETER
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[1]}-{c[2]}-{c[3]}-{c[4]}")
def test_kernels_match_float64(case):
    shape, d, x_dtype, r_dtype, out_dtype = case
    gen = torch.Generator().manual_seed(d)
    x = (torch.randn(*shape, d, generator=gen) * 2).to(x_dtype)
    r = None if r_dtype is None else torch.randn(*shape, d, generator=gen).to(r_dtype)
    w = torch.rand(d, generator=gen) + 0.5
    dy = torch.randn(*shape, d, generator=gen)
    ds = torch.randn(*shape, d, generator=gen)
    ds = None if r is None else ds
    ours = _run(x, r, w, out_dtype, dy, ds, "triton")
    plain = _run(x, r, w, out_dtype, dy, ds, "torch")
    errors = []
    for y, s, dx, dr, dw in (ours, plain):
        y64, ds64, dw64 = _reference(x if s is None else s, w, dy, ds)
        pairs = [(y, y64), (dx, ds64), (dw, dw64)]
        if s is not None:
            pairs += [(s, x.double() + r.double()), (dr, ds64)]
        errors.append([(t.double() - f).abs().max().item() for t, f in pairs])
        floors = [4 * torch.finfo(t.dtype).eps * max(1.0, f.abs().max().item()) for t, f in pairs]
    for name, o, p, floor in zip(("y", "dx", "dw", "s", "dr"), *errors, floors):
        assert o <= 2 * p + floor, (name, o, p)
    for o, p in zip(ours, plain):
        assert (o is None and p is None) or (o.dtype == p.dtype and o.shape == p.shape)


@INTERPRETER
def test_gradient_through_one_output_only():
    gen = torch.Generator().manual_seed(3)
    x, r = torch.randn(4, 40, generator=gen), torch.randn(4, 40, generator=gen)
    w = torch.rand(40, generator=gen) + 0.5
    for use in ("s", "y"):
        per_backend = []
        for backend in ("triton", "torch"):
            leaves = [t.clone().requires_grad_() for t in (x, r, w)]
            s, y = rms_norm(leaves[0], leaves[2], residual=leaves[1], backend=backend)
            out = (s if use == "s" else y).pow(2).sum()
            grads = torch.autograd.grad(out, leaves, allow_unused=True)
            per_backend.append(grads)
        for g_ours, g_plain in zip(*per_backend):
            if g_plain is None or not g_plain.any():  # the weight when only s is used
                assert g_ours is None or not g_ours.any()
            else:
                torch.testing.assert_close(g_ours, g_plain, rtol=1e-5, atol=1e-5)


@INTERPRETER
@pytest.mark.parametrize("kernels", ["triton", "torch"])
def test_return_sum_passes_x_through(kernels):
    """Without a residual, return_sum gives x itself back and its later gradient joins the
    norm's: the block's residual stream through its first norm."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 4, 24, generator=gen).requires_grad_()
    w = (torch.rand(24, generator=gen) + 0.5).requires_grad_()
    a = torch.randn(3, 4, 24, generator=gen)
    s, y = rms_norm(x, w, return_sum=True, backend=kernels)
    assert s.data_ptr() == x.data_ptr()
    out = (s * a + y.pow(2)).sum()
    dx, dw = torch.autograd.grad(out, (x, w))
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    out64 = (x64 * a.double() + rms_norm_reference(x64, w64, 1e-5).pow(2)).sum()
    dx64, dw64 = torch.autograd.grad(out64, (x64, w64))
    torch.testing.assert_close(dx.double(), dx64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw.double(), dw64, rtol=1e-5, atol=1e-5)


@INTERPRETER
def test_kernels_take_strided_and_empty_inputs():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 30, 2, generator=gen)[..., 0]  # last stride 2
    r = torch.randn(30, 3, generator=gen).t()  # (3, 30), transposed
    w = torch.rand(30, generator=gen) + 0.5
    dy, ds = torch.randn(3, 30, generator=gen), torch.randn(3, 30, generator=gen)
    ours = _run(x, r, w, None, dy, ds, "triton")
    plain = _run(x, r, w, None, dy, ds, "torch")
    for o, p in zip(ours, plain):
        torch.testing.assert_close(o, p, rtol=1e-5, atol=1e-5)
    empty = torch.empty(0, 8, requires_grad=True)
    weight = torch.ones(8, requires_grad=True)
    s, y = rms_norm(empty, weight, residual=torch.empty(0, 8), backend="triton")
    assert s.shape == y.shape == (0, 8)
    dx, dw = torch.autograd.grad(y.sum() + s.sum(), (empty, weight))
    assert dx.shape == (0, 8)
    assert torch.equal(dw, torch.zeros(8))


def test_auto_keeps_cpu_on_torch():
    """On CPU "auto" is the plain ops even under the interpreter, bit for bit."""
    x, r, w = torch.randn(2, 3, 16), torch.randn(2, 3, 16), torch.rand(16)
    assert torch.equal(rms_norm(x, w), rms_norm_reference(x, w, 1e-5))
    s, y = rms_norm(x, w, residual=r, out_dtype=BF16)
    assert torch.equal(s, x + r)
    assert torch.equal(y, rms_norm_reference(x + r, w, 1e-5).to(BF16))


@INTERPRETER
def test_auto_takes_the_plain_ops_past_the_widest_kernel_row(monkeypatch):
    from lm_core import rmsnorm as rmsnorm_module
    from lm_core import rmsnorm_triton

    assert rmsnorm_triton.MAX_D == _MAX_D
    monkeypatch.setitem(rmsnorm_module._RUNNABLE, "cpu", True)
    calls = []
    monkeypatch.setattr(rmsnorm_triton, "forward", lambda *a: calls.append(a) or None)
    wide = torch.randn(2, _MAX_D + 1)
    assert torch.equal(
        rms_norm(wide, torch.ones(_MAX_D + 1)),
        rms_norm_reference(wide, torch.ones(_MAX_D + 1), 1e-5),
    )
    assert not calls


def test_model_norm_is_the_course_norm():
    """`RMSNorm` keeps the course math: fp32 F.rms_norm rounded to the input's dtype, and
    out_dtype rounds that result (what a linear layer under autocast would do)."""
    from lm_core.model import RMSNorm

    norm = RMSNorm(24)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 24, dtype=BF16)
    expect = torch.nn.functional.rms_norm(x.float(), (24,), norm.weight, 1e-5)
    assert torch.equal(norm(x), expect.to(BF16))
    assert torch.equal(norm(x, out_dtype=F32), expect)


@INTERPRETER
def test_decoding_keeps_the_plain_norms_and_activation(monkeypatch):
    """With a KV cache (prefill and decode) the norms and the SwiGLU activation are the plain
    ops even where "auto" runs the kernels; a training forward runs them."""
    from lm_core import TransformerLM, get_config, rmsnorm_triton, swiglu_triton
    from lm_core import rmsnorm as rmsnorm_module
    from lm_core import swiglu as swiglu_module

    calls = {"rmsnorm": 0, "swiglu": 0}
    for name, gate, kernels in (
        ("rmsnorm", rmsnorm_module._RUNNABLE, rmsnorm_triton),
        ("swiglu", swiglu_module._RUNNABLE, swiglu_triton),
    ):
        monkeypatch.setitem(gate, "cpu", True)

        def counted(*args, _name=name, _forward=kernels.forward):
            calls[_name] += 1
            return _forward(*args)

        monkeypatch.setattr(kernels, "forward", counted)
    torch.manual_seed(0)
    model = TransformerLM(get_config("tiny", context_length=16))
    model.generate(torch.randint(0, model.config.vocab_size, (1, 4)), 3, temperature=0)
    assert calls == {"rmsnorm": 0, "swiglu": 0}
    model(torch.randint(0, model.config.vocab_size, (1, 8)))
    layers = model.config.num_layers
    assert calls == {"rmsnorm": 2 * layers + 1, "swiglu": layers}  # + the final norm


def test_add_forward_goes_through_hooks():
    """With a forward hook (tensor parallelism's layouts), add_forward calls the module on
    the sum, so the hook sees it; without one, it is the fused call with the same result."""
    from lm_core.model import RMSNorm

    norm = RMSNorm(8)
    x, r = torch.randn(2, 8), torch.randn(2, 8)
    s_plain, y_plain = norm.add_forward(x, r)
    x_through, y_alone = norm.add_forward(x, None)
    assert x_through is x or x_through.data_ptr() == x.data_ptr()
    assert torch.equal(y_alone, norm(x))
    seen = []
    norm.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    s, y = norm.add_forward(x, r)
    assert len(seen) == 1
    assert torch.equal(seen[0], x + r)
    assert torch.equal(s, s_plain)
    assert torch.equal(y, y_plain)


def test_errors_name_the_argument():
    x, w = torch.randn(2, 8), torch.ones(8)
    with pytest.raises(ValueError, match="weight: expected shape"):
        rms_norm(x, torch.ones(7))
    with pytest.raises(ValueError, match="x: expected at least one dimension"):
        rms_norm(torch.tensor(1.0), w)
    with pytest.raises(ValueError, match="residual: expected"):
        rms_norm(x, w, residual=torch.randn(2, 7))
    with pytest.raises(ValueError, match="backend must be"):
        rms_norm(x, w, backend="cuda")
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        rms_norm(x.double(), w, backend="triton")
    with pytest.raises(TypeError, match="out_dtype"):
        rms_norm(x, w, out_dtype=torch.float64, backend="triton")
    wide = torch.randn(1, _MAX_D + 1)
    with pytest.raises(ValueError, match="at most"):
        rms_norm(wide, torch.ones(_MAX_D + 1), backend="triton")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="checks the refusal")
def test_triton_backend_on_cpu_needs_the_interpreter():
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        rms_norm(torch.randn(2, 4), torch.ones(4), backend="triton")


def test_block_traces_under_autocast_without_a_graph_break():
    """The block asks autocast for the norms' output dtype; that and the "auto" gate trace
    into one graph (eager backend: no code generation)."""
    from lm_core import get_config
    from lm_core.model import TransformerBlock

    torch.manual_seed(0)
    block = TransformerBlock(get_config("tiny", context_length=8))
    x = torch.randn(1, 8, block.ln1.weight.shape[0])
    compiled = torch.compile(block, backend="eager", fullgraph=True)
    with torch.autocast("cpu", dtype=BF16):
        torch.testing.assert_close(compiled(x), block(x))


def _loss_and_grads(model, tokens, autocast: bool):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=BF16, enabled=autocast):
        loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_deferred_residual_add_is_the_same_math(monkeypatch, checkpointed):
    """Each block's last residual add taken by the next block's first norm
    (`model.chain_block`) changes no number: loss and every gradient bit for bit against
    the add at the end of each block, in bf16 autocast (a bf16 branch on an fp32 stream),
    through the plain chain and through checkpointed groups of two."""
    from lm_core import TransformerLM, apply_activation_checkpointing, get_config
    from lm_core import model as model_module

    torch.manual_seed(0)
    config = get_config("tiny", context_length=16, num_layers=3)
    model = TransformerLM(config)
    if checkpointed:
        apply_activation_checkpointing(model, 2)
    tokens = torch.randint(0, config.vocab_size, (2, 17))
    results = []
    for defer in (True, False):
        monkeypatch.setattr(model_module, "DEFER_RESIDUAL_ADD", defer)
        results.append(_loss_and_grads(model, tokens, autocast=True))
    (loss_d, grads_d), (loss_p, grads_p) = results
    assert torch.equal(loss_d, loss_p)
    for gd, gp in zip(grads_d, grads_p):
        assert torch.equal(gd, gp)


@INTERPRETER
def test_deferred_residual_add_runs_in_the_norm_kernels(monkeypatch):
    """With the kernels (interpreter): every block's first norm but the first one's gets the
    previous block's feed-forward output as its residual, and loss and gradients match the
    add at the end of each block."""
    from lm_core import TransformerLM, get_config, rmsnorm_triton
    from lm_core import model as model_module
    from lm_core import rmsnorm as rmsnorm_module

    monkeypatch.setitem(rmsnorm_module._RUNNABLE, "cpu", True)
    residuals = []
    forward = rmsnorm_triton.forward

    def recorded(x, r, *args):
        residuals.append(r is not None)
        return forward(x, r, *args)

    monkeypatch.setattr(rmsnorm_triton, "forward", recorded)
    torch.manual_seed(0)
    config = get_config("tiny", context_length=16, num_layers=3)
    model = TransformerLM(config)
    tokens = torch.randint(0, config.vocab_size, (2, 17))
    results = []
    for defer in (True, False):
        monkeypatch.setattr(model_module, "DEFER_RESIDUAL_ADD", defer)
        residuals.clear()
        results.append(_loss_and_grads(model, tokens, autocast=False))
        # per block (ln1, ln2), then the final norm on the stream the run added up
        expect = [False, True] + [defer, True] * (config.num_layers - 1) + [False]
        assert residuals == expect
    (loss_d, grads_d), (loss_p, grads_p) = results
    torch.testing.assert_close(loss_d, loss_p, rtol=1e-6, atol=1e-7)
    for gd, gp in zip(grads_d, grads_p):
        torch.testing.assert_close(gd, gp, rtol=1e-5, atol=1e-7)
