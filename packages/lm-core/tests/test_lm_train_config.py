"""TrainConfig: TOML in and out, CLI flags over a --config file, errors that name the option,
the programmatic entry point, and the run record in checkpoints (both formats)."""

from __future__ import annotations

import copy
import re
import typing
from pathlib import Path

import numpy as np
import pytest
import torch

from lm_core import TrainConfig, read_checkpoint, save_checkpoint
from lm_core.data import TokenFileMeta, write_token_meta
from lm_core.distributed import DDP_CHOICES, FSDP_CHOICES
from lm_core.train import build_parser, main, parse_args, run
from lm_core.train_checks import resolve_config
from lm_core.train_config import (
    RUN_RECORD,
    ConfigError,
    DdpKind,
    FsdpKind,
    OptimOptions,
    ParallelOptions,
    iter_options,
    recorded_option,
)

FAST = ["--size", "tiny", "--context-length", "32", "--batch-size", "4", "--no-progress"]
FAST_TOML = """
[model]
size = "tiny"
context_length = 32

[training]
batch_size = 4

[logging]
progress = false
"""
TRAINING_DOC = Path(__file__).resolve().parents[1] / "docs" / "training.md"

# Every flag of the trainer before its options became TrainConfig fields.
OLD_FLAGS = [
    *("--size", "--vocab-size", "--context-length", "--d-model", "--num-layers", "--num-heads"),
    *("--d-ff", "--rope-theta", "--attention", "--num-kv-heads", "--sliding-window", "--matmul"),
    *("--data", "--val-data", "--data-dtype", "--synthetic", "--synthetic-tokens"),
    *("--pack-documents", "--eot-id", "--steps", "--batch-size", "--grad-accum-steps"),
    *("--max-lr", "--min-lr", "--warmup-steps", "--cosine-steps", "--weight-decay", "--beta1"),
    *("--beta2", "--adam-eps", "--grad-clip", "--bf16", "--tf32", "--compile"),
    *("--activation-checkpointing", "--fused-loss", "--ddp", "--bucket-size-mb", "--zero"),
    *("--fsdp", "--tp", "--sequence-parallel", "--dist-backend", "--out-dir", "--metrics"),
    *("--ckpt-every", "--resume", "--overwrite", "--eval-every", "--eval-batches", "--log-every"),
    *("--no-progress", "--seed", "--device", "--log-dir", "--peak-tflops", "--tokenizer"),
    *("--sample-every", "--sample-tokens", "--sample-prompt", "--sample-temperature"),
]


