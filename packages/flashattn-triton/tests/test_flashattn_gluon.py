"""CPU checks of the Gluon dK/dV module: its switches, and that its kernel compiles for sm_90
with the installed Triton (no GPU needed: ``benchmarks/gluon_dkdv.py offline``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashattn_triton import gluon_bwd, gluon_dkdv, gluon_dq, gluon_fwd, options

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "gluon_dkdv.py"


@pytest.mark.parametrize(("value", "on"), [(None, True), ("1", True), ("0", False), (" 0 ", False)])
def test_switch(value, on, set_options):
    env = {} if value is None else {"FLASHATTN_TRITON_GLUON": value}
    set_options(options.from_env(env))
    assert gluon_dkdv.enabled() is on


def test_never_applies_off_gpu():
    q = torch.zeros(1, 2, 64, 128, dtype=torch.bfloat16)
    assert not gluon_dkdv.applies(q, q, q, q, q, q)
    assert not gluon_dkdv.try_dkdv(q, q, q, q, None, None, q, q, True, 0.1)
    assert not gluon_dq.try_dq(q, q, q, q, None, None, q, True, 0.1)
    assert not gluon_dq.small_grid(q)  # no SM count off-GPU


def test_onepass_never_applies_off_gpu():
    q = torch.zeros(1, 2, 16384, 128, dtype=torch.bfloat16)
    stats = torch.zeros(1, 2, 16384)
    assert not gluon_bwd.would_run(q, q, q, q, True)
    assert not gluon_bwd.try_onepass(q, q, q, q, stats, stats, q, q, q, True, 0.1)


@pytest.mark.parametrize(
    ("setting", "rule", "causal", "sms", "expected"),
    [
        ("auto", 32, False, 132, 2),  # the L2 rule's plain order, capped
        ("auto", 1, False, 132, 1),
        ("auto", 8, False, 132, 8),  # the L2 rule's own groups stay
        ("auto", 32, True, 8, 2),  # causal, 64 programs: 8 waves of 8 SMs
        ("auto", 32, True, 9, 32),  # causal, under 8 waves: the plain order stays
        ("off", 32, False, 132, 32),
        (4, 4, True, 132, 4),
    ],
)
def test_onepass_head_group(setting, rule, causal, sms, expected, monkeypatch, set_options):
    """Under ``head_group="auto"`` the one-pass kernel runs MAX_HEAD_GROUP heads' programs
    at a time where the L2 rule keeps the plain order, except on causal grids of fewer than
    CAUSAL_MIN_WAVES waves; the rule's own groups and an explicit setting pass through."""
    seen = {}
    for name in ("would_run", "applies", "rows_by_tma"):
        monkeypatch.setattr(gluon_bwd, name, lambda *a, **k: True)

    def rule_groups(t, bh, rows, d):
        return {"head_group": rule, "GROUPED": rule < bh}

    monkeypatch.setattr(gluon_bwd, "head_group_args", rule_groups)
    monkeypatch.setattr(gluon_bwd, "sm_count", lambda t: sms)
    monkeypatch.setattr(gluon_bwd, "run_guarded", lambda kernel, key, launch: launch() or True)
    monkeypatch.setattr(gluon_bwd, "launch_onepass", lambda *a, **k: seen.update(k))
    set_options(options.Options(head_group=setting))
    q = torch.zeros(2, 16, 256, 128, dtype=torch.bfloat16)  # 2 x 16 x 2 key tiles: 64 programs
    stats = torch.zeros(2, 16, 256)
    assert gluon_bwd.try_onepass(q, q, q, q, stats, stats, q, q, q, causal, 0.1)
    assert seen["head_group"] == expected
    assert (gluon_bwd.MAX_HEAD_GROUP, gluon_bwd.CAUSAL_MIN_WAVES) == (2, 8)


