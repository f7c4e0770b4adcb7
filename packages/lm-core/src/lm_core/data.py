"""Token data: random training windows, token files, synthetic sequences, packed documents.

`get_batch` draws `batch_size` random windows of `context_length + 1` tokens from a 1-D token
array (numpy array, `np.memmap` or tensor) and returns inputs x and next-token targets y.
Drawing start positions (`sample_starts`) is separate from reading the windows
(`gather_windows`) so data-parallel training can draw one global batch identically on every
rank and read only its own rows. `document_offsets` finds the documents in a batch of windows
from an end-of-text id, for packed training (`TransformerLM(...)(x, cu_seqlens=...)`).

A raw `.bin` token file may have a JSON sidecar next to it, `<file>.json` (written by
`python -m lm_core.tokenize encode`), naming its dtype, vocabulary size, end-of-text id and
token count (`TokenFileMeta`); `load_tokens` reads the dtype from it and checks the count.
"""

from __future__ import annotations

import json
import numbers
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

Generator = torch.Generator | np.random.Generator


def _num_tokens(tokens: np.ndarray | torch.Tensor) -> int:
    if tokens.ndim != 1:
        raise ValueError(f"tokens: expected a 1-D token array, got shape {tuple(tokens.shape)}")
    dtype = tokens.dtype
    is_int = (
        not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
        if isinstance(dtype, torch.dtype)
        else np.issubdtype(dtype, np.integer)
    )
    if not is_int:
        raise TypeError(f"tokens: expected an integer dtype, got {dtype}")
    return int(tokens.shape[0])


