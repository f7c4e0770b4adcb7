"""FSDP gradient accumulation without sync (`no_sync()`, `set_requires_gradient_sync`) and
`reshard_after_forward=False`, run inside each rank (see zs_harness)."""

from __future__ import annotations

import contextlib
import re

import pytest
import torch
from fsdp_scenarios import (
    ToyLM,
    batch,
    fsdp_step,
    loss_of,
    make_model,
    make_opt,
    max_rel_diff,
    reference_step,
)
from torch import nn

from zero_shard import FSDP

K = 3  # micro-batches per step


def _micro(step: int, k: int, rank: int, device: torch.device):
    return batch(K * step + k, rank, device)


def _accumulated_step(
    fsdp: FSDP, opt: torch.optim.Optimizer, step: int, rank: int, device, how: str
) -> None:
    """One optimizer step over K micro-batches of this rank, each loss divided by K; the
    first K-1 backward passes inside no_sync() ("no_sync"), after
    set_requires_gradient_sync(False) ("flag"), or synchronized ("sync")."""
    for k in range(K):
        last = k == K - 1
        if how == "flag":
            fsdp.set_requires_gradient_sync(last)
        quiet = how == "no_sync" and not last
        with fsdp.no_sync() if quiet else contextlib.nullcontext():
            (loss_of(fsdp, _micro(step, k, rank, device)) / K).backward()
    fsdp.finish_gradient_synchronization()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _big_batch_step(model: nn.Module, opt, step: int, world: int, device) -> None:
    """Single process: one step on the mean loss of every rank's K micro-batches."""
    losses = [loss_of(model, _micro(step, k, r, device)) for r in range(world) for k in range(K)]
    (sum(losses) / len(losses)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def scenario_no_sync_equals_big_batch(rank: int, world: int, device: torch.device) -> None:
    """K micro-batches with the first K-1 under no_sync(): one reduce-scatter per unit per
    step, the same all-gathers, and the weights of one big batch in one process (fp32, SGD
    with momentum: a gradient summed twice or lost shows at 1e-2); set_requires_gradient_sync
    is bitwise the same as no_sync, and both equal synchronizing every micro-batch to fp32
    round-off (only the order of the sums differs). Tied weights included (ToyLM)."""
    reference = make_model(device)
    ref_opt = make_opt("sgd", reference.parameters())
    runs = {}
    for how in ("no_sync", "flag", "sync"):
        fsdp = FSDP(make_model(device))
        n = len(fsdp.unit_names)
        opt = make_opt("sgd", fsdp.parameters())
        for step in range(3):
            fsdp.reset_stats()
            _accumulated_step(fsdp, opt, step, rank, device, how)
            expected = n if how != "sync" else K * n
            assert fsdp.stats["reduce_scatters"] == expected, (how, fsdp.stats)
            assert fsdp.stats["all_gathers"] == K * (2 * n - 1), (how, fsdp.stats)
            if how == "no_sync":
                _big_batch_step(reference, ref_opt, step, world, device)
        runs[how] = fsdp.gather_full_params()
    err = max_rel_diff(runs["no_sync"], reference.state_dict())
    assert err < 1e-5, f"no_sync vs one big batch in one process: {err:.2e}"
    for key, value in runs["no_sync"].items():
        assert torch.equal(runs["flag"][key], value), key
    assert max_rel_diff(runs["sync"], runs["no_sync"]) < 1e-6


class SkipLM(ToyLM):
    """ToyLM whose forward leaves out the last block while `skip` is set."""

    skip = False

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)  # (B, T, d)
        blocks = self.layers[:-1] if self.skip else self.layers
        for block in blocks:
            x = block(x)
        return self.head(self.norm(x))  # (B, T, VOCAB)