@pytest.mark.parametrize(
    ("setting", "rule", "h", "h_kv", "expected"),
    [
        ("auto", 3, 16, 8, 4),  # grouped-query heads: the L2 rule's group, rounded up to 2^k
        ("auto", 6, 16, 8, 8),
        ("auto", 5, 12, 6, 6),  # never more than the k/v heads
        ("auto", 3, 16, 16, 3),  # one k/v head per q head: the rule's group as it is
        (3, 3, 16, 8, 3),  # an explicit setting as it is
    ],
)
def test_onepass_head_group_of_grouped_query_heads(setting, rule, h, h_kv, expected, monkeypatch,
                                                   set_options):  # fmt: skip
    """Where the L2 rule groups k/v heads of grouped-query attention, the group is rounded up
    to a power of two (GQA_POW2_GROUPS) under ``head_group="auto"``."""
    monkeypatch.setattr(gluon_bwd, "sm_count", lambda t: 132)
    monkeypatch.setattr(
        gluon_bwd, "head_group_args", lambda t, bh, rows, d: {"head_group": min(rule, bh)}
    )
    set_options(options.Options(head_group=setting))
    q = torch.empty(1, h, 4096, 128, device="meta")
    k = torch.empty(1, h_kv, 4096, 128, device="meta")
    assert gluon_bwd.head_group(q, k, True) == expected
    assert gluon_bwd.GQA_POW2_GROUPS is True


@pytest.mark.parametrize(
    ("d", "b", "h", "n", "causal", "expected"),
    [
        (128, 1, 2, 2048, True, True),  # d = 128: MIN_KEYS
        (128, 1, 2, 2047, False, False),
        (64, 1, 32, 2048, False, False),  # 512 programs, 4 waves: twice MIN_KEYS
        (64, 1, 16, 4096, False, True),
        (64, 8, 16, 2048, False, True),  # 2048 programs, 15.5 waves: MIN_KEYS
        (64, 1, 16, 4096, True, False),  # causal, 4 waves: four times MIN_KEYS
        (64, 1, 8, 8192, True, True),
        (64, 8, 16, 2048, True, False),  # causal, 15.5 waves: twice MIN_KEYS
        (64, 4, 32, 4096, True, True),
    ],
)
def test_onepass_enough_keys(d, b, h, n, causal, expected, monkeypatch):
    """d = 128 from MIN_KEYS keys; d = 64 from a multiple of it that falls on grids of
    D64_MANY_WAVES waves (132 SMs, as an H100 or H200)."""
    monkeypatch.setattr(gluon_bwd, "sm_count", lambda t: 132)
    q = torch.empty(b, h, n, d, device="meta")
    assert gluon_bwd.enough_keys(q, q, causal) is expected
    assert (gluon_bwd.MIN_KEYS, gluon_bwd.D64_MANY_WAVES) == (2048, 8)


@pytest.mark.parametrize("cap", [0, -1, 1.5, True])
def test_onepass_head_group_refuses_a_bad_cap(cap):
    q = torch.zeros(1, 2, 256, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="cap: expected a positive int"):
        gluon_bwd.head_group(q, q, True, cap)


