"""Multi-process scenarios for the ddp_kit tests: each runs on every rank of a spawned group.

A scenario trains a small model with a wrapper on this rank's shard of each batch and, in the
same process, a single-process reference on the whole batch from the same initial weights;
it returns a list of failure descriptions (empty = pass) instead of raising, so that every rank
keeps making the same collective calls and the next scenario still runs in step.

Kept in its own module (not a test file) so spawned workers can import it by name.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import ddp_kit
from ddp_kit.buckets import MIB
from ddp_kit.launch import worker_device

WRAPPERS = ("naive", "flat", "individual", "bucketed")
IN_DIM, OUT_DIM = 6, 3

# The wrapper's gradients are the mean of per-shard means, the reference's the mean over the
# whole batch: the same sum in another order, so they differ by float32 rounding (~1e-7
# relative). Over a few SGD/AdamW steps that stays well below these bounds, while a missing
# average (a sum) or a missed broadcast moves weights by 1e-2 or more.
RTOL, ATOL = 1e-4, 1e-5


class ToyNet(nn.Module):
    """(B, 6) -> (B, 3) MLP; flags add the features a scenario needs.

    tied: fc2 is also registered as `fc2_again` and applied twice (one parameter, two uses).
    frozen: a layer with requires_grad=False in the residual path.
    unused: a layer forward never calls.
    double: a float64 layer (a second gradient dtype).
    buffers: a registered buffer and BatchNorm statistics (eval-mode batch norm) in forward.
    branch: a layer applied only when forward gets use_branch=True.
    """

    def __init__(
        self,
        hidden: int = 16,
        *,
        tied: bool = False,
        frozen: bool = False,
        unused: bool = False,
        double: bool = False,
        buffers: bool = False,
        branch: bool = False,
    ) -> None:
        super().__init__()
        self.flags = {
            "tied": tied,
            "frozen": frozen,
            "double": double,
            "buffers": buffers,
            "branch": branch,
        }
        self.fc1 = nn.Linear(IN_DIM, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        if tied:
            self.fc2_again = self.fc2
        if frozen:
            self.frozen = nn.Linear(hidden, hidden)
            self.frozen.requires_grad_(False)
        if unused:
            self.unused = nn.Linear(hidden, hidden)
        if double:
            self.fc_double = nn.Linear(hidden, hidden).double()
        if buffers:
            self.register_buffer("scale", torch.ones(hidden))
            self.bn = nn.BatchNorm1d(hidden)
        if branch:
            self.branch = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, OUT_DIM)

    def forward(self, x: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        f = self.flags
        h = torch.tanh(self.fc1(x))  # (B, H)
        if f["buffers"]:
            h = h * self.scale
            bn = self.bn
            h = F.batch_norm(h, bn.running_mean, bn.running_var, bn.weight, bn.bias, False)
        h = torch.tanh(self.fc2(h))
        if f["tied"]:
            h = torch.tanh(self.fc2_again(h))
        if f["frozen"]:
            h = h + self.frozen(h)
        if f["double"]:
            h = h + self.fc_double(h.double()).float()
        if f["branch"] and use_branch:
            h = h + self.branch(h)
        return self.head(h)  # (B, 3)


@dataclass
class Case:
    """One scenario: a wrapper, model features, optimizer and step pattern."""

    wrapper: str
    model: dict
    optimizer: str = "sgd"
    steps: int = 3
    per_rank: int = 4  # rows per rank per step
    micro_batches: int = 1  # >1: the first ones run under no_sync()
    rank_branch: bool = False  # only rank 0 uses the branch (a data-dependent graph)
    find_unused: bool = False
    bucket_mb: float | str = 25.0  # or "two" for a cap that gives exactly two buckets
    set_to_none: bool = True
    expect_buckets: int | str | None = None  # int, or "per-param"


def make_wrapper(
    kind: str, model: nn.Module, bucket_mb: float, find_unused: bool, **options
) -> nn.Module:
    kw = {"find_unused_parameters": find_unused, **options}
    if kind == "naive":
        return ddp_kit.NaiveDDP(model, **kw)
    if kind == "flat":
        return ddp_kit.FlatDDP(model, **kw)
    if kind == "individual":
        return ddp_kit.DDPIndividualParameters(model, **kw)
    if kind == "bucketed":
        return ddp_kit.DDPBucketed(model, bucket_mb, **kw)
    raise ValueError(kind)


def make_optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _two_bucket_cap_mb(model: nn.Module) -> float:
    """A cap (MiB) that splits the trainable parameters into exactly two buckets."""
    nbytes = [p.numel() * p.element_size() for p in model.parameters() if p.requires_grad]
    return 0.75 * sum(nbytes) / MIB


def _batch(case: Case, step: int, world: int, device: torch.device, seed: int):
    gen = torch.Generator().manual_seed(1000 * seed + step)
    x = torch.randn(world * case.per_rank, IN_DIM, generator=gen)  # (R*b, 6)
    y = torch.randn(world * case.per_rank, OUT_DIM, generator=gen)  # (R*b, 3)
    return x.to(device), y.to(device)


def run_case(case: Case, rank: int, world: int, device: torch.device, seed: int) -> list[str]:
    """Train wrapper and reference side by side; return what differs."""
    fails: list[str] = []
    torch.manual_seed(seed + 7919 * rank)  # a different init on every rank: tests the broadcast
    model = ToyNet(**case.model).to(device)
    torch.manual_seed(seed)  # the reference starts where rank 0 starts
    ref = ToyNet(**case.model).to(device)
    if case.model.get("buffers"):
        with torch.no_grad():
            model.scale.fill_(1.0 + 0.5 * rank)
            model.bn.running_mean.fill_(0.1 * rank)
            model.bn.running_var.fill_(1.0 + rank)
            model.bn.num_batches_tracked.fill_(rank)
            ref.scale.fill_(1.0)
            ref.bn.running_mean.fill_(0.0)
            ref.bn.running_var.fill_(1.0)
    bucket_mb = _two_bucket_cap_mb(model) if case.bucket_mb == "two" else case.bucket_mb
    # fc1.weight's gradient is the last one backward produces; a hook registered before the
    # wrapper's runs before the wrapper sees it and records how many buckets are already sent.
    holder: list = []
    sent_before_last: list[int] = []
    model.fc1.weight.register_post_accumulate_grad_hook(
        lambda _p: sent_before_last.append(len(holder[0]._launched)) if holder else None
    )
    ddp = make_wrapper(case.wrapper, model, bucket_mb, case.find_unused)
    holder.append(ddp)
    if ddp.module is not model or ddp.flags is not model.flags:
        fails.append("wrapper does not expose .module and the module's attributes")
    n_trainable = sum(1 for p in model.parameters() if p.requires_grad)
    expect = n_trainable if case.expect_buckets == "per-param" else case.expect_buckets
    if expect is not None and ddp.num_buckets != expect:
        fails.append(f"num_buckets {ddp.num_buckets}, expected {expect}")
    for (name, b), (_, rb) in zip(model.named_buffers(), ref.named_buffers()):
        if not torch.equal(b, rb):
            fails.append(f"buffer {name} not broadcast from rank 0")
    opt = make_optimizer(case.optimizer, ddp.parameters())
    ref_opt = make_optimizer(case.optimizer, ref.parameters())
    b = case.per_rank
    k = case.micro_batches
    m = b // k
    for step in range(case.steps):
        x, y = _batch(case, step, world, device, seed)
        opt.zero_grad(set_to_none=case.set_to_none)
        ref_opt.zero_grad(set_to_none=case.set_to_none)
        xs, ys = x[rank * b : (rank + 1) * b], y[rank * b : (rank + 1) * b]  # (b, 6), (b, 3)
        local_loss = torch.zeros((), device=device)
        for j in range(k):
            use_branch = (rank == 0) if case.rank_branch else (j == 0)
            xm, ym = xs[j * m : (j + 1) * m], ys[j * m : (j + 1) * m]  # (m, 6), (m, 3)
            loss = F.mse_loss(ddp(xm, use_branch=use_branch), ym) / k
            local_loss += loss.detach()
            if j < k - 1:
                with ddp.no_sync():
                    loss.backward()
            else:
                loss.backward()
        ddp.finish_gradient_synchronization()
        ref_loss = _reference_backward(ref, case, x, y, world)
        dist.all_reduce(local_loss, op=dist.ReduceOp.SUM)
        mean_loss = local_loss / world
        if not torch.allclose(mean_loss, ref_loss, rtol=RTOL, atol=ATOL):
            fails.append(f"step {step}: loss {mean_loss.item()} vs reference {ref_loss.item()}")
        fails += _compare_grads(model, ref, step)
        opt.step()
        ref_opt.step()
    fails += _check_overlap(case, ddp, sent_before_last)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assignment = ddp.bucket_assignment()
    if sorted(n for b in assignment for n in b) != sorted(trainable):
        fails.append(f"bucket_assignment {assignment} does not cover {trainable} once")
    elif assignment[-1][-1] != trainable[0] or any(
        [trainable.index(n) for n in b] != sorted((trainable.index(n) for n in b), reverse=True)
        for b in assignment
    ):  # launched by expected completion: reverse registration order, the first one last
        fails.append(f"bucket_assignment {assignment} is not in reverse registration order")
    if case.model.get("buffers"):
        with torch.no_grad():
            model.scale.fill_(float(rank + 3))
        ddp.sync_buffers()
        if not torch.all(model.scale == 3.0):
            fails.append("sync_buffers did not copy rank 0's buffer")
    for (name, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters()):
        if not torch.allclose(p, rp, rtol=RTOL, atol=ATOL):
            err = (p - rp).abs().max().item()
            fails.append(f"weight {name} differs from reference by {err:.2e}")
    fails += _compare_across_ranks(model, world)
    if case.wrapper in ("flat", "bucketed"):
        fails += _check_grad_views(ddp)
    ddp.close()
    return fails


def _reference_backward(ref: nn.Module, case: Case, x, y, world: int) -> torch.Tensor:
    """Whole-batch loss with the same micro-batch structure as the ranks; backward on it."""
    b, k = case.per_rank, case.micro_batches
    m = b // k
    total = torch.zeros((), device=x.device)
    for j in range(k):
        outs, targets = [], []
        for r in range(world):
            use_branch = (r == 0) if case.rank_branch else (j == 0)
            rows = slice(r * b + j * m, r * b + (j + 1) * m)
            outs.append(ref(x[rows], use_branch=use_branch))
            targets.append(y[rows])
        loss = F.mse_loss(torch.cat(outs), torch.cat(targets)) / k
        loss.backward()
        total += loss.detach()
    return total


def _compare_grads(model: nn.Module, ref: nn.Module, step: int) -> list[str]:
    fails = []
    for (name, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters()):
        if rp.grad is None or p.grad is None:
            if (rp.grad is None) != (p.grad is None):
                fails.append(
                    f"step {step}: grad of {name} is {'None' if p.grad is None else 'set'}, "
                    f"reference {'None' if rp.grad is None else 'set'}"
                )
            continue
        if not torch.allclose(p.grad, rp.grad, rtol=RTOL, atol=ATOL):
            err = (p.grad - rp.grad).abs().max().item()
            fails.append(f"step {step}: grad of {name} differs from reference by {err:.2e}")
    return fails


def _compare_across_ranks(model: nn.Module, world: int) -> list[str]:
    """Every rank must hold bit-identical weights (they apply identical averaged gradients)."""
    fails = []
    for name, p in model.named_parameters():
        flat = p.detach().reshape(-1).double()  # (numel,)
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        if not all(torch.equal(g, gathered[0]) for g in gathered):
            fails.append(f"weight {name} differs between ranks")
    return fails


def _check_overlap(case: Case, ddp, sent_before_last: list[int]) -> list[str]:
    """Overlapping wrappers with several buckets must send some before backward ends;
    NaiveDDP and FlatDDP must send nothing before finish_gradient_synchronization()."""
    if case.micro_batches > 1 or case.rank_branch or not sent_before_last:
        return []
    overlaps = case.wrapper in ("individual", "bucketed") and ddp.num_buckets > 1
    sent = sent_before_last[-1]
    if overlaps and sent < 1:
        return ["no bucket was sent before backward ended: no overlap"]
    if not overlaps and sent != 0:
        return [f"{sent} buckets sent during backward by a non-overlapping wrapper"]
    return []


def _check_grad_views(ddp) -> list[str]:
    """Gradients of multi-parameter buckets must live inside the bucket buffer."""
    fails = []
    for bucket in ddp._buckets:
        if bucket.buffer is None:
            continue
        lo = bucket.buffer.data_ptr()
        hi = lo + bucket.buffer.numel() * bucket.buffer.element_size()
        for name, p in zip(bucket.names, bucket.params):
            if p.grad is not None and not lo <= p.grad.data_ptr() < hi:
                fails.append(f"grad of {name} is not a view of its bucket buffer")
    return fails


def correctness_cases() -> dict[str, Case]:
    """Every named scenario of the correctness suite."""
    cases: dict[str, Case] = {}
    for w in WRAPPERS:
        cases[f"{w}-sgd"] = Case(w, {}, "sgd", set_to_none=True)
        cases[f"{w}-adamw"] = Case(w, {}, "adamw", set_to_none=False)
        cases[f"{w}-tied"] = Case(w, {"tied": True}, "adamw")
        cases[f"{w}-frozen"] = Case(w, {"frozen": True}, "sgd")
        cases[f"{w}-unused"] = Case(w, {"unused": True}, "adamw")
        cases[f"{w}-mixed-dtype"] = Case(
            w, {"double": True}, "sgd", expect_buckets=2 if w == "flat" else None
        )
        cases[f"{w}-buffers"] = Case(w, {"buffers": True}, "sgd")
        cases[f"{w}-no-sync"] = Case(w, {"branch": True}, "sgd", micro_batches=2, per_rank=4)
        cases[f"{w}-no-sync-adamw"] = Case(
            w, {"branch": True}, "adamw", micro_batches=4, per_rank=8, set_to_none=False
        )
        cases[f"{w}-rank-dependent-graph"] = Case(
            w, {"branch": True, "unused": True}, "adamw", rank_branch=True, find_unused=True
        )
        # The default (find_unused_parameters=False) is right too: no divergence, no abort.
        cases[f"{w}-rank-dependent-default"] = Case(
            w, {"branch": True, "unused": True}, "adamw", rank_branch=True
        )
        cases[f"{w}-rank-dependent-no-sync"] = Case(
            w, {"branch": True}, "sgd", rank_branch=True, micro_batches=2, per_rank=4
        )
        cases[f"{w}-find-unused-static"] = Case(w, {"unused": True}, "sgd", find_unused=True)
    cases["bucketed-one-bucket"] = Case("bucketed", {}, "sgd", bucket_mb=1.0, expect_buckets=1)
    cases["bucketed-two-buckets"] = Case("bucketed", {}, "sgd", bucket_mb="two", expect_buckets=2)
    cases["bucketed-per-tensor"] = Case(
        "bucketed", {"tied": True}, "adamw", bucket_mb=1e-9, expect_buckets="per-param"
    )
    cases["bucketed-two-buckets-unused-no-sync"] = Case(
        "bucketed",
        {"branch": True, "unused": True, "double": True},
        "adamw",
        bucket_mb="two",
        micro_batches=2,
    )
    cases["naive-per-param"] = Case("naive", {}, "sgd", expect_buckets="per-param")
    cases["individual-per-param"] = Case("individual", {}, "sgd", expect_buckets="per-param")
    cases["flat-one-bucket"] = Case("flat", {"tied": True}, "sgd", expect_buckets=1)
    return cases


def run_correctness(rank: int, world: int, backend: str, names: list[str]) -> dict[str, list[str]]:
    """Worker: run the named scenarios in order; {name: failures}."""
    device = worker_device(backend, rank)
    cases = correctness_cases()
    results: dict[str, list[str]] = {}
    for i, name in enumerate(names):
        results[name] = run_case(cases[name], rank, world, device, seed=i + 1)
    return results


def run_reduce_dtype(rank: int, world: int, backend: str) -> dict[str, list[str]]:
    """Worker: every wrapper with `reduce_dtype=torch.bfloat16` on a model with float32 and
    float64 gradients and a parameter no rank uses. Each averaged gradient must be what
    bf16 communication gives: the ranks' local gradients rounded to bf16, divided by the
    world size and summed in bf16 (bit for bit on gloo with 2 ranks, where that sum has one
    rounding; within bf16 rounding on NCCL), cast back to the parameter's dtype; and at least
    one must differ from the exact float average (the compression took place)."""
    device = worker_device(backend, rank)
    out: dict[str, list[str]] = {}
    for kind in WRAPPERS:
        fails: list[str] = []
        torch.manual_seed(11)
        model = ToyNet(double=True, unused=True).to(device)
        ddp = make_wrapper(kind, model, 25.0, False, reduce_dtype=torch.bfloat16)
        local = ToyNet(double=True, unused=True).to(device)  # this rank's plain backward
        local.load_state_dict(model.state_dict())
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        local_opt = torch.optim.SGD(local.parameters(), lr=0.05)
        compressed = False
        for step in range(2):
            x, y = _batch(Case(kind, {}), step, world, device, seed=5)
            xs, ys = x[rank * 4 : (rank + 1) * 4], y[rank * 4 : (rank + 1) * 4]  # (4, 6), (4, 3)
            opt.zero_grad()
            local_opt.zero_grad()
            F.mse_loss(ddp(xs), ys).backward()
            ddp.finish_gradient_synchronization()
            F.mse_loss(local(xs), ys).backward()
            for (name, p), lp in zip(model.named_parameters(), local.parameters()):
                if lp.grad is None:
                    if p.grad is not None:
                        fails.append(f"step {step}: {name} has a gradient no rank produced")
                    continue
                parts = [torch.empty_like(lp.grad) for _ in range(world)]
                dist.all_gather(parts, lp.grad.contiguous())
                want = torch.zeros_like(lp.grad, dtype=torch.bfloat16)
                for g in parts:
                    want = want + g.to(torch.bfloat16) / world
                want = want.to(p.dtype)
                exact = torch.stack(parts).mean(0)
                compressed |= not torch.equal(p.grad, exact)
                same = torch.equal(p.grad, want) if backend == "gloo" else torch.allclose(
                    p.grad, want, rtol=2 ** -7, atol=1e-6
                )  # fmt: skip
                if not same:
                    err = (p.grad - want).abs().max().item()
                    fails.append(f"step {step}: grad of {name} is {err:.2e} from bf16 averaging")
            opt.step()
            local.load_state_dict(model.state_dict())  # follow the averaged run
        if not compressed:
            fails.append("every gradient equals the exact average: nothing travelled in bf16")
        fails += _compare_across_ranks(model, world)
        ddp.close()
        out[kind] = fails
    return out


# ----- error cases -------------------------------------------------------------------------


def _expect(fn: Callable[[], object], exc: type[BaseException], needle: str) -> str:
    """'' if fn raises `exc` whose message contains `needle`, else what happened."""
    try:
        fn()
    except exc as e:
        if needle.lower() in str(e).lower():
            return ""
        return f"{type(e).__name__} without {needle!r}: {e}"
    except BaseException as e:  # report anything else as a failure
        return f"expected {exc.__name__}, got {type(e).__name__}: {e}\n{traceback.format_exc()}"
    return f"expected {exc.__name__} mentioning {needle!r}, nothing raised"


def run_errors(rank: int, world: int, backend: str) -> dict[str, str]:
    """Worker: misuse that must raise a clear error on every rank, never hang."""
    device = worker_device(backend, rank)
    out: dict[str, str] = {}
    for kind in WRAPPERS:
        torch.manual_seed(rank)
        other = ToyNet(hidden=16 if rank == 0 else 17).to(device)
        out[f"{kind}-shape-mismatch"] = _expect(
            lambda m=other, k=kind: make_wrapper(k, m, 25.0, False), ValueError, "differ across"
        )
    extra = ToyNet(unused=rank == 1).to(device)
    out["param-count-mismatch"] = _expect(
        lambda: make_wrapper("bucketed", extra, 25.0, False), ValueError, "differ across"
    )
    for kind in WRAPPERS:
        model = ToyNet().to(device)
        ddp = make_wrapper(kind, model, 25.0, False)
        x = torch.randn(4, IN_DIM, device=device)
        out[f"{kind}-finish-before-backward"] = _expect(
            ddp.finish_gradient_synchronization, RuntimeError, "before any backward"
        )
        ddp(x).sum().backward()
        ddp.finish_gradient_synchronization()
        out[f"{kind}-finish-twice"] = _expect(
            ddp.finish_gradient_synchronization, RuntimeError, "twice"
        )
        with ddp.no_sync():
            ddp(x).sum().backward()
        out[f"{kind}-finish-after-no-sync-only"] = _expect(
            ddp.finish_gradient_synchronization, RuntimeError, "no_sync"
        )
        ddp(x).sum().backward()  # the synchronized micro-batch; now a second backward:
        out[f"{kind}-second-backward"] = _expect(
            lambda d=ddp, x=x: d(x).sum().backward(), RuntimeError, "second gradient"
        )
        out[f"{kind}-no-sync-before-finish"] = _expect(
            lambda d=ddp: d.no_sync().__enter__(), RuntimeError, "finish_gradient_synchronization"
        )
        ddp.finish_gradient_synchronization()
        out[f"{kind}-wrapped-twice"] = _expect(
            lambda m=model, k=kind: make_wrapper(k, m, 25.0, False), RuntimeError, "already wrapped"
        )
        ddp.close()
    if backend == "nccl":
        cpu_model = ToyNet()
        out["nccl-cpu-module"] = _expect(lambda: ddp_kit.NaiveDDP(cpu_model), ValueError, "nccl")
    return out
