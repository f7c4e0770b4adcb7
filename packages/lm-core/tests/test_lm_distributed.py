"""The trainer under 2 gloo ranks equals one process on the whole batch (every wrapper,
with and without sharded optimizer state), and sharded checkpoints resume exactly.

Each test starts one 2-process group (ddp_kit.launch.spawn: file store, errors carry the
worker's traceback, hard timeout) and runs several trainer configurations in it.
"""

from __future__ import annotations

import socket

import pytest
import torch
from lm_dist_reference import BASE
from lm_dist_reference import assert_same_weights as _assert_same
from lm_dist_reference import single_process as _single

from lm_core import read_checkpoint

spawn = pytest.importorskip("ddp_kit.launch").spawn
FULL = ["--checkpoint-format", "full", "--out-dir"]  # one file (sharded: test_lm_dcp.py)


def test_two_ranks_equal_one_rank_for_every_wrapper():
    ref_w, ref_losses = _single([])
    acc_w, _ = _single(["--batch-size", "4", "--grad-accum-steps", "2"])
    runs = {
        "naive": ["--ddp", "naive"],
        "flat": ["--ddp", "flat"],
        "individual": ["--ddp", "individual"],
        "bucketed": ["--ddp", "bucketed", "--bucket-size-mb", "0.05"],  # several buckets
        "torch": ["--ddp", "torch"],
        "bucketed+accum": ["--ddp", "bucketed", "--batch-size", "4", "--grad-accum-steps", "2"],
        "flat+bf16": ["--ddp", "flat", "--ddp-reduce-dtype", "bf16"],
    }
    results = spawn(_worker(), 2, args=([[*BASE, *argv] for argv in runs.values()],), timeout_s=600)
    for (label, argv), r0, r1 in zip(runs.items(), results[0], results[1]):
        ref = acc_w if "--grad-accum-steps" in argv else ref_w
        if "--ddp-reduce-dtype" in argv:
            # Gradients averaged in bf16: near the reference, not equal to it (measured: mean
            # |difference| 5.3e-6, a few near-zero gradient elements stepping the other way
            # under AdamW, up to 7e-3); a missed sync leaves the ranks apart (checked below).
            diffs = torch.cat([(r0["weights"][k] - ref[k]).abs().flatten() for k in ref])
            assert diffs.mean() < 5e-5, (label, diffs.mean())
            assert diffs.max() > 0, f"{label}: equal to the float32 run, nothing sent in bf16"
        else:
            _assert_same(r0["weights"], ref, label)
        for key in ref:  # ranks hold identical weights
            assert torch.equal(r0["weights"][key], r1["weights"][key]), (label, key)
        # the logged loss is the mean over both ranks' rows: the global batch's loss
        if "--grad-accum-steps" not in argv:
            assert r0["losses"] == pytest.approx(ref_losses, rel=1e-5), label


def test_sharded_optimizer_with_wrappers_and_exact_resume(tmp_path):
    pytest.importorskip("zero_shard")
    long = [*BASE, "--steps", "8", "--cosine-steps", "8"]
    ckpt = str(tmp_path / "a" / "checkpoint.pt")
    runs = [
        [*long, "--ddp", "bucketed", "--zero"],
        [*long, "--ddp", "torch", "--zero"],
        [*long, "--ddp", "individual", "--zero"],
        [*long, "--steps", "4", "--ddp", "individual", "--zero", *FULL, str(tmp_path / "a")],
        [*long, "--ddp", "individual", "--zero", "--resume", ckpt],
    ]
    r0, r1 = spawn(_worker(), 2, args=(runs,), timeout_s=600)
    ref, _ = _single(["--steps", "8", "--cosine-steps", "8"])
    for label, res in zip(["bucketed+zero", "torch+zero", "individual+zero"], r0):
        _assert_same(res["weights"], ref, label)
    for key in ref:  # parameters are broadcast from their owners: identical on both ranks
        assert torch.equal(r0[2]["weights"][key], r1[2]["weights"][key]), key
    assert r0[4]["step"] == 8
    # resumed (4 + 4 steps; sharded state consolidated into the file, re-sharded on load) vs
    # the uninterrupted 8 steps on the same two ranks: the same operations in the same order
    for key, value in r0[2]["weights"].items():
        assert torch.equal(r0[4]["weights"][key], value), key
    assert r0[3]["losses"] + r0[4]["losses"] == r0[2]["losses"]


