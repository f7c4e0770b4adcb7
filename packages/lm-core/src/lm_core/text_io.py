"""Text files read as a stream of documents, in pieces that fit in memory.

`DocumentReader(path, ...)` yields pieces of document text (str, at most about `piece_chars`
characters) and `DOC_END` (None) where a document ends: at each occurrence of `separator` in
the text (e.g. "<|endoftext|>"), or, with `blank_lines=True`, at each run of blank lines; the
end of the file ends its last document. A file of any size is read `piece_chars` characters at
a time.

A document longer than `piece_chars` is cut where a byte-level BPE tokenizer with GPT-2's
pre-tokenization (ours) ends a pre-token anyway, so encoding the pieces one by one gives the
same tokens as encoding the whole document: before a whitespace character that follows a
non-space one, a line break if there is one (`find_cut`). Only a run of `piece_chars`
characters without such a point is cut where it is (`DocumentReader.hard_cuts` counts those).
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Iterator
from functools import partial
from pathlib import Path

DOC_END = None  # yielded where a document ends


# Where a whitespace run starts after a non-space character: a line break first, else any.
_CUT_PATTERNS = (re.compile(r"(?<=\S)[\r\n]"), re.compile(r"(?<=\S)\s"))


def find_cut(text: str, lo: int, hi: int) -> int | None:
    """The last cut position q in (lo, hi] of `text` where a whitespace run starts after a
    non-space character, preferring a line break; None if there is none.

    GPT-2's pre-tokenizer pattern always ends a pre-token there (no pre-token holds a
    non-space character followed by whitespace), and the text after q is split the same way
    whether it starts a string or not: encoding text[:q] and text[q:] apart gives the tokens
    of the whole. (A cut after a whitespace run would not: "a  \nb" splits as "a", "  ",
    "\n", "b", but "a  \n" alone ends in the one pre-token "  \n".)
    """
    for pattern in _CUT_PATTERNS:
        last = None
        for match in pattern.finditer(text, lo + 1, hi + 1):
            last = match.start()
        if last is not None:
            return last
    return None


class DocumentReader:
    """Iterate over one UTF-8 text file as pieces of documents and `DOC_END` markers.

    separator: the string between documents (not yielded; its own `DOC_END` instead), or None.
    blank_lines: documents are separated by runs of blank (whitespace-only) lines instead; the
        blank lines are not yielded.
    piece_chars: the most characters read at once, and about the longest piece yielded.

    `bytes_consumed` counts the file's bytes handed out so far (pieces, separators, blank
    lines); it equals the file size once the iteration is done. Text that is not valid UTF-8
    raises ValueError naming the file.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        separator: str | None = None,
        blank_lines: bool = False,
        piece_chars: int = 1 << 16,
    ) -> None:
        if isinstance(piece_chars, bool) or not isinstance(piece_chars, int) or piece_chars < 1:
            raise ValueError(f"piece_chars: expected a positive int, got {piece_chars!r}")
        if separator is not None and (not separator or any(c.isspace() for c in separator)):
            raise ValueError(
                f"separator: expected a non-empty string without whitespace, got {separator!r}"
            )
        self.path = Path(path)
        self.separator = separator
        self.blank_lines = blank_lines
        self.piece_chars = piece_chars
        self.bytes_consumed = 0
        self.hard_cuts = 0

    def __iter__(self) -> Iterator[str | None]:
        with open(self.path, "rb") as raw:
            # newline="": line endings reach the tokenizer untranslated (exact round trips)
            text = io.TextIOWrapper(raw, encoding="utf-8", errors="strict", newline="")
            try:
                if self.blank_lines:
                    yield from self._by_blank_lines(text)
                else:
                    yield from self._by_separator(text)
            except UnicodeDecodeError as exc:
                raise ValueError(f"{self.path}: not UTF-8 text ({exc})") from exc

    def _piece(self, text: str) -> str:
        self.bytes_consumed += len(text.encode("utf-8"))
        return text

    def _split_long(self, buf: str, start: int, reserve: int) -> tuple[list[str], int]:
        """Pieces cut from buf[start:] while more than piece_chars (+ reserve) remain, and the
        new start."""
        pieces = []
        while len(buf) - start - reserve >= self.piece_chars:
            cut = find_cut(buf, start, start + self.piece_chars)
            if cut is None:
                cut = start + self.piece_chars
                self.hard_cuts += 1
            pieces.append(self._piece(buf[start:cut]))
            start = cut
        return pieces, start

    def _by_separator(self, text: io.TextIOWrapper) -> Iterator[str | None]:
        sep = self.separator
        sep_bytes = len(sep.encode("utf-8")) if sep else 0
        # keep a possible partial separator at the end of the buffer for the next read
        reserve = len(sep) - 1 if sep else 0
        buf, start, open_doc = "", 0, False
        while True:
            chunk = text.read(self.piece_chars)
            if chunk:
                buf, start = buf[start:] + chunk, 0
            while sep and (i := buf.find(sep, start)) >= 0:
                if i > start:
                    yield self._piece(buf[start:i])
                self.bytes_consumed += sep_bytes
                yield DOC_END
                open_doc, start = False, i + len(sep)
            if not chunk:
                break
            pieces, start = self._split_long(buf, start, reserve)
            open_doc = open_doc or bool(pieces)
            yield from pieces
        if start < len(buf):
            open_doc = True
            yield self._piece(buf[start:])
        if open_doc:
            yield DOC_END

    def _by_blank_lines(self, text: io.TextIOWrapper) -> Iterator[str | None]:
        parts: list[str] = []
        size, open_doc, at_line_start = 0, False, True
        for line in iter(partial(text.readline, self.piece_chars), ""):
            complete = line.endswith(("\n", "\r"))
            if at_line_start and complete and not line.strip():
                self.bytes_consumed += len(line.encode("utf-8"))
                if parts:
                    yield self._piece("".join(parts))
                    parts, size = [], 0
                if open_doc:
                    yield DOC_END
                    open_doc = False
                continue
            parts.append(line)
            size += len(line)
            open_doc, at_line_start = True, complete
            if size >= self.piece_chars:
                buf = "".join(parts)
                pieces, start = self._split_long(buf, 0, 0)
                yield from pieces
                parts = [buf[start:]] if start < len(buf) else []
                size = len(buf) - start
        if parts:
            yield self._piece("".join(parts))
        if open_doc:
            yield DOC_END