def _positive_int(value: object, name: str) -> int:
    """`value` as an int if it is a positive integer (Python or NumPy), else a clear error."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected a positive int, got {value!r} ({type(value).__name__})")
    if value <= 0:
        raise ValueError(f"{name}: expected a positive int, got {value}")
    return int(value)


def sample_starts(
    num_tokens: int, batch_size: int, context_length: int, generator: Generator | None = None
) -> np.ndarray:
    """`batch_size` window starts, uniform in [0, num_tokens - context_length - 1]: int64 (B,).

    Uses `generator` (torch.Generator or np.random.Generator) or, if None, torch's global RNG.
    """
    batch_size = _positive_int(batch_size, "batch_size")
    context_length = _positive_int(context_length, "context_length")
    high = num_tokens - context_length  # exclusive bound: the target window needs one more token
    if high <= 0:
        raise ValueError(
            f"tokens: {num_tokens} tokens are too few for context_length={context_length} "
            f"(need at least {context_length + 1})"
        )
    if isinstance(generator, np.random.Generator):
        return generator.integers(0, high, size=batch_size, dtype=np.int64)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(
            f"generator: expected torch.Generator, np.random.Generator or None, got {generator!r}"
        )
    return torch.randint(0, high, (batch_size,), generator=generator).numpy()


def gather_windows(
    tokens: np.ndarray | torch.Tensor,
    starts: np.ndarray,
    context_length: int,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Windows at `starts`: x = tokens[s : s+T], y = tokens[s+1 : s+T+1], int64 (B, T) each."""
    offsets = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(context_length + 1)
    if isinstance(tokens, torch.Tensor):
        windows = tokens[torch.from_numpy(offsets).to(tokens.device)].long()  # (B, T+1)
    else:
        windows = torch.from_numpy(np.asarray(tokens[offsets], dtype=np.int64))  # (B, T+1)
    windows = to_device(windows, device)
    return windows[:, :-1], windows[:, 1:]


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device`: through pinned memory without waiting for a GPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def get_batch(
    tokens: np.ndarray | torch.Tensor,
    batch_size: int,
    context_length: int,
    device: torch.device | str = "cpu",
    generator: Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random training windows: (x, y), int64 (batch_size, context_length) on `device`.

    y[i, t] = x[i, t + 1] continued by one token: next-token targets. Reproducible given a
    `generator` (torch.Generator or np.random.Generator) whose state can be checkpointed.
    """
    starts = sample_starts(_num_tokens(tokens), batch_size, context_length, generator)
    return gather_windows(tokens, starts, context_length, device)


TOKEN_META_FORMAT = "lm_core.tokens/1"
# Token-file dtypes a sidecar may name: uint16 while the vocabulary fits, else uint32.
TOKEN_DTYPES = ("uint16", "uint32")


@dataclass(frozen=True)
class TokenFileMeta:
    """What the JSON sidecar `<file>.json` of a raw token file records.

    dtype: "uint16" or "uint32"; vocab_size: ids lie in [0, vocab_size); eot_id: the
    end-of-text id separating documents (None if the tokenizer has none); num_tokens: length
    of the file in tokens; tokenizer: the tokenizer file it was encoded with (informative).
    """

    dtype: str
    vocab_size: int
    eot_id: int | None
    num_tokens: int
    tokenizer: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in TOKEN_DTYPES:
            raise ValueError(f"dtype: expected one of {list(TOKEN_DTYPES)}, got {self.dtype!r}")
        for name in ("vocab_size", "num_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}: expected a non-negative int, got {value!r}")
        if self.vocab_size > np.iinfo(self.dtype).max + 1:
            raise ValueError(f"vocab_size {self.vocab_size} does not fit in {self.dtype}")
        if self.eot_id is not None and not 0 <= self.eot_id < self.vocab_size:
            raise ValueError(f"eot_id: expected None or an id in [0, {self.vocab_size})")


def token_meta_path(path: str | os.PathLike[str]) -> Path:
    """The sidecar of token file `path`: the same name with `.json` appended."""
    path = Path(path)
    return path.with_name(path.name + ".json")


def write_token_meta(path: str | os.PathLike[str], meta: TokenFileMeta) -> Path:
    """Write `meta` as the sidecar of token file `path`; returns the sidecar's path."""
    target = token_meta_path(path)
    target.write_text(json.dumps({"format": TOKEN_META_FORMAT, **asdict(meta)}, indent=2) + "\n")
    return target


def read_token_meta(path: str | os.PathLike[str]) -> TokenFileMeta | None:
    """The sidecar of token file `path`, or None when there is none.

    Raises ValueError naming the sidecar when it is not valid JSON of this format.
    """
    target = token_meta_path(path)
    if not target.is_file():
        return None
    try:
        data: Any = json.loads(target.read_text())
        if not isinstance(data, dict) or data.get("format") != TOKEN_META_FORMAT:
            raise ValueError(f"expected a JSON object with format {TOKEN_META_FORMAT!r}")
        data = {k: v for k, v in data.items() if k != "format"}
        return TokenFileMeta(**data)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"token file sidecar {target} is invalid: {exc}") from exc


def load_tokens(path: str | os.PathLike[str], dtype: np.dtype | str | None = None) -> np.ndarray:
    """Memory-map a token file: `.npy` (dtype from the header) or raw `.bin`.

    A raw file's dtype is `dtype` if given, else its sidecar's (`<file>.json`, see
    `TokenFileMeta`), else uint16. With a sidecar, a different `dtype` or a file length other
    than its token count is an error (a wrong dtype or a truncated file).
    Returns a read-only 1-D integer array; nothing is read into memory until indexed.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"token file not found: {path}")
    if path.stat().st_size == 0:
        raise ValueError(f"token file {path} is empty: expected a 1-D array of token ids")
    if path.suffix == ".npy":
        try:
            tokens = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError, EOFError) as exc:
            raise ValueError(
                f"token file {path}: not a .npy array of integer token ids that can be "
                f"memory-mapped ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})"
            ) from exc
    else:
        meta = read_token_meta(path)
        if dtype is not None:
            try:
                dtype = np.dtype(dtype)
            except TypeError as exc:
                raise TypeError(f"dtype: expected a NumPy integer dtype, got {dtype!r}") from exc
            if not np.issubdtype(dtype, np.integer):
                raise TypeError(f"dtype: expected a NumPy integer dtype (e.g. uint16), got {dtype}")
        if meta is not None and dtype is not None and dtype != np.dtype(meta.dtype):
            raise ValueError(
                f"token file {path}: dtype {np.dtype(dtype)} was asked for, but its sidecar "
                f"{token_meta_path(path)} says {meta.dtype}"
            )
        dtype = np.dtype(dtype if dtype is not None else meta.dtype if meta else np.uint16)
        size = path.stat().st_size
        if size % dtype.itemsize != 0:
            raise ValueError(
                f"token file {path}: size {size} bytes is not a multiple of "
                f"{dtype} ({dtype.itemsize} bytes); wrong dtype?"
            )
        if meta is not None and size // dtype.itemsize != meta.num_tokens:
            raise ValueError(
                f"token file {path}: holds {size // dtype.itemsize} tokens, its sidecar "
                f"{token_meta_path(path)} says {meta.num_tokens} (truncated or replaced?)"
            )
        tokens = np.memmap(path, dtype=dtype, mode="r")
    if not isinstance(tokens, np.ndarray) or not np.issubdtype(tokens.dtype, np.integer):
        got = tokens.dtype if isinstance(tokens, np.ndarray) else type(tokens).__name__
        raise TypeError(f"token file {path}: expected integer token ids, got {got}")
    if tokens.ndim != 1 or tokens.shape[0] == 0:
        raise ValueError(f"token file {path}: expected a non-empty 1-D array, got {tokens.shape}")
    return tokens


def synthetic_tokens(
    num_tokens: int, vocab_size: int, kind: str = "pattern", seed: int = 0, period: int = 97
) -> np.ndarray:
    """A synthetic int64 token stream of length `num_tokens`.

    kind="pattern": a fixed random sequence of `period` distinct tokens (period clipped to
        vocab_size), repeated. The next token is a function of the current one, so a model
        can drive the loss toward 0: a learnable signal for tests.
    kind="random": i.i.d. uniform tokens (loss cannot fall below ln(vocab_size)): benchmarks.
    """
    if num_tokens <= 0 or vocab_size <= 0:
        raise ValueError(
            f"synthetic_tokens: num_tokens and vocab_size must be positive, "
            f"got {num_tokens}, {vocab_size}"
        )
    rng = np.random.default_rng(seed)
    if kind == "random":
        return rng.integers(0, vocab_size, size=num_tokens, dtype=np.int64)
    if kind == "pattern":
        cycle = rng.permutation(vocab_size)[: min(period, vocab_size)].astype(np.int64)
        return np.resize(cycle, num_tokens)
    raise ValueError(f"synthetic_tokens: kind must be 'pattern' or 'random', got {kind!r}")


def document_offsets(token_ids: np.ndarray | torch.Tensor, eot_id: int) -> tuple[torch.Tensor, int]:
    """Packed-document offsets of a batch of windows: (cu_seqlens, max_seqlen).

    token_ids: (B, T) (or (T,)) integer ids, best on the CPU (a CUDA tensor is copied to the
    host first, which waits for the GPU). A document starts at every row start and at every
    `eot_id` token: the end-of-text token opens the document after it, as a beginning-of-
    sequence token would, so each token attends to its own document only (the eot predicts
    the next document's first token from itself alone). Returns int32 (S + 1,) CPU offsets
    into the B*T tokens taken row after row (0, ..., B*T) and the longest document's length,
    as `TransformerLM.forward(..., cu_seqlens=, max_seqlen=)` and `flash_attention_varlen`
    take them.
    """
    if isinstance(eot_id, bool) or not isinstance(eot_id, numbers.Integral) or eot_id < 0:
        raise ValueError(f"eot_id: expected a non-negative int token id, got {eot_id!r}")
    ids = token_ids.detach().cpu().numpy() if isinstance(token_ids, torch.Tensor) else token_ids
    ids = np.asarray(ids)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(
            f"token_ids: expected a non-empty (batch, seq) integer array, got shape "
            f"{tuple(ids.shape)} of {ids.dtype}"
        )
    batch, seq = ids.shape
    starts = ids.reshape(-1) == eot_id  # (B*T,): True where a document starts
    starts[::seq] = True  # every row starts one
    bounds = np.flatnonzero(starts)
    cu = np.append(bounds, batch * seq).astype(np.int32)
    return torch.from_numpy(cu), int(np.diff(cu).max())


def check_packing(
    cu_seqlens: torch.Tensor,
    max_seqlen: int | None,
    batch: int,
    seq: int,
    device: torch.device,
) -> None:
    """Check packed-document offsets for a (batch, seq) input (see `document_offsets`):
    an int32 1-D tensor on the input's device, `max_seqlen` None or an int in [1, seq]; the
    values (0 first, batch*seq last, never decreasing, every row start k*seq among them, no
    document longer than max_seqlen) for CPU tensors in eager mode only: reading a CUDA
    tensor would stall the host (flashattn_triton checks them again on its side)."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens: expected a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(
            f"cu_seqlens: expected a 1-D int32 tensor of at least 2 offsets, got "
            f"{cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}"
        )
    if cu_seqlens.device != device:
        raise ValueError(
            f"cu_seqlens: expected it on the token ids' device {device}, got {cu_seqlens.device}"
        )
    if max_seqlen is not None and (
        isinstance(max_seqlen, bool)
        or not isinstance(max_seqlen, int)
        or not 1 <= max_seqlen <= seq
    ):
        raise ValueError(f"max_seqlen: expected None or an int in [1, {seq}], got {max_seqlen!r}")
    compiling = getattr(torch, "compiler", None) is not None and torch.compiler.is_compiling()
    if cu_seqlens.device.type != "cpu" or compiling:
        return
    cu = cu_seqlens.numpy()
    if cu[0] != 0 or cu[-1] != batch * seq:
        raise ValueError(
            f"cu_seqlens: expected offsets from 0 to batch * seq = {batch * seq}, got "
            f"{int(cu[0])} ... {int(cu[-1])}"
        )
    lengths = np.diff(cu)
    if (lengths < 0).any():
        raise ValueError("cu_seqlens: offsets must never decrease")
    missing = np.setdiff1d(np.arange(0, batch * seq, seq), cu)
    if missing.size:
        raise ValueError(
            f"cu_seqlens: every row start must be an offset (documents do not cross rows), "
            f"missing {missing[:4].tolist()}"
        )
    if max_seqlen is not None and lengths.max() > max_seqlen:
        raise ValueError(
            f"max_seqlen={max_seqlen} is less than the longest document, {int(lengths.max())}"
        )
