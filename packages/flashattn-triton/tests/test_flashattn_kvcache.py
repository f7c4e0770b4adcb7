"""``flash_attention_kvcache``: attention of new queries over a KV cache whose filled length
differs per sequence, on CPU: the PyTorch backend, and the Triton kernels in Triton's
interpreter (float32, small tiles), both the split-KV decode kernels (few queries) and the
forward kernel (more queries). Every case is checked against a float64 reference that slices
each sequence's cache to its length and applies ``reference_features`` (masks written pair by
pair): o and lse.

Tolerance: float32 results against float64, 1e-5 relative (as the other feature tests); lse
within 1e-5 absolute, -inf exactly for rows that see no key.
"""

from __future__ import annotations

import pytest
import torch
from flashattn_testutil import reference_features, rel_err

import flashattn_triton as fa
from flashattn_triton import configs, launch, launch_kvcache

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")

needs_interpreter = pytest.mark.skipif(
    torch.cuda.is_available() or not launch.interpreting(),
    reason="needs TRITON_INTERPRET=1 on a machine without a GPU (set by tests/conftest.py)",
)


@pytest.fixture
def small_tiles(monkeypatch):
    monkeypatch.setattr(configs, "OVERRIDES", {"fwd.fp32": configs.TileConfig(32, 16, 4, 2)})


def _cache(b, h_q, h_kv, n_q, s, d=16):
    q = torch.randn(b, h_q, n_q, d)
    k = torch.randn(b, h_kv, s, d)
    v = torch.randn(b, h_kv, s, d)
    return q, k, v


def _reference(q, k, v, lens, causal, window):
    """Float64 o, lse: each sequence's cache cut to its length (clamped to [0, S])."""
    with torch.enable_grad():  # reference_features also takes gradients
        return _reference_in_grad_mode(q, k, v, lens, causal, window)


def _reference_in_grad_mode(q, k, v, lens, causal, window):
    o = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float64)
    for b, n in enumerate(lens):
        n = max(0, min(n, k.shape[2]))
        if n == 0:
            continue
        kb, vb = k[b, :, :n], v[b, :, :n]
        ref = reference_features(q[b], kb, vb, torch.zeros_like(q[b]), causal, window)
        o[b], lse[b] = ref["o"], ref["lse"]
    return o, lse


def _check(backend, shape, lens, causal, window):
    q, k, v = _cache(*shape)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    with torch.no_grad():
        o, lse = fa.flash_attention_kvcache(
            q, k, v, seqlens, causal, window_size=window, return_lse=True, backend=backend
        )
    ref_o, ref_lse = _reference(q, k, v, lens, causal, window)
    assert o.shape == q.shape
    assert o.dtype == q.dtype
    assert lse.shape == q.shape[:-1]
    assert lse.dtype == torch.float32
    assert torch.isfinite(o).all()
    assert rel_err(o, ref_o) < 1e-5
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin), "rows without keys must have lse -inf"
    assert torch.isneginf(lse[~fin]).all()
    if fin.any():
        assert (lse[fin].double() - ref_lse[fin]).abs().max().item() < 1e-5


# (batch, q heads, k/v heads, Nq, S), lengths per sequence, causal, window. Decode cases
# (Nq <= 16) take the split-KV kernels once DECODE_MIN_KEYS allows (see the fixture below).
DECODE = [
    ((3, 4, 2, 1, 70), [70, 0, 33], True, (-1, -1)),  # GQA 2; an empty cache; ragged
    ((2, 8, 1, 3, 90), [5, 90], True, (20, -1)),  # MQA, a window, a short cache
    ((2, 4, 4, 16, 100), [100, 60], False, (10, 3)),  # a two-sided window
    ((3, 2, 2, 4, 50), [1, 2, 3], True, (-1, -1)),  # fewer keys than queries: empty rows
    ((2, 2, 1, 2, 64), [80, -5], False, (-1, -1)),  # out of range: clamped to [0, S]
]
DENSE = [
    ((2, 2, 2, 40, 50), [50, 17], True, (-1, -1)),  # query tiles against ragged caches
    ((3, 4, 2, 33, 37), [37, 1, 30], False, (-1, -1)),
    ((2, 2, 1, 33, 64), [64, 40], True, (7, -1)),  # a window smaller than a tile
    ((1, 8, 2, 20, 96), [0], True, (-1, -1)),
    ((2, 2, 1, 70, 90), [85, 40], True, (12, -1)),  # more queries than a torch-backend tile
]


