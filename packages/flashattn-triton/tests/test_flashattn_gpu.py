"""GPU tests of the Triton kernels at real sizes (run with `nox -s gpu_tests`).

Tolerances: for float16/bfloat16 the kernel's error against a float64
reference must be at most 2x PyTorch SDPA's error on the same inputs (+1e-4 for cases where
both are tiny). float32 runs the matrix units in tf32x3 (torch's default 'highest' matmul
precision): error < 1e-4, about 2^-21 per product summed over d and the keys. L is checked
absolutely: fp32 accumulation of the same rounded inputs, |L - L_ref| < 1e-3 (1 + |L_ref|).
Shapes are chosen to share compiled kernels (compile time dominates this file).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from flashattn_testutil import reference_fwd_bwd, rel_err, run_fwd_bwd, saved_lse

import flashattn_triton
from flashattn_triton import (
    FlashAttention2Triton,
    flash_attention,
    gluon_bwd,
    gluon_fwd,
    launch,
    launch_backward,
)

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _inputs(shape_q, n_k, dtype, seed=None):
    g = torch.Generator(device=DEV)
    g.manual_seed(seed if seed is not None else torch.seed() % 2**31)
    *lead, n_q, d = shape_q
    q = torch.randn(*lead, n_q, d, device=DEV, generator=g).to(dtype)
    k = torch.randn(*lead, n_k, d, device=DEV, generator=g).to(dtype)
    v = torch.randn(*lead, n_k, d, device=DEV, generator=g).to(dtype)
    do = torch.randn(*lead, n_q, d, device=DEV, generator=g).to(dtype)
    return q, k, v, do


def _sdpa(q, k, v, causal):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _check(q, k, v, do, causal, compare_sdpa=True):
    """Compare ours (o, L, dq, dk, dv) with a float64 reference and with SDPA's error."""
    ref = reference_fwd_bwd(q, k, v, do, causal)
    ours = run_fwd_bwd(FlashAttention2Triton.apply, q, k, v, do, causal)
    for name in ("o", "dq", "dk", "dv"):
        assert torch.isfinite(ours[name]).all(), f"{name} has NaN/inf"
    qq = q.detach().clone().requires_grad_()
    o = FlashAttention2Triton.apply(qq, k, v, causal)
    lse = saved_lse(o, q)
    fin = torch.isfinite(ref["lse"])
    assert torch.equal(torch.isneginf(lse), ~fin), "rows without keys must have L = -inf"
    err_l = (lse[fin].double() - ref["lse"][fin]).abs() / (1 + ref["lse"][fin].abs())
    assert err_l.max().item() < 1e-3 if err_l.numel() else True
    errs = {name: rel_err(ours[name], ref[name]) for name in ("o", "dq", "dk", "dv")}
    if q.dtype == torch.float32:
        bound = dict.fromkeys(errs, 0.0001)
    elif compare_sdpa:
        sdpa = run_fwd_bwd(_sdpa, q, k, v, do, causal)
        bound = {name: 2 * rel_err(sdpa[name], ref[name]) + 1e-4 for name in errs}
    else:
        bound = dict.fromkeys(errs, 0.02)
    bad = {n: (errs[n], bound[n]) for n in errs if not errs[n] <= bound[n]}
    assert not bad, f"errors above bounds: {bad}"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    ("dtype", "d"),
    [(torch.bfloat16, d) for d in (16, 32, 64, 128)]
    + [(torch.float16, 64), (torch.float16, 128), (torch.float32, 32), (torch.float32, 128)],
)
def test_dtypes_and_head_dims(dtype, d, causal):
    q, k, v, do = _inputs((2, 3, 257, d), 257, dtype)
    _check(q, k, v, do, causal)


@pytest.mark.parametrize("n", [1, 1000, 4096])
@pytest.mark.parametrize("causal", [False, True])
def test_lengths(n, causal):
    q, k, v, do = _inputs((2, 2, n, 64), n, torch.bfloat16)
    _check(q, k, v, do, causal)


def test_leaderboard_length_16384():
    """(1, 16384, 64) bf16 causal: the leaderboard's length, one head (float64 reference)."""
    q, k, v, do = _inputs((1, 16384, 64), 16384, torch.bfloat16)
    _check(q, k, v, do, True)