def _toml(tmp_path: Path, text: str, name: str = "run.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _weights(result) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in result.model.state_dict().items()}


def test_every_old_flag_is_still_accepted():
    flags = {s for a in build_parser()._actions for s in a.option_strings}
    assert set(OLD_FLAGS) <= flags


def test_literal_choices_match_the_wrappers():
    assert typing.get_args(DdpKind) == DDP_CHOICES
    assert typing.get_args(FsdpKind) == FSDP_CHOICES


def test_every_field_has_a_doc():
    for key, f, _ in iter_options(TrainConfig()):
        assert f.metadata.get("doc"), key


def test_toml_round_trip(tmp_path):
    default = TrainConfig()
    path = _toml(tmp_path, default.to_toml())
    assert TrainConfig.from_toml(path) == default
    odd = default.with_overrides(
        {
            "sample.prompt": 'a "quoted"\\ line\nand a tab\t, \x7f, é, 😀',
            "data.path": str(tmp_path / "train.bin"),
            "optim.max_lr": 3e-4,
            "optim.eps": 1e-12,
            "optim.min_lr": 0.0,
            "logging.peak_tflops": float("inf"),
            "training.activation_checkpointing": 3,
            "training.bf16": True,
            "parallel.ddp": "bucketed",
            "model.rope_theta": 500000,  # an int where a float is expected: converted
        }
    )
    assert isinstance(odd.model.rope_theta, float)
    assert odd.data.path == tmp_path / "train.bin"
    path = _toml(tmp_path, odd.to_toml())
    assert TrainConfig.from_toml(path) == odd
    assert TrainConfig.from_dict(odd.to_dict()) == odd


def test_cli_flags_override_the_toml_file(tmp_path):
    path = _toml(
        tmp_path,
        FAST_TOML.replace("batch_size = 4", "batch_size = 4\nsteps = 7\nbf16 = true")
        + "\n[optim]\nmax_lr = 0.003\n",
    )
    config = parse_args(["--config", str(path)])
    assert (config.training.steps, config.training.bf16, config.optim.max_lr) == (7, True, 3e-3)
    config = parse_args(["--config", str(path), "--steps", "3", "--no-bf16", "--batch-size", "2"])
    assert (config.training.steps, config.training.bf16, config.training.batch_size) == (
        3,
        False,
        2,
    )
    assert config.optim.max_lr == 3e-3  # the file's, not the default
    assert config.optim.min_lr == pytest.approx(3e-4)  # derived from the merged max_lr


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[optim]\nmax_lr = 'abc'\n", "run.toml: optim.max_lr: expected a number, got 'abc'"),
        ("[optim]\nmax_lrr = 1e-3\n", "run.toml: optim.max_lrr: unknown key; did you mean"),
        ("[optimizer]\nmax_lr = 1e-3\n", "run.toml: optimizer: unknown section"),
        ("[training]\nsteps = 2.5\n", "run.toml: training.steps: expected an int, got 2.5"),
        ("[training]\nbf16 = 1\n", "run.toml: training.bf16: expected true or false, got 1"),
        ("[parallel]\nddp = 'magic'\n", "run.toml: parallel.ddp: expected one of"),
        ("[model]\nsize = 'huge'\n", "run.toml: model.size: expected one of"),
        ("optim = 3\n", "run.toml: optim: expected a table"),
        ("[optim\n", "run.toml: not a readable TOML file"),
    ],
)
def test_toml_errors_name_the_key(tmp_path, text, message, capsys):
    path = _toml(tmp_path, text)
    with pytest.raises(ConfigError, match=re.escape(message)):
        TrainConfig.from_toml(path)
    with pytest.raises(SystemExit) as exc:
        parse_args(["--config", str(path)])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "flags", "message"),
    [
        ("[training]\nsteps = 0\n", [], "run.toml: training.steps must be positive, got 0"),
        ("[optim]\nbeta2 = 1.0\n", [], "run.toml: optim.beta2 must be in [0, 1), got 1.0"),
        (
            "[training]\nactivation_checkpointing = 'often'\n",
            [],
            "run.toml: training.activation_checkpointing: every: expected one of",
        ),
        (  # cross-option checks apply to values from the file, named as written there
            "[parallel]\nzero = true\n",
            [],
            "run.toml: parallel.zero shards optimizer state across ranks: it needs a --ddp",
        ),
        (
            "[data]\npack_documents = true\neot_id = 0\n",
            ["--tp", "2"],
            "run.toml: data.pack_documents is not supported with --tp yet",
        ),
        (
            "[optim]\nwarmup_steps = 20\n",
            ["--steps", "10"],
            "run.toml: optim.warmup_steps (20) must be <= --cosine-steps (10)",
        ),
        (
            "[checkpoint]\nresume = 'nope.pt'\n",
            [],
            "run.toml: checkpoint.resume: not found: nope.pt",
        ),
    ],
)
def test_checks_run_on_values_from_the_file(tmp_path, text, flags, message, capsys):
    path = _toml(tmp_path, text)
    with pytest.raises(SystemExit) as exc:
        parse_args(["--config", str(path), *flags])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_a_flag_over_a_bad_file_value_fixes_it(tmp_path):
    path = _toml(tmp_path, "[parallel]\nzero = true\n")
    assert parse_args(["--config", str(path), "--ddp", "naive"]).parallel.zero
    assert not parse_args(["--config", str(path), "--no-zero"]).parallel.zero


