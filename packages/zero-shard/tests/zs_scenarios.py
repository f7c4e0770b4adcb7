"""Training scenarios run inside each rank: a sharded run beside an unsharded reference.

Every scenario trains two copies of the same model on the same per-rank batches with the same
gradient averaging: one with `ShardedOptimizer(optimizer_cls)`, one with a plain
`optimizer_cls` (the independent reference). The gradients are bitwise identical, so on CPU
(gloo) the weights must be bitwise identical too: each owner runs the very same per-tensor
update the reference runs. On GPUs (nccl) we allow fp32 round-off (see `assert_same`).
"""

from __future__ import annotations

import copy
import importlib
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.optim import Optimizer

from zero_shard import ShardedOptimizer

VOCAB = 32
STEPS = 10


# ------------------------------------------------------------------ models
class TiedLM(nn.Module):
    """Embedding tied to the output head, an MLP, a norm and a float64 parameter.

    tokens (B, T) -> logits (B, T, VOCAB). Seven parameter tensors of four sizes and two dtypes.
    """

    def __init__(self, d: int = 16, hidden: int = 24, transposed: bool = False) -> None:
        super().__init__()
        # `transposed`: one more parameter, stored non-contiguous (a transposed view).
        self.mix = nn.Parameter(0.1 * torch.randn(d, d).t()) if transposed else None
        self.emb = nn.Embedding(VOCAB, d)
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)
        self.norm = nn.LayerNorm(d)
        self.shift = nn.Parameter(0.1 * torch.randn(d, dtype=torch.float64))
        self.head = nn.Linear(d, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied: one Parameter used twice

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)  # (B, T, d)
        h = h + self.down(torch.relu(self.up(h)))
        h = self.norm(h) + self.shift.to(h.dtype)
        if self.mix is not None:
            h = h + h @ self.mix
        return self.head(h)  # (B, T, VOCAB)


class OneTensor(nn.Module):
    """A single parameter tensor: with 2 ranks, one rank owns nothing. (B, 7) -> (B, 3)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(7, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w


def make_model(kind: str, device: torch.device, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = {"tied": TiedLM, "one": OneTensor, "tied-t": lambda: TiedLM(transposed=True)}[kind]()
    return model.to(device)


def batch(kind: str, step: int, rank: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Fresh random data, different on every rank and step."""
    g = torch.Generator().manual_seed(10_007 * step + 101 * rank + 7)
    if kind.startswith("tied"):
        tokens = torch.randint(0, VOCAB, (4, 8), generator=g)
        targets = torch.randint(0, VOCAB, (4, 8), generator=g)
        return tokens.to(device), targets.to(device)
    x = torch.randn(5, 7, generator=g)
    y = torch.randn(5, 3, generator=g)
    return x.to(device), y.to(device)


def loss_of(kind: str, model: nn.Module, data: tuple[torch.Tensor, ...]) -> torch.Tensor:
    inputs, targets = data
    out = model(inputs)
    if kind.startswith("tied"):
        return F.cross_entropy(out.reshape(-1, VOCAB), targets.reshape(-1))  # (B*T, V)
    return F.mse_loss(out, targets)


# ------------------------------------------------------------------ optimizers
def optimizer_spec(name: str) -> tuple[type[Optimizer], dict[str, Any]]:
    """The optimizer class and its defaults; lm_core's AdamW is imported only when asked for."""
    if name == "sgd":
        return torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}
    if name == "adamw":
        return torch.optim.AdamW, {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1}
    if name == "lm_adamw":
        cls = importlib.import_module("lm_core").AdamW
        return cls, {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1}
    raise ValueError(f"unknown optimizer {name!r}")


