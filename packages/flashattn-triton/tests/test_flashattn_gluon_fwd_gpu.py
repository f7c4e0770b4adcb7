"""GPU tests of the Gluon d = 128 forward (``gluon_fwd``; run with `nox -s gpu_tests`).

Each case runs the public ``flash_attention`` with the Gluon forward allowed from any length
(its default starts at ``DEFAULTS[128]["min_keys"]`` keys), checks that the kernel ran, and
compares o, lse and the three gradients with a float64 reference: errors at most 2x SDPA's
on the same inputs (+1e-4), lse within 1e-3 (1 + |lse|), -inf exactly for rows without keys.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from flashattn_testutil import reference_features, rel_err

from flashattn_triton import flash_attention, gluon_dkdv, gluon_fwd, launch

pytestmark = pytest.mark.gpu
DEV = "cuda"


@pytest.fixture
def gluon_forward(monkeypatch):
    """Counts the Gluon forward's launches; ``allow(min_keys, head_dim, **over)`` sets where
    it starts (None: the shipped default) and overrides other ``DEFAULTS`` entries. Skips off
    Hopper or without Gluon."""
    if not gluon_dkdv.HAVE_GLUON or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels run on Hopper GPUs (compute capability 9) only")
    launches: list[tuple] = []
    grids: list[tuple] = []  # (block_m, persistent programs or 0) per launch
    real = gluon_fwd.launch_fwd

    def spy(q, k, v, *args, **kwargs):
        launches.append((tuple(q.shape), tuple(k.shape)))
        grids.append((kwargs.get("block_m", 128), kwargs.get("persistent", 0)))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(gluon_fwd, "launch_fwd", spy)

    def allow(min_keys: int | None, head_dim: int = 128, **over) -> list[tuple]:
        cfg = {**gluon_fwd.DEFAULTS[head_dim], **over}
        if min_keys is not None:
            cfg["min_keys"] = min_keys
            if "min_waves" in cfg:  # small test grids take it too
                cfg["min_waves"] = 0
        monkeypatch.setitem(gluon_fwd.DEFAULTS, head_dim, cfg)
        launch.clear_plans()
        return launches

    allow.grids = grids
    yield allow
    launch.clear_plans()


def _tensors(b, h, h_kv, n_q, n_k, dtype, seed, d=128):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(b, h, n_q, d, device=DEV, generator=g).to(dtype)
    k = torch.randn(b, h_kv, n_k, d, device=DEV, generator=g).to(dtype)
    v = torch.randn(b, h_kv, n_k, d, device=DEV, generator=g).to(dtype)
    do = torch.randn(b, h, n_q, d, device=DEV, generator=g).to(dtype)
    return q, k, v, do


def _ours(q, k, v, do, causal):
    qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o, lse = flash_attention(qq, kk, vv, causal, return_lse=True)
    o.backward(do)
    return {"o": o.detach(), "lse": lse, "dq": qq.grad, "dk": kk.grad, "dv": vv.grad}


def _sdpa(q, k, v, do, causal):
    qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal, enable_gqa=True)
    o.backward(do)
    return {"o": o.detach(), "dq": qq.grad, "dk": kk.grad, "dv": vv.grad}


def _check(q, k, v, do, causal, compare_sdpa=True):
    ref = reference_features(q, k, v, do, causal)
    ours = _ours(q, k, v, do, causal)
    if compare_sdpa:
        sdpa = _sdpa(q, k, v, do, causal)
        bound = {n: 2 * rel_err(sdpa[n], ref[n]) + 1e-4 for n in ("o", "dq", "dk", "dv")}
    else:  # SDPA aligns a causal mask top-left where Nq != Nk: no comparison there
        bound = dict.fromkeys(("o", "dq", "dk", "dv"), 0.02)
    for name, limit in bound.items():
        assert torch.isfinite(ours[name]).all(), name
        err = rel_err(ours[name], ref[name])
        assert err <= limit, (name, err, limit)
    fin = torch.isfinite(ref["lse"])
    assert torch.equal(torch.isneginf(ours["lse"]), ~fin), "rows without keys must have lse -inf"
    if fin.any():
        err = (ours["lse"][fin].double() - ref["lse"][fin]).abs() / (1 + ref["lse"][fin].abs())
        assert err.max().item() < 1e-3


# Where each grid runs, forced: per tile (never persistent) or persistent (any length,
# causal too).
GRIDS = {
    "per_tile": {"min_keys_persistent": 1 << 40},
    "persistent": {"min_keys_persistent": 0, "max_keys_persistent_causal": 1 << 40},
}


@pytest.mark.parametrize("grid", sorted(GRIDS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("b", "h", "h_kv", "n_q", "n_k", "causal"),
    [
        (2, 3, 3, 1000, 1000, True),  # ragged: 7.8 tiles of 128
        (2, 2, 2, 777, 777, False),
        (1, 2, 2, 300, 500, True),  # bottom-right causal, Nq < Nk
        (1, 2, 2, 500, 300, True),  # Nq > Nk: the first rows see no key
        (1, 1, 1, 65, 1, False),  # one key
        (2, 8, 2, 700, 700, True),  # grouped-query heads, 4 per k/v head
        (1, 4, 1, 513, 513, False),  # multi-query
    ],
)
def test_gluon_forward(b, h, h_kv, n_q, n_k, causal, dtype, grid, gluon_forward):
    launches = gluon_forward(0, **GRIDS[grid])
    q, k, v, do = _tensors(b, h, h_kv, n_q, n_k, dtype, seed=n_q + n_k + h)
    _check(q, k, v, do, causal, compare_sdpa=not (causal and n_q != n_k))
    assert launches
    assert all(s == (tuple(q.shape), tuple(k.shape)) for s in launches)


@pytest.mark.parametrize(
    ("b", "h", "h_kv", "n_q", "n_k", "causal"),
    [
        (2, 3, 3, 1000, 1000, True),  # ragged: 5.2 programs of 192 rows
        (1, 2, 2, 777, 777, False),
        (1, 2, 2, 300, 500, True),  # bottom-right causal, Nq < Nk
        (2, 8, 2, 700, 700, True),  # grouped-query heads
        (1, 2, 2, 193, 64, False),  # one row past a program; one key tile
    ],
)
def test_gluon_forward_d64_three_warpgroups(b, h, h_kv, n_q, n_k, causal, gluon_forward):
    """d = 64: the three-warpgroup program (192 query rows), its threshold lowered so that
    small shapes take it."""
    launches = gluon_forward(0, head_dim=64)
    q, k, v, do = _tensors(b, h, h_kv, n_q, n_k, torch.bfloat16, seed=n_q + n_k, d=64)
    _check(q, k, v, do, causal, compare_sdpa=not (causal and n_q != n_k))
    assert launches


@pytest.mark.parametrize("grid", sorted(GRIDS))
@pytest.mark.parametrize(
    ("b", "h", "h_kv", "n_q", "n_k", "causal"),
    [(2, 3, 3, 1000, 1000, True), (1, 2, 2, 300, 77, False), (2, 8, 2, 700, 700, True)],
)
def test_gluon_forward_register_stores(b, h, h_kv, n_q, n_k, causal, grid, gluon_forward):
    """With ``tma_store`` off, o leaves from the registers (rows past the end masked)."""
    launches = gluon_forward(0, **GRIDS[grid], tma_store=False)
    q, k, v, do = _tensors(b, h, h_kv, n_q, n_k, torch.bfloat16, seed=n_q + 7 * n_k)
    _check(q, k, v, do, causal, compare_sdpa=not (causal and n_q != n_k))
    assert launches


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    ("b", "h", "h_kv", "n_q", "n_k"),
    [
        (2, 40, 40, 1000, 1000),  # 640 tiles: each program loops over several
        (1, 3, 3, 777, 600),  # ragged, Nq > Nk
        (1, 2, 2, 130, 513),  # Nq < Nk, one row past a tile
        (2, 8, 2, 700, 700),  # grouped-query heads
        (3, 50, 10, 512, 512),  # the sweep's shortest length, batched
    ],
)
def test_gluon_forward_persistent(b, h, h_kv, n_q, n_k, causal, gluon_forward, monkeypatch):
    """d = 128 from min_keys_persistent keys (causal: up to max_keys_persistent_causal,
    raised here): the persistent grid (one program per SM), against the float64 reference;
    causal tiles in the serpentine order and in the plain one."""
    gluon_forward(None, max_keys_persistent_causal=1 << 40)
    grids = []
    real = gluon_fwd.launch_fwd
    monkeypatch.setattr(
        gluon_fwd,
        "launch_fwd",
        lambda *a, **kw: grids.append(kw.get("persistent")) or real(*a, **kw),
    )
    assert n_k >= gluon_fwd.DEFAULTS[128]["min_keys_persistent"]
    q, k, v, do = _tensors(b, h, h_kv, n_q, n_k, torch.bfloat16, seed=n_q * n_k + h)
    _check(q, k, v, do, causal, compare_sdpa=not (causal and n_q != n_k))
    assert grids == [torch.cuda.get_device_properties(0).multi_processor_count]
    if causal:
        gluon_forward(None, max_keys_persistent_causal=1 << 40, serpentine=False)
        _check(q, k, v, do, causal, compare_sdpa=n_q == n_k)
        assert len(grids) == 2


def test_gluon_forward_on_strided_views(gluon_forward):
    """A model's (B, N, 3, H, d) qkv buffer seen as (B, H, N, d) views: the 4-D descriptors
    read them in place and o comes back in q's layout."""
    launches = gluon_forward(0)
    b, n, h = 2, 600, 4
    x = torch.randn(b, n, 3, h, 128, device=DEV, dtype=torch.bfloat16)
    q, k, v = (x[:, :, i].transpose(1, 2) for i in range(3))
    do = torch.randn(b, n, h, 128, device=DEV, dtype=torch.bfloat16).transpose(1, 2)
    assert not q.is_contiguous()
    _check(q, k, v, do, True)
    assert launches