def test_the_same_run_from_a_toml_file_and_from_flags(tmp_path):
    flags = ["--steps", "3", "--log-every", "1", "--max-lr", "3e-3", "--warmup-steps", "1"]
    from_flags = main([*FAST, *flags])
    text = FAST_TOML.replace("batch_size = 4", "batch_size = 4\nsteps = 3").replace(
        "progress = false", "progress = false\nevery = 1"
    )
    path = _toml(tmp_path, text + "\n[optim]\nmax_lr = 3e-3\nwarmup_steps = 1\n")
    from_file = main(["--config", str(path)])
    assert [h["loss"] for h in from_file.history] == [h["loss"] for h in from_flags.history]
    for key, value in _weights(from_flags).items():
        assert torch.equal(value, from_file.model.state_dict()[key]), key
    # and from Python: the same config object, run directly
    config = TrainConfig.from_toml(path)
    before = copy.deepcopy(config)
    result = run(config)
    assert config == before  # run() works on a resolved copy
    assert result.step == 3
    assert result.final_loss == from_flags.final_loss
    for key, value in _weights(from_flags).items():
        assert torch.equal(value, result.model.state_dict()[key]), key


def test_run_checks_configs_built_in_python():
    config = TrainConfig(parallel=ParallelOptions(zero=True))
    with pytest.raises(ConfigError, match=r"parallel\.zero shards optimizer state") as exc:
        run(config)
    assert exc.value.key == "parallel.zero"
    config = TrainConfig(optim=OptimOptions(max_lr="abc"))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"optim\.max_lr: expected a number, got 'abc'"):
        run(config)
    config = TrainConfig()
    config.training.steps = -1
    with pytest.raises(ConfigError, match=r"^training.steps must be positive, got -1$"):
        run(config)
    config.training.steps = 1
    config.optim = {"max_lr": 1e-3}  # type: ignore[assignment]
    with pytest.raises(ConfigError, match="optim: expected a OptimOptions"):
        run(config)


def test_values_assigned_in_python_are_converted_like_toml_values(tmp_path):
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.arange(5000) % 256)
    config = TrainConfig()
    config.data.path = str(tokens)  # type: ignore[assignment]  # a str where a Path is expected
    config.optim.max_lr = 1  # an int where a float is expected
    resolved = resolve_config(config)
    assert resolved.data.path == tokens
    assert isinstance(resolved.optim.max_lr, float)
    assert config.data.path == str(tokens)  # the caller's config is left alone
    config.optim.max_lr = True  # a bool is no number
    with pytest.raises(ConfigError, match=r"optim\.max_lr: expected a number, got True"):
        resolve_config(config)


def test_a_resolved_config_resolves_to_itself_with_a_sidecar(tmp_path):
    """The sidecar fills model.vocab_size and data.eot_id; resolving that again (a config
    rebuilt from a checkpoint's record) must not refuse the eot id it filled in."""
    data = tmp_path / "train.bin"
    (np.arange(500) % 300).astype("uint16").tofile(data)
    write_token_meta(data, TokenFileMeta("uint16", 300, 7, 500))
    resolved = resolve_config(TrainConfig.from_dict({"data": {"path": str(data)}}))
    assert (resolved.model.vocab_size, resolved.data.eot_id) == (300, 7)
    assert resolve_config(resolved) == resolved
    with pytest.raises(ConfigError, match=r"data\.eot_id = 3: .* says the end-of-text id is 7"):
        resolve_config(resolved.with_overrides({"data.eot_id": 3}))
    with pytest.raises(ConfigError, match=r"data\.eot_id is only used with data\.pack_documents"):
        resolve_config(TrainConfig.from_dict({"data": {"eot_id": 7}}))  # no sidecar