@pytest.mark.parametrize(
    ("n_q", "n_k", "causal"), [(300, 500, False), (300, 500, True), (500, 300, True)]
)
def test_unequal_lengths(n_q, n_k, causal):
    """Causal with Nq != Nk is bottom-right aligned (SDPA aligns top-left: not compared)."""
    q, k, v, do = _inputs((2, 2, n_q, 64), n_k, torch.bfloat16)
    _check(q, k, v, do, causal, compare_sdpa=not causal)


@pytest.mark.parametrize("scheme", ["split", "fused", "atomic"])
def test_backward_schemes(scheme, monkeypatch, set_options):
    set_options(backward=scheme)
    q, k, v, do = _inputs((2, 3, 1000, 64), 1000, torch.bfloat16)
    _check(q, k, v, do, True)


@pytest.mark.parametrize(("shape", "causal", "kinds"), [
    ((1, 1, 16500, 64), True, {"fwd", "fused"}),  # 129 programs of 128 rows: small grid
    ((1, 1, 16500, 64), False, {"fwd", "dkdv", "dq"}),
    ((2, 4, 8000, 64), True, {"fwd", "dkdv", "dq"}),  # shorter than the measured lengths
])  # fmt: skip
def test_auto_scheme_by_grid_size(shape, causal, kinds, monkeypatch, set_options):
    """The default (auto) backward's Triton schemes: fused on small causal grids, split
    elsewhere; both within the accuracy bounds. The Gluon kernels that take long rows on
    Hopper are held off: the one-pass backward (its rule: test_flashattn_onepass_gpu.py)
    and the d = 64 Gluon forward from 2048 keys (test_flashattn_gluon_fwd_gpu.py)."""
    set_options(backward="auto")
    monkeypatch.setattr(gluon_bwd, "MIN_KEYS", 1 << 40)
    never = {"min_keys": 1 << 40, "min_keys_persistent": 1 << 40}
    monkeypatch.setitem(gluon_fwd.DEFAULTS, 64, {**gluon_fwd.DEFAULTS[64], **never})
    seen = set()
    run = launch._run

    def spy(kind, *args, **kwargs):
        seen.add(kind)
        return run(kind, *args, **kwargs)

    for module in (launch, launch_backward):  # the forward's kernels, the backward's
        monkeypatch.setattr(module, "_run", spy)
    q, k, v, do = _inputs(shape, shape[2], torch.bfloat16)
    _check(q, k, v, do, causal)
    assert seen == kinds


@pytest.mark.parametrize("d", [64, 80])
@pytest.mark.parametrize("scheme", ["split", "atomic"])
def test_tma_tile_flags(scheme, d, monkeypatch, set_options):
    """The opt-in `tma` tile flag (TMA loads; for atomic also TMA dQ reductions) on a ragged
    length and a padded head dim: same accuracy bounds as the default path."""
    from dataclasses import replace

    from flashattn_triton import configs

    q, k, v, do = _inputs((2, 3, 1000, d), 1000, torch.bfloat16)
    if not launch.tma_usable(q):
        pytest.skip("TMA needs compute capability >= 9.0")
    block_d = configs.block_d_for(d)
    kinds = ("fwd", "dq", "dkdv") if scheme == "split" else ("fwd", "atomic")
    monkeypatch.setattr(
        configs,
        "OVERRIDES",
        {
            kind: replace(configs.default_config(kind, 1000, 1000, block_d, 2), tma=True)
            for kind in kinds
        },
    )
    set_options(backward=scheme)
    _check(q, k, v, do, True)


def test_head_dim_padding():
    """d = 80 (padded to 128 with masked loads)."""
    q, k, v, do = _inputs((1, 2, 257, 80), 257, torch.bfloat16)
    _check(q, k, v, do, True)


def test_poisoned_outputs_are_fully_written(monkeypatch):
    """Fill every output buffer with NaN before the kernels run: none may survive."""
    real = launch.out_like

    def poisoned(t, dtype=None):
        return real(t, dtype).fill_(float("nan"))

    for module in (launch, launch_backward):
        monkeypatch.setattr(module, "out_like", poisoned)
    for causal in (False, True):
        q, k, v, do = _inputs((2, 3, 257, 64), 257, torch.bfloat16)
        out = run_fwd_bwd(FlashAttention2Triton.apply, q, k, v, do, causal)
        for name, t in out.items():
            assert not torch.isnan(t).any(), f"{name} not fully written (causal={causal})"


