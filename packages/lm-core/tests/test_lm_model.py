"""TransformerLM: shapes, equality with a plainly written course model, causality, RoPE,
input validation, initialization."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lm_core import TransformerLM, get_config
from lm_core.model import RMSNorm, RotaryEmbedding


def _reference_rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Course RoPE via complex numbers: pair (x[2i], x[2i+1]) at position p rotated by
    p * theta^(-2i/d). x: (B, H, T, d)."""
    t, d = x.shape[-2], x.shape[-1]
    freqs = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = torch.arange(t, dtype=torch.float64)[:, None] * freqs  # (T, d/2)
    z = torch.view_as_complex(x.double().reshape(*x.shape[:-1], d // 2, 2).contiguous())
    z = z * torch.polar(torch.ones_like(angle), angle)
    return torch.view_as_real(z).reshape(x.shape).to(x.dtype)


def _reference_rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def reference_forward(model: TransformerLM, ids: torch.Tensor) -> torch.Tensor:
    """The course model written out with separate q/k/v and w1/w3 matrices (split from the
    fused ones), explicit masked softmax attention and complex-number RoPE."""
    cfg = model.config
    d, h, dh = cfg.d_model, cfg.num_heads, cfg.head_dim
    b, t = ids.shape
    x = model.token_embeddings.weight[ids]
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    for blk in model.layers:
        a = _reference_rmsnorm(x, blk.ln1.weight)
        wq, wk, wv = blk.attn.qkv_proj.weight.split(d)

        def heads(y):
            return y.reshape(b, t, h, dh).permute(0, 2, 1, 3)

        q = _reference_rope(heads(a @ wq.T), cfg.rope_theta)
        k = _reference_rope(heads(a @ wk.T), cfg.rope_theta)
        v = heads(a @ wv.T)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(dh)
        scores = scores.masked_fill(~mask, float("-inf"))
        o = (scores.softmax(-1) @ v).permute(0, 2, 1, 3).reshape(b, t, d)
        x = x + o @ blk.attn.output_proj.weight.T
        f = _reference_rmsnorm(x, blk.ln2.weight)
        w1, w3 = blk.ffn.w13.weight.split(cfg.d_ff)
        x = x + (F.silu(f @ w1.T) * (f @ w3.T)) @ blk.ffn.w2.weight.T
    return _reference_rmsnorm(x, model.ln_final.weight) @ model.lm_head.weight.T


@pytest.mark.parametrize("attention", ["naive", "sdpa"])
def test_matches_plain_course_model(tiny, attention):
    torch.manual_seed(0)
    model = TransformerLM(get_config("tiny", attention=attention)).double()
    ids = torch.randint(0, tiny.vocab_size, (3, 37))
    ours = model(ids)
    ref = reference_forward(model, ids)
    assert ours.shape == (3, 37, tiny.vocab_size)
    # float64 on both sides except the RoPE cos/sin tables, which the model keeps in fp32
    # (relative rounding 6e-8): logits of O(1) agree to ~1e-7; a wrong formula is off by O(1).
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)


def test_causal_for_every_backend(backend):
    torch.manual_seed(1)
    model = TransformerLM(get_config("tiny", attention=backend))
    ids = torch.randint(0, 256, (2, 24))
    base = model(ids)
    for t in (0, 7, 23):
        changed = ids.clone()
        changed[:, t] = (changed[:, t] + 1) % 256
        out = model(changed)
        # Positions before t are computed from identical inputs through masked attention:
        # masked keys contribute exp(-inf) = 0, so the result is the same up to rounding.
        torch.testing.assert_close(out[:, :t], base[:, :t], rtol=0, atol=1e-6)
        assert not torch.allclose(out[:, t], base[:, t]), "changing token t must change logits t"


def test_rope_depends_only_on_relative_position():
    torch.manual_seed(2)
    d, t = 16, 32
    rope = RotaryEmbedding(d, t, theta=10000.0).double()
    q = torch.randn(d, dtype=torch.float64)
    k = torch.randn(d, dtype=torch.float64)
    rq = rope(q.expand(1, t, d))[0]  # (T, d): q placed at every position
    rk = rope(k.expand(1, t, d))[0]
    dots = rq @ rk.T  # dots[m, n] = <R_m q, R_n k>
    # Exact in real arithmetic; the cos/sin tables are fp32-rounded (relative 6e-8), so dots of
    # size ~|q||k| ~ 16 agree to ~1e-6. Absolute-position dependence would differ by O(1).
    for shift in (1, 5, 13):
        torch.testing.assert_close(dots[shift:, shift:], dots[:-shift, :-shift], rtol=0, atol=5e-6)
    # not trivially constant: the score does depend on the offset m - n
    assert (dots.diagonal(0) - dots.diagonal(3).mean()).abs().max() > 1e-3
    # rotation preserves norms
    torch.testing.assert_close(rq.norm(dim=-1), q.norm().expand(t))


def test_rope_matches_complex_reference():
    torch.manual_seed(3)
    x = torch.randn(2, 4, 10, 8, dtype=torch.float64)  # (B, H, T, d)
    rope = RotaryEmbedding(8, 16, theta=500.0).double()
    ours = rope(x.transpose(1, 2)).transpose(1, 2)  # ours rotates along dim 1
    torch.testing.assert_close(ours, _reference_rope(x, 500.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_fp32_semantics(dtype):
    torch.manual_seed(4)
    norm = RMSNorm(48)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = (torch.randn(3, 5, 48) * 30).to(dtype)
    out = norm(x)
    assert out.dtype == dtype
    ref = _reference_rmsnorm(x.double(), norm.weight.double()).to(dtype)
    # Computed in fp32 and rounded once to dtype: at most 1 ulp of dtype from the float64 ref.
    tol = {torch.float32: 1e-6, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


def test_bf16_autocast_forward_backward(tiny):
    torch.manual_seed(5)
    model = TransformerLM(tiny)
    ids = torch.randint(0, 256, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(ids)
    assert logits.dtype == torch.bfloat16
    logits.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
    ref = model(ids)
    # bf16 matmuls (8-bit mantissa) through 2 layers: logits agree to a few percent of scale
    assert (logits.float() - ref).abs().max() < 0.1 * ref.abs().max()


def test_input_validation(tiny):
    model = TransformerLM(tiny)
    with pytest.raises(TypeError, match="integer dtype"):
        model(torch.zeros(1, 4))
    with pytest.raises(ValueError, match=r"shape \(batch, seq\)"):
        model(torch.zeros(4, dtype=torch.long))
    with pytest.raises(
        ValueError, match="sequence length 65 exceeds the model's context_length 64"
    ):
        model(torch.zeros(1, 65, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[0, vocab_size=256\).*max 256"):
        model(torch.tensor([[1, 256]]))
    with pytest.raises(ValueError, match="min -1"):
        model(torch.tensor([[-1, 3]]))
    with pytest.raises(TypeError, match="ModelConfig"):
        TransformerLM({"d_model": 3})


@pytest.mark.parametrize(
    ("ids", "error", "match"),
    [
        (torch.zeros(2, 0, dtype=torch.long), ValueError, r"at least one token.*\(2, 0\)"),
        (torch.zeros(0, 3, dtype=torch.long), ValueError, r"at least one sequence.*\(0, 3\)"),
        (torch.zeros(1, 3, dtype=torch.uint8), TypeError, "token_ids: .*int64 or int32.*uint8"),
        (torch.zeros(1, 3, dtype=torch.bool), TypeError, "token_ids: .*int64 or int32.*bool"),
        (torch.zeros(1, 3, dtype=torch.int16), TypeError, "token_ids: .*int64 or int32.*int16"),
    ],
)
def test_empty_and_non_index_token_ids_are_refused_by_name(tiny, ids, error, match):
    # These used to fail inside torch (a reshape of 0 elements, the embedding's index check).
    model = TransformerLM(tiny)
    with pytest.raises(error, match=match):
        model(ids)


def test_int32_ids_and_full_context(tiny):
    model = TransformerLM(tiny)
    ids = torch.randint(0, 256, (1, tiny.context_length), dtype=torch.int32)
    assert model(ids).shape == (1, tiny.context_length, 256)


def test_initialization_statistics():
    torch.manual_seed(6)
    cfg = get_config("tiny", d_model=256, num_heads=4, d_ff=512, vocab_size=1024)
    model = TransformerLM(cfg)
    emb = model.token_embeddings.weight
    assert emb.abs().max() <= 3.0
    assert abs(emb.std().item() - 0.9866) < 0.02  # sd of N(0, 1) truncated at 3 sd: 0.9866
    blk = model.layers[0]
    d, f = cfg.d_model, cfg.d_ff
    for part in blk.attn.qkv_proj.weight.split(d):
        std = math.sqrt(2 / (d + d))
        assert part.abs().max() <= 3 * std + 1e-7
        assert abs(part.std().item() / (0.9866 * std) - 1) < 0.05
    for part in blk.ffn.w13.weight.split(f):
        std = math.sqrt(2 / (d + f))
        assert abs(part.std().item() / (0.9866 * std) - 1) < 0.05
    assert torch.equal(blk.ln1.weight, torch.ones(d))
    assert model.state_dict().keys() == {k for k, _ in model.named_parameters()}  # no buffers


def test_set_attention_switches_backend(tiny):
    torch.manual_seed(7)
    model = TransformerLM(tiny)
    ids = torch.randint(0, 256, (2, 20))
    a = model(ids)
    model.set_attention("naive")
    assert model.config.attention == "naive"
    torch.testing.assert_close(model(ids), a, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="unknown attention backend"):
        model.set_attention("bogus")
