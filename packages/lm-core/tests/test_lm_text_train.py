"""From text files to a trained model that writes text: tokenize, encode, train, sample.

The corpus is this repository's own Markdown documentation (real English and code, ~190 KB).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tokenizers", reason="needs the [text] extra: pip install 'lm-core[text]'")

from lm_core import generate as generate_cli
from lm_core.data import TokenFileMeta, write_token_meta
from lm_core.encode import encode_files
from lm_core.flops import train_step_flops
from lm_core.text_io import DOC_END, DocumentReader
from lm_core.tokenizer import train_bpe
from lm_core.train import main as train_main
from lm_core.train import parse_args

REPO = Path(__file__).resolve().parents[3]
DOCS = [
    *sorted(REPO.glob("packages/*/README.md")),
    *sorted(REPO.glob("packages/*/docs/*.md")),
    REPO / "README.md",
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Tokenizer (vocab 512) and train/val token files of the repo's docs."""
    if len(DOCS) < 4 or sum(p.stat().st_size for p in DOCS) < 50_000:
        pytest.fail(f"expected the repository's README and docs files under {REPO}")
    out = tmp_path_factory.mktemp("corpus")
    pieces = (p for f in DOCS for p in DocumentReader(f, blank_lines=True) if p is not DOC_END)
    tokenizer = train_bpe(pieces, 512, show_progress=False)
    tokenizer.save(out / "tokenizer.json")
    encode_files(tokenizer, DOCS, out, val_fraction=0.1, blank_lines=True, progress=False)
    return out


def _unigram_cross_entropy(train: np.ndarray, val: np.ndarray, vocab: int) -> float:
    """Loss of the best context-free model (train frequencies, add-one) on the validation set."""
    counts = np.bincount(train, minlength=vocab) + 1.0
    return float(-np.log(counts[val] / counts.sum()).mean())


