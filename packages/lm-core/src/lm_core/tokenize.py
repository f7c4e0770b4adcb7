"""`python -m lm_core.tokenize train|encode`: text files to a tokenizer, then to token files.

Examples:
    python -m lm_core.tokenize train --input corpus.txt --vocab-size 10000 --out tokenizer.json
    python -m lm_core.tokenize encode --tokenizer tokenizer.json --input corpus.txt --out data
    python -m lm_core.train --data data/train.bin --val-data data/val.bin ...

Documents are separated by `<|endoftext|>` in the text (`--eot-token` names another), or by
blank lines with `--blank-lines`; each file ends a document. `train` writes a byte-level BPE
tokenizer in Hugging Face `tokenizers` JSON; `encode` accepts any file of that format.
Needs `pip install 'lm-core[text]'` (the `tokenizers` package; tqdm for progress bars).
From Python: `run_train(TokenizerTrainConfig(...))`, `run_encode(EncodeConfig(...))`.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from lm_core._cli import as_field, as_flag
from lm_core.text_io import DOC_END, DocumentReader
from lm_core.tokenizer import EOT_TOKEN, MIN_BPE_VOCAB, TextTokenizer, train_bpe


def _add_input_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--input", nargs="+", type=Path, required=True, metavar="FILE", help="UTF-8 text files"
    )
    p.add_argument(
        "--blank-lines",
        action="store_true",
        help="documents are separated by blank lines (default: by the eot token)",
    )
    p.add_argument("--eot-token", default=EOT_TOKEN, help="the end-of-text special token")
    p.add_argument("--force", action="store_true", help="replace existing output files")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def build_parser() -> argparse.ArgumentParser:
    """The parser of both subcommands."""
    p = argparse.ArgumentParser(
        prog="python -m lm_core.tokenize",
        description="Train a byte-level BPE tokenizer, or encode text files into token files.",
        epilog=__doc__.split("\n\n")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="{train,encode}")
    t = sub.add_parser(
        "train",
        help="train a byte-level BPE tokenizer",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_input_args(t)
    t.add_argument("--vocab-size", type=int, default=10_000, help="vocabulary size")
    t.add_argument("--min-frequency", type=int, default=2, help="fewest occurrences of a merge")
    t.add_argument("--out", type=Path, required=True, help="tokenizer JSON file to write")
    e = sub.add_parser(
        "encode",
        help="encode text files into train.bin / val.bin",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_input_args(e)
    e.add_argument("--tokenizer", type=Path, required=True, help="tokenizers JSON file")
    e.add_argument("--out", type=Path, required=True, help="output directory")
    e.add_argument(
        "--val-fraction",
        type=float,
        default=0.01,
        help="fraction of the input (the tail) for val.bin; 0: no val.bin",
    )
    e.add_argument(
        "--chunk-chars",
        type=int,
        default=1 << 22,
        help="characters encoded per batch (bounds memory)",
    )
    return p


@dataclass(frozen=True, kw_only=True)
class _InputConfig:
    """The options both subcommands share: the text files and how they split into documents."""

    inputs: tuple[Path, ...]  # UTF-8 text files, each ending a document
    blank_lines: bool = False  # documents are separated by blank lines, not the eot token
    eot_token: str = EOT_TOKEN
    force: bool = False  # replace existing output files
    progress: bool = True  # progress bars (when tqdm is installed)

    def __post_init__(self) -> None:
        if isinstance(self.inputs, str | Path):  # one file given bare: tuple() would split it
            object.__setattr__(self, "inputs", (self.inputs,))
        object.__setattr__(self, "inputs", tuple(Path(p) for p in self.inputs))


@dataclass(frozen=True, kw_only=True)
class TokenizerTrainConfig(_InputConfig):
    """`python -m lm_core.tokenize train`, typed; checked when made (a ValueError naming the
    field)."""

    out: Path  # the tokenizer JSON file to write
    vocab_size: int = 10_000
    min_frequency: int = 2  # fewest occurrences of a merge

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "out", Path(self.out))
        _check_train(vars(self), as_field)


@dataclass(frozen=True, kw_only=True)
class EncodeConfig(_InputConfig):
    """`python -m lm_core.tokenize encode`, typed; checked when made (a ValueError naming
    the field)."""

    tokenizer: Path  # a tokenizers JSON file
    out: Path  # the output directory: train.bin, val.bin and their sidecars
    val_fraction: float = 0.01  # the input's tail for val.bin; 0: no val.bin
    chunk_chars: int = 1 << 22  # characters encoded per batch (bounds memory)

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "tokenizer", Path(self.tokenizer))
        object.__setattr__(self, "out", Path(self.out))
        _check_encode(vars(self), as_field)


# Flags whose names are not the field's with dashes.
_FLAGS = {"inputs": "--input"}
_as_flag = partial(as_flag, renamed=_FLAGS)


# The checks take a config's fields and how to call a field (`as_field`, or the CLI's
# `_as_flag`), so one set of checks gives both the config's errors and the command line's.
def _check_inputs(c: Mapping[str, Any], name: Callable[[str], str]) -> None:
    if not c["inputs"]:
        raise ValueError(f"{name('inputs')}: expected at least one text file")
    missing = [str(p) for p in c["inputs"] if not p.is_file()]
    if missing:
        raise ValueError(f"{name('inputs')}: file not found: {', '.join(missing)}")
    eot = c["eot_token"]
    if not eot or any(ch.isspace() for ch in eot):
        raise ValueError(f"{name('eot_token')}: expected a token without whitespace, got {eot!r}")


def _check_train(c: Mapping[str, Any], name: Callable[[str], str]) -> None:
    """ValueError for the first bad value of a TokenizerTrainConfig's fields `c`."""
    _check_inputs(c, name)
    if c["vocab_size"] < MIN_BPE_VOCAB:
        raise ValueError(
            f"{name('vocab_size')}: expected at least {MIN_BPE_VOCAB} (256 bytes + the eot "
            f"token), got {c['vocab_size']}"
        )
    if c["min_frequency"] < 1:
        raise ValueError(f"{name('min_frequency')}: expected >= 1, got {c['min_frequency']}")
    if c["out"].exists() and not c["force"]:
        raise ValueError(f"{name('out')}: {c['out']} exists (pass {name('force')} to replace it)")


