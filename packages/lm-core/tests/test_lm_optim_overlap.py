"""OverlappedOptimizer (optimizer step during the backward) against a plain AdamW step, and
compile_blocks, on CPU: units step inline, in the backward, and give bitwise the same values.

Why bitwise: AdamW updates every element from that element's parameter, gradient and state
alone, and each unit runs the same implementation (foreach on CPU) as the plain optimizer,
so splitting the parameters into units changes no floating-point operation.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc

import pytest
import torch
from torch import nn

from lm_core import AdamW, OverlappedOptimizer, TransformerLM, compile_blocks, cosine_lr
from lm_core.optim_overlap import default_units

KW = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def _model(tiny, layers=2):
    torch.manual_seed(0)
    return TransformerLM(dataclasses.replace(tiny, num_layers=layers))


def _groups(model):
    """Weight decay on matrices, none on norms (a common split; lr and decay per group)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0, "lr": 3e-2}]


def _batches(n, seed=1, batch=2, seq=16):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (batch, seq + 1), generator=g) for _ in range(n)]


def _loss(runner, ids):
    return runner(ids[:, :-1], ids[:, 1:])


def _train(model, opt, batches, runner=None, accum=1, schedule=True):
    """Steps over `batches` (accum micro-batches each); the lr set before the backward."""
    runner = model if runner is None else runner
    for step in range(len(batches) // accum):
        if schedule:
            lr = cosine_lr(step, 1e-2, 1e-3, 1, 4)
            for g in opt.param_groups:
                g["lr"] = lr * (3.0 if g["weight_decay"] == 0.0 else 1.0)
        for micro in range(accum):
            last = micro == accum - 1
            ctx = opt.no_step() if isinstance(opt, OverlappedOptimizer) and not last else None
            with ctx or contextlib.nullcontext():
                (_loss(runner, batches[step * accum + micro]) / accum).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y), (x - y).abs().max()


def test_same_parameters_and_state_as_adamw_with_groups_and_schedule(tiny):
    batches = _batches(4)
    ref_model = _model(tiny)
    ref_opt = AdamW(_groups(ref_model), **KW)
    ref = _train(ref_model, ref_opt, batches)
    model = _model(tiny)
    opt = OverlappedOptimizer(model, _groups(model), **KW)
    got = _train(model, opt, batches)
    _assert_same(got, ref)
    init = [p.detach() for p in _model(tiny).parameters()]
    assert all(not torch.equal(a, b) for a, b in zip(got, init))  # every parameter moved
    assert len(opt.optimizers) == 2 + 2 + 1  # embedding, 2 blocks, final norm, head
    mine, theirs = opt.state_dict(), ref_opt.state_dict()
    assert mine["param_groups"] == theirs["param_groups"]
    assert mine["state"].keys() == theirs["state"].keys()
    for i, s in theirs["state"].items():
        for k, v in s.items():
            assert torch.equal(mine["state"][i][k], v), (i, k)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("compile_mode", [None, "blocks", "model"])
def test_units_step_inside_the_backward(tiny, compile_mode):
    """Eager or blocks compiled one by one: a block's unit steps before the backward of the
    blocks below it has run. torch.compile(model): every hook fires at the end of the one
    backward node, and the result is still the plain step's."""
    layers = 3
    batches = _batches(2)
    ref_model = _model(tiny, layers)
    ref = _train(ref_model, AdamW(ref_model.parameters(), **KW), batches, schedule=False)
    model = _model(tiny, layers)
    opt = OverlappedOptimizer(model, **KW)
    log = []
    for i, unit_opt in enumerate(opt.optimizers):
        real = unit_opt.step
        unit_opt.step = lambda real=real, i=i: (log.append(("step", i)), real())[1]
    runner = model
    if compile_mode == "blocks":
        compile_blocks(model, backend="aot_eager")
    elif compile_mode == "model":
        runner = torch.compile(model, backend="aot_eager")
    if compile_mode != "model":

        def run_blocks(x, cu_seqlens=None, max_seqlen=None):
            for i, block in enumerate(model.layers):
                x = block(x)
                # fires when the blocks above are done: before block i's own backward
                x.register_hook(lambda g, i=i: log.append(("grad into", i)))
            return x

        model.run_blocks = run_blocks
    got = _train(model, opt, batches, runner=runner, schedule=False)
    _assert_same(got, ref)
    steps = [i for i, e in enumerate(log) if e[0] == "step"]
    first = log[: steps[layers + 2] + 1]  # the first step's events
    units = [e[1] for e in first if e[0] == "step"]
    assert sorted(units) == list(range(layers + 3))  # each unit once
    if compile_mode != "model":
        assert units == list(range(layers + 2, -1, -1))  # head, norm, blocks top down, embedding
        for block in range(1, layers):  # unit block + 1 stepped before block - 1's backward
            assert first.index(("step", block + 1)) < first.index(("grad into", block - 1))


