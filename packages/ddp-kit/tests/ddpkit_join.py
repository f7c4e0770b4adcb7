"""Uneven inputs under torch's `Join`: scenarios run on every rank of a spawned group.

Rank r trains on `batches[r]` batches inside `Join([model])` (rank 0 has more by default), and
the same process trains a single-process reference for `max(batches)` steps: at step s the
reference gradient is the sum, over the ranks that still have a batch, of each rank's mean
loss gradient, divided by the initial world size (torch's default) or by the number of those
ranks (`divide_by_initial_world_size=False`). Each rank's gradients must match the reference
in every step it trains; after the block every rank must hold the reference's final weights
(bit-identical across ranks) and the last step's averaged gradient (the joined rank's hook
leaves it in `.grad`).

Scenarios return failure descriptions instead of raising, so every rank keeps making the same
calls and the next scenario runs in step. Kept out of the test files so spawned workers can
import it by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from ddpkit_scenarios import (
    ATOL,
    IN_DIM,
    OUT_DIM,
    RTOL,
    WRAPPERS,
    ToyNet,
    _compare_across_ranks,
    _expect,
    make_wrapper,
)
from torch import nn
from torch.distributed.algorithms import Join
from torch.distributed.optim import ZeroRedundancyOptimizer

from ddp_kit.launch import worker_device

LR, MOMENTUM = 0.05, 0.9
PER_RANK = 4  # rows per rank per step


@dataclass
class JoinCase:
    """One uneven-input scenario (2 ranks)."""

    wrapper: str
    batches: tuple[int, int] = (5, 3)  # batches of rank 0 and rank 1
    divide_initial: bool = True  # Join(..., divide_by_initial_world_size=...)
    micro_batches: int = 1  # >1: all but the last under no_sync()
    zero: bool = False  # torch's ZeroRedundancyOptimizer (of SGD) in the same Join
    branch: str = ""  # "first-micro": only micro-batch 0 uses it; "rank1": only rank 1 does
    bf16: bool = False  # reduce_dtype=torch.bfloat16: compared within bf16 rounding

    @property
    def tolerance(self) -> tuple[float, float]:
        return (2e-2, 1e-3) if self.bf16 else (RTOL, ATOL)


def join_cases() -> dict[str, JoinCase]:
    """Every named uneven-input scenario."""
    cases: dict[str, JoinCase] = {}
    for w in WRAPPERS:
        cases[f"{w}"] = JoinCase(w)
        cases[f"{w}-divide-by-ranks-left"] = JoinCase(w, divide_initial=False)
        cases[f"{w}-no-sync"] = JoinCase(w, micro_batches=2, branch="first-micro")
        cases[f"{w}-zero-optimizer"] = JoinCase(w, zero=True)
    # A parameter only the rank that runs out uses: no rank uses it in the last steps.
    cases["bucketed-branch-on-short-rank"] = JoinCase("bucketed", branch="rank1")
    cases["flat-no-sync-divide-by-ranks-left"] = JoinCase(
        "flat", divide_initial=False, micro_batches=2, branch="first-micro"
    )
    cases["individual-short-rank-has-no-batch"] = JoinCase("individual", batches=(3, 0))
    cases["naive-rank0-shorter"] = JoinCase("naive", batches=(2, 4))
    # Gradients sent in bf16: pre-divided by the world size, or (ranks left) divided after.
    cases["bucketed-bf16"] = JoinCase("bucketed", bf16=True)
    cases["flat-bf16-divide-by-ranks-left"] = JoinCase("flat", divide_initial=False, bf16=True)
    return cases


def _batch(step: int, world: int, device: torch.device, seed: int):
    gen = torch.Generator().manual_seed(1000 * seed + step)
    x = torch.randn(world * PER_RANK, IN_DIM, generator=gen)  # (R*b, 6)
    y = torch.randn(world * PER_RANK, OUT_DIM, generator=gen)  # (R*b, 3)
    return x.to(device), y.to(device)


def _use_branch(case: JoinCase, rank: int, micro: int) -> bool:
    if case.branch == "first-micro":
        return micro == 0
    return case.branch == "rank1" and rank == 1


def _rank_loss(model: nn.Module, case: JoinCase, x, y, rank: int, micro: int) -> torch.Tensor:
    """Rank `rank`'s loss on micro-batch `micro` of its shard (a mean, / micro_batches)."""
    m = PER_RANK // case.micro_batches
    rows = slice(rank * PER_RANK + micro * m, rank * PER_RANK + (micro + 1) * m)
    out = model(x[rows], use_branch=_use_branch(case, rank, micro))  # (m, 3)
    return F.mse_loss(out, y[rows]) / case.micro_batches


