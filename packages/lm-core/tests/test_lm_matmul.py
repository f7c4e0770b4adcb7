"""The 3xTF32 matmul (`lm_core.matmul`, `lm_core.tf32x3_triton`) on CPU.

The Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1, as CI sets it) at small
awkward shapes: no dimension a multiple of a tile, K not a multiple of 4 (the split buffers'
padding), all four operand layouts. The references are float64 products.
The interpreter's dot is an exact float32 product, so what these tests pin down is the split
(hi + lo = x to 2^-22), the padding, the tiling and masking, and the op's backward; the
tensor cores' own rounding is checked on the GPU (test_lm_matmul_gpu.py).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F

from lm_core import TransformerLM, get_config, load_checkpoint, save_checkpoint
from lm_core.matmul import Linear, tf32x3_mm


def _interpreter_ok() -> bool:
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        from lm_core import tf32x3_triton
    except ImportError:
        return False
    return tf32x3_triton.interpreting()


needs_interpreter = pytest.mark.skipif(
    not _interpreter_ok(), reason="Triton kernels need TRITON_INTERPRET=1 and triton here"
)


def _rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).norm() / ref.norm()).item()


def _operands(m, n, k, a_transposed, b_transposed, seed=0):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn((k, m) if a_transposed else (m, k), generator=gen)
    b = torch.randn((n, k) if b_transposed else (k, n), generator=gen) / k**0.5
    return (a.t() if a_transposed else a), (b.t() if b_transposed else b)


@needs_interpreter
def test_split_is_exact_to_2_pow_22_and_tf32_representable():
    from lm_core.tf32x3_triton import split

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(70, 37, generator=gen) * torch.logspace(-20, 20, 37)  # wide exponents
    for src in (x, x.t().contiguous().t()):  # row-major and column-major inputs
        out = split(src)
        assert out.shape == (2, 256, 64)  # zero-padded to whole GEMM tiles
        hi, lo = out[0, :70, :37], out[1, :70, :37]
        bits = out.view(torch.int32) & 0x1FFF  # the 13 mantissa bits TF32 drops
        assert int(bits.abs().max()) == 0
        assert float(out[:, :, 37:].abs().max()) == 0.0
        assert float(out[:, 70:].abs().max()) == 0.0
        rel = ((hi.double() + lo.double() - x.double()).abs() / x.double().abs()).max().item()
        assert rel <= 2.0**-22
        assert (lo.abs() <= hi.abs() * 2.0**-11).all()


@needs_interpreter
@pytest.mark.parametrize("layout", ["nn", "tn", "nt", "tt"])
@pytest.mark.parametrize("mnk", [(37, 29, 45), (1, 7, 3), (65, 33, 18), (40, 96, 130)])
def test_mm_matches_float64(mnk, layout):
    m, n, k = mnk
    a, b = _operands(m, n, k, layout[0] == "t", layout[1] == "t")
    c = tf32x3_mm(a, b)
    assert c.shape == (m, n)
    assert c.is_contiguous()
    assert c.dtype == torch.float32
    # dropping the lo part of either operand would leave ~1e-4 (TF32 alone ~1e-3)
    assert _rel_err(c, a.double() @ b.double()) < 1e-6


@needs_interpreter
def test_mm_empty_and_zero_k():
    assert tf32x3_mm(torch.randn(0, 5), torch.randn(5, 3)).shape == (0, 3)
    c = tf32x3_mm(torch.randn(4, 0), torch.randn(0, 3))
    assert c.shape == (4, 3)
    assert float(c.abs().max()) == 0.0


@needs_interpreter
def test_backward_matches_float64_and_keeps_weight_layout():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(21, 13, generator=gen, requires_grad=True)
    w = torch.randn(11, 13, generator=gen, requires_grad=True)
    g = torch.randn(21, 11, generator=gen)
    tf32x3_mm(x, w.t()).backward(g)
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    (x64 @ w64.t()).backward(g.double())
    assert _rel_err(x.grad, x64.grad) < 1e-6
    assert _rel_err(w.grad, w64.grad) < 1e-6
    assert w.grad.stride() == w.stride()  # no transposed gradient for the optimizer


@needs_interpreter
def test_model_with_tf32x3_matches_default():
    """Same weights, same batch: logits and every parameter's gradient agree with torch's
    float32 matmul to float32 accuracy."""
    torch.manual_seed(0)
    ref = TransformerLM(get_config("tiny"))
    ours = TransformerLM(get_config("tiny", matmul="tf32x3"))
    ours.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 256, (2, 24))
    for model in (ref, ours):
        F.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
    torch.testing.assert_close(ours(ids), ref(ids), rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(ours.named_parameters(), ref.parameters(), strict=True):
        assert p.grad.stride() == q.grad.stride(), name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


@needs_interpreter
def test_compiles_without_graph_break():
    """The op is one node: fullgraph compile of forward and backward works."""
    torch.manual_seed(0)
    layer = Linear(12, 20, bias=False, matmul="tf32x3")
    x = torch.randn(3, 5, 12, requires_grad=True)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    y = compiled(x)
    y.sum().backward()
    torch.testing.assert_close(y, F.linear(x, layer.weight), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(layer.weight.grad, torch.ones(3 * 5, 20).t() @ x.reshape(15, 12))


@needs_interpreter
def test_linear_with_bias_matches_nn_linear():
    """Same constructor defaults as nn.Linear (bias on), same result and gradients."""
    torch.manual_seed(0)
    ours, ref = Linear(12, 20, matmul="tf32x3"), torch.nn.Linear(12, 20)
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(2, 7, 12)
    for layer in (ours, ref):
        layer(x).square().sum().backward()
    torch.testing.assert_close(ours(x), ref(x), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours.bias.grad, ref.bias.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad, rtol=1e-5, atol=1e-6)


def test_falls_back_outside_float32(monkeypatch):
    """bf16 inputs and autocast take torch's path (bitwise F.linear)."""
    monkeypatch.setattr(
        "lm_core.matmul.tf32x3_mm", lambda *a: pytest.fail("tf32x3_mm called outside fp32")
    )
    layer = Linear(8, 6, bias=False, matmul="tf32x3")
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(layer(x), F.linear(x, layer.weight))
    layer = layer.bfloat16()
    xb = x.bfloat16()
    assert torch.equal(layer(xb), F.linear(xb, layer.weight))


