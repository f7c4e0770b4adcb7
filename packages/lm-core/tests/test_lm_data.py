"""get_batch on arrays and memmaps, token files, synthetic tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lm_core import get_batch, load_tokens, synthetic_tokens
from lm_core.data import gather_windows, sample_starts


@pytest.fixture
def memmap(tmp_path):
    path = tmp_path / "tokens.bin"
    np.arange(1000, dtype=np.uint16).tofile(path)
    return load_tokens(path)


def test_shapes_ranges_and_targets(memmap):
    assert isinstance(memmap, np.memmap)
    x, y = get_batch(memmap, 8, 16, "cpu", torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (8, 16)
    assert x.dtype == y.dtype == torch.int64
    # tokens are 0..999 so each window is consecutive integers and y = x + 1
    assert torch.equal(y, x + 1)
    assert torch.equal(x[:, 1:], x[:, :-1] + 1)
    assert x.min() >= 0
    assert y.max() <= 999


def test_every_start_is_reachable():
    tokens = np.arange(12)
    starts = sample_starts(len(tokens), 2000, 4, torch.Generator().manual_seed(1))
    assert set(starts.tolist()) == set(range(8))  # 0 .. len - T - 1


def test_reproducible_with_torch_and_numpy_generators(memmap):
    g = torch.Generator().manual_seed(3)
    state = g.get_state()
    a = get_batch(memmap, 4, 8, "cpu", g)
    b = get_batch(memmap, 4, 8, "cpu", g)
    assert not torch.equal(a[0], b[0])
    g.set_state(state)  # a checkpointed state replays the same batches
    assert torch.equal(get_batch(memmap, 4, 8, "cpu", g)[0], a[0])
    n1 = get_batch(memmap, 4, 8, "cpu", np.random.default_rng(5))
    n2 = get_batch(memmap, 4, 8, "cpu", np.random.default_rng(5))
    assert torch.equal(n1[0], n2[0])


def test_tensor_tokens_and_row_selection():
    tokens = torch.arange(100, dtype=torch.int32)
    starts = np.array([0, 10, 50])
    x, y = gather_windows(tokens, starts[1:], 5)
    assert torch.equal(x[:, 0], torch.tensor([10, 50]))
    assert torch.equal(y[0], torch.arange(11, 16))


def test_too_short_and_bad_inputs():
    with pytest.raises(ValueError, match="too few for context_length=16"):
        get_batch(np.arange(16), 2, 16)
    get_batch(np.arange(17), 2, 16)  # exactly T + 1 tokens is enough
    with pytest.raises(ValueError, match="1-D"):
        get_batch(np.zeros((4, 4), dtype=np.int64), 2, 2)
    with pytest.raises(TypeError, match="integer"):
        get_batch(np.zeros(100), 2, 2)
    with pytest.raises(ValueError, match="batch_size"):
        get_batch(np.arange(100), 0, 2)


@pytest.mark.parametrize(
    ("batch_size", "context_length", "error", "match"),
    [
        (2.5, 4, TypeError, r"batch_size: expected a positive int, got 2\.5 \(float\)"),
        (2.0, 4, TypeError, r"batch_size: expected a positive int, got 2\.0"),
        ("2", 4, TypeError, "batch_size: expected a positive int"),
        (True, 4, TypeError, "batch_size: expected a positive int"),
        (2, 4.0, TypeError, "context_length: expected a positive int"),
        (-1, 4, ValueError, "batch_size: expected a positive int, got -1"),
    ],
)
def test_non_integer_sizes_are_refused_by_name(batch_size, context_length, error, match):
    with pytest.raises(error, match=match):
        get_batch(np.arange(100), batch_size, context_length)
    x, _ = get_batch(np.arange(100), np.int64(2), np.int32(4))  # NumPy integers are ints
    assert x.shape == (2, 4)


def test_empty_and_non_token_files_are_refused_by_name(tmp_path):
    (tmp_path / "empty.bin").write_bytes(b"")
    (tmp_path / "empty.npy").write_bytes(b"")
    (tmp_path / "garbage.npy").write_bytes(b"not a numpy file at all")
    np.save(tmp_path / "objects.npy", np.array(["a", 1], dtype=object), allow_pickle=True)
    np.save(tmp_path / "floats.npy", np.zeros(8, dtype=np.float32))
    np.save(tmp_path / "none.npy", np.zeros(0, dtype=np.uint16))
    np.zeros(8, dtype=np.float32).tofile(tmp_path / "floats.bin")
    cases = [
        ("empty.bin", {}, ValueError, r"empty\.bin is empty"),
        ("empty.npy", {}, ValueError, r"empty\.npy is empty"),
        ("garbage.npy", {}, ValueError, r"garbage\.npy: not a \.npy array"),
        ("objects.npy", {}, ValueError, r"objects\.npy: not a \.npy array"),
        ("floats.npy", {}, TypeError, r"floats\.npy: expected integer token ids, got float32"),
        ("none.npy", {}, ValueError, r"none\.npy: expected a non-empty 1-D array"),
        ("floats.bin", {"dtype": "float32"}, TypeError, "dtype: expected a NumPy integer"),
        ("floats.bin", {"dtype": "nonsense"}, TypeError, "dtype: expected a NumPy integer"),
    ]
    for name, kwargs, error, match in cases:
        with pytest.raises(error, match=match):
            load_tokens(tmp_path / name, **kwargs)


def test_load_tokens_npy_and_errors(tmp_path):
    np.save(tmp_path / "t.npy", np.arange(50, dtype=np.int32))
    tokens = load_tokens(tmp_path / "t.npy")
    assert tokens.dtype == np.int32
    assert len(tokens) == 50
    with pytest.raises(FileNotFoundError, match=r"missing\.bin"):
        load_tokens(tmp_path / "missing.bin")
    (tmp_path / "odd.bin").write_bytes(b"\x00" * 5)
    with pytest.raises(ValueError, match="not a multiple"):
        load_tokens(tmp_path / "odd.bin")


def test_synthetic_tokens():
    pattern = synthetic_tokens(500, 64, "pattern", seed=1, period=10)
    assert pattern.min() >= 0
    assert pattern.max() < 64
    assert np.array_equal(pattern[:10], pattern[10:20])
    assert len(set(pattern[:10].tolist())) == 10  # next token is a function of the current one
    rand = synthetic_tokens(10_000, 64, "random", seed=1)
    assert rand.max() == 63
    assert np.array_equal(rand, synthetic_tokens(10_000, 64, "random", seed=1))
    with pytest.raises(ValueError, match="kind"):
        synthetic_tokens(10, 10, "zipf")