def _reference_step(ref, ref_opt, case: JoinCase, step: int, world: int, device, seed: int):
    """One reference step: the ranks with a batch at `step` contribute, divided as Join does."""
    x, y = _batch(step, world, device, seed)
    active = [r for r in range(world) if step < case.batches[r]]
    divisor = world if case.divide_initial else len(active)
    ref_opt.zero_grad()
    for r in active:
        for j in range(case.micro_batches):
            (_rank_loss(ref, case, x, y, r, j) / divisor).backward()
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in ref.named_parameters()}
    ref_opt.step()
    return grads


def run_join_case(case: JoinCase, rank: int, world: int, device, seed: int) -> list[str]:
    """Train under Join next to the reference; return what differs."""
    fails: list[str] = []
    flags = {"branch": bool(case.branch)}
    torch.manual_seed(seed + 7919 * rank)  # a different init per rank: the wrapper broadcasts
    model = ToyNet(**flags).to(device)
    torch.manual_seed(seed)
    ref = ToyNet(**flags).to(device)
    options = {"reduce_dtype": torch.bfloat16} if case.bf16 else {}
    ddp = make_wrapper(case.wrapper, model, 25.0, False, **options)
    if case.zero:
        opt = ZeroRedundancyOptimizer(
            ddp.parameters(), optimizer_class=torch.optim.SGD, lr=LR, momentum=MOMENTUM
        )
        joinables = [ddp, opt]
    else:
        opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM)
        joinables = [ddp]
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=MOMENTUM)
    ref_grads: dict = {}
    k = case.micro_batches
    with Join(joinables, divide_by_initial_world_size=case.divide_initial):
        for step in range(case.batches[rank]):
            x, y = _batch(step, world, device, seed)
            opt.zero_grad()
            for j in range(k):
                loss = _rank_loss(ddp, case, x, y, rank, j)
                if j < k - 1:
                    with ddp.no_sync():
                        loss.backward()
                else:
                    loss.backward()
            ddp.finish_gradient_synchronization()
            ref_grads = _reference_step(ref, ref_opt, case, step, world, device, seed)
            fails += _compare_grads(model, ref_grads, f"step {step}", case.tolerance)
            opt.step()
    for step in range(case.batches[rank], max(case.batches)):
        ref_grads = _reference_step(ref, ref_opt, case, step, world, device, seed)
    if max(case.batches) > 0:  # every rank holds the last step's averaged gradient
        fails += _compare_grads(model, ref_grads, "after Join", case.tolerance)
    rtol, atol = case.tolerance
    for (name, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters()):
        if not torch.allclose(p, rp, rtol=rtol, atol=atol):
            err = (p - rp).abs().max().item()
            fails.append(f"weight {name} differs from reference by {err:.2e}")
    fails += _compare_across_ranks(model, world)
    ddp.close()
    return fails


def _compare_grads(
    model: nn.Module, ref_grads: dict, when: str, tolerance: tuple[float, float] = (RTOL, ATOL)
) -> list[str]:
    fails = []
    rtol, atol = tolerance
    for name, p in model.named_parameters():
        rg = ref_grads.get(name)
        if rg is None or p.grad is None:
            if (rg is None) != (p.grad is None):
                fails.append(
                    f"{when}: grad of {name} is {p.grad is not None}, reference {rg is not None}"
                )
            continue
        if not torch.allclose(p.grad, rg, rtol=rtol, atol=atol):
            err = (p.grad - rg).abs().max().item()
            fails.append(f"{when}: grad of {name} differs from reference by {err:.2e}")
    return fails