def test_dump_config_writes_the_merged_options(tmp_path, capsys):
    path = _toml(tmp_path, FAST_TOML + "\n[optim]\nmax_lr = 0.003\n")
    out = tmp_path / "dumped.toml"
    assert main(["--config", str(path), "--steps", "5", "--dump-config", str(out)]) is None
    dumped = TrainConfig.from_toml(out)
    assert dumped == parse_args(["--config", str(path), "--steps", "5"]).with_overrides(
        {
            "optim.min_lr": None,
            "optim.cosine_steps": None,
            "model.vocab_size": None,
            "checkpoint.format": None,
        }
    )  # derived values stay derived
    assert main(["--config", str(out), "--dump-config", "-"]) is None
    assert _toml(tmp_path, capsys.readouterr().out, "printed.toml").read_text() == out.read_text()
    with pytest.raises(SystemExit):  # checked like a run
        main(["--config", str(out), "--zero", "--dump-config", "-"])
    assert "--zero shards optimizer state" in capsys.readouterr().err


def test_checkpoint_records_the_resolved_config(tmp_path):
    result = main([*FAST, "--steps", "2", "--out-dir", str(tmp_path)])
    extra = read_checkpoint(tmp_path / "checkpoint.pt")["extra"]
    record = TrainConfig.from_dict(extra[RUN_RECORD])
    assert record.optim.min_lr == pytest.approx(1e-4)
    assert record.metrics_path == tmp_path / "metrics.jsonl"
    assert recorded_option(extra, "data.eot_id") is None
    assert resolve_config(record, check_run_dir=False) == record  # a resolved config is a fixpoint
    # the record reproduces the run
    with pytest.raises(ConfigError, match="already holds a training run"):
        run(record)  # its directory holds that run
    again = run(record.with_overrides({"checkpoint.out_dir": str(tmp_path / "again")}))
    for key, value in _weights(result).items():
        assert torch.equal(value, again.model.state_dict()[key]), key


def test_checkpoints_of_the_flag_record_era_still_resume_and_generate(tmp_path):
    """Before TrainConfig, `extra["args"]` held the flags flat (`eot_id`, `tokenizer`, ...):
    such a checkpoint resumes, and lm_core.generate still reads its tokenizer and eot id."""
    common = [*FAST, "--log-every", "1", "--cosine-steps", "4"]
    full = main([*common, "--steps", "4"])
    main([*common, "--steps", "2", "--out-dir", str(tmp_path / "a")])
    ckpt = tmp_path / "a" / "checkpoint.pt"
    payload = read_checkpoint(ckpt)
    old_extra = {
        "data_generator": payload["extra"]["data_generator"],
        "args": {"steps": 2, "tokenizer": "tok.json", "eot_id": 5, "no_progress": True},
    }
    save_checkpoint(ckpt, payload["model"], payload["optimizer"], 2, payload["config"], old_extra)
    assert recorded_option(old_extra, "sample.tokenizer") == "tok.json"
    assert recorded_option(old_extra, "data.eot_id") == 5
    assert recorded_option({}, "data.eot_id") is None
    resumed = main([*common, "--steps", "4", "--resume", str(ckpt)])
    for key, value in _weights(full).items():
        assert torch.equal(value, resumed.model.state_dict()[key]), key

    from lm_core import generate

    _, recorded = generate.load_model(generate.parse_args(["--checkpoint", str(ckpt)]))
    assert recorded == {"sample.tokenizer": "tok.json", "data.eot_id": 5}


def test_the_readme_example_config_runs(tmp_path):
    """The TOML file of the training docs (lm-core's docs/training.md), as a user copies it."""
    blocks = re.findall(r"```toml\n(.*?)```", TRAINING_DOC.read_text(), re.S)
    assert blocks, "docs/training.md shows an example TOML file"
    path = _toml(tmp_path, blocks[0])
    config = TrainConfig.from_toml(path)
    assert config.model.size == "tiny"
    flags = ["--steps", "2", "--warmup-steps", "0", "--out-dir", str(tmp_path / "run")]
    result = main(["--config", str(path), *flags, "--no-progress"])
    assert result.step == 2
