"""save_checkpoint / load_checkpoint: round trip, wrappers, atomicity, bad files."""

from __future__ import annotations

import copy
import os
import stat
import subprocess
import sys

import pytest
import torch
from torch import nn

from lm_core import (
    AdamW,
    TransformerLM,
    cross_entropy,
    get_config,
    load_checkpoint,
    read_checkpoint,
    save_checkpoint,
)


def _trained(seed: int, steps: int = 2, **overrides):
    torch.manual_seed(seed)
    model = TransformerLM(get_config("tiny", **overrides))
    opt = AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        ids = torch.randint(0, 256, (2, 9))
        cross_entropy(model(ids[:, :-1]), ids[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


class _Wrapper(nn.Module):
    """Stands in for a data-parallel wrapper (DDP keeps the model as `.module`)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


def test_round_trip_restores_everything(tmp_path):
    model, opt = _trained(0)
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, model, opt, step=2, extra={"note": "hi", "t": torch.arange(3)})
    after_save = torch.rand(3)  # global RNG state is saved, so this draw can be replayed

    fresh, fresh_opt = _trained(1, steps=0)
    step = load_checkpoint(path, fresh, fresh_opt)
    assert step == 2
    for (k, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), k
    for p, q in zip(model.parameters(), fresh.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], fresh_opt.state[q][key])
    assert torch.equal(torch.rand(3), after_save)
    payload = read_checkpoint(path)
    assert payload["config"] == model.config.to_dict()
    assert payload["extra"]["note"] == "hi"
    assert torch.equal(payload["extra"]["t"], torch.arange(3))


def test_compiled_and_wrapped_models_save_plain_keys(tmp_path):
    model, opt = _trained(2)
    wrapped = _Wrapper(torch.compile(model))  # compile is lazy: nothing is compiled here
    save_checkpoint(tmp_path / "a.pt", wrapped, opt, step=1)
    keys = read_checkpoint(tmp_path / "a.pt")["model"].keys()
    assert keys == model.state_dict().keys()
    target = _Wrapper(torch.compile(TransformerLM(get_config("tiny"))))
    load_checkpoint(tmp_path / "a.pt", target)
    assert torch.equal(target.module._orig_mod.lm_head.weight, model.lm_head.weight)


def test_state_dicts_taken_beforehand_save_like_the_objects(tmp_path):
    # The trainer under --fsdp gathers full states first and saves them as dicts.
    model, opt = _trained(4)
    save_checkpoint(tmp_path / "obj.pt", model, opt, step=2)
    save_checkpoint(
        tmp_path / "dict.pt", model.state_dict(), opt.state_dict(), step=2, config=model.config
    )
    a, b = read_checkpoint(tmp_path / "obj.pt"), read_checkpoint(tmp_path / "dict.pt")
    assert a["config"] == b["config"]
    for key, value in a["model"].items():
        assert torch.equal(b["model"][key], value), key
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
    fresh, fresh_opt = _trained(5, steps=0)
    assert load_checkpoint(tmp_path / "dict.pt", fresh, fresh_opt) == 2
    assert torch.equal(fresh.lm_head.weight, model.lm_head.weight)
    with pytest.raises(TypeError, match="model"):
        save_checkpoint(tmp_path / "x.pt", [1, 2], None, step=1)
    with pytest.raises(TypeError, match="optimizer"):
        save_checkpoint(tmp_path / "x.pt", model, "adam", step=1)


def test_prefixed_keys_from_other_code_are_stripped(tmp_path):
    model, _ = _trained(3)
    save_checkpoint(tmp_path / "a.pt", model, None, step=0)
    payload = read_checkpoint(tmp_path / "a.pt")
    payload["model"] = {f"module._orig_mod.{k}": v for k, v in payload["model"].items()}
    del payload["checksum"]  # other code writes none (nor did lm_core before it had one)
    torch.save(payload, tmp_path / "b.pt")
    fresh = TransformerLM(get_config("tiny"))
    load_checkpoint(tmp_path / "b.pt", fresh)
    assert torch.equal(fresh.token_embeddings.weight, model.token_embeddings.weight)


def test_failed_save_leaves_no_file_and_keeps_the_old_one(tmp_path):
    model, opt = _trained(4)
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, model, opt, step=1)
    before = path.read_bytes()
    with pytest.raises(Exception, match=r"pickle|lambda|serializ"):
        save_checkpoint(path, model, opt, step=2, extra={"bad": lambda: 0})
    assert os.listdir(tmp_path) == ["ckpt.pt"]  # no temporary file left behind
    assert path.read_bytes() == before
    with pytest.raises(Exception, match=r"pickle|lambda|serializ"):
        save_checkpoint(tmp_path / "new.pt", model, opt, step=2, extra={"bad": lambda: 0})
    assert os.listdir(tmp_path) == ["ckpt.pt"]


def test_missing_and_corrupt_files(tmp_path):
    model, opt = _trained(5, steps=1)
    with pytest.raises(FileNotFoundError, match=r"nope\.pt"):
        load_checkpoint(tmp_path / "nope.pt", model)
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, model, opt, step=1)
    data = path.read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(RuntimeError, match="corrupt"):
        load_checkpoint(tmp_path / "cut.pt", model)
    (tmp_path / "noise.pt").write_bytes(os.urandom(1000))
    with pytest.raises(RuntimeError, match="corrupt"):
        load_checkpoint(tmp_path / "noise.pt", model)
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    with pytest.raises(RuntimeError, match="not an lm_core checkpoint"):
        load_checkpoint(tmp_path / "other.pt", model)


def test_config_mismatch_names_the_field(tmp_path):
    model, opt = _trained(6, steps=1)
    save_checkpoint(tmp_path / "c.pt", model, opt, step=1)
    other = TransformerLM(get_config("tiny", d_ff=96))
    with pytest.raises(ValueError, match="d_ff=128 in the checkpoint vs 96 in the model"):
        load_checkpoint(tmp_path / "c.pt", other)
    # the attention backend and context length do not change the weights: allowed
    load_checkpoint(tmp_path / "c.pt", TransformerLM(get_config("tiny", attention="naive")))
    load_checkpoint(tmp_path / "c.pt", TransformerLM(get_config("tiny", context_length=32)))


def test_shape_mismatch_without_config_names_the_parameter(tmp_path):
    save_checkpoint(tmp_path / "l.pt", nn.Linear(3, 4), None, step=0)
    with pytest.raises(
        ValueError, match=r"weight has shape \(4, 3\) in the checkpoint vs \(5, 3\)"
    ):
        load_checkpoint(tmp_path / "l.pt", nn.Linear(3, 5))
    with pytest.raises(ValueError, match="missing keys"):
        load_checkpoint(tmp_path / "l.pt", nn.Linear(3, 4, bias=False))


def test_optimizer_mismatch(tmp_path):
    model, opt = _trained(7, steps=1)
    save_checkpoint(tmp_path / "o.pt", model, opt, step=1)
    params = list(model.parameters())
    two_groups = AdamW([{"params": params[:1]}, {"params": params[1:]}])
    with pytest.raises(ValueError, match="optimizer state does not match"):
        load_checkpoint(tmp_path / "o.pt", model, two_groups)
    save_checkpoint(tmp_path / "n.pt", model, None, step=1)
    with pytest.raises(ValueError, match="no optimizer state"):
        load_checkpoint(tmp_path / "n.pt", model, opt)


def test_bad_step():
    with pytest.raises(ValueError, match="step"):
        save_checkpoint("unused.pt", nn.Linear(1, 1), None, step=-1)


def _flip_bit_in_tensor_data(path) -> str:
    """Flip one bit in the middle of the largest tensor record of a torch.save zip file."""
    import struct
    import zipfile

    with zipfile.ZipFile(path) as zf:
        info = max((i for i in zf.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    raw = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack(
        "<HH", raw[info.header_offset + 26 : info.header_offset + 30]
    )
    start = info.header_offset + 30 + name_len + extra_len  # the record's (stored) bytes
    raw[start + info.file_size // 2] ^= 0x10
    path.write_bytes(bytes(raw))
    return info.filename


def test_flipped_bit_in_tensor_data_is_refused_and_legacy_files_still_load(tmp_path):
    model, opt = _trained(8, steps=1)
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, model, opt, step=1)
    _flip_bit_in_tensor_data(path)
    torch.load(path, weights_only=True)  # torch itself reads the damaged file without a word
    fresh = TransformerLM(get_config("tiny"))
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"ckpt\.pt is corrupt: .*checksum"):
        load_checkpoint(path, fresh)
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert read_checkpoint(path, verify=False)["step"] == 1  # salvage is still possible
    assert set(read_checkpoint(path, verify=False)["checksum"]) == {"sha256"}
    # a checkpoint written before checksums existed (no entry) loads as before, unverified
    save_checkpoint(path, model, opt, step=1)
    payload = read_checkpoint(path)
    del payload["checksum"]
    torch.save(payload, tmp_path / "legacy.pt")
    assert load_checkpoint(tmp_path / "legacy.pt", fresh) == 1
    assert torch.equal(fresh.lm_head.weight, model.lm_head.weight)


def _snapshot(model, opt):
    return (
        {k: v.clone() for k, v in model.state_dict().items()},
        copy.deepcopy(opt.state_dict()),
    )


def _assert_unchanged(model, opt, snap):
    weights, opt_state = snap
    for key, value in model.state_dict().items():
        assert torch.equal(value, weights[key]), key
    now = opt.state_dict()
    assert now["param_groups"] == opt_state["param_groups"]
    assert now["state"].keys() == opt_state["state"].keys()
    for i, entry in now["state"].items():
        for name, value in entry.items():
            assert torch.equal(value, opt_state["state"][i][name]), (i, name)


def test_failed_load_changes_neither_model_nor_optimizer(tmp_path):
    model, opt = _trained(9, steps=1)
    path = tmp_path / "c.pt"
    save_checkpoint(path, model, opt, step=1)
    target, target_opt = _trained(10, steps=1)  # a model with its own weights and state
    snap = _snapshot(target, target_opt)
    params = list(target.parameters())
    two_groups = AdamW([{"params": params[:1]}, {"params": params[1:]}])
    with pytest.raises(ValueError, match=r"parameter groups"):
        load_checkpoint(path, target, two_groups)
    _assert_unchanged(target, target_opt, snap)  # the model was loaded first, then refused
    # same group sizes, state of the wrong shape (parameters in another order): refused too
    payload = read_checkpoint(path)
    state = payload["optimizer"]["state"]
    state[0], state[1] = state[1], state[0]
    del payload["checksum"]
    torch.save(payload, tmp_path / "swapped.pt")
    with pytest.raises(ValueError, match=r"'exp_avg' of parameter 0 has shape"):
        load_checkpoint(tmp_path / "swapped.pt", target, target_opt)
    _assert_unchanged(target, target_opt, snap)
    # a dtype the model does not have: named, nothing changed
    payload = read_checkpoint(path)
    payload["model"]["lm_head.weight"] = payload["model"]["lm_head.weight"].half()
    del payload["checksum"]
    torch.save(payload, tmp_path / "half.pt")
    with pytest.raises(ValueError, match=r"lm_head\.weight has dtype torch\.float16"):
        load_checkpoint(tmp_path / "half.pt", target, target_opt)
    _assert_unchanged(target, target_opt, snap)
    assert load_checkpoint(path, target, target_opt) == 1  # the good file still loads


def test_stale_temp_files_of_dead_writers_are_removed_by_the_next_save(tmp_path):
    model, _ = _trained(11, steps=0)
    path = tmp_path / "ckpt.pt"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    dead_pid = int(dead.stdout)
    orphan = tmp_path / f".ckpt.pt.{dead_pid}.0badc0de.tmp"
    live = tmp_path / f".ckpt.pt.{os.getppid()}.0badc0de.tmp"  # a running writer's file
    others = [tmp_path / ".ckpt.pt.notes.tmp", tmp_path / f".other.pt.{dead_pid}.0badc0de.tmp"]
    for f in (orphan, live, *others):
        f.write_bytes(b"x" * 1000)
    save_checkpoint(path, model, None, step=0)
    assert not orphan.exists()
    assert live.exists()
    assert all(f.exists() for f in others)
    assert sorted(os.listdir(tmp_path)) == sorted(["ckpt.pt", live.name, *(f.name for f in others)])


@pytest.mark.skipif(os.name != "posix", reason="POSIX file modes")
def test_file_mode_follows_the_umask(tmp_path):
    model, _ = _trained(12, steps=0)
    for umask, mode in ((0o022, 0o644), (0o077, 0o600), (0o002, 0o664)):
        old = os.umask(umask)
        try:
            save_checkpoint(tmp_path / f"m{umask:o}.pt", model, None, step=0)
        finally:
            os.umask(old)
        assert stat.S_IMODE((tmp_path / f"m{umask:o}.pt").stat().st_mode) == mode, oct(umask)


@pytest.mark.skipif(os.name != "posix", reason="signals sent to the own process (POSIX)")
@pytest.mark.parametrize(
    ("sig", "handler", "raised"),
    [
        ("SIGTERM", lambda signum, frame: sys.exit(128 + signum), SystemExit),
        ("SIGINT", None, KeyboardInterrupt),  # Python's default Ctrl-C handler
    ],
)
def test_a_signal_during_a_save_is_handled_after_the_file_is_complete(
    tmp_path, sig, handler, raised
):
    """SIGTERM / SIGINT arriving while a checkpoint is written (raised inside torch.save's
    writer it aborted the process or left the file half-written) are held back: the save
    completes and replaces the old file, then the handler runs, and it is in place again."""
    import signal

    from lm_core.ckpt_io import atomic_write

    signum = getattr(signal, sig)
    before = signal.getsignal(signum)
    if handler is not None:
        signal.signal(signum, handler)
    try:
        installed = signal.getsignal(signum)
        target = tmp_path / "ckpt.pt"
        target.write_bytes(b"old")

        def write(f):
            f.write(b"new, first half; ")
            os.kill(os.getpid(), signum)
            for _ in range(1000):  # Python runs signal handlers between bytecodes
                pass
            f.write(b"second half")

        with pytest.raises(raised):
            atomic_write(target, write)
        assert target.read_bytes() == b"new, first half; second half"
        assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]  # no temporary file left
        assert signal.getsignal(signum) is installed
    finally:
        signal.signal(signum, before)