def test_gluon_forward_default_length(gluon_forward, monkeypatch):
    """Shipped default, causal: the Gluon forward from min_keys_persistent keys on (the
    persistent grid up to max_keys_persistent_causal, per tile from min_keys), the Triton
    forward below; both give the same o to within rounding."""
    launches = gluon_forward(None)
    cfg = dict(gluon_fwd.DEFAULTS[128])
    n = cfg["min_keys"]
    q, k, v, _ = _tensors(1, 2, 2, n, n, torch.bfloat16, seed=1)
    o_gluon = flash_attention(q, k, v, True)
    assert len(launches) == 1
    m = cfg["min_keys_persistent"] - 1
    flash_attention(q[:, :, :m], k[:, :, :m], v[:, :, :m], True)
    assert len(launches) == 1
    monkeypatch.setitem(
        gluon_fwd.DEFAULTS, 128, {**cfg, "min_keys": 2 * n, "min_keys_persistent": 2 * n}
    )
    launch.clear_plans()
    o_triton = flash_attention(q, k, v, True)
    assert len(launches) == 1
    assert rel_err(o_gluon, o_triton) < 1e-2


def test_d64_gluon_forward_by_grid(gluon_forward, monkeypatch):
    """Shipped d = 64 rule from min_keys keys: the three-warpgroup forward, one program per
    tile, on grids of at least min_waves waves of programs (a batch); below that (a batch of
    one) the persistent grid of two-warpgroup programs if non-causal, the Triton forward if
    causal. All give the same o to within rounding."""
    launches, grids = gluon_forward(None), gluon_forward.grids
    cfg = dict(gluon_fwd.DEFAULTS[64])
    n, rows = cfg["min_keys"], cfg["block_m"]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    per_batch = 16 * -(-n // rows)  # programs of 16 heads
    b = -(-cfg["min_waves"] * sms // per_batch)
    q, k, v, _ = _tensors(b, 16, 16, n, n, torch.bfloat16, seed=4, d=64)
    o_gluon = flash_attention(q, k, v, False)
    assert launches == [(tuple(q.shape), tuple(k.shape))]
    assert grids == [(192, 0)]
    o_persistent = flash_attention(q[:1], k[:1], v[:1], False)  # 1 / b of the waves
    assert grids == [(192, 0), (cfg["persistent_tiles"]["block_m"], sms)]
    flash_attention(q[:1], k[:1], v[:1], True)  # causal: the Triton forward
    assert len(launches) == 2
    never = {"min_keys": 1 << 40, "min_keys_persistent": 1 << 40}
    monkeypatch.setitem(gluon_fwd.DEFAULTS, 64, {**cfg, **never})
    launch.clear_plans()
    o_triton = flash_attention(q, k, v, False)
    assert len(launches) == 2
    assert rel_err(o_gluon, o_triton) < 1e-2
    assert rel_err(o_persistent, o_triton[:1]) < 1e-2


@pytest.mark.parametrize(
    ("b", "h", "h_kv", "n_q", "n_k", "causal"),
    [
        (2, 3, 3, 1000, 1000, False),  # ragged: 7.8 tiles of 128 rows
        (1, 3, 3, 777, 600, False),  # Nq > Nk
        (1, 2, 2, 130, 513, False),  # one row past a tile
        (2, 8, 2, 700, 700, False),  # grouped-query heads
        (2, 40, 40, 1000, 1000, False),  # 640 tiles: each program loops over several
        (2, 3, 3, 1000, 1000, True),  # causal, the grid's cap raised
    ],
)
def test_gluon_forward_d64_persistent(b, h, h_kv, n_q, n_k, causal, gluon_forward):
    """d = 64 on the persistent grid with its own tiles (``persistent_tiles``), from any
    length here, against the float64 reference."""
    never_per_tile = 1 << 40  # min_keys; the fixture also drops min_waves
    launches = gluon_forward(
        never_per_tile, head_dim=64, min_keys_persistent=0, max_keys_persistent_causal=1 << 40
    )
    q, k, v, do = _tensors(b, h, h_kv, n_q, n_k, torch.bfloat16, seed=n_q + 3 * n_k, d=64)
    _check(q, k, v, do, causal, compare_sdpa=not (causal and n_q != n_k))
    assert launches
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    block_m = gluon_fwd.DEFAULTS[64][gluon_fwd.PERSISTENT_TILES]["block_m"]
    assert set(gluon_forward.grids) == {(block_m, sms)}  # the persistent grid, its own tiles


@pytest.mark.parametrize("grid", sorted(GRIDS))
@pytest.mark.parametrize("causal", [True, False])
def test_gluon_forward_in_cuda_graph(gluon_forward, causal, grid):
    """Replays of a captured forward + backward give the eager result bit for bit."""
    launches = gluon_forward(0, **GRIDS[grid])
    q, k, v, do = _tensors(2, 4, 4, 1024, 1024, torch.bfloat16, seed=3)

    def step():
        # Fresh leaves per call: their gradient nodes belong to the stream of the call.
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        o = flash_attention(qq, kk, vv, causal)
        return (o, *torch.autograd.grad(o, (qq, kk, vv), do))

    eager = step()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    graph.replay()
    torch.cuda.synchronize()
    assert launches  # the captured forward is the Gluon kernel's
    for a, b in zip(eager, static):
        assert torch.equal(a, b)
