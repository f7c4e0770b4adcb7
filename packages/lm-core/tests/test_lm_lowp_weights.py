"""Linear weights held in bf16 with fp32 masters in AdamW (lm_core.lowp_weights): the same
training as fp32 weights under bf16 autocast, bit for bit on CPU; the Triton kernel (in its
interpreter) against the PyTorch-ops update; state dicts; refusals."""

from __future__ import annotations

import copy
import dataclasses
import os

import pytest
import torch
from torch import nn

from lm_core import AdamW, OverlappedOptimizer, TransformerLM
from lm_core import lowp_weights as lw
from lm_core import optim_lowp as lowp

BF16 = torch.bfloat16
KW = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="runs the Triton kernel in its interpreter"
)


def _model(tiny, layers=2):
    torch.manual_seed(0)
    return TransformerLM(dataclasses.replace(tiny, num_layers=layers))


def _batches(n, seed=1, batch=2, seq=16):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (batch, seq + 1), generator=g) for _ in range(n)]


def _train(model, opt, batches):
    losses = []
    for ids in batches:
        with torch.autocast("cpu", dtype=BF16):
            loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def _held(model):
    return [p for p in model.parameters() if lw.is_held(p)]


@pytest.mark.parametrize("overlapped", [False, True])
def test_held_weights_train_as_fp32_weights_under_autocast(tiny, overlapped):
    """Same losses, bit for bit, and masters equal to the fp32 run's weights; each held
    weight is its master rounded to bf16."""
    make = (lambda m: OverlappedOptimizer(m, **KW)) if overlapped else None
    make = make or (lambda m: AdamW(m.parameters(), **KW))
    ref, held = _model(tiny), _model(tiny)
    weights = lw.matmul_weights(held)
    assert len(weights) == 4 * 2  # qkv, output, w13, w2 per block; not the LM head
    assert held.lm_head.weight not in {id(w) for w in weights}
    lw.hold_in_bf16(weights)
    assert all(w.dtype == BF16 for w in weights)
    opt_ref, opt_held = make(ref), make(held)
    batches = _batches(4)
    losses_ref = _train(ref, opt_ref, batches)
    losses_held = _train(held, opt_held, batches)
    for a, b in zip(losses_ref, losses_held):
        assert torch.equal(a, b)
    fp32 = lw.master_state_dict(held, opt_held)
    assert fp32.keys() == ref.state_dict().keys()
    for name, value in ref.state_dict().items():
        assert fp32[name].dtype == value.dtype
        assert torch.equal(fp32[name], value), name
    for (name, p), (_, r) in zip(held.named_parameters(), ref.named_parameters()):
        if lw.is_held(p):
            assert torch.equal(p, r.to(BF16)), name
            assert p.grad is None


@needs_interpreter
@pytest.mark.parametrize("state_dtype", [torch.float32, BF16])
def test_triton_kernel_is_the_pytorch_update(state_dtype):
    """fused=True runs the master kernel (interpreted), fused=False the PyTorch ops: masters
    to fp32 rounding, bf16 moments bit for bit, each weight its master rounded."""
    runs = []
    for fused in (True, False):
        g = torch.Generator().manual_seed(0)
        params = [nn.Parameter(torch.randn(s, generator=g)) for s in [(33, 7), (50,), (1000,)]]
        lw.hold_in_bf16(params)
        opt = AdamW(params, fused=fused, state_dtype=state_dtype, **KW)
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen).to(BF16)
            opt.step()
        runs.append((params, opt))
    (pk, ok), (pt, ot) = runs
    for a, b in zip(pk, pt):
        sa, sb = ok.state[a], ot.state[b]
        assert sa["master"].dtype == torch.float32
        torch.testing.assert_close(sa["master"], sb["master"], rtol=2e-6, atol=1e-6)
        assert torch.equal(a, sa["master"].to(BF16))
        assert torch.equal(b, sb["master"].to(BF16))
        for n in lowp.MOMENTS:
            assert sa[n].dtype == state_dtype
            if state_dtype == BF16:
                assert torch.equal(sa[n], sb[n]), n
            else:
                torch.testing.assert_close(sa[n], sb[n], rtol=2e-6, atol=1e-7)


