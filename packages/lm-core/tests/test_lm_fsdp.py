"""`--fsdp ours|torch` under 2 ranks equals one process on the whole batch; checkpoints hold
full states (the layout of single-process training) and resume exactly.

Each test starts one 2-process group (ddp_kit.launch.spawn) and runs several trainer
configurations in it; the single-process references run in the test process. Weights come
back through `TrainResult.full_state_dict()` (gathered on rank 0 while the group is up).
"""

from __future__ import annotations

import pytest
import torch
from lm_dist_reference import BASE
from lm_dist_reference import assert_same_weights as _assert_same
from lm_dist_reference import single_process as _single

from lm_core import TransformerLM, get_config, read_checkpoint

spawn = pytest.importorskip("ddp_kit.launch").spawn

LONG = [*BASE, "--steps", "8", "--cosine-steps", "8"]
FUSED_AC = ["--fused-loss", "--activation-checkpointing", "1"]
ACCUM = ["--batch-size", "4", "--grad-accum-steps", "2"]
FROZEN = ["--steps", "1", "--max-lr", "0", "--min-lr", "0"]  # AdamW at lr 0: weights unchanged
# 4 steps, then one checkpoint file (--checkpoint-format dcp, the default: test_lm_dcp.py)
FIRST = ["--steps", "4", "--checkpoint-format", "full", "--out-dir"]


def _relative_error(weights, ref, init) -> float:
    """||w - ref|| / ||ref - init|| over all parameters: the error relative to how far
    training moved the weights."""
    num = sum(((weights[k] - ref[k]) ** 2).sum() for k in ref) ** 0.5
    den = sum(((ref[k] - init[k]) ** 2).sum() for k in ref) ** 0.5
    return float(num / den)


def _initial_weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(3)  # the trainer's --seed
    return TransformerLM(get_config("tiny", context_length=16)).state_dict()


def _worker():
    import lm_dist_workers

    return lm_dist_workers.train_runs


def test_fsdp_ours_equals_one_process_and_resumes_exactly(tmp_path):
    pytest.importorskip("zero_shard")
    ckpt = tmp_path / "a" / "checkpoint.pt"
    runs = {
        "init": [*BASE, "--fsdp", "ours", *FROZEN],
        "fp32": [*BASE, "--fsdp", "ours"],
        "compiled": [*BASE, "--fsdp", "ours", "--compile"],
        "fused+ac": [*BASE, "--fsdp", "ours", *FUSED_AC],
        "bf16": [*BASE, "--fsdp", "ours", "--bf16"],
        "accum": [*BASE, "--fsdp", "ours", *ACCUM],
        "full": [*LONG, "--fsdp", "ours"],
        "first": [*LONG, "--fsdp", "ours", *FIRST, str(tmp_path / "a")],
        "resumed": [*LONG, "--fsdp", "ours", "--resume", str(ckpt)],
    }
    r0, _ = spawn(_worker(), 2, args=(list(runs.values()),), timeout_s=600)
    res = dict(zip(runs, r0))

    # The model is built on the meta device and materialized shard by shard: bitwise the
    # full build for the seed.
    init = _initial_weights()
    for key, value in init.items():
        assert torch.equal(res["init"]["weights"][key], value), key
    ref, ref_losses = _single([])
    _assert_same(res["fp32"]["weights"], ref, "fp32")
    assert res["fp32"]["losses"] == pytest.approx(ref_losses, rel=1e-5)
    # --compile: each block's forward compiled, the unit hooks eager around it; same names
    # (the weights come back under the model's own keys), the same training up to inductor's
    # rounding (AdamW may turn it into a step-sized change of a few near-zero elements)
    _assert_same(res["compiled"]["weights"], ref, "compiled", outliers=1e-3)
    assert res["compiled"]["losses"] == pytest.approx(ref_losses, rel=1e-5)
    # The fused LM head + loss runs inside lm_head's call, so FSDP gathers its weight; the
    # checkpointed blocks re-gather theirs in the recomputation. Same flags in one process.
    fused_ref, fused_losses = _single(FUSED_AC)
    _assert_same(res["fused+ac"]["weights"], fused_ref, "fused+ac")
    assert res["fused+ac"]["losses"] == pytest.approx(fused_losses, rel=1e-5)
    accum_ref, _ = _single(ACCUM)
    _assert_same(res["accum"]["weights"], accum_ref, "accum")
    # the first micro-step runs under no_sync(): one reduce-scatter per unit (embedding, 2
    # blocks, head) per step, against one per unit per micro-step without it
    assert res["accum"]["stats"]["reduce_scatters"] == 4 * 4
    assert res["fp32"]["stats"]["reduce_scatters"] == 4 * 4

    # bf16: weights gathered and gradients reduce-scattered in bf16 on top of autocast. AdamW
    # turns rounding of small gradients into step-sized changes, so elementwise bounds say
    # little; instead the error against fp32 training, relative to how far training moved
    # the weights, must stay within 2x that of single-process bf16 autocast training
    # (measured: 0.049 against 0.046; a missed sync or wrong scale gives ~1).
    bf16_ref, _ = _single(["--bf16"])
    bound = _relative_error(bf16_ref, ref, init)
    assert _relative_error(res["bf16"]["weights"], ref, init) <= 2 * bound

    # Resume: the checkpoint holds gathered weights and optimizer state consolidated to full
    # shapes; re-sharded on load they continue bitwise as the uninterrupted run.
    assert res["resumed"]["step"] == 8
    for key, value in res["full"]["weights"].items():
        assert torch.equal(res["resumed"]["weights"][key], value), key
    assert res["first"]["losses"] + res["resumed"]["losses"] == res["full"]["losses"]

    # The file is what single-process training writes: it resumes in one process too.
    payload = read_checkpoint(ckpt)
    single_model = TransformerLM(get_config("tiny", context_length=16))
    for index, (key, p) in enumerate(single_model.named_parameters()):
        assert payload["model"][key].shape == p.shape, key
        assert payload["optimizer"]["state"][index]["exp_avg"].shape == p.shape, key
    alone, _ = _single(["--steps", "8", "--cosine-steps", "8", "--resume", str(ckpt)])
    _assert_same(alone, res["full"]["weights"], "resumed in one process")


