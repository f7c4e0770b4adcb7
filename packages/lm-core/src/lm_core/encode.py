"""Text files to token files: what `python -m lm_core.tokenize encode` runs.

`encode_files(tokenizer, inputs, out_dir)` streams the inputs (`lm_core.text_io`), encodes
batches of about `chunk_chars` characters with the Rust tokenizer on every core, and appends
the ids to `train.bin` (and `val.bin`), raw uint16 when the vocabulary fits, else uint32, each
with its JSON sidecar (`lm_core.data.TokenFileMeta`) so that `load_tokens` and the trainer know
the dtype, vocabulary size and end-of-text id. The end-of-text id follows every document.
Memory stays about `chunk_chars` characters and their tokens, whatever the input size.

Validation split: the tail of the stream from where `1 - val_fraction` of the input bytes have
been read; the piece that straddles that point is cut near it, where its tokens do not change
(the validation stream may start inside a document).

Output files are written under temporary names and renamed when complete: an interrupted run
leaves no partial `train.bin`; existing outputs are replaced only with `overwrite=True`.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from lm_core.data import TokenFileMeta, token_meta_path, write_token_meta
from lm_core.text_io import DOC_END, DocumentReader, find_cut
from lm_core.tokenizer import TextTokenizer

TRAIN_NAME = "train.bin"
VAL_NAME = "val.bin"


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id of a `vocab_size` vocabulary fits, else uint32."""
    if vocab_size <= 1 << 16:
        return np.dtype(np.uint16)
    if vocab_size <= 1 << 32:
        return np.dtype(np.uint32)
    raise ValueError(f"vocab_size: {vocab_size} ids do not fit in uint32")


@dataclass
class EncodeResult:
    """What `encode_files` wrote."""

    train_path: Path
    val_path: Path | None
    train_tokens: int
    val_tokens: int
    dtype: str
    vocab_size: int
    eot_id: int
    input_bytes: int
    batches: int  # encode_batch calls
    hard_cuts: int  # pieces cut inside a run without a safe cut point (see lm_core.text_io)
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return (self.train_tokens + self.val_tokens) / max(self.seconds, 1e-9)