@pytest.mark.skipif(not gluon_dkdv.HAVE_GLUON, reason="this Triton has no Gluon")
def test_onepass_compiles_for_hopper():
    """The one-pass backward compiles for sm_90 without a GPU, with its register split:
    the math warpgroups raised, the loader and reducer warps lowered to 24."""
    env = {**os.environ, "PYTHONPATH": str(Path(gluon_dkdv.__file__).parents[1])}
    env.pop("TRITON_INTERPRET", None)
    script = BENCH.parent / "onepass_bwd.py"
    out = subprocess.run(
        [sys.executable, str(script), "offline", "ws"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("ws "))
    assert "reg " in line, line
    assert "'24'" in line, line
    assert f"'{gluon_bwd.MATH_REGS}'" in line, line


def test_gluon_forward_never_applies_off_gpu():
    q = torch.zeros(1, 2, 16384, 128, dtype=torch.bfloat16)
    lse = torch.zeros(1, 2, 16384)
    assert not gluon_fwd.try_fwd(q, q, q, q, lse, True, 0.1)


def test_gluon_forward_defaults():
    """The measured head dims: d = 128 with 128-row programs of two 64-row warpgroups; d = 64
    with three (192 rows, 160 registers per math thread, which compiles without spills) from
    2048 keys on grids of 8 waves or more."""
    assert set(gluon_fwd.DEFAULTS) == {64, 128}
    cfg = gluon_fwd.DEFAULTS[128]
    assert cfg["block_m"] == 128
    assert cfg["min_keys"] >= 1
    d64 = gluon_fwd.DEFAULTS[64]
    assert (d64["block_m"], d64["consumer_regs"]) == (192, 160)
    assert (d64["min_keys"], d64["min_waves"]) == (2048, 8)
    # d = 64 below min_waves waves: non-causal calls from 2048 keys on the persistent grid,
    # with two math warpgroups (128-row tiles)
    assert (d64["min_keys_persistent"], d64["max_keys_persistent_causal"]) == (2048, 0)
    assert d64[gluon_fwd.PERSISTENT_TILES] == {"block_m": 128, "consumer_regs": 240}


@pytest.mark.skipif(not gluon_dkdv.HAVE_GLUON, reason="this Triton has no Gluon")
@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("block_m", 64),
        ("block_n", 256),
        ("persistent", True),
        ("persistent", -1),
        ("tma_store", 1),
        ("serpentine", "yes"),
    ],
)
def test_gluon_forward_rejects_tiles_it_cannot_run(name, value):
    q = torch.zeros(1, 2, 256, 128, dtype=torch.bfloat16)
    lse = torch.zeros(1, 2, 256)
    with pytest.raises(ValueError, match=name):
        gluon_fwd.launch_fwd(q, q, q, q, lse, True, 0.1, **{name: value})


