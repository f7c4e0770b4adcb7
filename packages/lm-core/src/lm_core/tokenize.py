"""`python -m lm_core.tokenize train|encode`: text files to a tokenizer, then to token files.

Examples:
    python -m lm_core.tokenize train --input corpus.txt --vocab-size 10000 --out tokenizer.json
    python -m lm_core.tokenize encode --tokenizer tokenizer.json --input corpus.txt --out data
    python -m lm_core.train --data data/train.bin --val-data data/val.bin ...

Documents are separated by `<|endoftext|>` in the text (`--eot-token` names another), or by
blank lines with `--blank-lines`; each file ends a document. `train` writes a byte-level BPE
tokenizer in Hugging Face `tokenizers` JSON; `encode` accepts any file of that format.
Needs `pip install 'lm-core[text]'` (the `tokenizers` package; tqdm for progress bars).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

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


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and validate; a bad value exits with an argparse error naming the flag."""
    parser = build_parser()
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.input if not p.is_file()]
    if missing:
        parser.error(f"--input: file not found: {', '.join(missing)}")
    if not args.eot_token or any(c.isspace() for c in args.eot_token):
        parser.error(f"--eot-token: expected a token without whitespace, got {args.eot_token!r}")
    if args.command == "train":
        if args.vocab_size < MIN_BPE_VOCAB:
            parser.error(
                f"--vocab-size: expected at least {MIN_BPE_VOCAB} (256 bytes + the eot token), "
                f"got {args.vocab_size}"
            )
        if args.min_frequency < 1:
            parser.error(f"--min-frequency: expected >= 1, got {args.min_frequency}")
        if args.out.exists() and not args.force:
            parser.error(f"--out: {args.out} exists (pass --force to replace it)")
    else:
        if not args.tokenizer.is_file():
            parser.error(f"--tokenizer: file not found: {args.tokenizer}")
        if not 0 <= args.val_fraction < 1:
            parser.error(f"--val-fraction: expected a number in [0, 1), got {args.val_fraction}")
        if args.chunk_chars < 1:
            parser.error(f"--chunk-chars: expected a positive int, got {args.chunk_chars}")
    return args


def _documents(args: argparse.Namespace, bar: object | None) -> Iterator[str]:
    """Every piece of document text of the inputs (the eot separators left out)."""
    separator = None if args.blank_lines else args.eot_token
    for path in args.input:
        reader = DocumentReader(path, separator=separator, blank_lines=args.blank_lines)
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


def run_train(args: argparse.Namespace) -> int:
    """`train`: fit the tokenizer and write it to --out."""
    total = sum(p.stat().st_size for p in args.input)
    bar = _progress_bar(total, not args.no_progress, "read")
    t0 = time.perf_counter()
    try:
        tokenizer = train_bpe(
            _documents(args, bar),
            args.vocab_size,
            eot_token=args.eot_token,
            min_frequency=args.min_frequency,
            show_progress=not args.no_progress,
        )
    finally:
        if bar is not None:
            bar.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(args.out)
    print(
        f"{args.out}: byte-level BPE, vocabulary {tokenizer.vocab_size:,} "
        f"({args.eot_token} = id {tokenizer.eot_id}), trained on {total:,} bytes "
        f"in {time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    return 0


def run_encode(args: argparse.Namespace) -> int:
    """`encode`: write --out/train.bin (+ val.bin) and their JSON sidecars."""
    from lm_core.encode import encode_files

    tokenizer = TextTokenizer.from_file(args.tokenizer, args.eot_token)
    result = encode_files(
        tokenizer,
        args.input,
        args.out,
        val_fraction=args.val_fraction,
        blank_lines=args.blank_lines,
        chunk_chars=args.chunk_chars,
        overwrite=args.force,
        progress=not args.no_progress,
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
    args = parse_args(argv)
    try:
        return run_train(args) if args.command == "train" else run_encode(args)
    except (ValueError, OSError, ImportError) as exc:
        print(f"python -m lm_core.tokenize {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
