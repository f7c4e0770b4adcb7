"""Grouped-query attention, sliding windows, the log-sum-exp output, packed variable-length
batches and the split-KV decode path, on CPU: the PyTorch backend, and the Triton kernels in
Triton's interpreter (float32, small tiles so that windows cut tiles and sequences span
several). Every case is checked against a float64 reference written with plain PyTorch
(``flashattn_testutil``: k/v expanded over the groups, a mask written pair by pair, a loop
over the packed sequences): o, lse, dq, dk and dv.

Tolerance: float32 results against float64, 1e-5 relative (measured 1e-7 to 6e-7, as the
dense tests); lse within 1e-5 absolute, -inf exactly for rows that see no key.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from flashattn_testutil import (
    check_against,
    offsets,
    reference_features,
    reference_varlen,
)

import flashattn_triton as fa
from flashattn_triton import configs, launch, launch_common, launch_varlen

# log2(0) = -inf is the intended L of rows that see no key; numpy warns about it.
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")

needs_interpreter = pytest.mark.skipif(
    torch.cuda.is_available() or not launch.interpreting(),
    reason="needs TRITON_INTERPRET=1 on a machine without a GPU (set by tests/conftest.py)",
)

SMALL_TILES = {
    "fwd.fp32": configs.TileConfig(32, 16, 4, 2),
    "dkdv.fp32": configs.TileConfig(16, 32, 4, 2),
    "dq.fp32": configs.TileConfig(32, 16, 4, 2),
}


@pytest.fixture
def small_tiles(monkeypatch):
    monkeypatch.setattr(configs, "OVERRIDES", dict(SMALL_TILES))


def _dense(b, h_q, h_kv, n_q, n_k, d=16):
    q = torch.randn(b, h_q, n_q, d)
    k = torch.randn(b, h_kv, n_k, d)
    v = torch.randn(b, h_kv, n_k, d)
    do = torch.randn(b, h_q, n_q, d)
    return q, k, v, do


def _run_dense(backend, q, k, v, do, causal, window):
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    o, lse = fa.flash_attention(
        qq, kk, vv, causal, window_size=window, return_lse=True, backend=backend
    )
    o.backward(do)
    assert not lse.requires_grad
    assert lse.dtype == torch.float32
    assert lse.shape == q.shape[:-1]
    return {"o": o.detach(), "lse": lse, "dq": qq.grad, "dk": kk.grad, "dv": vv.grad}


def _check_dense(backend, shape, causal, window):
    q, k, v, do = _dense(*shape)
    ref = reference_features(q, k, v, do, causal, window)
    check_against(_run_dense(backend, q, k, v, do, causal, window), ref, 1e-5, 1e-5)


# (batch, q heads, k/v heads, Nq, Nk), causal, window. Tiles: 32 queries x 16 keys forward
# and dQ, 32 keys x 16 queries dK/dV.
DENSE = [
    ((1, 8, 1, 37, 37), True, (-1, -1)),  # MQA, causal
    ((2, 4, 2, 33, 50), False, (-1, -1)),  # GQA 2, Nq < Nk
    ((1, 2, 2, 40, 40), True, (3, -1)),  # window smaller than a tile
    ((1, 4, 2, 50, 30), True, (5, -1)),  # Nq > Nk: rows without keys
    ((1, 2, 1, 45, 45), False, (6, 2)),  # two-sided window, not causal
    ((1, 2, 2, 30, 41), False, (-1, 3)),  # right bound only
    ((1, 2, 2, 30, 41), False, (4, -1)),  # left bound only
    ((1, 2, 2, 35, 35), True, (100, -1)),  # window larger than N: plain causal
    ((1, 8, 8, 1, 20), True, (2, -1)),  # one query
]


@pytest.mark.parametrize(("shape", "causal", "window"), DENSE)
def test_torch_backend(shape, causal, window):
    _check_dense("torch", shape, causal, window)


@needs_interpreter
@pytest.mark.parametrize(("shape", "causal", "window"), DENSE)
def test_triton_kernels(shape, causal, window, small_tiles):
    _check_dense("triton", shape, causal, window)


@needs_interpreter
def test_gqa_on_3d_and_5d_inputs(small_tiles):
    """Heads are dim -3 whatever the rank: (H, N, d) and (B, C, H, N, d)."""
    for lead_q, lead_kv in (((4,), (2,)), ((2, 1, 4), (2, 1, 1))):
        q, k, v, do = (torch.randn(*lead, 20, 16) for lead in (lead_q, lead_kv, lead_kv, lead_q))
        ref = reference_features(q, k, v, do, True)
        out = _run_dense("triton", q, k, v, do, True, (-1, -1))
        check_against(out, ref, 1e-5, 1e-5)


def _packed(lens_q, lens_k, h_q, h_kv, d=16):
    q = torch.randn(sum(lens_q), h_q, d)
    k = torch.randn(sum(lens_k), h_kv, d)
    v = torch.randn(sum(lens_k), h_kv, d)
    do = torch.randn(sum(lens_q), h_q, d)
    return q, k, v, do


def _check_varlen(backend, lens_q, lens_k, h_q, h_kv, causal, window):
    q, k, v, do = _packed(lens_q, lens_k, h_q, h_kv)
    cu_q, cu_k = offsets(lens_q), offsets(lens_k)
    ref = reference_varlen(q, k, v, do, cu_q.tolist(), cu_k.tolist(), causal, window)
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    o, lse = fa.flash_attention_varlen(
        qq, kk, vv, cu_q, cu_k, max(lens_q), max(lens_k), causal,
        window_size=window, return_lse=True, backend=backend,
    )  # fmt: skip
    assert o.shape == q.shape
    assert lse.shape == (h_q, sum(lens_q))
    o.backward(do)
    out = {"o": o.detach(), "lse": lse, "dq": qq.grad, "dk": kk.grad, "dv": vv.grad}
    check_against(out, ref, 1e-5, 1e-5)


VARLEN = [
    # query lengths, key lengths, q heads, k/v heads, causal, window
    ([5, 1, 40, 17], [5, 1, 40, 17], 2, 2, True, (-1, -1)),  # ragged, a length-1 sequence
    ([5, 0, 33], [9, 3, 20], 4, 2, False, (-1, -1)),  # an empty query sequence, Nq != Nk
    ([30, 12, 3], [30, 12, 3], 8, 1, True, (6, -1)),  # MQA with a window
    ([3, 20], [25, 20], 2, 2, True, (-1, 2)),  # causal + right bound (causal wins)
]


@pytest.mark.parametrize(("lens_q", "lens_k", "h_q", "h_kv", "causal", "window"), VARLEN)
def test_varlen_torch_backend(lens_q, lens_k, h_q, h_kv, causal, window):
    _check_varlen("torch", lens_q, lens_k, h_q, h_kv, causal, window)


@needs_interpreter
@pytest.mark.parametrize(("lens_q", "lens_k", "h_q", "h_kv", "causal", "window"), VARLEN)
def test_varlen_triton_kernels(lens_q, lens_k, h_q, h_kv, causal, window, small_tiles):
    _check_varlen("triton", lens_q, lens_k, h_q, h_kv, causal, window)


@needs_interpreter
@pytest.mark.parametrize("packed", [False, True])
def test_features_through_tma_descriptors(packed, monkeypatch):
    """With TMA tiles, k/v (and q/dO) tiles come through descriptors addressed by k/v head
    and, for packed sequences, by the sequence's first row: rows past a sequence's end are
    the next sequence's (masked), past the buffer zeros."""
    tiles = {kind: replace(cfg, tma=True) for kind, cfg in SMALL_TILES.items()}
    monkeypatch.setattr(configs, "OVERRIDES", tiles)
    used = []
    real = launch_common._stream_args
    monkeypatch.setattr(
        launch_common, "_stream_args", lambda kind, *a: used.append(kind) or _tma(real(kind, *a))
    )
    if packed:
        _check_varlen("triton", [19, 1, 40], [19, 1, 40], 4, 2, True, (7, -1))
    else:
        _check_dense("triton", (1, 4, 2, 40, 40), True, (9, -1))
    assert used == ["fwd", "dq", "dkdv"]  # each through descriptors (_tma)