def test_gluon_forward_dispatch_rule(monkeypatch, set_options):
    """Where the kernels would apply, the Gluon forward runs from min_keys keys with the
    shipped tiles and head groups; Options.head_group other than auto overrides the groups."""
    launches = []
    monkeypatch.setattr(gluon_fwd, "_applies", lambda *t, defaults=None: True)
    monkeypatch.setattr(gluon_fwd, "launch_fwd", lambda *a, **kw: launches.append(kw))
    group = {"heads": 3}  # what the L2 rule (or the option) says, per case below
    monkeypatch.setattr(gluon_fwd, "head_group_args", lambda *a: {"head_group": group["heads"]})
    cfg = gluon_fwd.DEFAULTS[128]
    # Causal, past the persistent grid's cap: one program per tile from min_keys keys.
    n = max(cfg["min_keys"], cfg["max_keys_persistent_causal"] + 1)
    q = torch.zeros(2, 8, n, 128, dtype=torch.bfloat16)
    kv = torch.zeros(2, 2, n, 128, dtype=torch.bfloat16)
    lse = torch.zeros(2, 8, n)
    short = kv[:, :, : cfg["min_keys_persistent"] - 1]
    assert not gluon_fwd.try_fwd(q, short, short, q, lse, True, 0.1)
    assert not launches
    assert gluon_fwd.try_fwd(q, kv, kv, q, lse, True, 0.1)
    shipped = {k: v for k, v in cfg.items() if k not in gluon_fwd.RULES and k != "serpentine"}
    assert launches == [shipped]
    assert shipped["tma_store"] is True
    set_options(head_group="off")
    assert gluon_fwd.try_fwd(q, kv, kv, q, lse, True, 0.1)
    assert launches[-1]["head_group"] == 3  # from head_group_args, which reads the option
    set_options(head_group="auto")
    group["heads"] = 1 << 20  # the plain order: the heads' K / V fit L2
    long_q = torch.zeros(1, 16, 16384, 64, dtype=torch.bfloat16)
    monkeypatch.setattr(gluon_fwd, "sm_count", lambda t: 132)
    # d = 128: the persistent grid from min_keys_persistent keys, one program per SM,
    # whatever the head-group option; causal only up to max_keys_persistent_causal keys
    # (tiles in the serpentine order), per tile beyond.
    m = cfg["min_keys_persistent"]
    assert m < n
    few_keys = kv[:, :, :m]
    assert gluon_fwd.try_fwd(q, few_keys, few_keys, q, lse, False, 0.1)
    persistent = {k: v for k, v in shipped.items() if k != "head_group"}
    assert launches[-1] == {**persistent, "serpentine": True, "persistent": 132}
    assert gluon_fwd.try_fwd(q, few_keys, few_keys, q, lse, True, 0.1)
    assert launches[-1]["persistent"] == 132
    # Causal, where the L2 rule would launch heads in groups: not the persistent grid (its
    # causal order reads every head at once); below min_keys that is the Triton forward.
    group["heads"] = 2
    n_launches = len(launches)
    assert not gluon_fwd.try_fwd(q, few_keys, few_keys, q, lse, True, 0.1)
    assert len(launches) == n_launches
    assert gluon_fwd.try_fwd(q, few_keys, few_keys, q, lse, False, 0.1)  # head by head
    assert launches[-1]["persistent"] == 132
    assert gluon_fwd.try_fwd(q, kv, kv, q, lse, True, 0.1)  # per tile, from min_keys
    assert "persistent" not in launches[-1]
    group["heads"] = 1 << 20
    cap = cfg["max_keys_persistent_causal"]
    assert m <= cap < 16384
    capped = torch.zeros(1, 2, cap + 1, 128, dtype=torch.bfloat16)
    assert gluon_fwd.try_fwd(capped, capped, capped, capped, lse, True, 0.1)
    assert "persistent" not in launches[-1]
    assert "serpentine" not in launches[-1]
    assert gluon_fwd.try_fwd(capped, capped, capped, capped, lse, False, 0.1)
    assert launches[-1]["persistent"] == 132
    fewer = kv[:, :, : m - 1]
    assert not gluon_fwd.try_fwd(q, fewer, fewer, q, lse, False, 0.1)
    assert not gluon_fwd.try_fwd(q, fewer, fewer, q, lse, True, 0.1)
    assert gluon_fwd.try_fwd(q, kv, kv, q, lse, False, 0.1)  # long: persistent too
    assert launches[-1]["persistent"] == 132
    # d = 64 on 176 programs of 192 rows (1.3 waves): the Triton forward's
    assert not gluon_fwd.try_fwd(q[..., :64], kv[..., :64], kv[..., :64], q, lse, True, 0.1)
    assert gluon_fwd.try_fwd(long_q, long_q, long_q, long_q, lse, True, 0.1)  # 10.4 waves
    assert launches[-1]["block_m"] == 192
    assert launches[-1]["consumer_regs"] == 160
    assert "min_waves" not in launches[-1]
    few = long_q[:, :8]  # 688 programs of 192 rows: 5.2 waves, the Triton forward's
    assert not gluon_fwd.try_fwd(few, few, few, few, lse, True, 0.1)
    batch = torch.zeros(8, 16, 2048, 64, dtype=torch.bfloat16)  # 1408 programs: 10.7 waves
    assert gluon_fwd.try_fwd(batch, batch, batch, batch, lse, False, 0.1)
    assert launches[-1]["block_m"] == 192
    one = batch[:1, :, :, :]  # 176 programs: 1.3 waves; non-causal: the persistent grid
    assert gluon_fwd.try_fwd(one, one, one, one, lse, False, 0.1)
    d64 = gluon_fwd.DEFAULTS[64]
    per_tile = {k: v for k, v in d64.items() if k not in gluon_fwd.RULES}
    per_tile.pop(gluon_fwd.PERSISTENT_TILES)
    assert launches[-1] == {
        **{k: v for k, v in per_tile.items() if k != "head_group"},
        "block_m": 128, "consumer_regs": 240, "persistent": 132,
    }  # fmt: skip
    assert not gluon_fwd.try_fwd(one, one, one, one, lse, True, 0.1)  # causal: Triton's
    assert gluon_fwd.try_fwd(long_q, long_q, long_q, long_q, lse, False, 0.1)  # 10.4 waves
    assert launches[-1] == per_tile  # one program per tile, heads in groups
    short_kv = batch[:, :, :2047]  # many waves, but under min_keys keys
    assert not gluon_fwd.try_fwd(batch, short_kv, short_kv, batch, lse, False, 0.1)
    assert not gluon_fwd.try_fwd(one, one[:, :, :2047], one[:, :, :2047], one, lse, False, 0.1)
    set_options(head_group="auto", tile_configs="fwd=128,64,4,2")  # explicit Triton tiles
    assert not gluon_fwd.try_fwd(q, kv, kv, q, lse, True, 0.1)
    set_options(tile_configs="dq=128,64,8,3")  # other kinds leave the forward alone
    assert gluon_fwd.try_fwd(q, kv, kv, q, lse, True, 0.1)
    set_options(tile_configs="", autotune=True)
    assert not gluon_fwd.try_fwd(q, kv, kv, q, lse, True, 0.1)


