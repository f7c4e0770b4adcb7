"""Text to tokens: tokenizer round trips, streaming reads, encode's files and sidecars, the CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("tokenizers", reason="needs the [text] extra: pip install 'lm-core[text]'")

from lm_core import load_tokens
from lm_core.data import TokenFileMeta, read_token_meta, token_meta_path, write_token_meta
from lm_core.encode import encode_files, token_dtype
from lm_core.text_io import DOC_END, DocumentReader, find_cut
from lm_core.tokenize import main
from lm_core.tokenizer import EOT_TOKEN, TextTokenizer, require_tokenizers, train_bpe

EOT = EOT_TOKEN
# Unicode of several scripts and widths, combining marks, emoji (4-byte UTF-8), every kind of
# whitespace run, CRLF, trailing spaces, and the special token inside and between words.
TRICKY = (
    "Héllo wörld! 日本語のテキスト 🤖🚀 e\u0301 Ω≈ç√ \t\ttabs  two  spaces   three\n"
    "crlf line\r\nlone cr\rtrailing   \n\n\n  indented\n\u00a0nbsp\u2003em-space\n"
    f"a{EOT}b {EOT} c\n{EOT}{EOT}\n"
)


def _corpus(n_docs: int = 60, seed: int = 0) -> str:
    """Documents with structure (repeated phrases, numbers, punctuation), eot-separated."""
    rng = np.random.default_rng(seed)
    names = ["Ada", "Grace", "Alan", "Edsger", "Barbara", "Ken"]
    verbs = ["wrote", "proved", "built", "tested", "named"]
    things = ["a compiler", "the kernel", "a proof", "two programs", "the cache"]
    docs = []
    for _ in range(n_docs):
        lines = [
            f"{rng.choice(names)} {rng.choice(verbs)} {rng.choice(things)} in "
            f"{int(rng.integers(1940, 2000))}. Ünïcödé ok, ≠ 🤖."
            for _ in range(int(rng.integers(1, 6)))
        ]
        docs.append("\n".join(lines) + "\n")
    return EOT.join(docs)


@pytest.fixture(scope="module")
def tokenizer():
    return train_bpe([_corpus(), TRICKY.replace(EOT, "")], 400, show_progress=False)


def test_round_trip_unicode_whitespace_and_special_token(tokenizer):
    ids = tokenizer.encode(TRICKY)
    assert tokenizer.decode(ids) == TRICKY
    assert ids.count(tokenizer.eot_id) == TRICKY.count(EOT) == 4
    assert tokenizer.eot_id == 0
    assert tokenizer.vocab_size == 400
    for text in ["", " ", "\n\n", "  x", "x  ", EOT, "🤖" * 3, "\u0301"]:
        assert tokenizer.decode(tokenizer.encode(text)) == text, repr(text)
    # merges were learned: common words are single tokens
    assert len(tokenizer.encode(" compiler")) == 1


def test_tokenizer_file_round_trip_and_foreign_formats(tmp_path, tokenizer):
    tokenizer.save(tmp_path / "tok.json")
    loaded = TextTokenizer.from_file(tmp_path / "tok.json")
    assert loaded.encode(TRICKY) == tokenizer.encode(TRICKY)
    assert loaded.source == str(tmp_path / "tok.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a Hugging Face"):
        TextTokenizer.from_file(tmp_path / "bad.json")
    with pytest.raises(FileNotFoundError, match="tokenizer file not found"):
        TextTokenizer.from_file(tmp_path / "missing.json")
    other = TextTokenizer.from_file(tmp_path / "tok.json", eot_token="</s>")
    assert other.eot_id is None
    with pytest.raises(ValueError, match=r"--eot-token.*'</s>'.*<\|endoftext\|>"):
        other.require_eot()


def test_train_bpe_validates_vocab_size():
    with pytest.raises(ValueError, match="at least 257"):
        train_bpe(["abc"], 256)
    with pytest.raises(TypeError, match="vocab_size"):
        train_bpe(["abc"], 300.0)


def test_missing_tokenizers_package_says_what_to_install(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "tokenizers":
            raise ImportError("No module named 'tokenizers'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(ImportError, match=r"pip install 'lm-core\[text\]'"):
        require_tokenizers()


# -- streaming reads ----------------------------------------------------------------------------


def _read(path, **kwargs):
    reader = DocumentReader(path, **kwargs)
    return list(reader), reader


def test_reader_splits_documents_and_counts_every_byte(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text(TRICKY, encoding="utf-8", newline="")
    items, reader = _read(path, separator=EOT)
    assert reader.bytes_consumed == path.stat().st_size
    # joining the pieces with the separator at each document end gives the text back
    rebuilt = "".join(EOT if i is DOC_END else i for i in items)
    assert rebuilt == TRICKY + EOT  # the end of the file ends the last document
    assert items.count(DOC_END) == 5
    blank = tmp_path / "b.txt"
    blank.write_text("\n\npara one\nline two\n\n \n\npara two\n\t\nlast", newline="")
    items, reader = _read(blank, blank_lines=True)
    assert items == ["para one\nline two\n", DOC_END, "para two\n", DOC_END, "last", DOC_END]
    assert reader.bytes_consumed == blank.stat().st_size


@pytest.mark.parametrize("blank_lines", [False, True])
def test_long_documents_are_cut_at_safe_points_only(tmp_path, tokenizer, blank_lines):
    """A file far larger than the piece size, in pieces that encode like the whole text."""
    text = _corpus(200, seed=1).replace(EOT, "" if blank_lines else "  \n")
    path = tmp_path / "big.txt"
    path.write_text(text, encoding="utf-8", newline="")
    items, reader = _read(path, separator=None, blank_lines=blank_lines, piece_chars=97)
    pieces = [i for i in items if i is not DOC_END]
    assert len(pieces) > 50
    assert max(map(len, pieces)) < 2 * 97
    assert reader.hard_cuts == 0
    assert "".join(pieces) == text
    assert [t for p in pieces for t in tokenizer.encode(p)] == tokenizer.encode(text)
    # the stronger invariant, whatever merges were learned: the same pre-tokens
    pre = tokenizer.tokenizer.pre_tokenizer.pre_tokenize_str
    assert [w for p in pieces for w, _ in pre(p)] == [w for w, _ in pre(text)]


def test_find_cut_prefers_line_breaks_then_spaces():
    assert find_cut("ab\ncd ef", 0, 8) == 2  # a line break beats a later space
    assert find_cut("ab cd ef", 0, 8) == 5  # before " ef"
    assert find_cut("ab  \ncd", 0, 8) == 2  # before the whole run "  \n", never inside it
    assert find_cut("abcdefgh", 0, 8) is None  # no whitespace: a hard cut is needed
    assert find_cut("   x", 0, 4) is None  # no whitespace after a non-space character


def test_reader_rejects_invalid_utf8_naming_the_file(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.txt: not UTF-8"):
        list(DocumentReader(path))


# -- encode ---------------------------------------------------------------------------------------


def _tokens(path):
    return np.fromfile(path, dtype=read_token_meta(path).dtype)


def test_encode_files_counts_dtype_sidecar_and_round_trip(tmp_path, tokenizer):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text(_corpus(40, seed=2), newline="")
    b.write_text(TRICKY, encoding="utf-8", newline="")
    res = encode_files(tokenizer, [a, b], tmp_path / "out", val_fraction=0.2, progress=False)
    train, val = _tokens(res.train_path), _tokens(res.val_path)
    assert train.dtype == val.dtype == np.uint16
    assert res.dtype == "uint16"
    assert (len(train), len(val)) == (res.train_tokens, res.val_tokens)
    total = len(train) + len(val)
    assert 0.1 * total < len(val) < 0.3 * total
    expected = tokenizer.encode(a.read_text() + EOT) + tokenizer.encode(TRICKY + EOT)
    assert np.concatenate([train, val]).tolist() == expected
    assert tokenizer.decode(np.concatenate([train, val])) == a.read_text() + EOT + TRICKY + EOT
    meta = read_token_meta(res.train_path)
    assert meta == TokenFileMeta("uint16", 400, 0, len(train), None)
    loaded = load_tokens(res.val_path)  # the dtype comes from the sidecar
    assert loaded.dtype == np.uint16
    assert len(loaded) == len(val)


def test_encode_streams_a_file_larger_than_the_chunk(tmp_path, tokenizer):
    text = _corpus(300, seed=3)
    path = tmp_path / "big.txt"
    path.write_text(text, newline="")
    seen = []
    res = encode_files(
        tokenizer,
        [path],
        tmp_path / "out",
        val_fraction=0,
        chunk_chars=500,
        progress=False,
        on_batch=seen.append,
    )
    assert len(text) > 40 * 500
    assert res.batches > 40  # one encode_batch per ~500 characters
    assert res.val_path is None
    assert not (tmp_path / "out" / "val.bin").exists()
    assert seen == sorted(seen)
    assert seen[-1] == res.train_tokens
    assert _tokens(res.train_path).tolist() == tokenizer.encode(text + EOT)


@pytest.mark.parametrize("val_fraction", [0.01, 0.3])
def test_validation_split_of_a_single_long_document(tmp_path, tokenizer, val_fraction):
    """No document boundary near the split point: the piece there is cut, tokens unchanged."""
    text = _corpus(100, seed=5).replace(EOT, "\n")
    path = tmp_path / "one.txt"
    path.write_text(text, newline="")
    res = encode_files(
        tokenizer,
        [path],
        tmp_path / "out",
        val_fraction=val_fraction,
        chunk_chars=2000,
        progress=False,
    )
    train, val = _tokens(res.train_path), _tokens(res.val_path)
    assert abs(len(val) / (len(train) + len(val)) - val_fraction) < 0.01
    assert np.concatenate([train, val]).tolist() == tokenizer.encode(text + EOT)
    assert res.hard_cuts == 0


def test_encode_uint32_for_a_large_foreign_vocabulary(tmp_path):
    tk = require_tokenizers()
    vocab = {f"w{i}": i for i in range(70_000)}
    vocab[EOT] = 70_000
    vocab["[UNK]"] = 70_001
    foreign = tk.Tokenizer(tk.models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    foreign.pre_tokenizer = tk.pre_tokenizers.WhitespaceSplit()
    foreign.add_special_tokens([EOT])
    foreign.save(str(tmp_path / "wl.json"))
    text = tmp_path / "t.txt"
    text.write_text(f"w1 w69999 w65536 {EOT} w3 zzz\n")
    assert (
        main(
            [
                "encode",
                "--tokenizer",
                str(tmp_path / "wl.json"),
                "--input",
                str(text),
                "--out",
                str(tmp_path / "o"),
                "--val-fraction",
                "0",
                "--no-progress",
            ]
        )
        == 0
    )
    meta = read_token_meta(tmp_path / "o" / "train.bin")
    assert (meta.dtype, meta.vocab_size, meta.eot_id) == ("uint32", 70_002, 70_000)
    tokens = load_tokens(tmp_path / "o" / "train.bin")
    assert tokens.dtype == np.uint32
    assert tokens.tolist() == [1, 69_999, 65_536, 70_000, 3, 70_001, 70_000]
    assert token_dtype(65_536) == np.uint16
    assert token_dtype(65_537) == np.uint32


def test_encode_errors_leave_no_partial_files(tmp_path, tokenizer):
    small = tmp_path / "s.txt"
    small.write_text("tiny")
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="validation split is empty"):
        encode_files(tokenizer, [small], out, val_fraction=0.01, progress=False)
    assert not list(out.iterdir())  # temporaries removed, nothing committed
    with pytest.raises(ValueError, match="val_fraction"):
        encode_files(tokenizer, [small], out, val_fraction=1.0)
    with pytest.raises(FileNotFoundError, match="input file not found"):
        encode_files(tokenizer, [tmp_path / "nope.txt"], out)
    encode_files(tokenizer, [small], out, val_fraction=0, progress=False)
    before = (out / "train.bin").read_bytes()
    with pytest.raises(FileExistsError, match="refusing to overwrite"):
        encode_files(tokenizer, [small, small], out, val_fraction=0, progress=False)
    assert (out / "train.bin").read_bytes() == before
    encode_files(tokenizer, [small, small], out, val_fraction=0, overwrite=True, progress=False)
    assert len(load_tokens(out / "train.bin")) == 2 * (len(before) // 2)  # uint16: 2 bytes each


def test_load_tokens_checks_the_sidecar(tmp_path):
    path = tmp_path / "t.bin"
    np.arange(10, dtype=np.uint32).tofile(path)
    write_token_meta(path, TokenFileMeta("uint32", 100, 0, 10))
    assert load_tokens(path).dtype == np.uint32
    with pytest.raises(ValueError, match="dtype uint16 was asked for"):
        load_tokens(path, "uint16")
    write_token_meta(path, TokenFileMeta("uint32", 100, 0, 12))
    with pytest.raises(ValueError, match=r"holds 10 tokens.*says 12"):
        load_tokens(path)
    token_meta_path(path).write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match=r"sidecar .* is invalid"):
        load_tokens(path)
    with pytest.raises(ValueError, match="does not fit in uint16"):
        TokenFileMeta("uint16", 70_000, 0, 1)
    with pytest.raises(ValueError, match="eot_id"):
        TokenFileMeta("uint16", 10, 10, 1)


# -- the CLI -------------------------------------------------------------------------------------


def test_cli_train_then_encode(tmp_path, capsys):
    corpus = tmp_path / "c.txt"
    corpus.write_text(_corpus(30, seed=4).replace(EOT, "\n\n"), newline="")
    tok = tmp_path / "tok.json"
    argv = [
        "train",
        "--input",
        str(corpus),
        "--vocab-size",
        "300",
        "--out",
        str(tok),
        "--blank-lines",
        "--no-progress",
    ]
    assert main(argv) == 0
    assert "vocabulary 300 (<|endoftext|> = id 0)" in capsys.readouterr().out
    loaded = TextTokenizer.from_file(tok)
    assert loaded.decode(loaded.encode(TRICKY)) == TRICKY
    with pytest.raises(SystemExit):
        main(argv)  # exists: refused without --force
    assert "--force" in capsys.readouterr().err
    out = tmp_path / "data"
    assert (
        main(
            [
                "encode",
                "--tokenizer",
                str(tok),
                "--input",
                str(corpus),
                "--out",
                str(out),
                "--blank-lines",
                "--val-fraction",
                "0.1",
                "--no-progress",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "train.bin" in printed
    assert "val.bin" in printed
    assert "tokens/s" in printed
    train = load_tokens(out / "train.bin")
    # 30 documents, each followed by the eot id; blank lines are not encoded
    assert (np.asarray(load_tokens(out / "val.bin")) == 0).sum() + (train == 0).sum() == 30
    assert (
        main(
            [
                "encode",
                "--tokenizer",
                str(tok),
                "--input",
                str(corpus),
                "--out",
                str(out),
                "--no-progress",
            ]
        )
        == 1
    )
    assert "refusing to overwrite" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["train", "--input", "MISSING", "--out", "x.json"], "--input"),
        (["train", "--input", "CORPUS", "--out", "x.json", "--vocab-size", "100"], "--vocab-size"),
        (["train", "--input", "CORPUS", "--out", "x.json", "--eot-token", "a b"], "--eot-token"),
        (["encode", "--input", "CORPUS", "--out", "d", "--tokenizer", "MISSING"], "--tokenizer"),
        (
            [
                "encode",
                "--input",
                "CORPUS",
                "--out",
                "d",
                "--tokenizer",
                "CORPUS",
                "--val-fraction",
                "1",
            ],
            "--val-fraction",
        ),
        (
            [
                "encode",
                "--input",
                "CORPUS",
                "--out",
                "d",
                "--tokenizer",
                "CORPUS",
                "--chunk-chars",
                "0",
            ],
            "--chunk-chars",
        ),
        (["fit"], "invalid choice"),
    ],
)
def test_cli_bad_flags_name_the_flag(tmp_path, argv, flag, capsys):
    corpus = tmp_path / "c.txt"
    corpus.write_text("text")
    argv = [
        str(corpus) if a == "CORPUS" else str(tmp_path / a) if a == "MISSING" else a for a in argv
    ]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


def test_cli_flags_become_a_checked_config(tmp_path):
    """`parse_args` maps the flags onto TokenizerTrainConfig / EncodeConfig; made from Python,
    a config rejects a bad value with a ValueError naming the field, not the flag."""
    from lm_core.tokenize import EncodeConfig, TokenizerTrainConfig, parse_args

    corpus = tmp_path / "c.txt"
    corpus.write_text("text")
    argv = ["train", "--input", str(corpus), "--out", str(tmp_path / "t.json"), "--no-progress"]
    cfg = parse_args([*argv, "--vocab-size", "300", "--blank-lines"])
    assert cfg == TokenizerTrainConfig(
        inputs=(corpus,), out=tmp_path / "t.json", vocab_size=300, blank_lines=True, progress=False
    )
    cfg = parse_args(["encode", "--input", str(corpus), "--out", "d", "--tokenizer", str(corpus)])
    assert isinstance(cfg, EncodeConfig)
    assert (cfg.val_fraction, cfg.chunk_chars, cfg.eot_token, cfg.progress) == (
        0.01,
        1 << 22,
        EOT,
        True,
    )
    with pytest.raises(ValueError, match=r"^vocab_size: expected at least 257"):
        TokenizerTrainConfig(inputs=[corpus], out=tmp_path / "t.json", vocab_size=100)
    with pytest.raises(ValueError, match=r"^val_fraction: expected a number in \[0, 1\)"):
        EncodeConfig(inputs=corpus, tokenizer=corpus, out=tmp_path, val_fraction=1.0)