def test_state_dict_round_trip_continues_bitwise(tiny):
    """Save after two steps, load into a fresh held model and optimizer, two more steps: the
    run an uninterrupted one makes. Masters and moments stay fp32 through the load."""
    batches = _batches(4)
    whole = _model(tiny)
    lw.hold_in_bf16(lw.matmul_weights(whole))
    opt_whole = AdamW(whole.parameters(), **KW)
    _train(whole, opt_whole, batches)

    first = _model(tiny)
    lw.hold_in_bf16(lw.matmul_weights(first))
    opt_first = AdamW(first.parameters(), **KW)
    _train(first, opt_first, batches[:2])
    saved_model = copy.deepcopy(first.state_dict())
    saved_opt = copy.deepcopy(opt_first.state_dict())

    resumed = _model(tiny)
    lw.hold_in_bf16(lw.matmul_weights(resumed))
    resumed.load_state_dict(saved_model)
    opt_resumed = AdamW(resumed.parameters(), **KW)
    opt_resumed.load_state_dict(saved_opt)
    for p in _held(resumed):
        state = opt_resumed.state[p]
        assert state["master"].dtype == state["exp_avg"].dtype == torch.float32
        assert getattr(p, lw.PENDING, None) is None  # the loaded master replaced it
    _train(resumed, opt_resumed, batches[2:])
    for a, b in zip(whole.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(_held(whole), _held(resumed)):
        assert torch.equal(opt_whole.state[a]["master"], opt_resumed.state[b]["master"])


def test_loading_masters_into_fp32_weights_gives_them_the_master_values(tiny):
    held = _model(tiny)
    lw.hold_in_bf16(lw.matmul_weights(held))
    opt = AdamW(held.parameters(), **KW)
    _train(held, opt, _batches(2))
    plain = _model(tiny)
    plain.load_state_dict(lw.master_state_dict(held, opt))
    opt_plain = AdamW(plain.parameters(), **KW)
    opt_plain.load_state_dict(opt.state_dict())  # masters in it: they become the weights
    for p, q in zip(plain.parameters(), held.parameters()):
        assert p.dtype == torch.float32
        if lw.is_held(q):
            assert torch.equal(p, opt.state[q]["master"])
            assert "master" not in opt_plain.state[p]


def test_master_state_dict_before_any_step(tiny):
    model = _model(tiny)
    reference = copy.deepcopy(model.state_dict())
    lw.hold_in_bf16(lw.matmul_weights(model))
    opt = AdamW(model.parameters(), **KW)
    out = lw.master_state_dict(model, opt)
    for name, value in reference.items():
        assert torch.equal(out[name], value), name


def test_refusals_name_the_problem(tiny):
    model = _model(tiny)
    weights = lw.matmul_weights(model)
    lw.hold_in_bf16(weights[:1])
    with pytest.raises(ValueError, match="held already"):
        lw.hold_in_bf16(weights[:1])
    with pytest.raises(ValueError, match="must be float32"):
        lw.hold_in_bf16([nn.Parameter(torch.zeros(2, dtype=torch.float64))])
    with pytest.raises(TypeError, match="expected parameters"):
        lw.hold_in_bf16([torch.zeros(2)])
    # a held weight loaded into an optimizer whose state dict has no master for it, after
    # its own pending master was taken: no silent bf16 master
    p = nn.Parameter(torch.randn(4))
    lw.hold_in_bf16([p])
    lw.take_master(p)
    opt = AdamW([p], **KW)
    state = {"state": {0: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(4),
                           "exp_avg_sq": torch.zeros(4)}},
             "param_groups": [{**opt.param_groups[0], "params": [0]}]}  # fmt: skip
    with pytest.raises(ValueError, match="no fp32 master"):
        opt.load_state_dict(state)


def test_weights_loaded_after_the_hold_are_refused_not_trained_from_a_stale_master(tiny):
    model = _model(tiny)
    lw.hold_in_bf16(lw.matmul_weights(model))
    other = _model(tiny, layers=2)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    model.load_state_dict(other.state_dict())  # fp32 values into the held bf16 weights
    opt = AdamW(model.parameters(), **KW)
    with pytest.raises(RuntimeError, match="changed after hold_in_bf16"):
        _train(model, opt, _batches(1))


def test_a_second_optimizer_starts_its_masters_from_the_bf16_weights(tiny):
    model = _model(tiny)
    lw.hold_in_bf16(lw.matmul_weights(model))
    _train(model, AdamW(model.parameters(), **KW), _batches(1))
    opt = AdamW(model.parameters(), **KW)
    before = [p.detach().float().clone() for p in _held(model)]
    with torch.no_grad():
        opt.step()  # no gradients: nothing steps, no state
    assert len(opt.state) == 0
    _train(model, opt, _batches(1, seed=3))
    for p, b in zip(_held(model), before):
        assert opt.state[p]["master"].dtype == torch.float32
        assert not torch.equal(opt.state[p]["master"], b)  # stepped from the bf16 value


FAST = ["--size", "tiny", "--context-length", "32", "--batch-size", "4", "--no-progress"]
FAST += ["--bf16", "--log-every", "1", "--cosine-steps", "4"]