@pytest.mark.skipif(not gluon_dkdv.HAVE_GLUON, reason="this Triton has no Gluon")
@pytest.mark.parametrize(
    ("causal", "kv_group", "persistent"), [(True, 1, False), (False, 4, False), (False, 1, True)]
)
def test_gluon_forward_compiles_for_hopper(causal, kv_group, persistent):
    """The shipped forward variants, per tile and persistent, compile for sm_90 without a
    GPU (Gluon API drift shows here before any GPU time), with their loader warp and both
    math warpgroups."""
    env = {**os.environ, "PYTHONPATH": str(Path(gluon_dkdv.__file__).parents[1])}
    env.pop("TRITON_INTERPRET", None)
    script = BENCH.parent / "gluon_fwd_ab.py"
    args = [sys.executable, str(script), "--offline", "--kv-group", str(kv_group)]
    args += ["--causal"] * causal + ["--persistent"] * persistent
    out = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "reg " in out.stdout, out.stdout
    assert "warps 12" in out.stdout, out.stdout  # 4 + 4 math warps, 1 loader, padded
    assert int(out.stdout.split("wgmma ")[1].split()[0]) > 0


@pytest.mark.skipif(not gluon_dkdv.HAVE_GLUON, reason="this Triton has no Gluon")
def test_three_warpgroup_forward_compiles_for_hopper():
    """The forward with three math warpgroups (192 query rows at d = 64, a benchmark
    variant) compiles for sm_90 without spills at 160 registers per math thread."""
    env = {**os.environ, "PYTHONPATH": str(Path(gluon_dkdv.__file__).parents[1])}
    env.pop("TRITON_INTERPRET", None)
    script = BENCH.parent / "gluon_fwd_ab.py"
    args = ["--offline", "--head-dim", "64", "--block-m", "192", "--regs", "160"]
    out = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "warps 16" in out.stdout, out.stdout  # 3 x 4 math warps, 1 loader, padded
    assert "stack   0" in out.stdout, out.stdout  # no spills
    assert "local 0" in out.stdout, out.stdout
    assert "'160'" in out.stdout, out.stdout  # the worker warpgroups' setmaxnreg


def test_tma_layout_rule():
    """What the 4-D descriptors accept: a unit last stride, a 16-byte aligned base and
    16-byte multiple strides (a (B, N, H, d) buffer seen as (B, H, N, d) qualifies)."""
    x = torch.zeros(2, 300, 3, 4, 128, dtype=torch.bfloat16)
    assert gluon_dkdv._tma_ok(x[:, :, 0].transpose(1, 2))
    assert gluon_dkdv._tma_ok(torch.zeros(2, 4, 300, 128, dtype=torch.float16))
    padded = torch.zeros(2, 4, 300, 129, dtype=torch.bfloat16)
    assert not gluon_dkdv._tma_ok(padded[..., :128])  # 258-byte rows
    assert not gluon_dkdv._tma_ok(padded[..., 1:])  # base 2 bytes off


