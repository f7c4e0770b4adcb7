"""save_checkpoint / load_checkpoint: round trip, wrappers, atomicity, bad files."""

from __future__ import annotations

import os

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
