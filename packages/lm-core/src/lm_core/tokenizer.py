"""Tokenizers: byte-level BPE trained and run by Hugging Face `tokenizers` (Rust).

`tokenizers` is an optional dependency (`pip install lm-core[text]`), imported when a tokenizer
is first built or loaded; without it `require_tokenizers()` raises an ImportError saying what to
install. We train and run tokenizers with it rather than a BPE of our own: it is the reference
implementation, multithreaded, and its JSON files are what other tools read and write.

`TextTokenizer` wraps any `tokenizers.Tokenizer` (ours, or any `tokenizer.json` of that format)
with the end-of-text token that separates documents. Its `decode` keeps special tokens, so
`decode(encode(text)) == text` for a byte-level BPE tokenizer, whatever the text.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

EOT_TOKEN = "<|endoftext|>"
# 256 byte tokens + the end-of-text token: the smallest byte-level BPE vocabulary.
MIN_BPE_VOCAB = 257


def require_tokenizers() -> Any:
    """The `tokenizers` module; ImportError with the install command when it is missing."""
    try:
        import tokenizers
    except ImportError as exc:
        raise ImportError(
            "lm_core's tokenizer needs the Hugging Face `tokenizers` package: "
            "`pip install 'lm-core[text]'` (or `pip install tokenizers`)"
        ) from exc
    return tokenizers


class TextTokenizer:
    """A `tokenizers.Tokenizer` and its end-of-text token.

    tokenizer: the Rust tokenizer; eot_token: the special token between documents (its id is
    `eot_id`, None when the vocabulary lacks it).
    """

    def __init__(self, tokenizer: Any, eot_token: str = EOT_TOKEN) -> None:
        self.tokenizer = tokenizer
        self.eot_token = eot_token
        self.source: str | None = None  # the file it was loaded from, if any
        self.eot_id: int | None = tokenizer.token_to_id(eot_token)
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        # ids need not be contiguous in a foreign file: size arrays by the largest id
        self.vocab_size: int = max(vocab.values()) + 1 if vocab else 0

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], eot_token: str = EOT_TOKEN) -> TextTokenizer:
        """Load a `tokenizers` JSON file (`tokenizer.json`); errors name the file."""
        tokenizers = require_tokenizers()
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {path}")
        try:
            tokenizer = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:
            raise ValueError(
                f"tokenizer file {path} is not a Hugging Face `tokenizers` JSON file: {exc}"
            ) from exc
        loaded = cls(tokenizer, eot_token)
        loaded.source = str(path)
        return loaded

    def special_tokens(self) -> list[str]:
        """The contents of the tokenizer's special added tokens (for error messages)."""
        decoder = self.tokenizer.get_added_tokens_decoder()
        return [t.content for _, t in sorted(decoder.items()) if t.special]

    def require_eot(self, flag: str = "--eot-token") -> int:
        """`eot_id`, or a ValueError naming `flag` and the tokenizer's special tokens."""
        if self.eot_id is None:
            raise ValueError(
                f"{flag}: the tokenizer has no token {self.eot_token!r}; its special tokens "
                f"are {self.special_tokens()}"
            )
        return self.eot_id

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (special tokens in the text become their ids)."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, encoded in parallel on every core by the Rust library."""
        batch = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
        return [e.ids for e in batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids`, special tokens included (the inverse of `encode`)."""
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the tokenizer as `tokenizers` JSON (atomically: temp file, then rename)."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp")
        self.tokenizer.save(str(tmp))
        os.replace(tmp, path)


def train_bpe(
    documents: Iterable[str],
    vocab_size: int,
    *,
    eot_token: str = EOT_TOKEN,
    min_frequency: int = 2,
    show_progress: bool = True,
) -> TextTokenizer:
    """Train a byte-level BPE tokenizer (GPT-2's pre-tokenization, no normalization) on
    `documents`, an iterable of text pieces that never contains `eot_token`.

    The vocabulary: `eot_token` (id 0), the 256 bytes, then merges up to `vocab_size` (fewer
    when the text runs out of pairs seen `min_frequency` times). Every string can be encoded
    and decodes back to itself.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise TypeError(f"vocab_size: expected an int, got {vocab_size!r}")
    if vocab_size < MIN_BPE_VOCAB:
        raise ValueError(
            f"vocab_size: expected at least {MIN_BPE_VOCAB} (256 bytes + {eot_token}), "
            f"got {vocab_size}"
        )
    tk = require_tokenizers()
    tokenizer = tk.Tokenizer(tk.models.BPE())
    # add_prefix_space=False and no normalizer: the text is kept byte for byte
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[eot_token],
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    return TextTokenizer(tokenizer, eot_token)