def test_gradient_accumulation_steps_on_the_last_micro_batch(tiny):
    batches = _batches(6)
    ref_model = _model(tiny)
    ref = _train(ref_model, AdamW(_groups(ref_model), **KW), batches, accum=3)
    model = _model(tiny)
    opt = OverlappedOptimizer(model, _groups(model), **KW)
    _assert_same(_train(model, opt, batches, accum=3), ref)


def test_all_backwards_in_no_step_then_step_is_a_plain_step(tiny):
    batches = _batches(2)
    ref_model = _model(tiny)
    ref = _train(ref_model, AdamW(ref_model.parameters(), **KW), batches, schedule=False)
    model = _model(tiny)
    opt = OverlappedOptimizer(model, **KW)
    for ids in batches:
        with opt.no_step():
            _loss(model, ids).backward()
        assert all(p.grad is not None for p in model.parameters())
        opt.step()
    _assert_same([p.detach() for p in model.parameters()], ref)


def test_a_second_backward_before_step_raises(tiny):
    model = _model(tiny)
    opt = OverlappedOptimizer(model, **KW)  # held: hooks reference it weakly
    a, b = _batches(2)
    _loss(model, a).backward()
    with pytest.raises(RuntimeError, match="no_step"):
        _loss(model, b).backward()
    assert opt.optimizers


def test_lr_changed_after_the_backward_raises(tiny):
    model = _model(tiny)
    opt = OverlappedOptimizer(model, **KW)
    (ids,) = _batches(1)
    _loss(model, ids).backward()
    opt.set_lr(5e-3)  # too late: the units already stepped with 1e-2
    with pytest.raises(RuntimeError, match="set_lr"):
        opt.step()
    opt.set_lr(1e-3)  # before the backward: fine, and the optimizer was reset
    _loss(model, ids).backward()
    opt.step()
    assert {g["lr"] for g in opt.param_groups} == {1e-3}


class _TwoParts(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)
        self.unused = nn.Parameter(torch.ones(3))  # never gets a gradient
        self.frozen = nn.Parameter(torch.ones(2), requires_grad=False)
        self.scale = nn.Parameter(torch.tensor(2.0))  # owned by the root: a unit of its own

    def forward(self, x):
        return (self.b(torch.relu(self.a(x))) * self.scale * self.frozen).square().mean()


def test_unused_and_frozen_parameters_and_root_parameters():
    """A unit whose gradients do not all arrive steps in step(); the result is AdamW's."""
    out = []
    for overlapped in (False, True):
        torch.manual_seed(0)
        model = _TwoParts()
        nn.init.normal_(model.b.weight)
        if overlapped:
            opt = OverlappedOptimizer(model, model.parameters(), **KW)
        else:
            opt = AdamW(model.parameters(), **KW)
        g = torch.Generator().manual_seed(3)
        for _ in range(3):
            model(torch.randn(5, 4, generator=g)).backward()
            opt.step()
            opt.zero_grad()
        out.append([p.detach().clone() for p in model.parameters()])
    _assert_same(*out)
    assert [len(list(u.parameters())) for u in default_units(_TwoParts())] == [2, 2]