def two_groups(model: nn.Module, lr: float) -> list[dict[str, Any]]:
    """Matrices with weight decay at `lr`; vectors without decay at lr / 2."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "lr": lr, "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "lr": lr / 2, "weight_decay": 0.0},
    ]


# ------------------------------------------------------------------ data-parallel wrappers
def wrap(model: nn.Module, kind: str, device: torch.device) -> nn.Module:
    """`manual` all-reduces gradients by hand; the others are torch DDP and ddp_kit wrappers."""
    if kind == "manual":
        return model
    if kind == "torch-ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)
    ddp_kit = importlib.import_module("ddp_kit")
    return getattr(ddp_kit, kind)(model)


def finish_grads(model: nn.Module, wrapped: nn.Module, kind: str) -> None:
    """Average gradients across ranks the way `kind` does it."""
    if kind == "manual":
        world = dist.get_world_size()
        for p in model.parameters():
            if p.grad is not None:
                # NCCL reduces only contiguous tensors (gloo takes any); a gradient keeps its
                # parameter's layout, which fused optimizers require, so reduce a copy.
                grad = p.grad.contiguous()
                dist.all_reduce(grad)
                if grad is not p.grad:
                    p.grad.copy_(grad)
                p.grad.div_(world)
    elif kind != "torch-ddp":
        wrapped.finish_gradient_synchronization()


class Run:
    """A model, its wrapper and its optimizer, stepped on the shared batches."""

    def __init__(self, model: nn.Module, wrapper: str, device: torch.device) -> None:
        self.model = model
        self.wrapper = wrapper
        self.wrapped = wrap(model, wrapper, device)
        self.opt: Optimizer | None = None

    def step(self, kind: str, step: int, rank: int, device: torch.device) -> None:
        assert self.opt is not None
        loss = loss_of(kind, self.wrapped, batch(kind, step, rank, device))
        loss.backward()
        finish_grads(self.model, self.wrapped, self.wrapper)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def assert_same(a: nn.Module, b: nn.Module, device: torch.device, what: str) -> None:
    """Bitwise on CPU. On CUDA, fp32 round-off: the two copies' all-reduces may run different
    NCCL algorithms/channels and the foreach kernels see different tensor lists, which can
    differ in the last bits; 10 optimizer steps keep that far below 1e-5 relative."""
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        if device.type == "cpu":
            assert torch.equal(p, q), f"{what}: parameter {name} differs (max |diff| "
            f"{(p - q).abs().max().item():.3e})"
        else:
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=f"{what}: {name}")


def pair(
    kind: str,
    wrapper: str,
    device: torch.device,
    make_opt: Callable[[nn.Module, bool], Optimizer],
) -> tuple[Run, Run]:
    """(sharded run, reference run) over identical copies of one model."""
    sharded = Run(make_model(kind, device), wrapper, device)
    reference = Run(make_model(kind, device), wrapper, device)
    sharded.opt = make_opt(sharded.model, True)
    reference.opt = make_opt(reference.model, False)
    return sharded, reference


def grouped_factory(opt_name: str, bucket_cap_mb: float = 16.0, param_sync: str = "broadcast"):
    cls, defaults = optimizer_spec(opt_name)

    def make(model: nn.Module, shard: bool) -> Optimizer:
        groups = two_groups(model, defaults["lr"])
        if shard:
            return ShardedOptimizer(
                groups, cls, bucket_cap_mb=bucket_cap_mb, param_sync=param_sync, **defaults
            )
        return cls(groups, **defaults)

    return make


# Sync settings every comparison runs under: buckets that hold every parameter, a 1 KB cap
# (large tensors broadcast in place), and all-gather with large and with ~200-byte chunks
# (parameters spanning chunk boundaries).
SYNCS = [(16.0, "broadcast"), (1 / 1024, "broadcast"), (16.0, "allgather"), (2e-4, "allgather")]


# ------------------------------------------------------------------ scenarios
def scenario_matches_reference(
    rank: int, world: int, device: torch.device, opt_name: str, wrapper: str = "manual"
) -> None:
    """Tied weights, two dtypes, two groups with their own lr and weight decay, 10 steps, under
    every sync setting; with the manual all-reduce also a non-contiguous parameter."""
    kind = "tied-t" if wrapper == "manual" else "tied"
    for cap, sync in SYNCS:
        factory = grouped_factory(opt_name, cap, sync)
        sharded, reference = pair(kind, wrapper, device, factory)
        opt = sharded.opt
        assert isinstance(opt, ShardedOptimizer)
        assert sum(opt.shard_numels()) == sum(p.numel() for p in sharded.model.parameters())
        assert max(opt.shard_numels()) > 0
        assert len(opt.local_optimizer.param_groups) == 2
        for step in range(STEPS):
            sharded.step(kind, step, rank, device)
            reference.step(kind, step, rank, device)
        what = f"{opt_name} {sync} cap={cap}MB {wrapper}"
        assert_same(sharded.model, reference.model, device, what)
        assert sharded.model.head.weight is sharded.model.emb.weight


def scenario_under_wrapper(rank: int, world: int, device: torch.device, wrapper: str) -> None:
    """The same comparison with a data-parallel wrapper averaging the gradients."""
    for opt_name in ("sgd", "adamw"):
        scenario_matches_reference(rank, world, device, opt_name, wrapper)


def scenario_one_tensor(rank: int, world: int, device: torch.device) -> None:
    """More ranks than parameter tensors: the rank with an empty shard steps and syncs too."""
    for opt_name in ("sgd", "adamw"):
        for sync in ("broadcast", "allgather"):
            _one_tensor_run(rank, world, device, opt_name, sync)


def _one_tensor_run(rank: int, world: int, device: torch.device, opt_name: str, sync: str):
    cls, defaults = optimizer_spec(opt_name)

    def make(model: nn.Module, shard: bool) -> Optimizer:
        if shard:
            return ShardedOptimizer(model.parameters(), cls, param_sync=sync, **defaults)
        return cls(model.parameters(), **defaults)

    sharded, reference = pair("one", "manual", device, make)
    opt = sharded.opt
    assert isinstance(opt, ShardedOptimizer)
    assert sorted(opt.shard_numels()) == [0] * (world - 1) + [21]
    mine = sum(len(g["params"]) for g in opt.local_optimizer.param_groups)
    assert mine == (1 if opt.owner(sharded.model.w) == rank else 0)
    for step in range(STEPS):
        sharded.step("one", step, rank, device)
        reference.step("one", step, rank, device)
    assert_same(sharded.model, reference.model, device, f"one tensor, {opt_name}, {sync}")


def scenario_add_group_midrun(rank: int, world: int, device: torch.device, opt_name: str) -> None:
    """Layers frozen at first are unfrozen after 5 steps and added as a group with its own lr."""
    cls, defaults = optimizer_spec(opt_name)

    def make(model: nn.Module, shard: bool) -> Optimizer:
        for p in (*model.down.parameters(), *model.norm.parameters()):
            p.requires_grad_(False)
        params = [p for p in model.parameters() if p.requires_grad]
        if shard:
            return ShardedOptimizer(params, cls, **defaults)
        return cls(params, **defaults)

    sharded, reference = pair("tied", "manual", device, make)
    for step in range(STEPS):
        if step == 5:
            for run in (sharded, reference):
                late = [*run.model.down.parameters(), *run.model.norm.parameters()]
                for p in late:
                    p.requires_grad_(True)
                assert run.opt is not None
                run.opt.add_param_group(
                    {"params": late, "lr": defaults["lr"] * 3, "weight_decay": 0.0}
                )
        sharded.step("tied", step, rank, device)
        reference.step("tied", step, rank, device)
    opt = sharded.opt
    assert isinstance(opt, ShardedOptimizer)
    assert len(opt.param_groups) == len(opt.local_optimizer.param_groups) == 2
    assert opt.param_groups[1]["lr"] == defaults["lr"] * 3
    assert_same(sharded.model, reference.model, device, f"group added mid-run, {opt_name}")


def scenario_lr_changes(rank: int, world: int, device: torch.device) -> None:
    """A LambdaLR scheduler plus lr written into param_groups by hand reach the shards."""
    sharded, reference = pair("tied", "manual", device, grouped_factory("adamw"))
    scheds = [
        torch.optim.lr_scheduler.LambdaLR(run.opt, lambda s: 1.0 / (1 + s))  # type: ignore[arg-type]
        for run in (sharded, reference)
    ]
    for step in range(STEPS):
        for run in (sharded, reference):
            assert run.opt is not None
            run.opt.param_groups[1]["lr"] = 1e-3 * (step + 1)  # what a training loop does
        sharded.step("tied", step, rank, device)
        reference.step("tied", step, rank, device)
        for s in scheds:
            s.step()
    opt = sharded.opt
    assert isinstance(opt, ShardedOptimizer)
    opt._push_hparams()
    for wrapper_group, local_group in zip(opt.param_groups, opt.local_optimizer.param_groups):
        assert wrapper_group["lr"] == local_group["lr"]
    assert_same(sharded.model, reference.model, device, "lr changes")


def _state_equal(a: dict[str, Any], b: dict[str, Any], device: torch.device) -> None:
    """Two full optimizer state dicts hold the same groups and the same state values
    (bitwise on CPU, fp32 round-off on CUDA as in `assert_same`)."""
    assert a["param_groups"] == b["param_groups"], (a["param_groups"], b["param_groups"])
    assert sorted(a["state"]) == sorted(b["state"])
    for k in a["state"]:
        sa, sb = a["state"][k], b["state"][k]
        assert sorted(sa) == sorted(sb), (k, sorted(sa), sorted(sb))
        for name in sa:
            va, vb = sa[name], sb[name]
            if isinstance(va, torch.Tensor) and device.type == "cpu":
                assert torch.equal(va.cpu(), vb.cpu()), f"state {k}/{name} differs"
            elif isinstance(va, torch.Tensor):
                torch.testing.assert_close(va.cpu(), vb.cpu(), rtol=1e-5, atol=1e-6)
            else:
                assert va == vb, (k, name, va, vb)


def scenario_save_resume(
    rank: int, world: int, device: torch.device, opt_name: str, tmp: str
) -> None:
    """Consolidate after 5 steps, save, rebuild, load, run 5 more == 10 uninterrupted steps.

    Also: the consolidated dict equals the plain optimizer's own state_dict (same layout and
    values); a plain optimizer's dict loads into a ShardedOptimizer; per-rank shards round-trip.
    """
    make = grouped_factory(opt_name)
    sharded, reference = pair("tied", "manual", device, make)
    for step in range(5):
        sharded.step("tied", step, rank, device)
        reference.step("tied", step, rank, device)
    opt = sharded.opt
    assert isinstance(opt, ShardedOptimizer)
    opt.consolidate_state_dict(to=0)
    ckpt = f"{tmp}/ckpt.pt"
    if rank == 0:
        full = opt.state_dict()
        _state_equal(full, reference.opt.state_dict(), device)  # type: ignore[union-attr]
        torch.save({"model": sharded.model.state_dict(), "optim": full}, f"{ckpt}.tmp")
        import os

        os.replace(f"{ckpt}.tmp", ckpt)
    else:
        try:
            opt.state_dict()
        except RuntimeError:
            pass
        else:
            raise AssertionError("state_dict() on a rank that received nothing must raise")
    local = copy.deepcopy(opt.local_state_dict())
    dist.barrier()

    resumed = Run(make_model("tied", device, seed=123), "manual", device)
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)
    resumed.model.load_state_dict(saved["model"])
    resumed.opt = make(resumed.model, True)
    resumed.opt.load_state_dict(saved["optim"])
    assert isinstance(resumed.opt, ShardedOptimizer)
    assert resumed.opt.state is resumed.opt.local_optimizer.state  # still after loading
    assert all(resumed.opt.owner(p) == rank for p in resumed.opt.state)
    assert len(resumed.opt.state) == len(opt.state) > 0
    from_plain = Run(make_model("tied", device, seed=5), "manual", device)
    from_plain.model.load_state_dict(saved["model"])
    from_plain.opt = make(from_plain.model, True)
    from_plain.opt.load_state_dict(copy.deepcopy(reference.opt.state_dict()))  # type: ignore[union-attr]

    from_shard = Run(make_model("tied", device, seed=9), "manual", device)
    from_shard.model.load_state_dict(saved["model"])
    from_shard.opt = make(from_shard.model, True)
    from_shard.opt.load_local_state_dict(local)

    for step in range(5, STEPS):
        for run in (sharded, reference, resumed, from_plain, from_shard):
            run.step("tied", step, rank, device)
    assert_same(resumed.model, sharded.model, device, "resumed vs uninterrupted")
    assert_same(resumed.model, reference.model, device, "resumed vs reference")
    assert_same(from_plain.model, reference.model, device, "plain state dict loaded")
    assert_same(from_shard.model, reference.model, device, "local shard reloaded")
    if rank == 0:
        torch.save(reference.model.state_dict(), f"{tmp}/reference_at_10.pt")


def scenario_other_world_size(
    rank: int, world: int, device: torch.device, opt_name: str, tmp: str
) -> None:
    """Load a state dict consolidated under another world size; then match a plain optimizer
    that loaded the same dict, step for step."""
    saved = torch.load(f"{tmp}/ckpt.pt", map_location="cpu", weights_only=False)
    make = grouped_factory(opt_name)
    sharded, reference = pair("tied", "manual", device, make)
    for run in (sharded, reference):
        run.model.load_state_dict(saved["model"])
        assert run.opt is not None
        run.opt.load_state_dict(copy.deepcopy(saved["optim"]))
    for step in range(5, STEPS):
        sharded.step("tied", step, rank, device)
        reference.step("tied", step, rank, device)
    assert_same(sharded.model, reference.model, device, f"world size {world} resume")


def _all_ranks_equal(params: Any, world: int) -> bool:
    mine = torch.cat([p.detach().reshape(-1).double() for p in params])  # (P,)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    return all(torch.equal(everyone[0], t) for t in everyone)


def scenario_broadcast_at_construction(rank: int, world: int, device: torch.device) -> None:
    """Without a data-parallel wrapper, ranks that built their models from different seeds
    start from rank 0's parameters (a non-contiguous one included), also for a group added
    later, and stay equal while training."""
    model = make_model("tied-t", device, seed=rank)
    cls, defaults = optimizer_spec("adamw")
    opt = ShardedOptimizer(two_groups(model, 1e-2), cls, **defaults)
    rank0 = make_model("tied-t", device, seed=0)
    for (name, p), q in zip(model.named_parameters(), rank0.parameters()):
        assert torch.equal(p, q), f"{name} is not rank 0's after construction"
    torch.manual_seed(100 + rank)
    extra = nn.Linear(16, 16).to(device)  # differs per rank
    opt.add_param_group({"params": list(extra.parameters()), "lr": 1e-3})
    assert _all_ranks_equal(extra.parameters(), world), "added group not broadcast"
    run = Run(model, "manual", device)
    run.opt = opt
    for step in range(2):
        run.step("tied", step, rank, device)
    assert _all_ranks_equal(model.parameters(), world), "ranks diverged while training"


def _expect(exc: type[BaseException], text: str, fn: Callable[[], Any]) -> None:
    with pytest.raises(exc, match=re.escape(text)):
        fn()


def scenario_errors(rank: int, world: int, device: torch.device) -> None:
    """Clear errors for misuse that needs a process group."""
    cls, defaults = optimizer_spec("adamw")
    # Ranks passing different parameters fail on every rank instead of hanging later.
    other = make_model("tied" if rank == 0 else "one", device)
    _expect(
        ValueError,
        "differs across ranks",
        lambda: ShardedOptimizer(other.parameters(), cls, **defaults),
    )
    if device.type == "cuda":
        cpu_model = make_model("tied", torch.device("cpu"))
        _expect(
            ValueError, "NCCL", lambda: ShardedOptimizer(cpu_model.parameters(), cls, **defaults)
        )

    model = make_model("tied", device)
    opt = ShardedOptimizer(two_groups(model, 1e-2), cls, **defaults)
    _expect(RuntimeError, "consolidate_state_dict(to=", opt.state_dict)
    _expect(ValueError, "to: expected a rank", lambda: opt.consolidate_state_dict(to=world))
    run = Run(model, "manual", device)
    run.opt = opt
    run.step("tied", 0, rank, device)
    full = None
    for target in range(world):  # consolidate on every rank in turn
        opt.consolidate_state_dict(to=target)
        if rank == target:
            full = opt.state_dict()
        else:
            _expect(RuntimeError, "not consolidated", opt.state_dict)
    assert full is not None
    run.step("tied", 1, rank, device)
    if rank == world - 1:  # the last target: its snapshot is stale now
        _expect(RuntimeError, "a step has run since", opt.state_dict)

    _expect(ValueError, "keys 'state' and 'param_groups'", lambda: opt.load_state_dict({"a": 1}))
    one_group = cls(make_model("tied", device).parameters(), **defaults).state_dict()
    _expect(
        ValueError,
        "1 parameter group(s), this optimizer has 2",
        lambda: opt.load_state_dict(one_group),
    )
    other_model = cls(two_groups(make_model("one", device), 1e-2), **defaults).state_dict()
    _expect(
        ValueError, "parameter group 0 lists 1 parameters", lambda: opt.load_state_dict(other_model)
    )
    bad = copy.deepcopy(full)
    bad["state"][0]["exp_avg"] = bad["state"][0]["exp_avg"].t().contiguous()
    _expect(ValueError, "from another model", lambda: opt.load_state_dict(bad))
    extra = copy.deepcopy(full)
    extra["state"][99] = {}
    _expect(ValueError, "parameter index 99", lambda: opt.load_state_dict(extra))

    local = opt.local_state_dict()
    _expect(ValueError, "load_local_state_dict", lambda: opt.load_state_dict(local))
    _expect(ValueError, "a 'zero_shard' key", lambda: opt.load_local_state_dict(full))
    moved = copy.deepcopy(local)
    moved["zero_shard"]["world_size"] = world + 2
    _expect(
        ValueError, f"world size ({world + 2} vs {world}", lambda: opt.load_local_state_dict(moved)
    )
    # After all those refusals the optimizer still works and the ranks agree.
    opt.load_state_dict(full)
    run.step("tied", 2, rank, device)
    mine = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    assert all(torch.equal(everyone[0], t) for t in everyone)
