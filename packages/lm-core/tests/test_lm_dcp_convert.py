"""Sharded (DCP) checkpoints in one process: the converter's round trip and its argument
errors, `--checkpoint-format` defaults and checks, run directories holding a sharded
checkpoint, and the single-process save / load API."""

from __future__ import annotations

import random

import pytest
import torch

from lm_core import AdamW, TransformerLM, cross_entropy, get_config, read_checkpoint
from lm_core import save_checkpoint as save_file
from lm_core.convert_checkpoint import main as convert
from lm_core.dcp_checkpoint import load_dcp_checkpoint, save_dcp_checkpoint
from lm_core.train import main, parse_args
from lm_core.train_config import TrainConfig

TINY = ["--size", "tiny", "--context-length", "16", "--batch-size", "4", "--no-progress"]


def _trained(seed: int, steps: int = 2):
    torch.manual_seed(seed)
    model = TransformerLM(get_config("tiny", context_length=16))
    opt = AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        ids = torch.randint(0, 256, (2, 9))
        cross_entropy(model(ids[:, :-1]), ids[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_file_to_directory_and_back_is_the_same_checkpoint(tmp_path):
    model, opt = _trained(0)
    file = tmp_path / "a.pt"
    save_file(file, model, opt, step=2, extra={"note": "hi", "t": torch.arange(3)})
    convert([str(file), str(tmp_path / "a.dcp")])  # --to dcp: the default for a file
    convert([str(tmp_path / "a.dcp"), str(tmp_path / "b.pt")])
    a, b = read_checkpoint(file), read_checkpoint(tmp_path / "b.pt")
    assert a["checksum"] == b["checksum"]  # every entry, RNG state included, the same
    # the directory loads directly too
    fresh, fresh_opt = _trained(1, steps=0)
    meta = load_dcp_checkpoint(tmp_path / "a.dcp", fresh, fresh_opt, restore_rng=False)
    assert meta["step"] == 2
    assert meta["extra"]["note"] == "hi"
    for (key, value), got in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(value, got), key
    for p, q in zip(model.parameters(), fresh.parameters()):
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][name], fresh_opt.state[q][name]), name


def test_save_and_load_in_one_process_restore_everything(tmp_path):
    model, opt = _trained(0)
    path = tmp_path / "ckpt.dcp"
    random.seed(5)
    save_dcp_checkpoint(path, model, opt, step=2, extra={"k": 1})
    after_save = (torch.rand(3), random.random())
    fresh, fresh_opt = _trained(1, steps=0)
    assert load_dcp_checkpoint(path, fresh, fresh_opt)["step"] == 2
    assert torch.equal(torch.rand(3), after_save[0])  # RNG state restored
    assert random.random() == after_save[1]
    ids = torch.randint(0, 256, (2, 8))
    assert torch.equal(fresh(ids), model(ids))
    # a second save replaces the first whole
    save_dcp_checkpoint(path, fresh, fresh_opt, step=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.dcp"]
    with pytest.raises(ValueError, match=f"checkpoint {path}: optimizer state does not match"):
        load_dcp_checkpoint(path, fresh, AdamW([{"params": [fresh.lm_head.weight]}]))
    sgd = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match=f"checkpoint {path}: optimizer state of .* holds"):
        load_dcp_checkpoint(path, fresh, sgd)
    assert not sgd.state  # the state made to check it is gone again


def test_converter_argument_errors(tmp_path, capsys):
    model, opt = _trained(0, steps=1)
    file = tmp_path / "a.pt"
    save_file(file, model, opt, step=1)
    convert([str(file), str(tmp_path / "a.dcp")])
    cases = [
        ([str(tmp_path / "nope"), str(tmp_path / "x.pt")], "src: not found"),
        ([str(file), str(tmp_path / "x.pt"), "--to", "full"], "is already a file checkpoint"),
        ([str(file), str(file)], f"out: {file} exists; pass --overwrite"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as exc:
            convert(argv)
        assert exc.value.code == 2
        assert message in capsys.readouterr().err
    with pytest.raises(RuntimeError, match=r"a\.dcp is a directory \(a sharded checkpoint\?\)"):
        read_checkpoint(tmp_path / "a.dcp")  # the file reader names the converter
    (tmp_path / "broken.dcp").mkdir()
    with pytest.raises(RuntimeError, match=r"broken\.dcp is not a complete lm_core sharded"):
        convert([str(tmp_path / "broken.dcp"), str(tmp_path / "y.pt")])


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ([], "full"),
        (["--ddp", "torch"], "full"),
        (["--ddp", "bucketed", "--zero"], "dcp"),
        (["--fsdp", "ours"], "dcp"),
        (["--fsdp", "torch"], "dcp"),
        (["--fsdp", "torch", "--tp", "2"], "full"),
        (["--fsdp", "ours", "--checkpoint-format", "full"], "full"),
        (["--checkpoint-format", "dcp"], "dcp"),
    ],
)
def test_checkpoint_format_default_per_mode(flags, expected):
    assert parse_args([*TINY, *flags]).checkpoint.format == expected


def test_checkpoint_format_checks(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_args([*TINY, "--fsdp", "torch", "--tp", "2", "--checkpoint-format", "dcp"])
    err = capsys.readouterr().err
    assert "--checkpoint-format dcp is not supported with --tp 2" in err
    config = TrainConfig.from_dict({"checkpoint": {"format": "dcp"}})
    assert config.checkpoint.format == "dcp"
    assert 'format = "dcp"' in config.to_toml()
    toml = tmp_path / "run.toml"
    toml.write_text('[checkpoint]\nformat = "sharded"\n')
    with pytest.raises(SystemExit):
        parse_args(["--config", str(toml)])
    assert "checkpoint.format: expected one of ['full', 'dcp'] or None" in capsys.readouterr().err


def test_run_directory_with_a_sharded_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    main([*TINY, "--steps", "2", "--checkpoint-format", "dcp", "--out-dir", str(out)])
    ckpt = out / "checkpoint.dcp"
    assert ckpt.is_dir()
    for fmt in ("dcp", "full"):  # a new run over it is refused, whatever it would write
        with pytest.raises(SystemExit):
            parse_args([*TINY, "--checkpoint-format", fmt, "--out-dir", str(out)])
        assert f"--resume {ckpt}" in capsys.readouterr().err
    again = ["--steps", "3", "--checkpoint-format", "dcp", "--out-dir", str(out)]
    resumed = main([*TINY, *again, "--resume", str(ckpt)])
    assert resumed.step == 3
    with pytest.raises(SystemExit):
        parse_args([*TINY, "--resume", str(tmp_path / "missing.dcp")])
    assert "missing.dcp" in capsys.readouterr().err