def _tma(stream_args: dict) -> dict:
    assert stream_args["USE_TMA"], stream_args
    return stream_args


@needs_interpreter
def test_varlen_equals_dense_per_sequence(small_tiles):
    """Two sequences packed give each one's dense result: nothing crosses the boundary."""
    q, k, v, _ = _packed([20, 13], [20, 13], 2, 1)
    cu = offsets([20, 13])
    o = fa.flash_attention_varlen(q, k, v, cu, cu, 20, 20, True, backend="triton")
    for a, b in ((0, 20), (20, 33)):
        dense = fa.flash_attention(
            *(t[a:b].transpose(0, 1) for t in (q, k, v)), True, backend="triton"
        )
        torch.testing.assert_close(o[a:b], dense.transpose(0, 1), rtol=0, atol=1e-6)


@needs_interpreter
@pytest.mark.parametrize(
    ("shape", "causal", "window"),
    [
        ((2, 4, 2, 1, 70), True, (-1, -1)),  # one query, GQA 2: two heads per program
        ((1, 8, 1, 3, 90), True, (20, -1)),  # MQA: 24 rows in one tile, a window
        ((1, 2, 2, 16, 100), False, (-1, -1)),  # the most queries taking the path
        ((1, 2, 2, 4, 3), True, (-1, -1)),  # Nq > Nk: a row without keys
        ((1, 2, 1, 2, 50), False, (10, 3)),
    ],
)
def test_decode_path_splits_keys(shape, causal, window, small_tiles, monkeypatch):
    """Few queries against many keys run the split-KV kernels (keys split over programs,
    then combined), with GQA heads packed into one tile's rows; same results."""
    monkeypatch.setattr(configs, "DECODE_MIN_KEYS", 1)
    splits = []
    real = configs.decode_splits

    def spy(*args):
        splits.append(real(*args))
        return splits[-1]

    monkeypatch.setattr(configs, "decode_splits", spy)
    _check_dense("triton", shape, causal, window)
    assert splits, "the decode path did not run"
    if window[0] < 0 and shape[-1] >= 48:
        assert splits[0] > 1  # several splits, then the combine kernel
    else:  # a window: only the keys some query sees are split (here one tile)
        assert splits[0] == 1 or window[0] < 0