def test_cpu_without_interpreter_is_plain_float32(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    a, b = _operands(9, 7, 5, False, True)
    assert torch.equal(tf32x3_mm(a, b), a @ b)


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match=r"ModelConfig\.matmul"):
        get_config("tiny", matmul="tf32")
    with pytest.raises(ValueError, match="matmul: unknown backend"):
        Linear(4, 4, matmul="fp64")
    with pytest.raises(ValueError, match="matmul: unknown backend"):
        TransformerLM(get_config("tiny")).set_matmul("fast")
    with pytest.raises(ValueError, match="a must be a 2-D float32"):
        tf32x3_mm(torch.randn(3, 4, dtype=torch.float64), torch.randn(4, 2))
    with pytest.raises(ValueError, match="do not chain"):
        tf32x3_mm(torch.randn(3, 4), torch.randn(5, 2))


def test_set_matmul_switches_every_linear_and_the_config():
    model = TransformerLM(get_config("tiny"))
    model.set_matmul("tf32x3")
    assert model.config.matmul == "tf32x3"
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * model.config.num_layers + 1  # qkv, out, w13, w2; the head
    assert all(m.matmul == "tf32x3" for m in linears)


def test_checkpoint_loads_across_matmul_backends(tmp_path):
    """matmul changes no parameter and not the function computed: a free config field."""
    model = TransformerLM(get_config("tiny", matmul="tf32x3"))
    save_checkpoint(tmp_path / "ckpt.pt", model, None, step=0)
    other = TransformerLM(get_config("tiny"))
    load_checkpoint(tmp_path / "ckpt.pt", other)
    for p, q in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(p, q)
    assert dataclasses.replace(other.config, matmul="tf32x3") == model.config


def test_gluon_gemm_only_where_it_can_run(monkeypatch):
    """The Gluon GEMM is offered only for CUDA tensors, and never when turned off (the check
    must not touch CUDA before that: this machine may have none)."""
    pytest.importorskip("triton")
    from lm_core import tf32x3_gluon

    assert not tf32x3_gluon.usable(torch.device("cpu"))
    monkeypatch.setattr(tf32x3_gluon, "ENABLED", False)
    assert not tf32x3_gluon.usable(torch.device("cuda", 0))
    assert tf32x3_gluon.tiles(300, 1000) == 3 * 8


def test_gluon_plans_offered(monkeypatch):
    """A in registers only where TMA can read A as it is; split K only where the output tiles
    leave SMs idle and each slice keeps >= 8 K tiles; either withheld when switched off."""
    pytest.importorskip("triton")
    from lm_core import tf32x3_gluon as g

    rows = torch.empty(64, 12)
    assert g.a_major(rows) == "k"
    assert g.a_major(torch.empty(12, 64).t()) == "m"
    assert g.a_major(torch.empty(64, 7)) is None  # row stride not 16-byte aligned
    assert g.a_major(torch.empty(1000)[1:769].view(64, 12)) is None  # base address misaligned
    assert g.k_slices(2048, 4) == (16, 4)
    assert g.k_slices(32 * 9, 4) == (3, 3)  # 9 K tiles: three slices of 3
    plans = g.plans(768, 768, 2048, "m", sms=132)  # 36 tiles, 64 K tiles
    expected = {(raw, s) for raw in (False, True) for s in (1, 2, 4)}
    assert {(p.a_raw, p.split_k) for p in plans} == expected
    assert all(not p.a_kmajor for p in plans if p.a_raw)
    # 474 tiles fill 3.6 waves of 132 well enough; A not readable by TMA
    assert g.plans(10000, 768, 2048, None, sms=132) == [g.Plan()]
    # 144 tiles: 2 waves, the second one 12/132 busy; 2 slices make 288 (2.2 of 3 waves)
    assert [p.split_k for p in g.plans(768, 3072, 2048, None, sms=132)] == [1, 2, 4]
    assert [p.split_k for p in g.plans(768, 768, 512, "k", sms=132)] == [1, 2, 1, 2]  # 16 K tiles
    monkeypatch.setattr(g, "RAW_A", False)
    monkeypatch.setattr(g, "SPLIT_K", False)
    assert g.plans(768, 768, 2048, "m", sms=132) == [g.Plan()]
