"""Public API: exports, input validation, backend choice, configs and FLOP helpers (CPU)."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

import flashattn_triton as fa
from flashattn_triton import _device, configs, options
from flashattn_triton.api import resolve_backend
from flashattn_triton.flops import visible_pairs


def _qkv(*shape, dtype=torch.float32):
    return tuple(torch.randn(*shape, dtype=dtype) for _ in range(3))


def test_public_exports():
    for name in fa.__all__:
        assert hasattr(fa, name), name
    assert issubclass(fa.FlashAttention2Torch, torch.autograd.Function)
    assert issubclass(fa.FlashAttention2Triton, torch.autograd.Function)
    assert hasattr(torch.ops.flashattn_triton, "fwd")
    assert hasattr(torch.ops.flashattn_triton, "bwd")


@pytest.mark.parametrize(
    ("make", "exc", "match"),
    [
        (lambda q, k, v: (q[0, 0, 0], k, v), ValueError, "at least 2 dims"),
        (lambda q, k, v: (q, k[0], v), ValueError, "same number of dims"),
        (lambda q, k, v: (q, k.double(), v), TypeError, "share one dtype"),
        (lambda q, k, v: (q, k, v.to("meta")), ValueError, "one device"),
        (lambda q, k, v: (q, k[..., :8], v), ValueError, "k head_dim"),
        (lambda q, k, v: (q, k, v[..., :8]), ValueError, "v head_dim"),
        (lambda q, k, v: (q, k[:1], v[:1]), ValueError, "leading"),
        (lambda q, k, v: (q, k, v[:, :, :5]), ValueError, "same sequence length"),
        (lambda q, k, v: (q.long(), k.long(), v.long()), TypeError, "floating-point"),
        (lambda q, k, v: ([1.0], k, v), TypeError, "torch.Tensor"),
    ],
)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bad_inputs_raise_clear_errors(make, exc, match, backend):
    q, k, v = make(*_qkv(2, 3, 10, 16))
    with pytest.raises(exc, match=match):
        fa.flash_attention(q, k, v, backend=backend)


def test_quick_input_check_accepts_only_what_the_detailed_one_does():
    """``check_qkv`` first tries one expression for the common call (``_plain_qkv``): it
    must accept plain and grouped-query inputs, and nothing the detailed checks refuse."""
    from flashattn_triton import _checks

    q, k, v = _qkv(2, 6, 10, 16)
    plain = [(q, k, v, True), (q, k, v, False), (q[0], k[0], v[0], False),
             (q, k[:, :, :7], v[:, :, :7], True), (q, k[:, :1], v[:, :1], True),
             (q, k[:, :3, :5], v[:, :3, :5], False), (q[0], k[0, :2], v[0, :2], True),
             (q[0, 0], k[0, 0, :5], v[0, 0, :5], True)]  # fmt: skip
    other = [
        (q, k, v, 1), (q, k.double(), v, True), (q, k, v.to("meta"), True),
        (q, k[..., :8], v, True), (q, k[:1], v[:1], True), (q, k, v[:, :, :5], True),
        (q.long(), k.long(), v.long(), True), (q[0, 0, 0], k[0, 0, 0], v[0, 0, 0], True),
        ([1.0], k, v, True), (q, k[:, :4], v[:, :4], True), (q, k[:, :1], v[:, :2], True),
        (q, k[:, :0], v[:, :0], True), (q, k[:1, :1], v[:1, :1], True),
        (q, k[:, :2], v[:, :2], 0), (q, k, v[..., :8], True), (q[0], k, v, True),
    ]  # fmt: skip
    accepted = []
    for args in plain + other:
        if _checks._plain_qkv(*args):
            _checks._check_qkv_in_detail(*args)  # must not raise
            accepted.append(args)
        else:
            with pytest.raises((TypeError, ValueError)):
                _checks._check_qkv_in_detail(*args)
    assert accepted == plain


def test_bad_flags():
    q, k, v = _qkv(2, 10, 16)
    with pytest.raises(TypeError, match="causal"):
        fa.flash_attention(q, k, v, causal=1)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="softmax_scale"):
            fa.flash_attention(q, k, v, softmax_scale=bad)
    with pytest.raises(TypeError, match="softmax_scale"):
        fa.flash_attention(q, k, v, softmax_scale=True)
    with pytest.raises(ValueError, match="backend"):
        fa.flash_attention(q, k, v, backend="cuda")
    with pytest.raises(ValueError, match="backend"):
        fa.FlashAttention(backend="nope")


def test_environment_is_read_at_import_and_bad_values_wait_for_the_first_call():
    # Read at import: a graph torch.compile traces must not make the first read (a changed
    # global there would cost a recompile). A bad value must not break the import.
    script = (
        "import flashattn_triton as fa, flashattn_triton.options as o\n"
        "print(o._current is not None and o._current.backward)\n"
        "try:\n    fa.get_options()\nexcept ValueError as e:\n    print('error', e)\n"
    )
    for value, expected in (("split", "split"), ("magic", "False\nerror FLASHATTN_TRITON_BWD")):
        env = {**os.environ, "FLASHATTN_TRITON_BWD": value}
        out = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith(expected), out.stdout


def test_triton_backend_limits():
    q, k, v = _qkv(1, 10, 16, dtype=torch.float64)
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        fa.flash_attention(q, k, v, backend="triton")
    q, k, v = _qkv(1, 10, 160)
    with pytest.raises(ValueError, match=r"head_dim 1\.\.128"):
        fa.flash_attention(q, k, v, backend="triton")
    assert fa.flash_attention(q, k, v, backend="torch").shape == q.shape  # torch takes it


def test_triton_on_cpu_without_interpreter_says_what_to_do(monkeypatch):
    monkeypatch.setattr(_device, "interpreting", lambda: False)
    q, k, v = _qkv(1, 10, 16)
    with pytest.raises(RuntimeError, match=r"TRITON_INTERPRET=1.*backend='torch'"):
        fa.FlashAttention2Triton.apply(q, k, v, False)


def test_auto_backend_uses_torch_off_gpu():
    q, k, v = _qkv(2, 12, 16)
    assert resolve_backend("auto", q) == "torch"
    assert resolve_backend("triton", q) == "triton"
    o = fa.flash_attention(q, k, v, causal=True)
    ref, _ = fa.attention_reference(q, k, v, causal=True)
    assert torch.allclose(o.double(), ref, atol=1e-5)
    assert torch.allclose(fa.FlashAttention(causal=True)(q, k, v), o)
    assert "causal=True" in repr(fa.FlashAttention(causal=True))


def test_visible_pairs_match_brute_force():
    for n_q, n_k in [(1, 1), (7, 7), (3, 9), (9, 3), (16, 1), (1, 16)]:
        mask = fa.causal_mask(n_q, n_k)
        assert visible_pairs(n_q, n_k, True) == int(mask.sum())
        assert visible_pairs(n_q, n_k, False) == n_q * n_k


def test_flops_and_floor():
    f = fa.attention_flops(16, 16384, 16384, 64, True, "fwd")
    assert math.isclose(f, 4 * 64 * 16 * 16384 * 16385 / 2)
    assert math.isclose(fa.attention_flops(1, 8, 8, 16, False, "bwd"), 2.5 * 4 * 16 * 64)
    assert math.isclose(fa.attention_flops(1, 8, 8, 16, False), 3.5 * 4 * 16 * 64)
    floor = fa.attention_floor_ms(16, 16384, 16384, 64, True, 2, 800.0, 3000.0)
    assert math.isclose(floor, 3.5 * f / 800e12 * 1e3)
    assert math.isclose(fa.tflops_per_s(1e12, 1000.0), 1.0)
    with pytest.raises(ValueError, match="mode"):
        fa.attention_flops(1, 8, 8, 16, False, "both")


def test_configs_parse_fit_and_prune(set_options):
    spec = "fwd=64,32,4,2; dq.fp32=32,32,4,2"
    cfg = configs.default_config("fwd", 4096, 4096, 64, 2, tile_configs=spec)
    assert cfg == configs.TileConfig(64, 32, 4, 2)
    cfg = configs.default_config("dq", 4096, 4096, 64, 4, tile_configs=spec)
    assert cfg == configs.TileConfig(32, 32, 4, 2)
    with pytest.raises(ValueError, match="unknown kind"):
        configs.default_config("fwd", 64, 64, 64, 2, tile_configs="bogus=1,2,3,4")
    with pytest.raises(ValueError, match="m,n,warps,stages"):
        set_options(tile_configs="fwd=1,2")
    with pytest.raises(ValueError, match=r"FLASHATTN_TRITON_CONFIGS.*unknown kind"):
        options.from_env({"FLASHATTN_TRITON_CONFIGS": "bogus=1,2,3,4"})
    # Short sequences clamp tiles; float32 tiles never go below 32.
    assert configs.default_config("fwd", 5, 5, 64, 2).block_m == 16
    assert configs.default_config("fwd", 5, 5, 64, 4).block_m == 32
    for kind in ("fwd", "dkdv", "dq", "fused", "atomic"):
        for bd in (16, 32, 64, 128):
            for elem in (2, 4):
                cfg = configs.default_config(kind, 16384, 16384, bd, elem)
                assert configs.fits(kind, cfg, bd, elem), (kind, bd, elem)
                kept = configs.prune_configs(kind, configs.CANDIDATES[kind], 16384, 16384, bd, elem)
                assert kept
                assert all(configs.fits(kind, c, bd, elem) for c in kept)
    with pytest.raises(ValueError, match="FLASHATTN_TRITON_BWD"):
        options.from_env({"FLASHATTN_TRITON_BWD": "magic"})
    with pytest.raises(ValueError, match="backward"):
        set_options(backward="magic")
    with pytest.raises(ValueError, match="FP32_PRECISION"):
        options.from_env({"FLASHATTN_TRITON_FP32_PRECISION": "fp64"})
    with pytest.raises(ValueError, match="FLASHATTN_TRITON_FAST_LAUNCH"):
        options.from_env({"FLASHATTN_TRITON_FAST_LAUNCH": "maybe"})
    with pytest.raises(TypeError, match="unknown option"):
        set_options(bwd="split")


def test_small_grid_rules(monkeypatch, set_options):
    """Small causal grids (about one wave) halve 128-wide grid-axis tiles and, for 16-bit
    inputs, pick the fused backward; explicit settings and overrides win."""
    set_options(backward="auto", tile_configs="")
    monkeypatch.setattr(configs, "OVERRIDES", {})
    sms = 132
    # batch x heads = 1 at 32768 tokens: 256 programs of 128 rows on 132 SMs (<= 2 per SM).
    assert configs.small_grid(1, 32768, sms)
    assert not configs.small_grid(3, 32768, sms)  # 768 programs
    assert not configs.small_grid(1, 32768, 0)  # SM count unknown
    assert not configs.small_grid(1, 8192, sms)  # below the measured lengths
    assert not configs.small_grid(2, 32768, sms, per_sm=1)

    def resolve(*args):
        return configs.resolve_backward_scheme("auto", *args)

    assert resolve(True, 1, 32768, 64, 2, sms) == "fused"
    assert resolve(True, 2, 32768, 64, 2, sms) == "split"  # 512 programs: a full grid
    assert resolve(False, 1, 32768, 64, 2, sms) == "split"  # no causal imbalance
    assert resolve(True, 1, 32768, 64, 4, sms) == "split"  # float32: fused not measured
    assert resolve(True, 1, 32768, 128, 2, sms) == "split"  # d = 128: only below 1 per SM
    assert resolve(True, 1, 16384, 128, 2, sms) == "fused"
    assert resolve(True, 1, 32768, 64, 2, 0) == "split"  # SM count unknown
    assert resolve(True, 4, 512, 64, 2, sms) == "split"  # short sequences: not measured
    assert configs.resolve_backward_scheme("atomic", True, 1, 32768, 64, 2, sms) == "atomic"
    # Tiles: 128-wide grid axes halve at 4 warps; narrower ones and other kinds stay.
    half = configs.for_small_grid
    assert half("fwd", configs.TileConfig(128, 128, 4, 3)) == configs.TileConfig(64, 128, 4, 3)
    assert half("dq", configs.TileConfig(128, 64, 8, 3)) == configs.TileConfig(64, 64, 4, 3)
    tma = configs.TileConfig(128, 128, 4, 3, tma=True)
    assert half("fwd", tma) == configs.TileConfig(64, 128, 4, 3)
    assert half("dkdv", configs.TileConfig(32, 128, 4, 3)) == configs.TileConfig(32, 64, 4, 3)
    assert half("fwd", configs.TileConfig(64, 64, 4, 3)) == configs.TileConfig(64, 64, 4, 3)
    fused = configs.TileConfig(32, 128, 8, 4, block_n2=64)
    assert half("fused", fused) == fused
    atomic = configs.TileConfig(32, 128, 8, 3)
    assert half("atomic", atomic) == atomic
    table = configs.DEFAULTS["fwd"][64]
    assert configs.default_config("fwd", 32768, 32768, 64, 2) == table
    assert configs.default_config("fwd", 32768, 32768, 64, 2, small_grid=True).block_m == 64
    monkeypatch.setattr(configs, "OVERRIDES", {"fwd": configs.TileConfig(128, 64, 8, 3)})
    forced = configs.default_config("fwd", 32768, 32768, 64, 2, small_grid=True)
    assert forced == configs.TileConfig(128, 64, 8, 3)


def test_few_programs_rule(monkeypatch, set_options):
    """The d = 128 forward's 128-row tile is used from FEW_WAVES waves of programs up; fewer
    programs (and one-wave causal grids) take its FEW_PROGRAMS entry; overrides still win."""
    set_options(tile_configs="")
    monkeypatch.setattr(configs, "OVERRIDES", {})
    sms = 132
    few = configs.few_programs
    assert few("fwd", 16, 1000, 128, sms)  # 16 x 8 = 128 programs of 128 rows
    assert few("fwd", 1, 32768, 128, sms)  # 256
    assert not few("fwd", 128, 512, 128, sms)  # 512
    assert not few("fwd", 16, 1000, 128, 0)  # SM count unknown
    assert not few("fwd", 16, 1000, 64, sms)  # no entry for d = 64
    assert not few("dq", 16, 1000, 128, sms)
    big = configs.default_config("fwd", 16384, 16384, 128, 2)
    assert (big.block_m, big.tma) == (128, True)
    small = configs.default_config("fwd", 16384, 16384, 128, 2, few_programs=True)
    assert small == configs.FEW_PROGRAMS["fwd"][128]
    # One-wave causal grid: the entry's 64-row tile is not halved again.
    both = configs.default_config("fwd", 32768, 32768, 128, 2, small_grid=True, few_programs=True)
    assert both == configs.FEW_PROGRAMS["fwd"][128]
    # float32 has its own table, untouched by the rule.
    fp32 = configs.default_config("fwd", 16384, 16384, 128, 4, few_programs=True)
    assert fp32 == configs.default_config("fwd", 16384, 16384, 128, 4)
    monkeypatch.setattr(configs, "OVERRIDES", {"fwd": configs.TileConfig(128, 64, 8, 3)})
    forced = configs.default_config("fwd", 16384, 16384, 128, 2, few_programs=True)
    assert forced == configs.TileConfig(128, 64, 8, 3)


def test_few_programs_flag_without_an_entry_keeps_the_table(monkeypatch, set_options):
    """A kind with no FEW_PROGRAMS entry ignores the flag instead of failing."""
    set_options(tile_configs="")
    monkeypatch.setattr(configs, "OVERRIDES", {})
    for kind in ("dq", "dkdv"):
        plain = configs.default_config(kind, 16384, 16384, 128, 2)
        assert configs.default_config(kind, 16384, 16384, 128, 2, few_programs=True) == plain


def test_onepass_scheme_rule(monkeypatch, set_options):
    """Where the one-pass Gluon backward could run (faked here: it needs a Hopper GPU),
    ``auto`` takes it except on the small causal grids that get the fused backward,
    ``onepass`` always, ``split`` never; where it cannot run, ``onepass`` is ``auto``."""
    from flashattn_triton import launch_backward

    monkeypatch.setattr(launch_backward, "sm_count", lambda t: 132)
    applies = {"on": True}
    monkeypatch.setattr(launch_backward, "_onepass_applies", lambda *a: applies["on"])

    def scheme(setting, h, n, causal=True):
        set_options(backward=setting)
        q = torch.empty(1, h, n, 128, dtype=torch.bfloat16)
        return launch_backward._backward_scheme(q, q, causal, None, q, q)[0]

    assert scheme("auto", 16, 16384) == "onepass"
    assert scheme("auto", 1, 16384) == "fused"  # 128 programs of 128 rows: one wave
    assert scheme("auto", 1, 16384, causal=False) == "onepass"
    assert scheme("onepass", 1, 16384) == "onepass"
    assert scheme("split", 16, 16384) == "split"
    applies["on"] = False
    assert scheme("onepass", 16, 16384) == "split"
    assert scheme("onepass", 1, 16384) == "fused"