@pytest.mark.parametrize(
    ("bh_kv", "key_tiles", "slots"),
    [(8, 1024, 264), (16, 256, 264), (32, 2048, 264), (64, 1024, 264), (140, 1024, 264),
     (3, 1024, 132), (1, 32, 264), (8, 5, 264)],
)  # fmt: skip
def test_decode_splits_fill_whole_waves(bh_kv, key_tiles, slots):
    """The split count is the smallest whose waves of programs are nearly full: the program
    count never falls just past a wave (the last wave would run almost empty), and no split
    gets less than one key tile."""
    s = configs.decode_splits(bh_kv, key_tiles, slots)
    assert 1 <= s <= min(key_tiles, configs.DECODE_MAX_SPLITS)
    waves = bh_kv * s / slots
    fullness = waves / -(-waves // 1)
    best = max(
        (bh_kv * t / slots) / -(-(bh_kv * t / slots) // 1)
        for t in range(1, min(key_tiles, configs.DECODE_MAX_SPLITS) + 1)
    )
    assert fullness >= configs.DECODE_WAVE_EFFICIENCY * best
    if s > 1:  # one split fewer would leave the waves emptier
        fewer = bh_kv * (s - 1) / slots
        assert fewer / -(-fewer // 1) < configs.DECODE_WAVE_EFFICIENCY * best


def test_decode_splits_edge_cases():
    assert configs.decode_splits(8, 1024, 264) == 32  # 256 programs: one wave of 264
    assert configs.decode_splits(256, 1024, 264) == 1  # the batch x heads fill a wave
    assert configs.decode_splits(8, 1024, 0) == 3  # SM count unknown (the interpreter)
    assert configs.decode_splits(8, 2, 0) == 2  # never more splits than key tiles


def test_decode_programs_per_sm_follow_shared_memory():
    """Three stages of 64-key K and V tiles at d = 128 in bf16 hold 96 KB: two programs on a
    Hopper SM (228 KB), one on 164 KB; small tiles stop at DECODE_MAX_PROGRAMS_PER_SM."""
    tile = configs.decode_config(1, 128, 2)
    assert (tile.block_n, tile.num_stages) == (64, 3)
    assert configs.decode_programs_per_sm(tile, 128, 2, 228 * 1024) == 2
    assert configs.decode_programs_per_sm(tile, 128, 2, 164 * 1024) == 1
    small = configs.decode_config(1, 32, 2)
    cap = configs.DECODE_MAX_PROGRAMS_PER_SM
    assert configs.decode_programs_per_sm(small, 32, 2, 228 * 1024) == cap
    assert configs.decode_programs_per_sm(tile, 128, 2, 1024) == 1  # at least one


@needs_interpreter
@pytest.mark.parametrize(
    ("shape", "causal", "window"),
    [
        ((1, 4, 2, 1, 200), True, (-1, -1)),  # GQA 2: 2 programs per split
        ((2, 2, 2, 3, 170), True, (-1, -1)),  # 4 (batch, head) programs, a ragged last tile
        ((1, 2, 1, 2, 190), True, (60, -1)),  # a window: only the keys it sees are split
    ],
)
def test_decode_with_a_gpu_sized_split_count(shape, causal, window, monkeypatch, set_options):
    """The wave rule's split counts (here as if on 4 SMs of 228 KB: 16 slots) cut the keys
    into many short slices of whole tiles; the combine still gives the reference results."""
    monkeypatch.setattr(configs, "DECODE_MIN_KEYS", 1)
    monkeypatch.setattr(launch, "sm_count", lambda t: 4)
    monkeypatch.setattr(launch, "smem_per_sm", lambda t: 228 * 1024)
    set_options(tile_configs="decode.fp32=16,16,4,2")
    splits = []
    real = configs.decode_splits
    monkeypatch.setattr(configs, "decode_splits", lambda *a: splits.append(real(*a)) or splits[-1])
    _check_dense("triton", shape, causal, window)
    assert splits, "the decode path did not run"
    assert splits[0] > 3  # the wave rule, not the interpreter's fallback of 3


@needs_interpreter
def test_decode_tiles_follow_the_tile_configs_option(monkeypatch, set_options):
    """``tile_configs="decode.fp32=..."`` sets the decode kernel's key tile (and so the number
    of splits): 16-key tiles over 70 keys make 5 tiles."""
    monkeypatch.setattr(configs, "DECODE_MIN_KEYS", 1)
    set_options(tile_configs="decode.fp32=16,16,4,2")
    tiles = []
    real = configs.decode_splits
    monkeypatch.setattr(configs, "decode_splits", lambda *a: tiles.append(a[1]) or real(*a))
    _check_dense("triton", (1, 4, 2, 2, 70), True, (-1, -1))
    assert tiles == [5]
    with pytest.raises(ValueError, match="unknown kind 'decodes'"):
        set_options(tile_configs="decodes=16,16,4,2")


@needs_interpreter
def test_torch_compile_fullgraph_with_features():
    """GQA, a window, return_lse and varlen trace into one graph (the custom ops)."""

    def layer(q, k, v, cu):
        o, lse = fa.flash_attention(
            q, k, v, True, window_size=(4, -1), return_lse=True, backend="triton"
        )
        packed = o[0].transpose(0, 1)  # (N, H, d)
        pk, pv = k[0].transpose(0, 1), v[0].transpose(0, 1)
        p = fa.flash_attention_varlen(packed, pk, pv, cu, cu, 12, 12, True, backend="triton")
        return p.sum() + lse.sum()

    q, k, v, _ = _dense(1, 4, 2, 24, 24)
    cu = offsets([12, 12])
    args = [t.clone().requires_grad_() for t in (q, k, v)]
    eager = layer(*args, cu)
    eager.backward()
    grads = [a.grad.clone() for a in args]
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    args2 = [t.clone().requires_grad_() for t in (q, k, v)]
    got = compiled(*args2, cu)
    got.backward()
    torch.testing.assert_close(got, eager, rtol=1e-6, atol=1e-5)
    for a, g in zip(args2, grads):
        torch.testing.assert_close(a.grad, g, rtol=1e-5, atol=1e-6)


@needs_interpreter
def test_new_custom_ops_pass_opcheck():
    q, k, v, do = _dense(1, 4, 2, 20, 20)
    torch.library.opcheck(torch.ops.flashattn_triton.fwd.default, (q, k, v, True, 0.25, 3, 0))
    o, lse = torch.ops.flashattn_triton.fwd(q, k, v, True, 0.25, 3, 0)
    torch.library.opcheck(
        torch.ops.flashattn_triton.bwd.default, (do, q, k, v, o, lse, True, 0.25, 3, 0)
    )
    cu = offsets([7, 13])
    args = (q, k, v, cu, cu, 13, 13, True, 0.25, -1, -1)
    torch.library.opcheck(torch.ops.flashattn_triton.varlen_fwd.default, args)
    o, lse = torch.ops.flashattn_triton.varlen_fwd(*args)
    torch.library.opcheck(
        torch.ops.flashattn_triton.varlen_bwd.default, (do, q, k, v, o, lse, *args[3:])
    )


# ---- bad inputs: clear errors naming the argument, before any launch ----------------------


@pytest.fixture
def no_launch(monkeypatch):
    """Any launcher call fails the test: errors must come first."""

    def fail(*args, **kwargs):
        raise AssertionError("a launcher ran before the error")

    for mod, names in ((launch, ("forward", "backward")), (launch_varlen, ("forward_varlen",))):
        for name in names:
            monkeypatch.setattr(mod, name, fail)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bad_heads_and_windows(backend, no_launch):
    q, k, v, _ = _dense(1, 6, 4, 10, 10)
    with pytest.raises(ValueError, match=r"q heads 6 and k/v heads 4"):
        fa.flash_attention(q, k, v, backend=backend)
    q, k, v, _ = _dense(1, 4, 2, 10, 10)
    with pytest.raises(ValueError, match="leading"):
        fa.flash_attention(q, k, v[:, :1], backend=backend)
    for bad in ((-2, 0), (0, -5)):
        with pytest.raises(ValueError, match=r"window_size"):
            fa.flash_attention(q, k, v, window_size=bad, backend=backend)
    for bad in ((1,), (1, 2, 3), 5, (1.5, 2), (True, 0), "full"):
        with pytest.raises(TypeError, match=r"window_size"):
            fa.flash_attention(q, k, v, window_size=bad, backend=backend)
    with pytest.raises(TypeError, match="return_lse"):
        fa.flash_attention(q, k, v, return_lse=1, backend=backend)
    with pytest.raises(TypeError, match="window_size"):
        fa.FlashAttention(window_size=(3,))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bad_varlen_inputs(backend, no_launch):
    q, k, v, _ = _packed([4, 6], [4, 6], 4, 2)
    cu = offsets([4, 6])

    def call(**changes):
        args = {
            "q": q, "k": k, "v": v, "cu_seqlens_q": cu, "cu_seqlens_k": cu,
            "max_seqlen_q": 6, "max_seqlen_k": 6,
        }  # fmt: skip
        args.update(changes)
        return fa.flash_attention_varlen(**args, causal=True, backend=backend)

    bad = torch.tensor([0, 7, 6, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cu_seqlens_q must be non-decreasing.*7 then 6"):
        call(cu_seqlens_q=bad, cu_seqlens_k=torch.tensor([0, 3, 6, 10], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"cu_seqlens_k must end at .* 10, got 9"):
        call(cu_seqlens_k=torch.tensor([0, 4, 9], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"cu_seqlens_q must start at 0"):
        call(cu_seqlens_q=torch.tensor([1, 4, 10], dtype=torch.int32))
    with pytest.raises(TypeError, match=r"cu_seqlens_q must be an int32"):
        call(cu_seqlens_q=cu.long())
    with pytest.raises(ValueError, match=r"cu_seqlens_k must be a 1-D"):
        call(cu_seqlens_k=cu[:1])
    with pytest.raises(ValueError, match=r"the same length"):
        call(cu_seqlens_k=offsets([4, 3, 3]))
    with pytest.raises(ValueError, match=r"max_seqlen_q=5 is less than .* 6"):
        call(max_seqlen_q=5)
    with pytest.raises(TypeError, match=r"max_seqlen_k must be an int"):
        call(max_seqlen_k=6.0)
    with pytest.raises(ValueError, match=r"shape \(total_tokens, heads, head_dim\)"):
        call(q=q[None])
    with pytest.raises(ValueError, match=r"q heads 4 and k/v heads 3"):
        call(k=torch.randn(10, 3, 16), v=torch.randn(10, 3, 16))


def test_offsets_checked_once_per_tensor_version(monkeypatch):
    """Reading offsets (a device-to-host copy on a GPU) happens once per tensor version."""
    from flashattn_triton import api

    reads = []
    real = api.check_offsets

    def spy(*args):
        reads.append(args[1])
        return real(*args)

    monkeypatch.setattr(api, "check_offsets", spy)
    q, k, v, _ = _packed([4, 6], [4, 6], 2, 2)
    cu_q, cu_k = offsets([4, 6]), offsets([4, 6])
    for _ in range(3):
        fa.flash_attention_varlen(q, k, v, cu_q, cu_k, 6, 6, backend="torch")
    assert reads == ["cu_seqlens_q", "cu_seqlens_k"]
    fa.flash_attention_varlen(q, k, v, cu_q, cu_q, 6, 6, backend="torch")  # seen already
    assert len(reads) == 2
    cu_q[1] = 11  # in place: a new version, checked again
    with pytest.raises(ValueError, match="non-decreasing"):
        fa.flash_attention_varlen(q, k, v, cu_q, cu_k, 6, 6, backend="torch")


def test_window_normalization():
    """Bounds past every key are unbounded; causal sets right = 0 (flash-attn's rule)."""
    from flashattn_triton.features import features

    assert features(4, 4, True, -1, -1, 50, 50) == (1, True, False, 0, 0)
    assert features(4, 4, False, 49, 49, 50, 50) == (1, False, False, 0, 0)
    assert features(8, 2, True, 100, 7, 50, 50) == (4, True, False, 0, 0)
    assert features(4, 4, False, 3, -1, 50, 60) == (1, True, True, 3, 110)
    assert features(4, 4, True, 3, 9, 50, 60) == (1, True, True, 3, 0)