def test_bnhd_layout_and_stride0_grad():
    """(B, N, H, d) buffers seen as (B, H, N, d) run without copies; an expanded (stride-0)
    dO as from o.sum().backward() gives the same grads as a materialized one."""
    b, n, h, d = 2, 300, 4, 64
    x = torch.randn(b, n, 3, h, d, device=DEV, dtype=torch.bfloat16)
    q, k, v = (x[:, :, i].transpose(1, 2) for i in range(3))  # (B, H, N, d) views
    do = torch.ones(b, h, n, d, device=DEV, dtype=torch.bfloat16)
    ref = reference_fwd_bwd(q, k, v, do, True)
    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
    o = flash_attention(qq, kk, vv, causal=True)
    assert o.shape == (b, h, n, d)
    o.float().sum().backward()  # dO is a stride-0 expanded tensor
    for name, t in (("dq", qq.grad), ("dk", kk.grad), ("dv", vv.grad)):
        assert rel_err(t, ref[name]) < 2e-2, name
    assert rel_err(o, ref["o"]) < 2e-2


class _AttentionLayer(torch.nn.Module):
    """A model's attention: one qkv projection seen as (B, N, 3, H, d), causal
    flash_attention on its (B, H, N, d) views. ``rotate``: an element-wise op on q and k
    first (as RoPE; inductor then lays q and k out in one fused buffer)."""

    def __init__(self, width: int, head_dim: int, rotate: bool = False):
        super().__init__()
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.heads, self.head_dim, self.rotate = width // head_dim, head_dim, rotate

    def forward(self, x):
        b, n, width = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, self.head_dim).unbind(2)
        if self.rotate:
            q, k = q * 1.5 - 0.25, k.sin()
        o = flash_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), True)
        return o.transpose(1, 2).reshape(b, n, width)