class _Progress:
    """A tqdm bar over input bytes with tokens/s (if tqdm is installed and enabled)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = None
        self.t0 = time.perf_counter()
        if enabled:
            try:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=total, unit="B", unit_scale=True, desc="encode")
            except ImportError:
                pass

    def update(self, nbytes: int, tokens: int) -> None:
        if self.bar is not None:
            rate = tokens / max(time.perf_counter() - self.t0, 1e-9)
            self.bar.set_postfix(tokens=f"{tokens:,}", tok_s=f"{rate:,.0f}", refresh=False)
            self.bar.update(nbytes)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class _TokenSink:
    """One output token file written under a temporary name; `commit` renames it."""

    def __init__(self, path: Path, dtype: np.dtype) -> None:
        self.path = path
        self.tmp = path.with_name(f".{path.name}.tmp")
        self.dtype = dtype
        self.count = 0
        self.file: BinaryIO = open(self.tmp, "wb")  # noqa: SIM115

    def write(self, ids: np.ndarray) -> None:
        ids.tofile(self.file)
        self.count += len(ids)

    def commit(self, meta: TokenFileMeta) -> None:
        self.file.close()
        os.replace(self.tmp, self.path)
        write_token_meta(self.path, meta)

    def discard(self) -> None:
        self.file.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.tmp)


def _split_text(text: str, fraction: float) -> tuple[str, str]:
    """(head, tail) of `text` cut near `fraction` of its length where its tokens do not change
    (`lm_core.text_io.find_cut`); the whole text is the head when it has no such point."""
    if fraction <= 0:
        return "", text
    k = min(max(1, round(len(text) * fraction)), len(text))
    cut = find_cut(text, 0, k) or find_cut(text, k, len(text))
    if cut is None:
        return text, ""
    return text[:cut], text[cut:]


def _check_inputs(inputs: Sequence[str | os.PathLike[str]]) -> list[Path]:
    paths = [Path(p) for p in inputs]
    if not paths:
        raise ValueError("inputs: expected at least one text file")
    for p in paths:
        if not p.is_file():
            raise FileNotFoundError(f"input file not found: {p}")
    return paths


def encode_files(
    tokenizer: TextTokenizer,
    inputs: Sequence[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    *,
    val_fraction: float = 0.01,
    blank_lines: bool = False,
    chunk_chars: int = 1 << 22,
    overwrite: bool = False,
    progress: bool = True,
    on_batch: Callable[[int], Any] | None = None,
) -> EncodeResult:
    """Encode text files into `out_dir/train.bin` (+ `val.bin` when `val_fraction` > 0).

    Documents are separated by the tokenizer's end-of-text token in the text (or by blank
    lines with `blank_lines=True`) and by file ends; each is followed by the end-of-text id.
    `chunk_chars`: characters per `encode_batch` call (memory bound; pieces are at most
    min(chunk_chars, 65536) characters). `on_batch(tokens_so_far)` is called after each batch.
    Errors: a missing input, a tokenizer without the end-of-text token, `val_fraction` outside
    [0, 1), existing outputs without `overwrite`, an empty train or validation split.
    """
    paths = _check_inputs(inputs)
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction: expected a number in [0, 1), got {val_fraction}")
    if isinstance(chunk_chars, bool) or not isinstance(chunk_chars, int) or chunk_chars < 1:
        raise ValueError(f"chunk_chars: expected a positive int, got {chunk_chars!r}")
    eot_id = tokenizer.require_eot()
    dtype = token_dtype(tokenizer.vocab_size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = [TRAIN_NAME, VAL_NAME] if val_fraction > 0 else [TRAIN_NAME]
    if not overwrite:
        targets = [out / n for n in names] + [token_meta_path(out / n) for n in names]
        existing = [str(p) for p in targets if p.exists()]
        if existing:
            raise FileExistsError(f"refusing to overwrite {existing} (pass overwrite / --force)")
    total_bytes = sum(p.stat().st_size for p in paths)
    val_mark = total_bytes * (1 - val_fraction) if val_fraction > 0 else float("inf")
    piece_chars = min(chunk_chars, 1 << 16)
    eot = np.array([eot_id], dtype=dtype)

    sinks = [_TokenSink(out / n, dtype) for n in names]
    sink = sinks[0]
    batch: list[str | None] = []
    batch_chars = 0
    batches = 0
    hard_cuts = 0
    position = 0  # input bytes handed out by the readers
    reported = 0  # of which shown by the progress bar
    bar = _Progress(total_bytes, progress)
    t0 = time.perf_counter()

    def flush() -> None:
        nonlocal batch, batch_chars, batches, reported
        texts = [item for item in batch if item is not DOC_END]
        encoded = iter(tokenizer.encode_batch(texts)) if texts else iter(())
        parts = [
            eot if item is DOC_END else np.asarray(next(encoded), dtype=dtype) for item in batch
        ]
        if parts:
            sink.write(np.concatenate(parts))
        batches += bool(texts)
        batch, batch_chars = [], 0
        tokens = sum(s.count for s in sinks)
        bar.update(position - reported, tokens)
        reported = position
        if on_batch is not None:
            on_batch(tokens)

    try:
        for path in paths:
            separator = None if blank_lines else tokenizer.eot_token
            reader = DocumentReader(
                path, separator=separator, blank_lines=blank_lines, piece_chars=piece_chars
            )
            start = position
            for item in reader:
                begin, position = position, start + reader.bytes_consumed  # the item's bytes
                if item is not DOC_END and sink is sinks[0] and position > val_mark:
                    head, tail = _split_text(item, (val_mark - begin) / (position - begin))
                    if tail:  # else the whole piece stays in train, the next one switches
                        if head:
                            batch.append(head)
                        flush()
                        sink, item = sinks[1], tail
                batch.append(item)
                batch_chars += len(item) if item is not DOC_END else 0
                if batch_chars >= chunk_chars:
                    flush()
            hard_cuts += reader.hard_cuts
        flush()
        for s in sinks:
            s.file.flush()
        for name, s in zip(names, sinks):
            if s.count == 0:
                split = "validation" if name == VAL_NAME else "training"
                raise ValueError(
                    f"the {split} split is empty: the input ({total_bytes} bytes) is too small "
                    f"for val_fraction={val_fraction}"
                )
        for s in sinks:
            s.commit(
                TokenFileMeta(
                    dtype=dtype.name,
                    vocab_size=tokenizer.vocab_size,
                    eot_id=eot_id,
                    num_tokens=s.count,
                    tokenizer=getattr(tokenizer, "source", None),
                )
            )
    except BaseException:
        for s in sinks:
            s.discard()
        raise
    finally:
        bar.close()
    return EncodeResult(
        train_path=sinks[0].path,
        val_path=sinks[1].path if len(sinks) > 1 else None,
        train_tokens=sinks[0].count,
        val_tokens=sinks[1].count if len(sinks) > 1 else 0,
        dtype=dtype.name,
        vocab_size=tokenizer.vocab_size,
        eot_id=eot_id,
        input_bytes=total_bytes,
        batches=batches,
        hard_cuts=hard_cuts,
        seconds=time.perf_counter() - t0,
    )