def test_bf16_optimizer_states_under_zero_and_fsdp_and_resume_across_state_dtypes(tmp_path):
    """--optimizer-state-dtype bf16 on 2 ranks, against one process with bf16 states. ZeRO
    steps whole parameters on their owners with lm_core's AdamW, FSDP flat shards (other
    element indices, so other stochastic rounding bits); and two ranks sum gradients in
    another order, so a moment next to a rounding threshold may round the other way: an
    update then moves by up to 2^-7 of itself, ~2.3e-5 at lr 3e-3, which 6 steps bound by
    1.4e-4 (measured: 1.9e-5 ZeRO, 7.9e-5 FSDP); a wrong shard or a missed sync moves
    weights by ~1e-3. A resume equals the uninterrupted run bitwise (the bits depend on the
    step, not on a generator); a checkpoint with fp32 states resumes with bf16 ones."""
    pytest.importorskip("zero_shard")
    bf16 = ["--optimizer-state-dtype", "bf16"]
    long = [*BASE, "--steps", "6", "--cosine-steps", "6"]
    zero = [*long, "--ddp", "individual", "--zero"]
    ckpt = [str(tmp_path / d / "checkpoint.pt") for d in ("a", "b")]
    runs = [
        [*zero, *bf16],
        [*zero, *bf16, "--steps", "3", *FULL, str(tmp_path / "a")],
        [*zero, *bf16, "--resume", ckpt[0]],
        [*zero, "--steps", "3", *FULL, str(tmp_path / "b")],  # fp32 states
        [*zero, *bf16, "--resume", ckpt[1]],
        [*long, "--fsdp", "ours", *bf16],
    ]
    r0, _ = spawn(_worker(), 2, args=(runs,), timeout_s=600)
    ref, _ = _single(["--steps", "6", "--cosine-steps", "6", *bf16])
    for key, value in r0[0]["weights"].items():
        torch.testing.assert_close(value, ref[key], rtol=0, atol=2e-4)
        torch.testing.assert_close(r0[5]["weights"][key], ref[key], rtol=0, atol=2e-4)
        assert torch.equal(r0[2]["weights"][key], value), key
        torch.testing.assert_close(r0[4]["weights"][key], value, rtol=0, atol=2e-4)
    assert r0[1]["losses"] + r0[2]["losses"] == r0[0]["losses"]
    assert r0[4]["step"] == 6
    for path, dtype in zip(ckpt, (torch.bfloat16, torch.float32)):  # saved in their dtype
        states = read_checkpoint(path)["optimizer"]["state"].values()
        assert {s[n].dtype for s in states for n in ("exp_avg", "exp_avg_sq")} == {dtype}


def _worker():
    import lm_dist_workers

    return lm_dist_workers.train_runs


def test_the_out_dir_check_of_sharded_checkpoints(tmp_path):
    """--checkpoint-format dcp on 2 ranks: an out-dir they share passes, existing or not
    (nothing is created, the marker is gone); one path per rank (as on two hosts without a
    shared filesystem) is refused on both ranks with the same message, unless the format is
    full (no check). The two-host run: test_lm_multinode.py."""
    import lm_dist_workers

    (tmp_path / "existing").mkdir()
    for host in ("host0", "host1"):
        (tmp_path / host).mkdir()
    r0, r1 = spawn(lm_dist_workers.shared_dir_checks, 2, args=(str(tmp_path),), timeout_s=120)
    assert r0[:2] == r1[:2] == [None, None]
    mine = [f"--out-dir {tmp_path / host / 'run'} is not" for host in ("host0", "host1")]
    assert mine[0] in r0[2], r0[2]
    assert r1[2] == r0[2].replace(*mine)  # each names the out-dir as given to it
    assert f"rank 1 (host {socket.gethostname()}) does not see the file" in r0[2]
    assert f"created in {tmp_path / 'host0'} (it looked in {tmp_path / 'host1'})" in r0[2]
    assert "--checkpoint-format full" in r0[2]
    assert r0[3] is None, r0[3]
    assert r1[3] is None, r1[3]
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert left == ["existing", "host0", "host1"]  # no marker left, no out-dir created


@pytest.mark.parametrize(
    ("where", "fault_rank"), [("save", 0), ("resume", 1)], ids=["save_on_rank0", "resume_on_rank1"]
)
def test_a_checkpoint_failing_on_one_rank_fails_every_rank(tmp_path, where, fault_rank):
    """Rank 0's write of the full checkpoint fails (a full disk), or one rank's read of it
    (a damaged copy on its host): every rank raises, the others naming the failed rank,
    instead of waiting in a collective for a rank that left (spawn's timeout would fail it)."""
    import lm_dist_workers

    out = str(tmp_path / "run")
    first = [*BASE, "--steps", "2", "--ddp", "torch", *FULL, out]
    resume = [*BASE, "--ddp", "torch", "--resume", str(tmp_path / "run" / "checkpoint.pt")]
    runs = [first] if where == "save" else [first, resume]
    r0, r1 = spawn(
        lm_dist_workers.train_with_a_fault, 2, args=(runs, fault_rank, where), timeout_s=180
    )
    failed, other = (r0[-1], r1[-1]) if fault_rank == 0 else (r1[-1], r0[-1])
    expected = ("OSError", "No space left on device") if where == "save" else (
        "ValueError", "damaged copy on this host"
    )  # fmt: skip
    assert failed is not None
    assert failed[0] == expected[0]
    assert expected[1] in failed[1], failed
    assert other is not None
    assert expected[1] in other[1], other
    assert f"(raised on rank {fault_rank})" in other[1], other
    if where == "resume":  # the first run saved normally
        assert r0[0] is None
        assert r1[0] is None
