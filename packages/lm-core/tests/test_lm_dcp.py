"""Sharded (DCP) checkpoints of the trainer under gloo: `--fsdp ours`, `--fsdp torch` and
`--zero` write one by default, every rank its own shards; it resumes bitwise in fresh
processes at the same world size, loads at 4 ranks, in one process without a process group
and into another engine with the model and optimizer state equal to what was saved; one
saved by a single process loads at 2 ranks; the converter turns it into the single file that
`lm_core.load_checkpoint` reads, with the same logits.

One spawn (ddp_kit.launch.spawn: hard timeout, errors carry the rank's traceback) per group
of trainer runs; the module's checkpoints are written once (`saved`).
"""

from __future__ import annotations

import shutil

import pytest
import torch
from lm_dist_reference import BASE

from lm_core import AdamW, TransformerLM, get_config, load_checkpoint, read_checkpoint
from lm_core.convert_checkpoint import main as convert
from lm_core.dcp_checkpoint import read_dcp_meta
from lm_core.train import main

spawn = pytest.importorskip("ddp_kit.launch").spawn
pytest.importorskip("zero_shard")

LONG = [*BASE, "--steps", "8", "--cosine-steps", "8"]
ENGINES = {
    "ours": ["--fsdp", "ours"],
    "torch": ["--fsdp", "torch"],
    "zero": ["--ddp", "individual", "--zero"],
}
TIMEOUT = 240  # seconds per spawn: the tiny model trains in ~1 s a run, torch's import costs


def _worker():
    import lm_dcp_workers

    return lm_dcp_workers.train_and_report