@pytest.mark.parametrize(("shape", "lens", "causal", "window"), DECODE + DENSE)
def test_torch_backend(shape, lens, causal, window):
    _check("torch", shape, lens, causal, window)


@needs_interpreter
@pytest.mark.parametrize(("shape", "lens", "causal", "window"), DECODE)
def test_triton_decode_kernels(shape, lens, causal, window, small_tiles, monkeypatch):
    """Few queries: the split-KV kernels, splits over the cache's rows, each sequence's own
    length and window start read in the kernel."""
    monkeypatch.setattr(configs, "DECODE_MIN_KEYS", 1)
    splits = []
    real = configs.decode_splits
    monkeypatch.setattr(configs, "decode_splits", lambda *a: splits.append(real(*a)) or splits[-1])
    _check("triton", shape, lens, causal, window)
    assert splits, "the decode path did not run"
    assert splits[0] > 1, "one split: the combine kernel did not run"


@needs_interpreter
@pytest.mark.parametrize("window", [(-1, -1), (40, -1)])
def test_decode_splits_share_each_sequences_own_keys(window, small_tiles, monkeypatch):
    """The split-KV programs divide each sequence's visible keys (its length, from its window
    start), not the cache's S rows: a sequence filled to a fraction of S still gives every
    split keys to read (a finite partial log-sum-exp), so the GPU stays as full as the split
    count assumes."""
    monkeypatch.setattr(configs, "DECODE_MIN_KEYS", 1)
    monkeypatch.setattr(configs, "decode_splits", lambda *a: 4)
    parts, tiles = [], []
    real = launch.fastlaunch.launch

    def spy(kernel, grid, *args, **kwargs):
        name = getattr(kernel, "__name__", str(kernel))
        if "combine" in name:
            parts.append(args[1].clone())  # LSE_PART (B, H, splits, n_q)
        elif "decode" in name:
            tiles.append(kwargs["BLOCK_N"])
        return real(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(launch.fastlaunch, "launch", spy)
    q, k, v = _cache(3, 2, 2, 1, 512)
    lens = [100, 512, 70]
    with torch.no_grad():
        o = fa.flash_attention_kvcache(
            q, k, v, torch.tensor(lens, dtype=torch.int32), True, window_size=window,
            backend="triton",
        )  # fmt: skip
    ref_o, _ = _reference(q, k, v, lens, True, window)
    assert rel_err(o, ref_o) < 1e-5
    (lse_part,), (block_n,) = parts, tiles
    busy = torch.isfinite(lse_part).all(dim=(1, 3)).sum(dim=1).tolist()  # per sequence
    # visible keys: from the first query's window start (in whole tiles) to the length
    first = [0 if window[0] < 0 else max(n - 1 - window[0], 0) // block_n * block_n for n in lens]
    want = [min(4, -(-(n - f) // block_n)) for n, f in zip(lens, first)]
    assert busy == want, (busy, want, block_n)
    assert sum(busy) > 4 + 2  # more than the 1 + 4 + 1 of splits cut over the 512 rows


@needs_interpreter
@pytest.mark.parametrize(("shape", "lens", "causal", "window"), DENSE + DECODE[:2])
def test_triton_forward_kernel(shape, lens, causal, window, small_tiles, monkeypatch):
    """More queries (or the decode path held off): the forward kernel with KV_LENS."""
    monkeypatch.setattr(configs, "DECODE_MIN_KEYS", 1 << 30)
    _check("triton", shape, lens, causal, window)


@needs_interpreter
def test_one_int_length_and_strided_caches(small_tiles):
    """An int length applies to every sequence; caches laid out (B, S, H, d) and passed
    transposed (the layout flash-attn and most KV caches use) need no copy."""
    q, k, v = _cache(2, 4, 2, 3, 40)
    k_bshd, v_bshd = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    with torch.no_grad():
        got = fa.flash_attention_kvcache(
            q, k_bshd.transpose(1, 2), v_bshd.transpose(1, 2), 25, True, backend="triton"
        )
    ref_o, _ = _reference(q, k, v, [25, 25], True, (-1, -1))
    assert rel_err(got, ref_o) < 1e-5


@needs_interpreter
def test_equals_flash_attention_on_the_filled_part(small_tiles):
    """Where every sequence has the same length n, the call is flash_attention on k[:, :, :n]."""
    q, k, v = _cache(2, 4, 2, 5, 48)
    with torch.no_grad():
        got = fa.flash_attention_kvcache(q, k, v, 30, True, window_size=(9, -1), backend="triton")
        want = fa.flash_attention(
            q, k[:, :, :30], v[:, :, :30], True, window_size=(9, -1), backend="triton"
        )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@needs_interpreter
def test_lengths_are_read_at_launch_not_at_the_first_call(small_tiles, monkeypatch):
    """The lengths are an input of the launch, not part of its plan: the same tensor, changed
    in place between calls (as a decode loop or a CUDA graph does), gives the new result."""
    monkeypatch.setattr(configs, "DECODE_MIN_KEYS", 1)
    q, k, v = _cache(2, 2, 1, 1, 40)
    seqlens = torch.tensor([10, 20], dtype=torch.int32)
    with torch.no_grad():
        for n0, n1 in ((10, 20), (11, 21), (40, 3)):
            seqlens.copy_(torch.tensor([n0, n1]))
            got = fa.flash_attention_kvcache(q, k, v, seqlens, True, backend="triton")
            ref_o, _ = _reference(q, k, v, [n0, n1], True, (-1, -1))
            assert rel_err(got, ref_o) < 1e-5


@needs_interpreter
def test_torch_compile_fullgraph():
    """The custom op keeps a compiled decode step in one graph."""

    def step(q, k, v, seqlens):
        return fa.flash_attention_kvcache(q, k, v, seqlens, True, backend="triton") * 2

    q, k, v = _cache(2, 4, 2, 1, 24)
    seqlens = torch.tensor([24, 9], dtype=torch.int32)
    with torch.no_grad():
        eager = step(q, k, v, seqlens)
        got = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v, seqlens)
    torch.testing.assert_close(got, eager, rtol=1e-6, atol=1e-6)


@needs_interpreter
def test_custom_op_passes_opcheck():
    q, k, v = _cache(2, 4, 2, 3, 20)
    seqlens = torch.tensor([20, 7], dtype=torch.int32)
    torch.library.opcheck(
        torch.ops.flashattn_triton.kvcache_fwd.default, (q, k, v, seqlens, True, 0.25, 3, 0)
    )


# ---- new rows stored by the call (k=, v=) -------------------------------------------------


def _appended(k, v, k_new, v_new, lens):
    """The caches after storing k_new, v_new from row lens[b] on, rows past S dropped."""
    k, v = k.clone(), v.clone()
    for b, n in enumerate(lens):
        n = max(0, min(n, k.shape[2]))
        rows = min(k_new.shape[2], k.shape[2] - n)
        k[b, :, n : n + rows] = k_new[b, :, :rows]
        v[b, :, n : n + rows] = v_new[b, :, :rows]
    return k, v


def _check_append(backend, shape, lens, n_new, causal, window):
    q, k, v = _cache(*shape)
    b, _, h_kv, _, _ = shape
    k_new, v_new = torch.randn(b, h_kv, n_new, 16), torch.randn(b, h_kv, n_new, 16)
    want_k, want_v = _appended(k, v, k_new, v_new, lens)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    with torch.no_grad():
        o, lse = fa.flash_attention_kvcache(
            q, k, v, seqlens, causal, window_size=window, return_lse=True, k=k_new, v=v_new,
            backend=backend,
        )  # fmt: skip
    assert torch.equal(k, want_k), "the cache rows stored"
    assert torch.equal(v, want_v), "the cache rows stored"
    assert seqlens.tolist() == lens, "cache_seqlens is the caller's to advance"
    seen = [max(n, 0) + n_new for n in lens]  # a negative length counts as 0
    ref_o, ref_lse = _reference(q, want_k, want_v, seen, causal, window)
    assert rel_err(o, ref_o) < 1e-5
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin)
    if fin.any():
        assert (lse[fin].double() - ref_lse[fin]).abs().max().item() < 1e-5


# (batch, q heads, k/v heads, Nq, S), lengths before the call, new rows, causal, window.
APPEND = [
    ((3, 4, 2, 1, 70), [69, 0, 33], 1, True, (-1, -1)),  # decode: one new row each, GQA
    ((2, 8, 1, 3, 90), [5, 87], 3, True, (20, -1)),  # MQA, a window, the cache filled up
    ((2, 2, 2, 2, 64), [63, 60], 5, False, (-1, -1)),  # rows past S dropped, counts clamped
    ((2, 2, 1, 4, 50), [-3, 20], 4, True, (-1, -1)),  # a negative length counts as 0
]
APPEND_DENSE = [
    ((2, 2, 2, 40, 90), [10, 50], 40, True, (-1, -1)),  # a chunk of 40 queries and rows
    ((2, 4, 2, 33, 80), [0, 47], 33, True, (9, -1)),
]


@pytest.mark.parametrize(("shape", "lens", "n_new", "causal", "window"), APPEND + APPEND_DENSE)
def test_append_torch_backend(shape, lens, n_new, causal, window):
    _check_append("torch", shape, lens, n_new, causal, window)


@needs_interpreter
@pytest.mark.parametrize(("shape", "lens", "n_new", "causal", "window"), APPEND)
def test_append_triton_decode_kernels(shape, lens, n_new, causal, window, small_tiles, monkeypatch):
    monkeypatch.setattr(configs, "DECODE_MIN_KEYS", 1)
    _check_append("triton", shape, lens, n_new, causal, window)


@needs_interpreter
@pytest.mark.parametrize(("shape", "lens", "n_new", "causal", "window"), APPEND_DENSE + APPEND[1:2])
def test_append_triton_forward_kernel(shape, lens, n_new, causal, window, small_tiles, monkeypatch):
    monkeypatch.setattr(configs, "DECODE_MIN_KEYS", 1 << 30)
    _check_append("triton", shape, lens, n_new, causal, window)


@needs_interpreter
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_append_into_strided_caches_from_strided_rows(backend, small_tiles):
    """(B, S, H, d) caches passed transposed take the rows in place; new rows laid out
    (B, T, H, d) (as a model's qkv projection gives them) are read where they are; an int
    length works as a tensor of it."""
    q, k, v = _cache(2, 4, 2, 1, 30)
    k_bshd, v_bshd = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    k_new = torch.randn(2, 1, 2, 16).transpose(1, 2)  # (B, Hkv, 1, d), strided
    v_new = torch.randn(2, 1, 2, 16).transpose(1, 2)
    want_k, want_v = _appended(k, v, k_new, v_new, [12, 12])
    with torch.no_grad():
        got = fa.flash_attention_kvcache(
            q, k_bshd.transpose(1, 2), v_bshd.transpose(1, 2), 12, True, k=k_new, v=v_new,
            backend=backend,
        )  # fmt: skip
    assert torch.equal(k_bshd.transpose(1, 2), want_k)
    assert torch.equal(v_bshd.transpose(1, 2), want_v)
    ref_o, _ = _reference(q, want_k, want_v, [13, 13], True, (-1, -1))
    assert rel_err(got, ref_o) < 1e-5


@needs_interpreter
def test_append_decode_loop_matches_writing_the_cache_first(small_tiles, monkeypatch):
    """A decode loop that passes each step's row and advances the lengths in place (the same
    tensors every step: replayed launches) gives what writing the row first gives."""
    monkeypatch.setattr(configs, "DECODE_MIN_KEYS", 1)
    _, k, v = _cache(2, 4, 2, 1, 24)
    k_ref, v_ref = k.clone(), v.clone()
    seqlens = torch.tensor([3, 9], dtype=torch.int32)
    q = torch.empty(2, 4, 1, 16)
    k_new, v_new = torch.empty(2, 2, 1, 16), torch.empty(2, 2, 1, 16)
    with torch.no_grad():
        for _ in range(4):
            for t in (q, k_new, v_new):
                t.copy_(torch.randn(t.shape))
            got = fa.flash_attention_kvcache(
                q, k, v, seqlens, True, k=k_new, v=v_new, backend="triton"
            )
            lens = seqlens.tolist()
            k_ref, v_ref = _appended(k_ref, v_ref, k_new, v_new, lens)
            seqlens += 1
            want = fa.flash_attention_kvcache(q, k_ref, v_ref, seqlens, True, backend="torch")
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(k, k_ref)
    assert torch.equal(v, v_ref)


@needs_interpreter
def test_append_in_bfloat16_matches_the_torch_backend(small_tiles, monkeypatch):
    """bfloat16 under the interpreter takes its float32 detour: the rows still land in the
    caller's caches, and a negative length counts as 0 there too."""
    monkeypatch.setattr(configs, "DECODE_MIN_KEYS", 1)
    q, k, v = (t.bfloat16() for t in _cache(2, 4, 2, 2, 40))
    k_new, v_new = torch.randn(2, 2, 2, 16).bfloat16(), torch.randn(2, 2, 2, 16).bfloat16()
    seqlens = torch.tensor([-4, 30], dtype=torch.int32)
    got_k, got_v, want_k, want_v = k.clone(), v.clone(), k.clone(), v.clone()
    with torch.no_grad():
        got = fa.flash_attention_kvcache(
            q, got_k, got_v, seqlens, True, k=k_new, v=v_new, backend="triton"
        )
        want = fa.flash_attention_kvcache(
            q, want_k, want_v, seqlens, True, k=k_new, v=v_new, backend="torch"
        )
    assert torch.equal(got_k, want_k)
    assert torch.equal(got_v, want_v)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@needs_interpreter
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_append_of_no_rows_is_a_plain_call(backend, small_tiles, monkeypatch):
    monkeypatch.setattr(configs, "DECODE_MIN_KEYS", 1)
    q, k, v = _cache(2, 4, 2, 1, 30)
    seqlens = torch.tensor([7, 30], dtype=torch.int32)
    empty = torch.empty(2, 2, 0, 16)
    before = (k.clone(), v.clone())
    with torch.no_grad():
        got = fa.flash_attention_kvcache(q, k, v, seqlens, True, k=empty, v=empty, backend=backend)
        want = fa.flash_attention_kvcache(q, k, v, seqlens, True, backend=backend)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.equal(k, before[0])
    assert torch.equal(v, before[1])


@needs_interpreter
def test_append_no_query_still_stores_the_rows():
    _, k, v = _cache(2, 2, 2, 1, 20)
    k_new, v_new = torch.randn(2, 2, 3, 16), torch.randn(2, 2, 3, 16)
    want_k, want_v = _appended(k, v, k_new, v_new, [4, 18])
    with torch.no_grad():
        o = fa.flash_attention_kvcache(
            torch.randn(2, 2, 0, 16), k, v, torch.tensor([4, 18], dtype=torch.int32), True,
            k=k_new, v=v_new, backend="triton",
        )  # fmt: skip
    assert o.shape == (2, 2, 0, 16)
    assert torch.equal(k, want_k)
    assert torch.equal(v, want_v)


@needs_interpreter
@pytest.mark.parametrize("compile_backend", ["aot_eager", "inductor"])
def test_append_torch_compile_fullgraph_stores_in_place(compile_backend):
    """Compiled in one graph, the call still stores into the caller's caches."""

    def step(q, k, v, seqlens, k_new, v_new):
        o = fa.flash_attention_kvcache(q, k, v, seqlens, True, k=k_new, v=v_new, backend="triton")
        return o * 2

    q, k, v = _cache(2, 4, 2, 1, 24)
    k_new, v_new = torch.randn(2, 2, 1, 16), torch.randn(2, 2, 1, 16)
    seqlens = torch.tensor([23, 9], dtype=torch.int32)
    k2, v2 = k.clone(), v.clone()
    compiled = torch.compile(step, fullgraph=True, backend=compile_backend)
    with torch.no_grad():
        eager = step(q, k, v, seqlens, k_new, v_new)
        got = compiled(q, k2, v2, seqlens, k_new, v_new)
    torch.testing.assert_close(got, eager, rtol=1e-6, atol=1e-6)
    assert torch.equal(k2, k)
    assert torch.equal(v2, v)


@needs_interpreter
def test_append_custom_op_passes_opcheck():
    q, k, v = _cache(2, 4, 2, 3, 20)
    seqlens = torch.tensor([10, 7], dtype=torch.int32)
    k_new, v_new = torch.randn(2, 2, 3, 16), torch.randn(2, 2, 3, 16)
    torch.library.opcheck(
        torch.ops.flashattn_triton.kvcache_append_fwd.default,
        (q, k, v, seqlens, k_new, v_new, True, 0.25, 3, 0),
    )


# ---- bad inputs: clear errors naming the argument, before any launch ----------------------


@pytest.fixture
def no_launch(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("a launcher ran before the error")

    monkeypatch.setattr(launch_kvcache, "forward_kvcache", fail)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bad_inputs(backend, no_launch):
    q, k, v = _cache(2, 4, 2, 1, 16)
    ok = torch.tensor([3, 4], dtype=torch.int32)

    def call(*args, **kwargs):
        with torch.no_grad():
            fa.flash_attention_kvcache(*args, backend=backend, **kwargs)

    with pytest.raises(ValueError, match="k_cache must have shape"):
        call(q, k[0], v, ok)
    with pytest.raises(ValueError, match="q heads 4 and k/v heads 3"):
        call(q, torch.randn(2, 3, 16, 16), torch.randn(2, 3, 16, 16), ok)
    with pytest.raises(TypeError, match="cache_seqlens must be an int32 tensor"):
        call(q, k, v, ok.long())
    with pytest.raises(ValueError, match=r"cache_seqlens must have shape \(batch,\) = \(2,\)"):
        call(q, k, v, ok[:1])
    with pytest.raises(ValueError, match=r"cache_seqlens must lie in \[0, 16\]"):
        call(q, k, v, 17)
    with pytest.raises(TypeError, match="cache_seqlens must be an int or"):
        call(q, k, v, 3.0)
    with pytest.raises(ValueError, match="window_size values"):
        call(q, k, v, ok, window_size=(-2, 0))
    new = torch.randn(2, 2, 1, 16)
    with pytest.raises(
        ValueError, match=r"k and v \(the new rows to store\) must be given together"
    ):
        call(q, k, v, ok, k=new)
    with pytest.raises(ValueError, match=r"v must match v_cache in batch, heads and head_dim"):
        call(q, k, v, ok, k=new, v=torch.randn(2, 1, 1, 16))
    with pytest.raises(TypeError, match="k must have k_cache's dtype"):
        call(q, k, v, ok, k=new.double(), v=new)
    with pytest.raises(ValueError, match="the same number of new rows, got 1 and 2"):
        call(q, k, v, ok, k=new, v=torch.randn(2, 2, 2, 16))
    with pytest.raises(ValueError, match="k_cache must have a unit last stride"):
        call(q, k.transpose(2, 3).contiguous().transpose(2, 3), v, ok, k=new, v=new)
    with pytest.raises(ValueError, match=r"cache_seqlens \+ new rows = 16 \+ 1 exceeds"):
        call(q, k, v, 16, k=new, v=new)
    with pytest.raises(RuntimeError, match="computes no gradients"):
        fa.flash_attention_kvcache(q, k, v, ok, k=new.requires_grad_(), v=new, backend=backend)
    with pytest.raises(RuntimeError, match="computes no gradients"):
        fa.flash_attention_kvcache(q.requires_grad_(), k, v, ok, backend=backend)


@needs_interpreter
def test_returned_lse_holds_no_split_scratch(small_tiles, monkeypatch):
    """A split decode call writes the splits' partial results into one workspace; o and lse,
    which callers keep (and autograd saves), are allocations of their own, so that keeping
    them holds none of it, through the dense and the KV-cache launchers."""
    monkeypatch.setattr(configs, "DECODE_MIN_KEYS", 1)
    splits = []
    real = configs.decode_splits
    monkeypatch.setattr(configs, "decode_splits", lambda *a: splits.append(real(*a)) or splits[-1])
    q, k, v = _cache(2, 4, 2, 3, 200)
    lens = torch.tensor([150, 200], dtype=torch.int32)
    for o, lse in (
        launch.forward(q, k, v, True, 0.25),
        launch_kvcache.forward_kvcache(q, k, v, lens, True, 0.25, -1, -1),
    ):
        assert lse.untyped_storage().nbytes() == lse.numel() * 4
        assert o.untyped_storage().nbytes() == o.numel() * 4
    assert len(splits) == 2, "the decode path did not run twice"
    assert min(splits) > 1, "no split: nothing to check"