def test_trainer_bf16_weights_train_as_autocast_and_checkpoint_the_fp32_model(tmp_path):
    """`--bf16-weights`: the losses of `--bf16` bit for bit (no clipping here: clipped bf16
    gradients are scaled in bf16); the checkpoint holds the fp32 model and no masters twice;
    2 + 2 resumed steps equal 4 uninterrupted ones; the checkpoint also resumes without
    the option."""
    from lm_core.checkpoint import read_checkpoint
    from lm_core.train import main

    common = [*FAST, "--grad-clip", "0"]
    plain = main([*common, "--steps", "4"])
    held = main([*common, "--steps", "4", "--bf16-weights", "--out-dir", str(tmp_path / "h")])
    assert [h["loss"] for h in held.history] == [h["loss"] for h in plain.history]
    payload = read_checkpoint(tmp_path / "h" / "checkpoint.pt")
    for name, value in plain.model.state_dict().items():
        assert payload["model"][name].dtype == value.dtype, name
        assert torch.equal(payload["model"][name], value), name
    assert not any("master" in e for e in payload["optimizer"]["state"].values())

    main([*common, "--steps", "2", "--bf16-weights", "--out-dir", str(tmp_path / "a")])
    ckpt = str(tmp_path / "a" / "checkpoint.pt")
    resumed = main([*common, "--steps", "4", "--bf16-weights", "--resume", ckpt])
    assert [h["loss"] for h in resumed.history] == [h["loss"] for h in held.history[2:]]
    for a, b in zip(held.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)
    unheld = main([*common, "--steps", "4", "--resume", ckpt])
    assert [h["loss"] for h in unheld.history] == [h["loss"] for h in plain.history[2:]]


def test_trainer_bf16_weights_with_clipping_is_bitwise_too():
    """Clipping takes the norm of bf16 gradients in fp32 and leaves their scale to the
    optimizer, which applies it in fp32: losses and gradient norms equal `--bf16`'s."""
    from lm_core.train import main

    plain = main([*FAST, "--steps", "4", "--grad-clip", "0.05"])
    held = main([*FAST, "--steps", "4", "--grad-clip", "0.05", "--bf16-weights"])
    assert plain.history[0]["grad_norm"] > 0.05  # the clip is active
    for key in ("loss", "grad_norm"):
        assert [h[key] for h in held.history] == [h[key] for h in plain.history], key
    for (name, a), b in zip(plain.model.named_parameters(), held.model.parameters()):
        assert torch.equal(a.to(b.dtype), b), name


@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=needs_interpreter)])
def test_clipped_step_equals_the_fp32_weights_clipped_step(tiny, fused):
    """clip_grad_norm + AdamW on held weights (the PyTorch ops, or the kernel interpreted):
    the fp32 run's norm, and masters equal to (kernel: within fp32 rounding of) its weights."""
    from lm_core.optim import clip_grad_norm

    ref, held = _model(tiny), _model(tiny)
    lw.hold_in_bf16(lw.matmul_weights(held))
    opts = [AdamW(m.parameters(), fused=fused, **KW) for m in (ref, held)]
    ids = _batches(1)[0]
    norms = []
    for model, opt in zip((ref, held), opts):
        with torch.autocast("cpu", dtype=BF16):
            model(ids[:, :-1], ids[:, 1:]).backward()
        norms.append(clip_grad_norm(list(model.parameters()), 0.01))
        if model is held:  # the held gradients wait, unscaled, for the optimizer
            assert all(getattr(p, lw.GRAD_SCALE, None) is not None for p in _held(held))
        opt.step()
    assert torch.equal(norms[0], norms[1])
    assert norms[0] > 0.01
    for p, r in zip(held.parameters(), ref.parameters()):
        value = opts[1].state[p]["master"] if lw.is_held(p) else p
        assert getattr(p, lw.GRAD_SCALE, None) is None
        if fused and lw.is_held(p):
            torch.testing.assert_close(value, r, rtol=2e-6, atol=1e-7)
        else:
            assert torch.equal(value, r)


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        (["--grad-accum-steps", "2"], "grad-accum-steps"),
        (["--checkpoint-format", "dcp"], "checkpoint-format"),
        (["--ddp", "flat"], "--ddp"),
    ],
)
def test_trainer_refuses_what_bf16_weights_cannot_do(extra, why, capsys):
    from lm_core.train import main

    with pytest.raises(SystemExit):
        main([*FAST, "--steps", "1", "--bf16-weights", *extra])
    err = capsys.readouterr().err
    assert "--bf16-weights" in err
    assert why in err
    with pytest.raises(SystemExit):
        main([*[a for a in FAST if a != "--bf16"], "--steps", "1", "--bf16-weights"])
    assert "needs --bf16" in capsys.readouterr().err
