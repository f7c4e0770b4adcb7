"""The trainer CLI in-process: end to end, exact resume, flag validation."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from lm_core import read_checkpoint, synthetic_tokens
from lm_core.train import main, parse_args

FAST = ["--size", "tiny", "--context-length", "32", "--batch-size", "8", "--no-progress"]


def _weights(result):
    return {k: v.clone() for k, v in result.model.state_dict().items()}


def test_end_to_end_loss_falls_and_files_written(tmp_path):
    flags = ["--steps", "60", "--log-every", "1", "--eval-every", "30", "--warmup-steps", "5"]
    result = main([*FAST, *flags, "--out-dir", str(tmp_path), "--max-lr", "3e-3"])
    assert result.step == 60
    losses = [h["loss"] for h in result.history]
    assert len(losses) == 60
    # ln(256) = 5.55 at the start; the repeating pattern is learnable well below that
    assert losses[0] > 5.0
    assert np.mean(losses[-5:]) < 2.0
    assert result.evals[-1]["val_loss"] < 2.0
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if "loss" in x] == list(range(1, 61))
    assert [x["step"] for x in lines if "val_loss" in x] == [30, 60]
    assert {"lr", "tokens_per_s", "grad_norm"} <= lines[0].keys()
    assert (tmp_path / "checkpoint.pt").is_file()


def test_resume_reproduces_uninterrupted_run_bitwise(tmp_path):
    common = [*FAST, "--log-every", "1", "--cosine-steps", "8", "--warmup-steps", "2"]
    full = main([*common, "--steps", "8"])
    first = main([*common, "--steps", "4", "--out-dir", str(tmp_path / "a")])
    resume = ["--resume", str(tmp_path / "a" / "checkpoint.pt")]
    resumed = main([*common, "--steps", "8", *resume, "--out-dir", str(tmp_path / "b")])
    assert first.step == 4
    assert resumed.step == 8
    full_losses = [h["loss"] for h in full.history]
    assert [h["loss"] for h in first.history + resumed.history] == full_losses
    for key, value in _weights(full).items():
        assert torch.equal(value, resumed.model.state_dict()[key]), key


def _logged_steps(path):
    return [json.loads(x)["step"] for x in path.read_text().splitlines() if "loss" in x]


def test_an_existing_run_is_never_overwritten_unless_asked(tmp_path, capsys):
    run = [*FAST, "--log-every", "1", "--out-dir", str(tmp_path)]
    main([*run, "--steps", "6"])
    ckpt, metrics = tmp_path / "checkpoint.pt", tmp_path / "metrics.jsonl"
    before = ckpt.read_bytes(), metrics.read_bytes()
    with pytest.raises(SystemExit) as exc:
        main([*run, "--steps", "3"])  # a fresh run over it: would replace step 6 by step 3
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"--out-dir {tmp_path} already holds a training run" in err
    assert f"--resume {ckpt}" in err
    assert "--overwrite" in err
    assert (ckpt.read_bytes(), metrics.read_bytes()) == before  # nothing touched
    # another run's checkpoint in --out-dir is not replaced by a resumed run either
    main([*FAST, "--steps", "2", "--out-dir", str(tmp_path / "other")])
    with pytest.raises(SystemExit):
        main([*run, "--steps", "8", "--resume", str(tmp_path / "other" / "checkpoint.pt")])
    assert "another run's checkpoint.pt" in capsys.readouterr().err
    assert (ckpt.read_bytes(), metrics.read_bytes()) == before
    # --overwrite starts over: a new log, the checkpoint replaced by the new run's
    main([*run, "--steps", "3", "--overwrite"])
    assert _logged_steps(metrics) == [1, 2, 3]
    assert read_checkpoint(ckpt)["step"] == 3


def test_resume_continues_the_metrics_log_without_repeating_steps(tmp_path):
    run = [*FAST, "--log-every", "1", "--cosine-steps", "6", "--out-dir", str(tmp_path)]
    first = main([*run, "--steps", "4"])
    metrics = tmp_path / "metrics.jsonl"
    # killed after logging steps 5 and 6 (the last line half-written) but before saving them
    with metrics.open("a") as f:
        f.write(
            json.dumps({"step": 5, "loss": 9.0})
            + "\n"
            + json.dumps({"step": 6, "loss": 9.0})
            + "\n"
        )
        f.write('{"step": 7, "lo')
    resumed = main([*run, "--steps", "6", "--resume", str(tmp_path / "checkpoint.pt")])
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3, 4, 5, 6]  # each step once: the redone ones
    assert [x["loss"] for x in lines] == [h["loss"] for h in first.history + resumed.history]


def test_grad_accumulation_matches_one_big_batch():
    # A step's micro-batches are drawn together: 2 micro-batches of 4 see the same 8 windows
    # as one batch of 8, so the gradients agree up to summation order. AdamW divides each
    # gradient element by its own running magnitude, so an element whose gradient is near
    # zero can turn that rounding into ~1e-6 of weight (seen on torch 2.13 CPU); a wrong
    # micro-batch would move weights by a fraction of the learning rate (1e-3), far above 1e-5.
    common = ["--size", "tiny", "--context-length", "32", "--no-progress", "--steps", "3"]
    one = main([*common, "--batch-size", "8"])
    two = main([*common, "--batch-size", "4", "--grad-accum-steps", "2"])
    for key, value in _weights(one).items():
        torch.testing.assert_close(two.model.state_dict()[key], value, rtol=1e-5, atol=1e-5)
    assert one.final_loss == pytest.approx(two.final_loss, rel=1e-5)


def test_matmul_flag_reaches_the_model():
    result = main([*FAST, "--steps", "2", "--matmul", "tf32x3"])
    assert result.model.config.matmul == "tf32x3"
    assert result.model.layers[0].ffn.w13.matmul == "tf32x3"
    assert np.isfinite(result.final_loss)


def test_fused_loss_and_activation_checkpointing_match_plain_training():
    # The fused loss equals cross_entropy of the logits up to fp32 rounding, and checkpointed
    # blocks recompute the same values (gradients: test_lm_fused_loss, test_lm_activation_ckpt).
    # Over three AdamW steps the losses agree closely; weights to a fraction of the learning
    # rate (1e-3): AdamW divides each gradient element by its own magnitude, so an element
    # with |g| near eps turns a rounding-level difference into a step-sized one.
    common = [*FAST, "--steps", "3", "--log-every", "1", "--batch-size", "4", "--num-layers", "3"]
    plain = main(common)
    other = main([*common, "--fused-loss", "--activation-checkpointing", "1"])
    for a, b in zip(other.history, plain.history):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    for key, value in _weights(plain).items():
        torch.testing.assert_close(other.model.state_dict()[key], value, rtol=1e-5, atol=1e-4)
    evals = main([*common, "--fused-loss", "--activation-checkpointing", "optimal", "--bf16",
                  "--eval-every", "3"])  # fmt: skip
    assert np.isfinite(evals.evals[-1]["val_loss"])


@pytest.mark.parametrize(
    ("setting", "threads", "before"),
    [("calling", False, True), ("device", True, False), (None, False, False)],
)
def test_backward_thread_holds_during_training_and_is_restored(
    setting, threads, before, monkeypatch
):
    # The flag sets process-wide autograd state: it must hold in every step and be undone
    # when training returns; without it training keeps the caller's setting.
    from lm_core import trainer

    seen = []
    step = trainer.train_step

    def recording_step(*args, **kwargs):
        seen.append(torch._C._is_multithreading_enabled())
        return step(*args, **kwargs)

    monkeypatch.setattr(trainer, "train_step", recording_step)
    flag = [] if setting is None else ["--backward-thread", setting]
    with torch.autograd.set_multithreading_enabled(before):
        result = main([*FAST, "--steps", "2", *flag])
        assert torch._C._is_multithreading_enabled() is before
    assert seen == [threads, threads]
    assert np.isfinite(result.final_loss)


def test_token_files_and_bf16(tmp_path):
    tokens = synthetic_tokens(20_000, 256, "pattern", seed=3).astype(np.uint16)
    tokens.tofile(tmp_path / "train.bin")
    np.save(tmp_path / "val.npy", tokens[:2000])
    files = ["--data", str(tmp_path / "train.bin"), "--val-data", str(tmp_path / "val.npy")]
    result = main(
        [*FAST, *files, "--steps", "4", "--bf16", "--eval-every", "2", "--log-every", "2"]
    )
    assert len(result.evals) == 2
    assert all(np.isfinite(h["loss"]) for h in result.history)


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--steps", "0"], "--steps"),
        (["--batch-size", "-1"], "--batch-size"),
        (["--bucket-size-mb", "0"], "--bucket-size-mb"),
        (["--ddp-reduce-dtype", "bf16"], "--ddp-reduce-dtype"),
        (["--ddp", "flat", "--ddp-reduce-dtype", "int8"], "--ddp-reduce-dtype"),
        (["--steps", "10", "--warmup-steps", "20"], "--warmup-steps"),
        (["--beta2", "1.0"], "--beta2"),
        (["--grad-clip", "-1"], "--grad-clip"),
        (["--zero"], "--zero"),
        (["--resume", "/nonexistent/ckpt.pt"], "--resume"),
        (["--d-model", "30", "--num-heads", "4"], "d_model=30"),
        (["--size", "huge"], "--size"),
        (["--ddp", "magic"], "--ddp"),
        (["--activation-checkpointing", "0"], "--activation-checkpointing"),
        (["--activation-checkpointing", "often"], "--activation-checkpointing"),
        (["--fsdp", "magic"], "--fsdp"),
        (["--fsdp", "ours", "--ddp", "naive"], "--fsdp"),
        (["--fsdp", "torch", "--ddp", "torch"], "excludes --ddp"),
        (["--fsdp", "ours", "--zero"], "--zero"),
        (["--fsdp", "torch", "--zero", "--ddp", "none"], "already shards"),
        (["--matmul", "fp64"], "--matmul"),
        (["--backward-thread", "gpu"], "--backward-thread"),
    ],
)
def test_bad_flags_exit_with_a_message_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "sharded"),
    [
        (["--resume", "{tmp}/run/checkpoint.dcp"], True),  # the name of a sharded checkpoint
        (["--fsdp", "ours", "--resume", "{tmp}/run"], True),  # format dcp (--fsdp's default)
        (["--resume", "{tmp}/run"], False),  # a missing directory, full format
        (["--fsdp", "ours", "--resume", "{tmp}/checkpoint.pt"], False),  # a file's name
    ],
)
def test_a_missing_resume_path_is_not_found_file_or_directory(tmp_path, argv, sharded, capsys):
    argv = [a.format(tmp=tmp_path) for a in argv]
    with pytest.raises(SystemExit) as exc:
        parse_args([*FAST, *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"--resume: not found: {argv[-1]}" in err  # neither "file" nor "directory"
    assert "file not found" not in err
    said = "expected a sharded checkpoint directory (OUT/checkpoint.dcp, written by a run with "
    assert (said + "--out-dir OUT and --checkpoint-format dcp)" in err) == sharded, err


def test_ddp_none_inside_a_process_group_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="--ddp"):
        main([*FAST, "--steps", "1"])


def test_module_entry_point_runs():
    out = subprocess.run(
        [sys.executable, "-m", "lm_core.train", *FAST, "--steps", "2", "--log-every", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "step=2" in out.stdout


def test_wrap_model_names_a_bad_reduce_dtype():
    from lm_core.distributed import DistEnv, wrap_model

    with pytest.raises(ValueError, match=r"--ddp-reduce-dtype: expected one of"):
        wrap_model(torch.nn.Linear(2, 2), "none", DistEnv(), reduce_dtype="int8")