def test_torch_compile_fullgraph_model():
    """A compiled module calling flash_attention has no graph break (fullgraph=True)."""
    model = _AttentionLayer(128, 64).to(DEV, torch.bfloat16)
    x = torch.randn(2, 256, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    eager = model(x)
    compiled = torch.compile(model, fullgraph=True)
    out = compiled(x)
    out.sum().backward()
    assert rel_err(out, eager) < 1e-2
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("d", [64, 128])
def test_compiled_model_replays_launch_plans(d, monkeypatch, set_options):
    """In a compiled model (q, k from one rotated buffer, v a view of the qkv projection, as
    inductor lays them out), every call after the first per layout replays its launch plan:
    no launch goes through Triton's dispatch from the third step on, forward or backward."""
    from flashattn_triton import fastlaunch

    set_options(fast_launch=True, traced_compile=False)  # the opaque ops keep the plans
    launch.clear_plans()
    layers = [_AttentionLayer(256, d, rotate=True) for _ in range(2)]
    model = torch.compile(torch.nn.Sequential(*layers).to(DEV, torch.bfloat16))
    x = torch.randn(4, 1024, 256, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    jit_launches = []
    real = fastlaunch.launch
    monkeypatch.setattr(
        fastlaunch, "launch", lambda *a, **k: jit_launches.append(1) or real(*a, **k)
    )
    for step in range(4):
        if step == 2:
            jit_launches.clear()
        model(x).float().square().mean().backward()
    torch.cuda.synchronize()
    assert not jit_launches, f"{len(jit_launches)} launches went through Triton's dispatch"
    assert launch._PLANS.replays() >= 2


def test_compile_apply_like_leaderboard():
    """torch.compile(FlashAttention2Triton.apply, fullgraph=True) with o.sum().backward()."""
    q, k, v, _ = _inputs((4, 512, 64), 512, torch.bfloat16)
    qq, kk, vv = (t.requires_grad_() for t in (q, k, v))
    flash = torch.compile(FlashAttention2Triton.apply, fullgraph=True)
    o = flash(qq, kk, vv, True)
    o.sum().backward()
    ref = reference_fwd_bwd(q, k, v, torch.ones_like(q), True)
    assert rel_err(o, ref["o"]) < 2e-2
    assert rel_err(qq.grad, ref["dq"]) < 2e-2


def test_flops_helpers_agree_with_leaderboard_count():
    f = flashattn_triton.attention_flops(16, 16384, 16384, 64, True, "fwd")
    assert math.isclose(f, 4 * 64 * 16 * 16384 * 16385 / 2)


def _require_hopper_gluon(gluon_dkdv) -> None:
    """Skip where the Gluon kernels cannot run: no Gluon in this Triton, or not a Hopper GPU
    (compute capability 9)."""
    if not gluon_dkdv.HAVE_GLUON or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels run on Hopper GPUs (compute capability 9) only")


def _spy_gluon(monkeypatch):
    """Record, per backward, whether the Gluon dK/dV and dQ kernels ran, as (dK/dV, dQ)
    pairs. The split backward runs its dQ kernel first, then asks gluon_dkdv.try_dkdv (on
    every CUDA backward), so a Gluon dQ launch pairs with the try_dkdv call after it."""
    from flashattn_triton import gluon_dkdv, gluon_dq

    calls: list[tuple[bool, bool]] = []
    dq_launched: list[bool] = []
    real_dkdv, real_launch_dq = gluon_dkdv.try_dkdv, gluon_dq.launch_dq

    def spy_launch_dq(*args, **kwargs):
        real_launch_dq(*args, **kwargs)
        dq_launched.append(True)

    def spy_dkdv(*args, **kwargs):
        calls.append((real_dkdv(*args, **kwargs), bool(dq_launched)))
        dq_launched.clear()
        return calls[-1][0]

    monkeypatch.setattr(gluon_dkdv, "try_dkdv", spy_dkdv)
    monkeypatch.setattr(gluon_dq, "launch_dq", spy_launch_dq)
    return gluon_dkdv, calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("shape", "n_k", "causal"),
    [
        ((2, 3, 1000, 128), 1000, True),  # ragged: 1000 = 15.6 tiles of 64
        ((2, 2, 777, 128), 777, False),
        ((1, 2, 300, 128), 500, True),  # bottom-right causal, Nq < Nk
        ((1, 2, 500, 128), 300, True),  # Nq > Nk: the first rows see no key
        ((1, 1, 1, 128), 1, True),
        ((4, 16, 2048, 128), 2048, True),  # a model's shape
    ],
)
def test_gluon_dkdv_on_hopper(shape, n_k, causal, dtype, monkeypatch, set_options):
    """d = 128 on Hopper: the split backward's dK/dV and dQ come from the Gluon kernels,
    within the same bounds as every other path."""
    set_options(backward="split")
    set_options(gluon=True)
    gluon_dkdv, calls = _spy_gluon(monkeypatch)
    _require_hopper_gluon(gluon_dkdv)
    from flashattn_triton import gluon_dq

    q, k, v, do = _inputs(shape, n_k, dtype)
    assert gluon_dkdv.applies(q, k, v, do)
    _check(q, k, v, do, causal, compare_sdpa=not (causal and shape[2] != n_k))
    # Gluon dQ on small grids or with at least MIN_KEYS keys (the model shape, 4 x 16 x 2048,
    # is the latter on an H100; the ragged ones are small).
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    small = shape[0] * shape[1] * -(-shape[2] // 128) < gluon_dq.MAX_WAVES * sms
    assert gluon_dq.small_grid(q) == small
    assert calls == [(True, small or n_k >= gluon_dq.MIN_KEYS)]


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [True, False])
def test_head_grouped_launch_order(d, causal, monkeypatch, set_options):
    """Programs launched 3 heads at a time (7 heads: a partial last group) give the same
    accuracy; at d = 128 on Hopper this includes the Gluon dK/dV and dQ kernels."""
    set_options(head_group="3")
    set_options(backward="split")
    q, k, v, do = _inputs((7, 1000, d), 1000, torch.bfloat16)
    _check(q, k, v, do, causal)


def test_gluon_dkdv_on_strided_views(monkeypatch, set_options):
    """A model's (B, N, 3, H, d) qkv buffer seen as (B, H, N, d) views (and a transposed dO)
    runs the Gluon kernel through its 4-D descriptors."""
    set_options(backward="split")
    set_options(gluon=True)
    gluon_dkdv, calls = _spy_gluon(monkeypatch)
    _require_hopper_gluon(gluon_dkdv)
    b, n, h, d = 2, 300, 4, 128
    x = torch.randn(b, n, 3, h, d, device=DEV, dtype=torch.bfloat16)
    q, k, v = (x[:, :, i].transpose(1, 2) for i in range(3))
    do = torch.randn(b, n, h, d, device=DEV, dtype=torch.bfloat16).transpose(1, 2)
    assert not q.is_contiguous()
    assert gluon_dkdv.applies(q, k, v, do)
    _check(q, k, v, do, True)
    _check(q, k, v, do, False)
    assert calls == [(True, True), (True, True)]


@pytest.mark.parametrize(
    ("shape", "n_k", "h_kv", "causal"),
    [
        ((2, 3, 1000, 128), 1000, 3, True),  # ragged: the last key tile runs past n_k
        ((1, 2, 300, 128), 500, 2, False),
        ((2, 8, 700, 128), 700, 2, True),  # grouped-query heads: dK, dV per k/v head
    ],
)
def test_gluon_dkdv_tma_store_matches_register_stores(shape, n_k, h_kv, causal, monkeypatch):
    """dK, dV stored by TMA through the K / V buffers equal the register stores bit for bit
    (the same products and rounding), on a qkv-buffer view too; rows past n_k are left."""
    from flashattn_triton import configs, gluon_dkdv, launch

    _require_hopper_gluon(gluon_dkdv)
    b, h, n_q, d = shape
    q, do = (torch.randn(b, h, n_q, d, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    kv = torch.randn(b, n_k + 64, 2, h_kv, d, device=DEV, dtype=torch.bfloat16)
    k, v = (kv[:, :n_k, i].transpose(1, 2) for i in range(2))  # strided (B, Hkv, N, d)
    scale = d**-0.5
    o, lse = launch.forward(q, k, v, causal, scale)
    delta = (do.float() * o.float()).sum(-1)
    rows = -(-n_q // configs.STATS_ROWS) * configs.STATS_ROWS  # padded as the launcher does
    lse_p, delta_p = (
        torch.nn.functional.pad(t, (0, rows - n_q)).contiguous() for t in (lse, delta)
    )
    cfg = {**gluon_dkdv.DEFAULTS[128], "row_tma": True}
    out = {}
    for tma_store in (False, True):
        buf = torch.full((b, n_k + 64, 2, h_kv, d), 7.0, device=DEV, dtype=torch.bfloat16)
        dk, dv = (buf[:, :, i].transpose(1, 2) for i in range(2))  # rows past n_k: 7
        gluon_dkdv.launch_dkdv(
            q, k, v, do, lse_p, delta_p, dk[:, :, :n_k], dv[:, :, :n_k], causal, scale,
            **{**cfg, "tma_store": tma_store},
        )  # fmt: skip
        torch.cuda.synchronize()
        out[tma_store] = buf
    assert torch.isfinite(out[True][:, :n_k]).all()
    assert torch.equal(out[False], out[True])
    assert (out[True][:, n_k:] == 7.0).all()  # nothing written past the tensors' rows


def test_gluon_dkdv_falls_back(monkeypatch, set_options):
    """Inputs TMA cannot read (a base 2 bytes past 16-byte alignment, 258-byte rows), and
    FLASHATTN_TRITON_GLUON=0, take the Triton kernel, with the Gluon path's gradients."""
    set_options(backward="split")
    set_options(gluon=True)
    gluon_dkdv, calls = _spy_gluon(monkeypatch)
    b, h, n, d = 2, 3, 300, 128
    scale = d**-0.5
    buf = torch.randn(4, b, h, n, d + 1, device=DEV, dtype=torch.bfloat16)
    q, k, v, do = (buf[i, ..., 1:] for i in range(4))
    assert not gluon_dkdv.applies(q, k, v, do)
    o, lse = launch.forward(q, k, v, True, scale)
    strided = launch.backward(do, q, k, v, o, lse, True, scale)
    dense = [t.contiguous() for t in (do, q, k, v, o)]
    gluon = launch.backward(*dense, lse, True, scale)
    set_options(gluon=False)
    off = launch.backward(*dense, lse, True, scale)
    has_gluon = gluon_dkdv.HAVE_GLUON and torch.cuda.get_device_capability()[0] == 9
    assert calls == [(False, False), (has_gluon, has_gluon), (False, False)]
    for name, a, g, t in zip(("dq", "dk", "dv"), strided, gluon, off):
        assert rel_err(a, t) < 1e-3, name  # the same Triton kernels
        assert rel_err(g, t) < 1e-2, name  # Gluon against Triton: bf16 rounding apart


def _fwd_bwd_outputs(q, k, v, do, causal):
    qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = flash_attention(qq, kk, vv, causal=causal)
    o.backward(do)
    return o.detach(), qq.grad, kk.grad, vv.grad


@pytest.mark.parametrize(
    ("shape", "n_k", "causal", "dtype", "layout"),
    [
        ((2, 4, 1000, 64), 1000, True, torch.bfloat16, "plain"),  # ragged, split + TMA
        ((2, 4, 512, 64), 512, False, torch.float16, "model"),  # (B, N, H, d) views
        ((1, 2, 16384, 64), 16384, True, torch.bfloat16, "plain"),  # small grid: fused
        ((2, 8, 1024, 128), 1024, True, torch.bfloat16, "plain"),  # d = 128 (Gluon dK/dV)
        ((1, 4, 4096, 128), 4096, True, torch.bfloat16, "model"),  # Gluon dQ too
        ((2, 3, 77, 40), 120, False, torch.bfloat16, "plain"),  # padded head dim, Nq != Nk
        ((1, 2, 300, 64), 300, True, torch.float32, "plain"),  # tf32x3
        ((2, 8, 4, 128), 8192, True, torch.bfloat16, "plain"),  # split-KV decode forward
    ],
)
def test_fast_launch_replays_exactly(shape, n_k, causal, dtype, layout, set_options, monkeypatch):
    """Replayed launches (fastlaunch) give bit-for-bit the outputs of Triton's dispatch on
    fresh inputs of the same layout, and the replay path is really taken: for 16-bit inputs
    by the remembered call (no plan key derived again, also where the backward's row
    statistics need padding); float32 calls derive their plan key each time."""
    b, h, n_q, d = shape
    if d == 128:  # the one-pass backward sums dQ in no fixed order (its replays: onepass tests)
        set_options(backward="split")

    def make(seed):
        if layout == "model":
            g = torch.Generator(device=DEV).manual_seed(seed)
            qkv = torch.randn(b, n_q, 3, h, d, device=DEV, generator=g).to(dtype)
            q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
            do = torch.randn(b, n_q, h, d, device=DEV, generator=g).to(dtype).transpose(1, 2)
            return q, k, v, do
        return _inputs(shape, n_k, dtype, seed=seed)

    set_options(fast_launch=False)
    launch.clear_plans()
    first = make(1)
    want = _fwd_bwd_outputs(*first, causal)
    set_options(fast_launch=True)
    _fwd_bwd_outputs(*make(2), causal)  # records the plans
    assert launch._PLANS.replays() >= 2, "forward and backward should both be replayed"
    planned = []
    for module in (launch, launch_backward):
        real = module._launch_planned
        monkeypatch.setattr(
            module, "_launch_planned", lambda *a, _real=real: planned.append(1) or _real(*a)
        )
    got = _fwd_bwd_outputs(*first, causal)  # replayed on the first inputs
    for name, a, w in zip(("o", "dq", "dk", "dv"), got, want):
        assert torch.equal(a, w), f"{name} differs between replay and dispatch"
    if dtype == torch.float32:
        assert len(planned) == 2
    else:
        assert not planned, planned


def test_runs_from_a_fresh_thread():
    """A thread that never made a CUDA call (no current context) can run the TMA kernels:
    their descriptors are filled through the driver API, which needs one."""
    import threading

    q, k, v, do = _inputs((2, 4, 512, 64), 512, torch.bfloat16, seed=3)
    want = _fwd_bwd_outputs(q, k, v, do, True)
    got, errors = [], []

    def work():
        try:
            got.append(_fwd_bwd_outputs(q, k, v, do, True))
        except Exception as e:  # reported below, on the test's thread
            errors.append(e)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert not errors, errors
    for a, w in zip(got[0], want):
        assert torch.equal(a, w)
