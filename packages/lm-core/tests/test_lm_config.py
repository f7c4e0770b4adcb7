"""ModelConfig validation, presets and get_config."""

from __future__ import annotations

import dataclasses

import pytest

from lm_core import MODEL_SIZES, ModelConfig, TransformerLM, get_config

HANDOUT_TABLE_1 = {  # d_model, d_ff, num_layers, num_heads
    "small": (768, 3072, 12, 12),
    "medium": (1024, 4096, 24, 16),
    "large": (1280, 5120, 36, 20),
    "xl": (1600, 6400, 48, 25),
    "2.7B": (2560, 10240, 32, 32),
}


def _kwargs(**changes):
    base = {"vocab_size": 100, "context_length": 16, "d_model": 32, "num_layers": 2}
    base.update(num_heads=4, d_ff=64)
    base.update(changes)
    return base


@pytest.mark.parametrize("name", list(HANDOUT_TABLE_1))
def test_presets_match_handout(name):
    cfg = MODEL_SIZES[name]
    assert (cfg.d_model, cfg.d_ff, cfg.num_layers, cfg.num_heads) == HANDOUT_TABLE_1[name]
    assert cfg.vocab_size == 10_000
    assert cfg.rope_theta == 10000.0
    assert cfg.attention == "sdpa"


def test_8b_preset_of_issue_7():
    cfg = MODEL_SIZES["8B"]
    dims = (cfg.vocab_size, cfg.d_model, cfg.d_ff, cfg.num_layers, cfg.num_heads)
    assert dims == (151_936, 4096, 11_008, 34, 32)
    assert (cfg.head_dim, cfg.context_length, cfg.rope_theta) == (128, 32_768, 10000.0)


def test_tiny_preset_exists_and_builds():
    model = TransformerLM(MODEL_SIZES["tiny"])
    assert model.config.vocab_size == 256


@pytest.mark.parametrize("name", [*HANDOUT_TABLE_1, "8B"])
def test_param_count_matches_course_formula(name):
    """Fused QKV / gate-up keep the course model's parameter count:
    V*D (embedding) + L*(4D^2 + 3*D*F + 2D) + D (final norm) + D*V (head)."""
    import torch

    cfg = MODEL_SIZES[name]
    with torch.device("meta"):
        model = TransformerLM(cfg)
    d, f, v, n_layers = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.num_layers
    expected = v * d + n_layers * (4 * d * d + 3 * d * f + 2 * d) + d + d * v
    assert model.num_params() == expected
    assert model.num_params(non_embedding=True) == expected - v * d
    if name == "8B":  # docs/model.md's table; built on the meta device only (no memory)
        assert expected == 8_125_698_048


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"d_model": 30, "num_heads": 4}, "d_model=30 must be divisible by num_heads=4"),
        ({"d_model": 12, "num_heads": 4}, "head dim"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"num_layers": -1}, "num_layers"),
        ({"context_length": 0}, "context_length"),
        ({"rope_theta": 0.0}, "rope_theta"),
        ({"attention": "flash3"}, "'flash3'"),
    ],
)
def test_invalid_config_names_the_problem(changes, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**_kwargs(**changes))


def test_non_int_size_is_type_error():
    with pytest.raises(TypeError, match="d_ff"):
        ModelConfig(**_kwargs(d_ff=64.0))


def test_get_config_unknown_size_lists_names():
    with pytest.raises(ValueError, match="unknown model size 'huge'") as err:
        get_config("huge")
    for name in MODEL_SIZES:
        assert name in str(err.value)


def test_get_config_overrides_and_unknown_field():
    cfg = get_config("xl", context_length=512, attention="naive")
    assert (cfg.context_length, cfg.attention, cfg.d_model) == (512, "naive", 1600)
    assert MODEL_SIZES["xl"].context_length == 1024  # presets are not mutated
    with pytest.raises(ValueError, match="d_modell"):
        get_config("xl", d_modell=3)


def test_config_dict_round_trip():
    cfg = get_config("small")
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="bogus"):
        ModelConfig.from_dict({**cfg.to_dict(), "bogus": 1})
    assert dataclasses.is_dataclass(cfg)