def test_train_on_real_text_beats_unigram_then_generate(corpus, tmp_path, capsys):
    train = np.fromfile(corpus / "train.bin", np.uint16)
    val = np.fromfile(corpus / "val.bin", np.uint16)
    unigram = _unigram_cross_entropy(train, val, 512)
    run = tmp_path / "run"
    argv = [
        "--size",
        "tiny",
        "--data",
        str(corpus / "train.bin"),
        "--val-data",
        str(corpus / "val.bin"),
        "--steps",
        "120",
        "--batch-size",
        "16",
        "--max-lr",
        "1e-2",
        "--warmup-steps",
        "10",
        "--eval-every",
        "60",
        "--eval-batches",
        "8",
        "--log-every",
        "20",
        "--no-progress",
        "--out-dir",
        str(run),
        "--log-dir",
        str(run / "tb"),
        "--tokenizer",
        str(corpus / "tokenizer.json"),
        "--sample-every",
        "120",
        "--sample-tokens",
        "16",
        "--peak-tflops",
        "1",
    ]
    result = train_main(argv)
    printed = capsys.readouterr().out
    # the sidecar set the vocabulary (the tiny preset has 256) and the trainer said so
    assert result.model.config.vocab_size == 512
    assert "vocab_size 512 from" in printed
    assert "end-of-text id 0" in printed
    assert "sample at step 120:" in printed
    first, last = result.evals[0]["val_loss"], result.evals[-1]["val_loss"]
    assert last < first
    assert last < unigram - 1.0, (last, unigram)  # context is used, not only frequencies
    assert result.evals[-1]["val_ppl"] == pytest.approx(np.exp(last))
    flops_per_token = train_step_flops(result.model.config, 1, 64) / 64
    entry = result.history[-1]
    assert entry["mfu"] == pytest.approx(entry["tokens_per_s"] * flops_per_token / 1e12)
    lines = [json.loads(x) for x in (run / "tb" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if "val_ppl" in x] == [60, 120]
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        assert "tensorboard is not installed" in printed
    else:
        events = EventAccumulator(str(run / "tb"))
        events.Reload()
        tags = set(events.Tags()["scalars"])
        assert {"train/loss", "train/tokens_per_s", "train/mfu", "val/loss", "val/ppl"} <= tags
        assert [e.step for e in events.Scalars("val/loss")] == [60, 120]

    # generate from the checkpoint; the tokenizer path comes from the run's flags
    ckpt = str(run / "checkpoint.pt")
    args = [
        "--checkpoint",
        ckpt,
        "--prompt",
        "The model",
        "--max-new-tokens",
        "30",
        "--temperature",
        "0.8",
        "--top-p",
        "0.95",
        "--seed",
        "0",
        "--ignore-eot",
    ]
    assert generate_cli.main(args) == 0
    one = capsys.readouterr().out
    assert generate_cli.main(args) == 0
    assert capsys.readouterr().out == one  # same seed, same text
    assert one.startswith("The model")
    assert len(one) > len("The model") + 20
    assert generate_cli.main([*args[:-2], "1", "--ignore-eot"]) == 0
    assert capsys.readouterr().out != one


def test_generate_cli_checks_the_tokenizer_and_room(corpus, tmp_path, capsys):
    run = tmp_path / "run"
    train_main(
        [
            "--size",
            "tiny",
            "--data",
            str(corpus / "train.bin"),
            "--steps",
            "1",
            "--no-progress",
            "--out-dir",
            str(run),
        ]
    )
    ckpt = str(run / "checkpoint.pt")
    assert generate_cli.main(["--checkpoint", ckpt]) == 1
    assert "--tokenizer: required" in capsys.readouterr().err
    tok = str(corpus / "tokenizer.json")
    assert (
        generate_cli.main(["--checkpoint", ckpt, "--tokenizer", tok, "--max-new-tokens", "64"]) == 1
    )
    assert "--max-new-tokens" in capsys.readouterr().err
    assert generate_cli.main(["--checkpoint", ckpt, "--tokenizer", tok, "--eot-token", "</s>"]) == 1
    assert "the run's data used 0" in capsys.readouterr().err
    # greedy, a batch of two: both samples equal
    assert (
        generate_cli.main(
            [
                "--checkpoint",
                ckpt,
                "--tokenizer",
                tok,
                "--temperature",
                "0",
                "--num-samples",
                "2",
                "--max-new-tokens",
                "8",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out.split("--- sample 1 ---\n")
    assert out[0].removeprefix("--- sample 0 ---\n") == out[1]
    # two prompts of different lengths in one batch: each continues as it does alone
    greedy = ["--checkpoint", ckpt, "--tokenizer", tok, "--temperature", "0"]
    greedy += ["--max-new-tokens", "8", "--ignore-eot"]
    alone = []
    for text in ("The", "A longer prompt, with more tokens in it"):
        assert generate_cli.main([*greedy, "--prompt", text]) == 0
        alone.append(capsys.readouterr().out.rstrip("\n"))
    both = ["--prompt", "The", "--prompt", "A longer prompt, with more tokens in it"]
    assert generate_cli.main([*greedy, *both]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("--- prompt 0, sample 0 ---\n")
    first, second = printed.removeprefix("--- prompt 0, sample 0 ---\n").split(
        "\n--- prompt 1, sample 0 ---\n"
    )
    assert [first, second.rstrip("\n")] == alone


def _bin(path: Path, vocab: int, eot: int, dtype: str = "uint16") -> Path:
    (np.arange(500) % vocab).astype(dtype).tofile(path)
    write_token_meta(path, TokenFileMeta(dtype, vocab, eot, 500))
    return path


@pytest.mark.parametrize(
    ("extra", "flag"),
    [
        (["--vocab-size", "100"], "--vocab-size 100 is smaller"),
        (["--val-data", "VAL_OTHER"], "--val-data: (dtype, vocab_size, eot_id)"),
        (["--data-dtype", "uint32"], "--data-dtype uint32"),
        (["--sample-every", "5"], "--sample-every needs --tokenizer"),
        (["--sample-every", "5", "--tokenizer", "TRAIN", "--fsdp", "torch"], "--sample-every"),
        (["--sample-tokens", "0"], "--sample-tokens"),
        (["--peak-tflops", "0"], "--peak-tflops"),
        (["--tokenizer", "/nonexistent.json"], "--tokenizer"),
    ],
)
def test_sidecar_and_monitor_flags_are_validated(tmp_path, extra, flag, capsys):
    train = _bin(tmp_path / "train.bin", 300, 0)
    other = _bin(tmp_path / "other.bin", 301, 0)
    names = {"VAL_OTHER": str(other), "TRAIN": str(train)}
    with pytest.raises(SystemExit) as exc:
        parse_args(["--data", str(train), *(names.get(a, a) for a in extra)])
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


def test_sidecar_vocab_applies_and_explicit_larger_vocab_wins(tmp_path):
    train = _bin(tmp_path / "train.bin", 300, 7)
    config = parse_args(["--data", str(train)])
    assert config.model_config.vocab_size == 300
    assert config.data.eot_id == 7
    config = parse_args(["--data", str(train), "--vocab-size", "512"])
    assert config.model_config.vocab_size == 512
    assert parse_args([]).model_config.vocab_size == 256  # no data: the preset's


def test_a_tokenizer_that_does_not_match_the_data_is_refused(corpus, tmp_path):
    tok = str(corpus / "tokenizer.json")  # 512 ids, end-of-text id 0
    other_eot = _bin(tmp_path / "a.bin", 600, 7)
    with pytest.raises(ValueError, match="end-of-text id is 0, the data's sidecar says 7"):
        train_main(["--data", str(other_eot), "--tokenizer", tok, "--steps", "1", "--no-progress"])
    small = _bin(tmp_path / "b.bin", 300, 0)
    with pytest.raises(ValueError, match=r"vocabulary \(512\) is larger than the model's \(300\)"):
        train_main(["--data", str(small), "--tokenizer", tok, "--steps", "1", "--no-progress"])
