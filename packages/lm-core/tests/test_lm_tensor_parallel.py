"""Tensor parallelism (`lm_core.parallel`, `--tp`) and 2-D FSDP x TP equal one process.

gloo on CPU, fp32: the tiny model (4 heads, d_ff 128) split 2 ways. One test checks the
gradients of `apply_tensor_parallel` directly; the trainer tests run `--tp 2` on 2 ranks and
`--tp 2 --fsdp torch` on a 2 x 2 mesh (4 ranks) against single-process training, and resume
from their checkpoints (single-process layout) exactly.
"""

from __future__ import annotations

import pytest
import torch
from lm_dist_reference import BASE
from lm_dist_reference import assert_same_weights as _assert_same
from lm_dist_reference import single_process as _single

from lm_core import TransformerLM, cross_entropy, get_config, read_checkpoint
from lm_core.parallel import check_tensor_parallel, from_tp_layout, to_tp_layout

spawn = pytest.importorskip("ddp_kit.launch").spawn
pytest.importorskip("torch.distributed.tensor.parallel")

LONG = [*BASE, "--steps", "8", "--cosine-steps", "8"]
FUSED_AC = ["--fused-loss", "--activation-checkpointing", "1"]
ACCUM = ["--batch-size", "4", "--grad-accum-steps", "2"]
# Split matmuls round differently everywhere: a few AdamW outliers (see assert_same_weights).
TP_OUTLIERS = 1e-3


def _train_worker():
    import lm_dist_workers

    return lm_dist_workers.train_runs


def test_layout_round_trip_and_rank_blocks():
    model = TransformerLM(get_config("tiny"))
    state = model.state_dict()
    tp_state = to_tp_layout(state, 2)
    for key, value in state.items():
        assert torch.equal(from_tp_layout(tp_state, 2)[key], value), key
    # rank 0's half of qkv holds q, k, v of heads 0-1 (16 features each): rows 0-31, 64-95,
    # 128-159 of the (192, 64) single-process matrix
    qkv = state["layers.0.attn.qkv_proj.weight"]
    half = tp_state["layers.0.attn.qkv_proj.weight"][:96]
    assert torch.equal(half, torch.cat([qkv[0:32], qkv[64:96], qkv[128:160]]))
    w13 = state["layers.0.ffn.w13.weight"]  # (256, 64): w1 rows 0-127, w3 rows 128-255
    half = tp_state["layers.0.ffn.w13.weight"][:128]
    assert torch.equal(half, torch.cat([w13[0:64], w13[128:192]]))


def test_check_tensor_parallel_names_the_problem():
    tiny = get_config("tiny")
    with pytest.raises(ValueError, match="num_heads=4"):
        check_tensor_parallel(tiny, 3)
    with pytest.raises(ValueError, match="sequence length 15"):
        check_tensor_parallel(tiny, 2, sequence_parallel=True, seq_len=15)
    with pytest.raises(ValueError, match="tf32x3"):
        check_tensor_parallel(get_config("tiny", matmul="tf32x3"), 2)


def test_apply_tensor_parallel_checks_its_arguments():
    from lm_core.parallel import apply_tensor_parallel

    with pytest.raises(TypeError, match="TransformerLM"):
        apply_tensor_parallel(torch.nn.Linear(4, 4), None)
    with pytest.raises(ValueError, match="1-D DeviceMesh"):
        apply_tensor_parallel(TransformerLM(get_config("tiny")), None)


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        (["--tp", "3"], "num_heads=4 is not divisible by 3"),
        (["--tp", "2", "--ddp", "naive"], "--fsdp torch"),
        (["--tp", "2", "--fsdp", "ours"], "use --fsdp torch"),
        (["--sequence-parallel"], "needs --tp"),
        (["--tp", "2", "--sequence-parallel", "--context-length", "15"], "divisible by tp=2"),
    ],
)
def test_tp_flag_errors(flag, message, capsys):
    from lm_core.train import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--size", "tiny", *flag])
    assert message in capsys.readouterr().err


def test_tp_on_one_process_says_how_to_launch():
    import torch.distributed as dist

    from lm_core.train import main

    with pytest.raises(ValueError, match="torchrun --nproc_per_node 2"):
        main(["--size", "tiny", "--tp", "2", "--steps", "1", "--no-progress"])
    assert not dist.is_initialized()  # the one-process group it made is gone


def test_tp_gradients_equal_one_process():
    import lm_tp_workers

    x, y = lm_tp_workers.tp_batch()
    ref_model = lm_tp_workers.tp_model()
    loss = cross_entropy(ref_model(x), y)
    loss.backward()
    ref = {n: p.grad for n, p in ref_model.named_parameters()}
    fused_model = lm_tp_workers.tp_model()
    fused_loss = fused_model(x, y)
    fused_loss.backward()
    configs = [(False, False), (True, True)]  # (sequence_parallel, fused loss)
    r0, r1 = spawn(lm_tp_workers.tp_gradients, 2, args=(configs,), timeout_s=120)
    for i, (sp, fused) in enumerate(configs):
        expected_loss = fused_loss if fused else loss
        assert r0[i]["loss"] == pytest.approx(expected_loss.item(), rel=1e-6)
        assert r1[i]["loss"] == r0[i]["loss"]
        assert "already applied" in r0[i]["twice"]
        for name, g in ref.items():
            # fp32; only the order of the sums across the two halves differs
            label = f"sp={sp} fused={fused} {name}"
            torch.testing.assert_close(r0[i]["grads"][name], g, rtol=1e-5, atol=1e-7, msg=label)