def _same_state(got: dict, ref: dict, label: str) -> None:
    """Model weights (key -> tensor) or optimizer states ({"state", "param_groups"}) equal,
    bitwise."""
    if "state" in ref:
        assert sorted(got["state"]) == sorted(ref["state"]), label
        for index, entry in ref["state"].items():
            assert sorted(got["state"][index]) == sorted(entry), (label, index)
            for name, value in entry.items():
                assert torch.equal(got["state"][index][name], value), (label, index, name)
        lrs = [g["lr"] for g in got["param_groups"]]
        assert lrs == [g["lr"] for g in ref["param_groups"]], label
        return
    assert sorted(got) == sorted(ref), label
    for key, value in ref.items():
        assert torch.equal(got[key], value), (label, key)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Per engine: 8 uninterrupted steps on 2 ranks, and 4 steps saving a checkpoint (the
    default format under --fsdp / --zero: dcp); and 4 steps in this process, saved as dcp."""
    root = tmp_path_factory.mktemp("dcp")
    runs = []
    for name, flags in ENGINES.items():
        runs += [[*LONG, *flags], [*LONG, *flags, "--steps", "4", "--out-dir", str(root / name)]]
    r0, _ = spawn(_worker(), 2, args=(runs,), timeout_s=TIMEOUT)
    out = {
        name: {"full": r0[2 * i], "first": r0[2 * i + 1], "ckpt": root / name / "checkpoint.dcp"}
        for i, name in enumerate(ENGINES)
    }
    torch.set_num_threads(1)
    one = root / "one"
    result = main([*LONG, "--steps", "4", "--checkpoint-format", "dcp", "--out-dir", str(one)])
    out["one"] = {
        "weights": {k: v.clone() for k, v in result.model.state_dict().items()},
        "optim": result.optimizer.state_dict(),
        "ckpt": one / "checkpoint.dcp",
    }
    return out


def test_every_rank_writes_its_own_shards(saved):
    for name in ENGINES:
        ckpt = saved[name]["ckpt"]
        _, meta = read_dcp_meta(ckpt)
        assert meta["world_size"] == 2
        assert meta["step"] == 4
        # __{rank}_{thread}.distcp: each rank's writer threads (lm_core.dcp_io.io_threads)
        sizes = [sum(f.stat().st_size for f in ckpt.glob(f"__{r}_*.distcp")) for r in range(2)]
        assert min(sizes) > 0.3 * sum(sizes), (name, sizes)  # no rank writes (nearly) all
        assert not (ckpt.parent / "checkpoint.pt").exists()


def test_resume_in_fresh_processes_is_bitwise(saved, tmp_path):
    runs = [
        [*LONG, *flags, "--resume", str(saved[name]["ckpt"])] for name, flags in ENGINES.items()
    ]
    runs.append([*LONG, "--fsdp", "ours", "--steps", "4", "--resume", str(saved["one"]["ckpt"])])
    # a damaged file that one rank hashes: both ranks raise (none waits in a collective)
    damaged = tmp_path / "damaged.dcp"
    shutil.copytree(saved["ours"]["ckpt"], damaged)
    shard = damaged / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    failing = [[*LONG, "--fsdp", "ours", "--resume", str(damaged)]]
    r0, r1 = spawn(_worker(), 2, args=(runs, failing), timeout_s=TIMEOUT)
    expected = f"checkpoint {damaged} is corrupt: its file __0_0.distcp does not match"
    assert expected in r1[-1]["error"], r1[-1]
    assert expected in r0[-1]["error"], r0[-1]
    r0 = r0[:-1]
    for (name, res), resumed in zip(((n, saved[n]) for n in ENGINES), r0):
        assert resumed["step"] == 8
        _same_state(resumed["weights"], res["full"]["weights"], f"{name} resumed")
        assert res["first"]["losses"] + resumed["losses"] == res["full"]["losses"], name
    # 1 -> 2: saved by one process without a process group, sharded over 2 ranks
    _same_state(r0[-1]["weights"], saved["one"]["weights"], "1 -> 2 weights")
    _same_state(r0[-1]["optim"], saved["one"]["optim"], "1 -> 2 optimizer")


def test_loads_at_4_ranks_in_one_process_and_into_other_engines(saved):
    pairs = [(name, name) for name in ENGINES] + [
        ("ours", "torch"),
        ("torch", "zero"),
        ("zero", "ours"),
    ]
    runs = [
        [*LONG, *ENGINES[dst], "--steps", "4", "--resume", str(saved[src]["ckpt"])]
        for src, dst in pairs
    ]
    r0, *_ = spawn(_worker(), 4, args=(runs,), timeout_s=TIMEOUT)
    for (src, dst), loaded in zip(pairs, r0):
        label = f"{src} on 2 ranks -> {dst} on 4"
        _same_state(loaded["weights"], saved[src]["first"]["weights"], label)
        _same_state(loaded["optim"], saved[src]["first"]["optim"], label)
    # 2 -> 1: this process, no process group (DCP's no-dist mode)
    for src in ENGINES:
        alone = main([*LONG, "--steps", "4", "--resume", str(saved[src]["ckpt"])])
        _same_state(alone.model.state_dict(), saved[src]["first"]["weights"], f"{src} -> 1")
        _same_state(alone.optimizer.state_dict(), saved[src]["first"]["optim"], f"{src} -> 1")


def test_converted_file_loads_with_the_same_logits(saved, tmp_path):
    ckpt = saved["ours"]["ckpt"]
    file = tmp_path / "model.pt"
    convert([str(ckpt), str(file)])
    model = TransformerLM(get_config("tiny", context_length=16))
    opt = AdamW(model.parameters())
    assert load_checkpoint(file, model, opt) == 4
    _same_state(model.state_dict(), saved["ours"]["first"]["weights"], "converted")
    _same_state(opt.state_dict(), saved["ours"]["first"]["optim"], "converted optimizer")
    reference = TransformerLM(get_config("tiny", context_length=16))
    reference.load_state_dict(saved["ours"]["first"]["weights"])
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    assert torch.equal(model(ids), reference(ids))
    # and back: the directory written from the file holds the same tensors
    back = tmp_path / "back.dcp"
    convert([str(file), str(back), "--to", "dcp"])
    again = tmp_path / "again.pt"
    convert([str(back), str(again)])
    assert read_checkpoint(again)["checksum"] == read_checkpoint(file)["checksum"]


def test_another_model_config_is_refused(saved):
    ckpt = saved["ours"]["ckpt"]
    with pytest.raises(ValueError, match=f"checkpoint {ckpt} was saved for another model config"):
        main([*LONG, "--num-layers", "3", "--steps", "4", "--resume", str(ckpt)])