def test_rows_by_tma_rule():
    """Row statistics go by 1-D TMA only where every tile starts on a 16-byte boundary:
    contiguous float32 (B, H, n_q) with n_q a multiple of 4."""
    lse = torch.zeros(2, 3, 1000)
    assert gluon_dkdv.rows_by_tma(lse, torch.zeros_like(lse))
    for n_q in (777, 1, 1002):  # b*h*n_q + row would start mid-16-byte
        odd = torch.zeros(2, 3, n_q)
        assert not gluon_dkdv.rows_by_tma(odd, torch.zeros_like(odd))
    assert not gluon_dkdv.rows_by_tma(lse, torch.zeros(2, 3, 1000, dtype=torch.float64))
    assert not gluon_dkdv.rows_by_tma(torch.zeros(2, 1000, 3).transpose(1, 2), lse)
    assert not gluon_dkdv.rows_by_tma(torch.zeros(2 * 3 * 1000 + 1)[1:].view(2, 3, 1000), lse)


def test_defaults_cover_only_measured_head_dims():
    assert set(gluon_dkdv.DEFAULTS) == {128}
    assert set(gluon_dq.DEFAULTS) == {128}
    assert gluon_dq.DEFAULTS[128]["block_m"] % 64 == 0
    for cfg in gluon_dkdv.DEFAULTS.values():
        assert cfg["block_n"] % 64 == 0
        assert cfg["block_m"] in (32, 64)


