"""Sharded checkpoints through torch.distributed.checkpoint, run inside each rank (see
zs_harness): FSDP and ShardedOptimizer save their own shards at one world size and load at
another; the full states (gathered / consolidated) must equal what was saved, bitwise.

Every save also writes `<dir>.ref.pt` from rank 0: the full model and optimizer state at the
save (by parameter name), which the loads at other world sizes (and the no-process-group load
in the test process) compare against.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsdp_scenarios import ToyLM, batch, fsdp_step, loss_of, make_model
from torch import nn

from zero_shard import FSDP, FlatShard, ShardedOptimizer

STEPS = 3  # steps before a save


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


def sharded_adamw(params: Any) -> ShardedOptimizer:
    return ShardedOptimizer(params, torch.optim.AdamW, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


def names_of(model: nn.Module) -> list[str]:
    return [n for n, _ in model.named_parameters()]


def replicated_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, world: int) -> None:
    """One step on the mean loss over every rank's batch, computed by each rank alone (the
    gradients are equal on every rank without a data-parallel wrapper)."""
    device = next(model.parameters()).device
    loss = sum(loss_of(model, batch(step, r, device)) for r in range(world)) / world
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


# ------------------------------------------------------------------ full views
def full_fsdp_optimizer_state(fsdp: FSDP, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Collective: the optimizer state by parameter name in full shapes (every rank)."""
    state = fsdp.sharded_optimizer_state_dict(opt)["state"]
    world = dist.get_world_size()
    out: dict[str, Any] = {}
    for name, entry in state.items():
        out[name] = {}
        for k, v in entry.items():
            if isinstance(v, FlatShard):
                chunk = -(-v.numel() // world)
                row = v.local.new_zeros(chunk)
                row[: v.local.numel()] = v.local
                rows = [torch.empty_like(row) for _ in range(world)]
                dist.all_gather(rows, row)
                v = torch.cat(rows)[: v.numel()].view(v.shape)
            out[name][k] = v.detach().clone().cpu() if isinstance(v, torch.Tensor) else v
    return out


def full_zero_optimizer_state(opt: ShardedOptimizer, names: list[str]) -> dict[str, Any]:
    """Collective: the consolidated state by parameter name (rank 0; None elsewhere)."""
    opt.consolidate_state_dict(to=0)
    if dist.get_rank() != 0:
        return {}
    full = opt.state_dict()
    return {names[i]: dict(e.items()) for i, e in full["state"].items()}


def assert_states_equal(got: dict[str, Any], ref: dict[str, Any], what: str) -> None:
    assert got.keys() == ref.keys(), (what, sorted(got), sorted(ref))
    for name in ref:
        a, b = got[name], ref[name]
        if isinstance(b, dict):
            assert_states_equal(a, b, f"{what} {name}")
        elif isinstance(b, torch.Tensor):
            assert torch.equal(a.cpu(), b.cpu()), f"{what} {name}"
        else:
            assert a == b, (what, name, a, b)


# ------------------------------------------------------------------ FSDP
def _fsdp(device: torch.device, seed: int) -> tuple[FSDP, torch.optim.Optimizer]:
    fsdp = FSDP(make_model(device, seed=seed))
    return fsdp, adamw(fsdp.parameters())


def fsdp_state(fsdp: FSDP, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": fsdp.sharded_state_dict(), "optim": fsdp.sharded_optimizer_state_dict(opt)}


def scenario_fsdp_save(rank: int, world: int, device: torch.device, path: str) -> None:
    """Train STEPS steps, save each rank's shards; rank 0 writes the full state beside."""
    fsdp, opt = _fsdp(device, seed=0)
    for step in range(STEPS):
        fsdp_step(fsdp, opt, step, rank, device)
    state = fsdp_state(fsdp, opt)
    assert isinstance(state["model"]["layers.0.up.weight"], FlatShard)
    dcp.save(state, checkpoint_id=path)
    model = {k: v.cpu() for k, v in fsdp.gather_full_params().items()}
    optim = full_fsdp_optimizer_state(fsdp, opt)
    if rank == 0:
        torch.save({"model": model, "optim": optim}, f"{path}.ref.pt")


def scenario_fsdp_load(rank: int, world: int, device: torch.device, path: str) -> None:
    """Fresh FSDP (other weights) at this world size: load, then its full state == saved."""
    fsdp, opt = _fsdp(device, seed=7)
    state = fsdp_state(fsdp, opt)
    dcp.load(state, checkpoint_id=path)
    fsdp.load_sharded_state_dict(state["model"])
    fsdp.load_sharded_optimizer_state_dict(opt, state["optim"])
    ref = torch.load(f"{path}.ref.pt", weights_only=True)
    model = {k: v.cpu() for k, v in fsdp.gather_full_params().items()}
    assert_states_equal(model, ref["model"], f"model at world {world}")
    assert_states_equal(full_fsdp_optimizer_state(fsdp, opt), ref["optim"], f"optim at {world}")
    assert opt.param_groups[0]["lr"] == 1e-2


def scenario_fsdp_resume(rank: int, world: int, device: torch.device, path: str) -> None:
    """Save after STEPS steps and go on; a fresh FSDP loading the save and taking the same
    steps ends bitwise where the uninterrupted one does."""
    fsdp, opt = _fsdp(device, seed=0)
    for step in range(STEPS):
        fsdp_step(fsdp, opt, step, rank, device)
    dcp.save(fsdp_state(fsdp, opt), checkpoint_id=path)
    for step in range(STEPS, STEPS + 2):
        fsdp_step(fsdp, opt, step, rank, device)
    fresh, fresh_opt = _fsdp(device, seed=7)
    state = fsdp_state(fresh, fresh_opt)
    dcp.load(state, checkpoint_id=path)
    fresh.load_sharded_state_dict(state["model"])
    fresh.load_sharded_optimizer_state_dict(fresh_opt, state["optim"])
    for step in range(STEPS, STEPS + 2):
        fsdp_step(fresh, fresh_opt, step, rank, device)
    for p, q in zip(fsdp.parameters(), fresh.parameters()):
        assert torch.equal(p, q)
    assert_states_equal(fresh_opt.state_dict()["state"], opt.state_dict()["state"], "resumed")


# ------------------------------------------------------------------ ShardedOptimizer
def _zero(device: torch.device, seed: int) -> tuple[nn.Module, ShardedOptimizer]:
    model = make_model(device, seed=seed)
    return model, sharded_adamw(model.parameters())


def zero_state(model: nn.Module, opt: ShardedOptimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.sharded_state_dict(names_of(model))}


def scenario_zero_save(rank: int, world: int, device: torch.device, path: str) -> None:
    model, opt = _zero(device, seed=0)
    for step in range(STEPS):
        replicated_step(model, opt, step, world)
    state = zero_state(model, opt)
    mine = {n for n, p in model.named_parameters() if opt.owner(p) == rank}
    assert set(state["optim"]["state"]) == mine, "each rank lists its own parameters' state"
    dcp.save(state, checkpoint_id=path)
    optim = full_zero_optimizer_state(opt, names_of(model))
    if rank == 0:
        model_state = {k: v.cpu() for k, v in model.state_dict().items()}
        torch.save({"model": model_state, "optim": optim}, f"{path}.ref.pt")


def scenario_zero_load(rank: int, world: int, device: torch.device, path: str) -> None:
    model, opt = _zero(device, seed=7)
    names = names_of(model)
    state = zero_state(model, opt)
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    opt.load_sharded_state_dict(state["optim"], names)
    ref = torch.load(f"{path}.ref.pt", weights_only=True)
    got = {k: v.cpu() for k, v in model.state_dict().items()}
    assert_states_equal(got, ref["model"], f"model at world {world}")
    optim = full_zero_optimizer_state(opt, names)
    if rank == 0:
        assert_states_equal(optim, ref["optim"], f"optimizer at world {world}")


def scenario_zero_resume(rank: int, world: int, device: torch.device, path: str) -> None:
    model, opt = _zero(device, seed=0)
    for step in range(STEPS):
        replicated_step(model, opt, step, world)
    dcp.save(zero_state(model, opt), checkpoint_id=path)
    for step in range(STEPS, STEPS + 2):
        replicated_step(model, opt, step, world)
    fresh, fresh_opt = _zero(device, seed=7)
    state = zero_state(fresh, fresh_opt)
    dcp.load(state, checkpoint_id=path)
    fresh.load_state_dict(state["model"])
    fresh_opt.load_sharded_state_dict(state["optim"], names_of(fresh))
    for step in range(STEPS, STEPS + 2):
        replicated_step(fresh, fresh_opt, step, world)
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(p, q)


def scenario_fsdp_into_zero(rank: int, world: int, device: torch.device, path: str) -> None:
    """An FSDP checkpoint (flat shards) loads into a replicated model + ShardedOptimizer: the
    layouts name the same tensors in the same full shapes."""
    scenario_zero_load(rank, world, device, path)


def plain_save(path: str) -> None:
    """In a process without a process group: train a plain ToyLM with torch AdamW and save it
    through torch's own state-dict API (DCP's no-dist mode: one process writes everything)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = make_model(torch.device("cpu"))
    opt = adamw(model.parameters())
    for step in range(STEPS):
        replicated_step(model, opt, step, world=2)
    model_state, optim_state = get_state_dict(model, opt)
    with warnings.catch_warnings():  # DCP warns that it runs in one process, as told
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path, no_dist=True)
    names = names_of(model)
    optim = {names[i]: dict(e) for i, e in opt.state_dict()["state"].items()}
    torch.save({"model": model.state_dict(), "optim": optim}, f"{path}.ref.pt")


def plain_load(path: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    """In a process without a process group: a plain ToyLM and torch AdamW loaded from a
    sharded checkpoint through torch's own state-dict API (DCP's no-dist mode)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = ToyLM()
    opt = adamw(model.parameters())
    model_state, optim_state = get_state_dict(model, opt)
    state = {"model": model_state, "optim": optim_state}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=path, no_dist=True)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return model, opt
