"""FLOP formulas: written out here by hand, against lm_core's count and small cases."""

from __future__ import annotations

import pytest

from perf_tools import flops


class Cfg:
    d_model, d_ff, num_layers, num_heads, vocab_size = 8, 16, 2, 2, 10


def test_forward_flops_small_case_by_hand():
    b, t = 3, 5
    # per token per layer: q,k,v,o 4*8*8 + SwiGLU 3*8*16 = 256 + 384 = 640 MACs; head 8*10 = 80
    dense = 2 * b * t * (2 * 640 + 80)
    attn = 2 * (2 * b * t * t * 8) * 2  # QK^T and PV per layer, 2 layers
    assert flops.formula_forward_flops(Cfg, b, t) == dense + attn


def test_mode_factors():
    f = flops.formula_forward_flops(Cfg, 1, 4)
    assert flops.step_flops(Cfg, 1, 4, "forward") == f
    assert flops.step_flops(Cfg, 1, 4, "fwd-bwd") == 3 * f
    assert flops.step_flops(Cfg, 1, 4, "train") == 3 * f
    with pytest.raises(ValueError, match="mode"):
        flops.step_flops(Cfg, 1, 4, "sideways")


@pytest.mark.parametrize("size", ["tiny", "small", "xl", "2.7B"])
@pytest.mark.parametrize(("batch", "seq"), [(1, 7), (4, 512)])
def test_matches_lm_core(size, batch, seq):
    lm_core = pytest.importorskip("lm_core")
    cfg = lm_core.MODEL_SIZES[size]
    assert flops.forward_flops(cfg, batch, seq) == flops.formula_forward_flops(cfg, batch, seq)


def test_attention_flops():
    full = 4 * 2 * 3 * 128 * 64 * 32  # B=2, H=3, Nq=128, Nk=64, d=32: QK^T + PV
    assert flops.attention_flops(2, 3, 128, 64, 32, False, "fwd") == full
    assert flops.attention_flops(2, 3, 128, 64, 32, False, "bwd") == 2.5 * full
    # causal, Nq = Nk = 64: query i sees keys 0..i, 64 * 65 / 2 pairs of 4 * d FLOPs
    causal = 4 * 2 * 3 * (64 * 65 // 2) * 32
    assert flops.attention_flops(2, 3, 64, 64, 32, True, "fwd") == causal
    assert flops.attention_flops(2, 3, 64, 64, 32, True, "fwd_bwd") == 3.5 * causal
    with pytest.raises(ValueError, match="pass_"):
        flops.attention_flops(1, 1, 1, 1, 1, False, "sideways")


def test_one_source_of_truth():
    """perf_tools applies lm_core's and flashattn_triton's formulas, it does not restate them."""
    import flashattn_triton
    import lm_core

    cfg = lm_core.MODEL_SIZES["small"]
    assert flops.forward_flops(cfg, 2, 64) == lm_core.forward_flops(cfg, 2, 64)
    assert flops.formula_forward_flops(cfg, 2, 64) == lm_core.forward_flops(cfg, 2, 64)
    got = flops.attention_flops(2, 3, 100, 100, 16, True, "bwd")
    assert got == flashattn_triton.attention_flops(6, 100, 100, 16, True, "bwd")


def test_attention_substeps():
    sub = flops.attention_substep_flops(Cfg, 2, 5)
    d_head = 4
    assert sub["scores"] == sub["weighted_sum"] == 2 * 2 * 2 * 5 * 5 * d_head * 2
    assert sub["softmax"] == flops.SOFTMAX_FLOPS_PER_ELEMENT * 2 * 2 * 5 * 5 * 2