def test_state_dict_loads_into_and_from_a_plain_adamw(tiny):
    batches = _batches(4)
    model = _model(tiny)
    opt = OverlappedOptimizer(model, _groups(model), **KW)
    _train(model, opt, batches[:2], schedule=False)
    saved_params = {k: v.clone() for k, v in model.state_dict().items()}
    # state_dict() holds the live tensors, as torch's does, and load_state_dict keeps them:
    # a snapshot, copied again for each load
    saved = copy.deepcopy(opt.state_dict())
    # a plain AdamW continues from the overlapped state ...
    ref_model = _model(tiny)
    ref_model.load_state_dict(saved_params)
    ref_opt = AdamW(_groups(ref_model), **KW)
    ref_opt.load_state_dict(copy.deepcopy(saved))
    ref = _train(ref_model, ref_opt, batches[2:], schedule=False)
    # ... as the overlapped one does, and as a fresh overlapped one loading a plain state
    cont = _train(model, opt, batches[2:], schedule=False)
    _assert_same(cont, ref)
    fresh_model = _model(tiny)
    fresh_model.load_state_dict(saved_params)
    fresh = OverlappedOptimizer(fresh_model, _groups(fresh_model), **KW)
    plain = AdamW(_groups(_model(tiny)), **KW)
    plain.load_state_dict(copy.deepcopy(saved))
    fresh.load_state_dict(copy.deepcopy(plain.state_dict()))
    _assert_same(_train(fresh_model, fresh, batches[2:], schedule=False), ref)
    with pytest.raises(ValueError, match="param groups"):
        fresh.load_state_dict({"state": {}, "param_groups": saved["param_groups"][:1]})


def test_torch_adamw_per_unit_matches_torch_adamw(tiny):
    batches = _batches(2)
    kw = dict(KW, foreach=False)
    ref_model = _model(tiny)
    ref = _train(ref_model, torch.optim.AdamW(ref_model.parameters(), **kw), batches)
    model = _model(tiny)
    opt = OverlappedOptimizer(model, optimizer_cls=torch.optim.AdamW, **kw)
    _assert_same(_train(model, opt, batches), ref)


def test_remove_and_garbage_collection_leave_no_hooks(tiny):
    model = _model(tiny)
    opt = OverlappedOptimizer(model, **KW)
    (ids,) = _batches(1)
    opt.remove()
    before = [p.detach().clone() for p in model.parameters()]
    _loss(model, ids).backward()
    _assert_same([p.detach() for p in model.parameters()], before)  # nothing stepped
    assert all(p.grad is not None for p in model.parameters())
    opt.step()  # a plain step now
    assert all(p.grad is None for p in model.parameters())
    opt2 = OverlappedOptimizer(model, **KW)
    del opt2
    gc.collect()
    before = [p.detach().clone() for p in model.parameters()]
    _loss(model, ids).backward()
    _assert_same([p.detach() for p in model.parameters()], before)


class _Wrapper(nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module


def test_bad_arguments_name_them(tiny):
    model = _model(tiny)
    with pytest.raises(ValueError, match="params: a tensor of shape"):
        OverlappedOptimizer(model, [nn.Parameter(torch.ones(2))])
    with pytest.raises(ValueError, match="appears twice"):
        OverlappedOptimizer(model, [model.ln_final.weight, model.ln_final.weight])
    with pytest.raises(TypeError, match="not a mix"):
        OverlappedOptimizer(model, [model.ln_final.weight, {"params": [model.lm_head.weight]}])
    with pytest.raises(ValueError, match="empty"):
        OverlappedOptimizer(model, [])
    with pytest.raises(ValueError, match="units: a parameter belongs to units 0 and 1"):
        OverlappedOptimizer(model, units=[model.layers[0], model.layers[0].ln1])
    with pytest.raises(TypeError, match="optimizer_cls"):
        OverlappedOptimizer(model, optimizer_cls=dict)
    with pytest.raises(ValueError, match="data-parallel"):
        OverlappedOptimizer(_Wrapper(model))
    with torch.device("meta"):
        meta = TransformerLM(tiny)
    with pytest.raises(ValueError, match="meta"):
        OverlappedOptimizer(meta)
    with pytest.raises(ValueError, match="lr"):
        OverlappedOptimizer(model, lr=-1.0)  # the unit optimizer's own check


def test_compile_blocks_refuses_wrappers_and_other_models(tiny):
    model = _model(tiny)
    with pytest.raises(TypeError, match="wrapper"):
        compile_blocks(torch.compile(model))
    with pytest.raises(TypeError, match="layers"):
        compile_blocks(nn.Linear(2, 2))
    assert compile_blocks(model, backend="eager") is model
    assert all(b._compiled_call_impl is not None for b in model.layers)
    assert model.state_dict().keys() == _model(tiny).state_dict().keys()