def scenario_no_sync_rules(rank: int, world: int, device: torch.device) -> None:
    """A unit that ran only under no_sync is reduce-scattered by finish; finish after no_sync
    backward passes only, and turning sync off while a synchronized backward awaits its
    finish, are refused; zero_grad() drops what no_sync accumulated; clip_grad_norm_ waits
    for the sync."""
    runs = []
    for quiet in (True, False):
        torch.manual_seed(0)
        fsdp = FSDP(SkipLM().to(device))
        with fsdp.no_sync() if quiet else contextlib.nullcontext():
            loss_of(fsdp, batch(0, rank, device)).backward()  # every block
        fsdp.module.skip = True
        loss_of(fsdp, batch(1, rank, device)).backward()  # layers.2 not reached
        fsdp.finish_gradient_synchronization()
        assert fsdp.stats["reduce_scatters"] == (5 if quiet else 9), fsdp.stats
        runs.append([p.grad.clone() for p in fsdp.parameters()])
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)

    def expect(text: str, fn) -> None:
        with pytest.raises(RuntimeError, match=re.escape(text)):
            fn()

    fsdp = FSDP(make_model(device))
    with fsdp.no_sync():
        loss_of(fsdp, batch(0, rank, device)).backward()
        expect("gradients are not synchronized yet", lambda: fsdp.clip_grad_norm_(1.0))
    expect("only backward passes with gradient sync off", fsdp.finish_gradient_synchronization)
    fsdp.zero_grad()  # drops the accumulated gradients
    loss_of(fsdp, batch(1, rank, device)).backward()
    waiting = "still waiting for finish_gradient_synchronization()"
    expect(waiting, lambda: fsdp.no_sync().__enter__())
    expect("still waiting", lambda: fsdp.set_requires_gradient_sync(False))
    fsdp.finish_gradient_synchronization()
    plain = FSDP(make_model(device))
    loss_of(plain, batch(1, rank, device)).backward()
    plain.finish_gradient_synchronization()
    for p, q in zip(fsdp.parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad)
    with pytest.raises(TypeError, match="requires_gradient_sync: expected True or False"):
        fsdp.set_requires_gradient_sync(0)  # type: ignore[arg-type]


def scenario_keep_gathered(rank: int, world: int, device: torch.device, remat: int) -> None:
    """reshard_after_forward=False: every unit stays gathered from its forward to its
    backward (one all-gather per unit per step instead of two; with activation
    checkpointing the recompute finds the weights too), nothing stays gathered after
    backward or after a no_grad forward, and training is bitwise that of the default."""
    runs = []
    for reshard in (True, False):
        fsdp = FSDP(make_model(device, remat=remat), reshard_after_forward=reshard)
        assert fsdp.reshard_after_forward is reshard
        n = len(fsdp.unit_names)
        opt = make_opt("adamw", fsdp.parameters())
        for step in range(2):
            fsdp.reset_stats()
            loss = loss_of(fsdp, batch(step, rank, device))
            if not reshard:
                assert fsdp.gathered_units() == fsdp.unit_names
            loss.backward()
            assert fsdp.gathered_units() == []
            fsdp.finish_gradient_synchronization()
            opt.step()
            opt.zero_grad(set_to_none=True)
            # default: every unit again for backward but the last (checkpointed segments
            # may re-gather once more); kept: each unit once
            gathers = fsdp.stats["all_gathers"]
            assert gathers == n if not reshard else gathers >= 2 * n - 1, (remat, fsdp.stats)
            assert fsdp.stats["reduce_scatters"] == n
            assert fsdp.stats["peak_gathered_units"] == (2 if reshard else n), fsdp.stats
        with torch.no_grad():
            fsdp(batch(0, rank, device)[0])
        assert fsdp.gathered_units() == []
        runs.append(fsdp.gather_full_params())
    for key, value in runs[0].items():
        assert torch.equal(runs[1][key], value), key
    with pytest.raises(TypeError, match="reshard_after_forward: expected True or False"):
        FSDP(make_model(device), reshard_after_forward="no")  # type: ignore[arg-type]


def scenario_keep_gathered_no_sync(rank: int, world: int, device: torch.device) -> None:
    """Both options together equal one process on the big batch."""
    reference = make_model(device)
    ref_opt = make_opt("sgd", reference.parameters())
    fsdp = FSDP(make_model(device), reshard_after_forward=False)
    opt = make_opt("sgd", fsdp.parameters())
    for step in range(2):
        _accumulated_step(fsdp, opt, step, rank, device, "no_sync")
        _big_batch_step(reference, ref_opt, step, world, device)
    assert max_rel_diff(fsdp.gather_full_params(), reference.state_dict()) < 1e-5
    fsdp_step(fsdp, opt, 5, rank, device)  # and plain steps afterwards
    reference_step(reference, ref_opt, 5, world, device)
    assert max_rel_diff(fsdp.gather_full_params(), reference.state_dict()) < 1e-5