def _check_encode(c: Mapping[str, Any], name: Callable[[str], str]) -> None:
    """ValueError for the first bad value of an EncodeConfig's fields `c`."""
    _check_inputs(c, name)
    if not c["tokenizer"].is_file():
        raise ValueError(f"{name('tokenizer')}: file not found: {c['tokenizer']}")
    if not 0 <= c["val_fraction"] < 1:
        raise ValueError(
            f"{name('val_fraction')}: expected a number in [0, 1), got {c['val_fraction']}"
        )
    if c["chunk_chars"] < 1:
        raise ValueError(f"{name('chunk_chars')}: expected a positive int, got {c['chunk_chars']}")


def config_from_args(ns: argparse.Namespace) -> TokenizerTrainConfig | EncodeConfig:
    """The config of parsed flags (by `ns.command`); a bad value is a ValueError naming the
    flag."""
    common = {
        "inputs": tuple(ns.input),
        "blank_lines": ns.blank_lines,
        "eot_token": ns.eot_token,
        "force": ns.force,
        "progress": not ns.no_progress,
    }
    if ns.command == "train":
        fields = {
            **common,
            "out": ns.out,
            "vocab_size": ns.vocab_size,
            "min_frequency": ns.min_frequency,
        }
        _check_train(fields, _as_flag)  # first, so that the error names the flag
        return TokenizerTrainConfig(**fields)
    fields = {
        **common,
        "tokenizer": ns.tokenizer,
        "out": ns.out,
        "val_fraction": ns.val_fraction,
        "chunk_chars": ns.chunk_chars,
    }
    _check_encode(fields, _as_flag)
    return EncodeConfig(**fields)


def parse_args(argv: Sequence[str] | None = None) -> TokenizerTrainConfig | EncodeConfig:
    """The config of a command line (a TokenizerTrainConfig for `train`, an EncodeConfig for
    `encode`); a bad value exits with an argparse error naming the flag."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        return config_from_args(ns)
    except ValueError as exc:
        parser.error(str(exc))


def _documents(cfg: _InputConfig, bar: object | None) -> Iterator[str]:
    """Every piece of document text of the inputs (the eot separators left out)."""
    separator = None if cfg.blank_lines else cfg.eot_token
    for path in cfg.inputs:
        reader = DocumentReader(path, separator=separator, blank_lines=cfg.blank_lines)
        seen = 0
        for item in reader:
            if bar is not None:
                bar.update(reader.bytes_consumed - seen)
                seen = reader.bytes_consumed
            if item is not DOC_END:
                yield item


def _progress_bar(total: int, enabled: bool, desc: str) -> object | None:
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="B", unit_scale=True, desc=desc)


def run_train(cfg: TokenizerTrainConfig) -> int:
    """`train`: fit the tokenizer and write it to `cfg.out`."""
    total = sum(p.stat().st_size for p in cfg.inputs)
    bar = _progress_bar(total, cfg.progress, "read")
    t0 = time.perf_counter()
    try:
        tokenizer = train_bpe(
            _documents(cfg, bar),
            cfg.vocab_size,
            eot_token=cfg.eot_token,
            min_frequency=cfg.min_frequency,
            show_progress=cfg.progress,
        )
    finally:
        if bar is not None:
            bar.close()
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(cfg.out)
    print(
        f"{cfg.out}: byte-level BPE, vocabulary {tokenizer.vocab_size:,} "
        f"({cfg.eot_token} = id {tokenizer.eot_id}), trained on {total:,} bytes "
        f"in {time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    return 0


def run_encode(cfg: EncodeConfig) -> int:
    """`encode`: write `cfg.out`/train.bin (+ val.bin) and their JSON sidecars."""
    from lm_core.encode import encode_files

    tokenizer = TextTokenizer.from_file(cfg.tokenizer, cfg.eot_token)
    result = encode_files(
        tokenizer,
        cfg.inputs,
        cfg.out,
        val_fraction=cfg.val_fraction,
        blank_lines=cfg.blank_lines,
        chunk_chars=cfg.chunk_chars,
        overwrite=cfg.force,
        progress=cfg.progress,
    )
    lines = [f"{result.train_path}: {result.train_tokens:,} tokens ({result.dtype})"]
    if result.val_path is not None:
        lines.append(f"{result.val_path}: {result.val_tokens:,} tokens ({result.dtype})")
    lines.append(
        f"vocabulary {result.vocab_size:,}, eot id {result.eot_id}; {result.input_bytes:,} "
        f"bytes in {result.seconds:.1f} s, {result.tokens_per_s:,.0f} tokens/s"
    )
    if result.hard_cuts:
        lines.append(
            f"note: {result.hard_cuts} long runs without a line break or space were cut "
            "mid-run (their tokens may differ slightly from encoding them whole)"
        )
    print("\n".join(lines), flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Parse `argv` (default: sys.argv[1:]) and run; returns the exit status."""
    cfg = parse_args(argv)  # the one place flags become a config
    train = isinstance(cfg, TokenizerTrainConfig)
    command = "train" if train else "encode"
    try:
        return run_train(cfg) if train else run_encode(cfg)
    except (ValueError, OSError, ImportError) as exc:
        print(f"python -m lm_core.tokenize {command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