def run_throw_case(kind: str, rank: int, world: int, device, seed: int) -> list[str]:
    """Join(throw_on_early_termination=True): once rank 1 (3 batches) runs out, rank 0 (5)
    raises at its next step and rank 1 leaves Join with an error too; then the wrapper still
    trains (the step that raised never started) and the ranks stay identical."""
    fails: list[str] = []
    torch.manual_seed(seed + 7919 * rank)
    model = ToyNet().to(device)
    ddp = make_wrapper(kind, model, 25.0, False)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    case = JoinCase(kind)
    steps = 0
    try:
        with Join([ddp], throw_on_early_termination=True):
            for step in range(case.batches[rank]):
                x, y = _batch(step, world, device, seed)
                opt.zero_grad()
                _rank_loss(ddp, case, x, y, rank, 0).backward()
                ddp.finish_gradient_synchronization()
                opt.step()
                steps += 1
        fails.append("no rank raised")
    except RuntimeError as exc:
        expect = "exhausted inputs" if rank == 0 else "exhausted all inputs"
        if expect not in str(exc):
            fails.append(f"unexpected error: {exc}")
    if steps != 3:
        fails.append(f"{steps} steps ran before the error, expected 3")
    x, y = _batch(99, world, device, seed)
    opt.zero_grad()
    _rank_loss(ddp, case, x, y, rank, 0).backward()
    ddp.finish_gradient_synchronization()
    opt.step()
    fails += _compare_across_ranks(model, world)
    ddp.close()
    return fails


def run_join_errors(rank: int, world: int, device, seed: int) -> dict[str, str]:
    """Misuse with Join: a clear error on every rank, no collective left unmatched."""
    out: dict[str, str] = {}
    torch.manual_seed(seed)
    model = ToyNet(buffers=True).to(device)
    ddp = make_wrapper("bucketed", model, 25.0, False)
    x = torch.randn(4, IN_DIM, device=device)
    out["divide-flag-not-bool"] = _expect(
        lambda: Join([ddp], divide_by_initial_world_size=1),
        TypeError,
        "divide_by_initial_world_size",
    )

    def sync_buffers_in_join() -> None:
        with Join([ddp]):
            ddp.sync_buffers()

    out["sync-buffers-inside-join"] = _expect(sync_buffers_in_join, RuntimeError, "inside a Join")
    ddp(x).sum().backward()
    out["join-between-backward-and-finish"] = _expect(
        lambda: Join([ddp]), RuntimeError, "between steps"
    )
    ddp.finish_gradient_synchronization()
    ddp.close()

    model = ToyNet().to(device)
    ddp = make_wrapper("individual", model, 25.0, False)
    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.SGD, lr=LR)

    def optimizer_first() -> None:
        with Join([opt, ddp]):
            ddp(x).sum().backward()

    out["wrapper-not-first-joinable"] = _expect(optimizer_first, RuntimeError, "first to Join")
    ddp.close()
    return out


def run_join(rank: int, world: int, backend: str, names: list[str]) -> dict[str, list[str] | str]:
    """Worker: the named scenarios in order ({name: failures}), then the throw cases and the
    misuse cases ({name: error text, '' when right})."""
    device = worker_device(backend, rank)
    cases = join_cases()
    results: dict[str, list[str] | str] = {}
    for i, name in enumerate(names):
        results[name] = run_join_case(cases[name], rank, world, device, seed=i + 1)
    for kind in ("flat", "individual"):
        results[f"{kind}-throw-on-early-termination"] = run_throw_case(kind, rank, world, device, 7)
    results.update(run_join_errors(rank, world, device, seed=11))
    return results