@pytest.mark.skipif(not gluon_dkdv.HAVE_GLUON, reason="this Triton has no Gluon")
@pytest.mark.parametrize(
    ("kernel", "shape", "grouped", "kv_group", "flags"),
    [
        ("dkdv", "2,1,256,128", False, 1, ""),
        ("dkdv", "2,1,256,64", False, 1, ""),
        ("dq", "2,1,256,128", False, 1, ""),
        ("dkdv", "2,1,256,128", True, 1, ""),
        ("dq", "2,1,256,128", True, 1, ""),
        ("dkdv", "2,4,256,128", False, 4, ""),
        ("dq", "2,4,256,128", False, 4, ""),
        ("dkdv", "2,1,256,128", False, 1, ",ts"),
        ("dkdv", "2,4,256,128", True, 4, ",ts"),
    ],
)
def test_kernel_compiles_for_hopper(kernel, shape, grouped, kv_group, flags):
    """The default d = 128 variants (and a d = 64 dK/dV one) compile for sm_90 (catches
    Gluon API drift across Triton versions before any GPU time is spent), also in the
    head-grouped order, whose index math is the @triton.jit ``kernels._grouped_program``,
    for grouped-query heads (kv_group q heads per k/v head), and with dK, dV stored by TMA
    (``ts``)."""
    env = {**os.environ, "PYTHONPATH": str(Path(gluon_dkdv.__file__).parents[1])}
    env.pop("TRITON_INTERPRET", None)
    spec = "32,64,4,128"  # d = 64: an explored variant; d = 128: the default (row_tma: rt)
    if shape.endswith("128"):
        cfg = (gluon_dkdv if kernel == "dkdv" else gluon_dq).DEFAULTS[128]
        spec = f"{cfg['block_m']},{cfg['block_n']},{cfg['stages']},{cfg['maxnreg'] or 0}"
        spec += ",rt" * bool(cfg.get("row_tma"))
    spec += flags
    args = [sys.executable, str(BENCH), "--kernel", kernel, "offline", spec, "--shape", shape]
    out = subprocess.run(
        args + ["--grouped"] * grouped + ["--kv-group", str(kv_group)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "reg " in out.stdout, out.stdout
    assert "schedule: " in out.stdout, out.stdout
    assert "M" in out.stdout.split("schedule: ")[1], "no wgmma in the compiled kernel"


def _ab_defaults():
    import importlib.util

    path = BENCH.parent / "ab_defaults.py"
    spec = importlib.util.spec_from_file_location("ab_defaults", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_ab_defaults_shapes_and_errors(capsys):
    """benchmarks/ab_defaults.py: its shape syntax, and clear errors before any GPU work."""
    ab = _ab_defaults()
    assert ab.parse_shape("2,32,32768,view") == (2, 32, 32768, True, True)
    assert ab.parse_shape("1,16,4096,nc") == (1, 16, 4096, False, False)
    for bad in ("2,32", "2,32,x", "2,32,64,causal"):
        with pytest.raises(ValueError, match="B,H,N"):
            ab.parse_shape(bad)
    with pytest.raises(SystemExit) as e:
        ab.main(["gluon-dq", "2,8,bad"])
    assert e.value.code == 2
    assert "B,H,N" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ab.main(["fwd-tile", "2,8,1000", "--old", "1,2"])
    with pytest.raises(SystemExit):
        ab.main(["tile", "2,8,1000", "--d", "64", "--new", "32,64,4", "--old", "32,64,4,3"])
    before = options.get_options()
    with pytest.raises(SystemExit):
        ab.main(["head-group", "2,8,1000", "--new", "fast", "--old", "off"])
    assert "head_group" in capsys.readouterr().err
    assert options.get_options() == before
    with pytest.raises(SystemExit):
        ab.main(["gluon-dq", "2,8,1000", "--d", "64"])
    assert "--d" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            ab.main(["gluon-dq", "2,8,1000"])
        assert "needs a CUDA GPU" in capsys.readouterr().err


def test_ab_defaults_restores_what_it_switched(monkeypatch, set_options):
    """After a comparison the caller's override / head-group setting is back, and the
    Gluon defaults are in place (benchmarks/ab_defaults.py ``_restore``)."""
    from flashattn_triton import configs

    ab = _ab_defaults()
    mine = configs.TileConfig.parse("32,64,4,3")
    monkeypatch.setattr(configs, "OVERRIDES", {"dkdv": mine})
    pairs = ab.sides("tile", "64,64,4,3", "32,64,4,2", "dkdv")
    pairs[1][1]()
    ab._restore("tile", "dkdv", (mine, None), pairs)
    assert configs.OVERRIDES["dkdv"] is mine
    assert len(configs.OVERRIDES) == 1
    set_options(head_group="off")
    pairs = ab.sides("head-group", "off", "4")
    pairs[0][1]()
    assert options.get_options().head_group == 4
    ab._restore("head-group", "dkdv", (None, "off"), pairs)
    assert options.get_options().head_group == "off"
    before = dict(gluon_dq.DEFAULTS)
    pairs = ab.sides("gluon-dq", "64,64,4,3")
    pairs[1][1]()
    assert not gluon_dq.DEFAULTS
    ab._restore("gluon-dq", "dkdv", (None, None), pairs)
    assert dict(gluon_dq.DEFAULTS) == before


def test_ab_defaults_source_mode(tmp_path, capsys):
    """``source``: --old must hold a flashattn_triton package (clear error before any GPU
    work); a copy of this package loads under another name next to the installed one, and
    the switches point run()'s target at one launch module or the other."""
    import shutil

    from flashattn_triton import launch

    ab = _ab_defaults()
    with pytest.raises(SystemExit) as e:
        ab.main(["source", "2,8,1000", "--d", "64", "--old", str(tmp_path)])
    assert e.value.code == 2
    assert "no flashattn_triton/__init__.py" in capsys.readouterr().err
    shutil.copytree(Path(launch.__file__).parent, tmp_path / "flashattn_triton")
    target = {}
    pairs = ab.sides("source", str(tmp_path), target=target)
    old_launch = ab.load_source(str(tmp_path))
    assert old_launch.__name__ == f"{ab.OLD_PACKAGE}.launch"
    assert old_launch is not launch
    assert Path(old_launch.__file__).parent == tmp_path / "flashattn_triton"
    # the copy's custom ops live in its own namespace; ours keep their implementation
    assert torch.ops.flashattn_triton_old.fwd.default is not torch.ops.flashattn_triton.fwd.default
    from flashattn_triton import ops

    assert ops.NAMESPACE == "flashattn_triton"
    pairs[1][1]()
    assert target["launch"] is old_launch
    pairs[0][1]()
    assert target["launch"] is launch
