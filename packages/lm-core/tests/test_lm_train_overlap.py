"""`lm_core.train --optimizer-overlap` (AdamW stepped per block during the backward,
`OverlappedOptimizer`) and `--compile-blocks` (each block compiled on its own, which the
overlap needs): the same training as the plain trainer, checkpoints that either resumes, and
the combinations refused by name. CPU: each unit steps inline; the GPU's side stream is
checked by `test_lm_optim_overlap_gpu.py`."""

from __future__ import annotations

import pytest
import torch

import lm_core.trainer as trainer
from lm_core import OverlappedOptimizer
from lm_core.activation_ckpt import checkpoint_group_size
from lm_core.train import main
from lm_core.train_config import ConfigError

FAST = ["--size", "tiny", "--context-length", "32", "--batch-size", "4", "--no-progress"]
COMMON = [*FAST, "--log-every", "1", "--grad-clip", "0", "--max-lr", "3e-3", "--warmup-steps", "2"]


def _losses(result):
    return [h["loss"] for h in result.history]


def _assert_same_model(a, b):
    for (name, x), y in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        assert torch.equal(x, y), name


@pytest.mark.parametrize(
    "flags",
    [["--grad-accum-steps", "2"], ["--bf16", "--bf16-weights"]],
    ids=["fp32-accum", "bf16-held-weights"],
)
def test_overlapped_run_is_the_plain_run(flags):
    """Losses, logged LRs and final weights bit for bit: AdamW updates each element from
    its own state, so stepping per block changes no number; the LR is set before the
    backward, where the blocks step."""
    plain = main([*COMMON, "--steps", "6", *flags])
    overlapped = main([*COMMON, "--steps", "6", "--optimizer-overlap", *flags])
    assert isinstance(overlapped.optimizer, OverlappedOptimizer)
    assert _losses(overlapped) == _losses(plain)
    assert [h["lr"] for h in overlapped.history] == [h["lr"] for h in plain.history]
    _assert_same_model(plain, overlapped)


def test_overlapped_checkpoints_resume_either_way(tmp_path):
    """A run saved with --optimizer-overlap resumes with or without it (one state-dict
    layout), and both continue the uninterrupted run exactly."""
    common = [*COMMON, "--cosine-steps", "8"]
    full = main([*common, "--steps", "8", "--optimizer-overlap"])
    main([*common, "--steps", "4", "--optimizer-overlap", "--out-dir", str(tmp_path / "a")])
    resume = ["--steps", "8", "--resume", str(tmp_path / "a" / "checkpoint.pt")]
    for i, extra in enumerate((["--optimizer-overlap"], [])):
        rest = main([*common, *resume, *extra, "--out-dir", str(tmp_path / f"b{i}")])
        assert rest.step == 8
        assert _losses(rest) == _losses(full)[4:]
        _assert_same_model(full, rest)


def test_compile_blocks_compiles_each_block_before_the_wrappers(monkeypatch):
    """--compile-blocks hands the model (activation checkpointing already applied) to
    `compile_blocks`, and the whole-model compile stays off."""
    seen = []

    def record(model):
        seen.append((type(model).__name__, checkpoint_group_size(model)))
        return model

    monkeypatch.setattr(trainer, "compile_blocks", record)
    result = main([*COMMON, "--steps", "2", "--compile-blocks", "--activation-checkpointing", "1"])
    assert seen == [("TransformerLM", 1)]
    assert result.parallel.module is result.model  # not torch.compile's wrapper


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--optimizer-overlap", "--grad-clip", "1.0"], "--grad-clip 0"),
        (["--optimizer-overlap", "--grad-clip", "0", "--ddp", "torch"], "excludes --ddp"),
        (
            ["--optimizer-overlap", "--grad-clip", "0", "--checkpoint-format", "dcp"],
            "--checkpoint-format full",
        ),
        (["--compile-blocks", "--compile"], "excludes --compile"),
        (["--compile-blocks", "--fsdp", "torch"], "excludes --fsdp"),
    ],
)
def test_refusals_name_the_options(flags, named, capsys):
    with pytest.raises((ConfigError, SystemExit)):
        main([*FAST, "--steps", "1", *flags])
    out = capsys.readouterr()
    assert named in out.err + out.out