def test_tp2_trainer_equals_one_process_and_resumes_exactly(tmp_path):
    ckpt = tmp_path / "tp" / "checkpoint.pt"
    runs = {
        "tp": [*BASE, "--tp", "2"],
        "sp+fused+ac": [*BASE, "--tp", "2", "--sequence-parallel", *FUSED_AC],
        "full": [*LONG, "--tp", "2"],
        "first": [*LONG, "--tp", "2", "--steps", "4", "--out-dir", str(tmp_path / "tp")],
        "resumed": [*LONG, "--tp", "2", "--resume", str(ckpt)],
    }
    r0, _ = spawn(_train_worker(), 2, args=(list(runs.values()),), timeout_s=300)
    res = dict(zip(runs, r0))
    ref, ref_losses = _single([])
    _assert_same(res["tp"]["weights"], ref, "tp", outliers=TP_OUTLIERS)
    assert res["tp"]["losses"] == pytest.approx(ref_losses, rel=1e-5)
    fused_ref, fused_losses = _single(FUSED_AC)
    _assert_same(res["sp+fused+ac"]["weights"], fused_ref, "sp+fused+ac", TP_OUTLIERS)
    assert res["sp+fused+ac"]["losses"] == pytest.approx(fused_losses, rel=1e-5)
    # the checkpoint is gathered and reordered to single-process layout; reloaded and
    # re-sharded it continues bitwise as the uninterrupted run
    for key, value in res["full"]["weights"].items():
        assert torch.equal(res["resumed"]["weights"][key], value), key
    assert res["first"]["losses"] + res["resumed"]["losses"] == res["full"]["losses"]
    payload = read_checkpoint(ckpt)
    single_model = TransformerLM(get_config("tiny", context_length=16))
    for index, (key, p) in enumerate(single_model.named_parameters()):
        assert payload["model"][key].shape == p.shape, key
        assert payload["optimizer"]["state"][index]["exp_avg"].shape == p.shape, key
    alone, _ = _single(["--steps", "8", "--cosine-steps", "8", "--resume", str(ckpt)])
    _assert_same(alone, res["full"]["weights"], "tp checkpoint in one process", TP_OUTLIERS)


def test_fsdp_x_tp_2x2_equals_one_process_and_resumes(tmp_path):
    from lm_core.fsdp import torch_fsdp_api

    try:
        torch_fsdp_api()
    except ImportError as exc:
        pytest.skip(f"torch's fully_shard is not available here: {exc}")
    ckpt = tmp_path / "2d" / "checkpoint.pt"
    two_d = ["--tp", "2", "--fsdp", "torch"]
    runs = {
        "2d": [*BASE, *two_d],
        "2d+sp+accum": [*BASE, *two_d, "--sequence-parallel", *ACCUM],
        "first": [*LONG, *two_d, "--steps", "4", "--out-dir", str(tmp_path / "2d")],
        "resumed": [*LONG, *two_d, "--resume", str(ckpt)],
    }
    r0 = spawn(_train_worker(), 4, args=(list(runs.values()),), timeout_s=400)[0]
    res = dict(zip(runs, r0))
    ref, ref_losses = _single([])
    _assert_same(res["2d"]["weights"], ref, "2d", outliers=TP_OUTLIERS)
    assert res["2d"]["losses"] == pytest.approx(ref_losses, rel=1e-5)
    accum_ref, _ = _single(ACCUM)
    _assert_same(res["2d+sp+accum"]["weights"], accum_ref, "2d+sp+accum", TP_OUTLIERS)
    long_ref, long_losses = _single(["--steps", "8", "--cosine-steps", "8"])
    _assert_same(res["resumed"]["weights"], long_ref, "2d resumed", TP_OUTLIERS)
    assert res["first"]["losses"] + res["resumed"]["losses"] == pytest.approx(long_losses, rel=1e-5)


@pytest.mark.nccl
def test_tp_on_two_gpus_equals_one_gpu():
    # The same comparison over NCCL (torch of the GPU machine); the reference runs on cuda:0.
    # fp32 without TF32: only the summation order differs, as on CPU.
    runs = [[*BASE, "--tp", "2"], [*BASE, "--tp", "2", "--sequence-parallel", *FUSED_AC]]
    r0, _ = spawn(_train_worker(), 2, backend="nccl", args=(runs,), timeout_s=600)
    for label, extra, res in zip(["tp", "sp+fused+ac"], [[], FUSED_AC], r0):
        ref, losses = _single(extra)
        ref = {k: v.cpu() for k, v in ref.items()}
        _assert_same(res["weights"], ref, label, TP_OUTLIERS)
        assert res["losses"] == pytest.approx(losses, rel=1e-5)