def test_fsdp_torch_equals_one_process_and_resumes_exactly(tmp_path):
    from lm_core.fsdp import torch_fsdp_api

    try:
        torch_fsdp_api()
    except ImportError as exc:
        pytest.skip(f"torch's fully_shard is not available here: {exc}")
    # fully_shard runs on CPU over gloo in torch 2.13 (all-gather and reduce-scatter of CPU
    # tensors); this test checks it there and `nccl` below on GPUs.
    ckpt = tmp_path / "t" / "checkpoint.pt"
    runs = {
        "init": [*BASE, "--fsdp", "torch", *FROZEN],
        "fp32": [*BASE, "--fsdp", "torch"],
        "fused+ac": [*BASE, "--fsdp", "torch", *FUSED_AC],
        "bf16": [*BASE, "--fsdp", "torch", "--bf16"],
        "accum": [*BASE, "--fsdp", "torch", *ACCUM],
        "full": [*LONG, "--fsdp", "torch"],
        "first": [*LONG, "--fsdp", "torch", *FIRST, str(tmp_path / "t")],
        "resumed": [*LONG, "--fsdp", "torch", "--resume", str(ckpt)],
    }
    r0, _ = spawn(_worker(), 2, args=(list(runs.values()),), timeout_s=600)
    res = dict(zip(runs, r0))

    # meta build, fully_shard, to_empty, then each init root on full tensors: bitwise the
    # full build (reset_parameters on the DTensors would not be; see lm_core.fsdp)
    init = _initial_weights()
    for key, value in init.items():
        assert torch.equal(res["init"]["weights"][key], value), key
    ref, ref_losses = _single([])
    _assert_same(res["fp32"]["weights"], ref, "fp32")
    assert res["fp32"]["losses"] == pytest.approx(ref_losses, rel=1e-5)
    fused_ref, _ = _single(FUSED_AC)
    _assert_same(res["fused+ac"]["weights"], fused_ref, "fused+ac")
    accum_ref, _ = _single(ACCUM)
    _assert_same(res["accum"]["weights"], accum_ref, "accum")
    # bf16 parameters, fp32 reduction (MixedPrecisionPolicy) under autocast: the bound of the
    # `ours` test (measured: 0.049 against 0.046)
    bf16_ref, _ = _single(["--bf16"])
    bound = _relative_error(bf16_ref, ref, init)
    assert _relative_error(res["bf16"]["weights"], ref, init) <= 2 * bound
    # get/set_{model,optimizer}_state_dict(full_state_dict=True): the same DTensor shards
    # come back, so the resumed run is the uninterrupted one.
    for key, value in res["full"]["weights"].items():
        assert torch.equal(res["resumed"]["weights"][key], value), key
    assert res["first"]["losses"] + res["resumed"]["losses"] == res["full"]["losses"]
    payload = read_checkpoint(ckpt)
    assert sorted(payload["optimizer"]["state"]) == list(range(len(ref)))


@pytest.mark.nccl
@pytest.mark.parametrize("engine", ["ours", "torch"])
def test_fsdp_on_two_gpus_equals_one_gpu(engine):
    # The same comparison on 2 GPUs over NCCL (the single-GPU reference runs here on
    # cuda:0). fp32 without TF32 (the trainer's default): only the summation order differs,
    # as on CPU. The fused loss runs its Triton kernel on CUDA.
    runs = [[*BASE, "--fsdp", engine], [*BASE, "--fsdp", engine, *FUSED_AC]]
    r0, _ = spawn(_worker(), 2, backend="nccl", args=(runs,), timeout_s=600)
    for label, extra, res in zip(["fp32", "fused+ac"], [[], FUSED_AC], r0):
        ref, losses = _single(extra)
        ref = {k: v.cpu() for k, v in ref.items()}
        _assert_same(res["weights"], ref, f"{engine} {label}")
        assert res["losses"] == pytest.approx(losses, rel=1e-5)
