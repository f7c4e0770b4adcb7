"""The FLOP formula against torch's own FLOP counter on the naive-attention model."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from lm_core import TransformerLM, forward_flops, get_config, train_step_flops
from lm_core.flops import backward_flops


@pytest.mark.parametrize(("batch", "seq"), [(2, 16), (1, 37)])
def test_formula_matches_flop_counter(batch, seq):
    # naive attention runs QK^T and PV as plain matmuls over the full T x T matrix, which is
    # exactly what the formula counts; FlopCounterMode counts every matmul the model runs.
    cfg = get_config("tiny", attention="naive", d_ff=96)
    model = TransformerLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    with FlopCounterMode(display=False) as fwd:
        logits = model(ids)
    assert fwd.get_total_flops() == forward_flops(cfg, batch, seq)
    with FlopCounterMode(display=False) as bwd:
        logits.sum().backward()
    assert bwd.get_total_flops() == backward_flops(cfg, batch, seq)
    assert train_step_flops(cfg, batch, seq) == 3 * forward_flops(cfg, batch, seq)


def test_xl_value():
    cfg = get_config("xl")
    n, d, f, layers, v, t = 4 * 512, 1600, 6400, 48, 10_000, 512
    expected = 2 * n * (layers * (4 * d * d + 3 * d * f) + d * v) + layers * 4 * 4 * t * t * d
    assert forward_flops(cfg, 4, 512) == expected


def test_bad_arguments():
    with pytest.raises(ValueError, match="batch"):
        forward_flops(get_config("tiny"), 0, 4)
    with pytest.raises(TypeError, match="ModelConfig"):
        forward_flops({"d_model": 3}, 1, 4)
