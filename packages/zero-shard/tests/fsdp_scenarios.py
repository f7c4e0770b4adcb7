"""FSDP scenarios run inside each rank (see zs_harness): FSDP training beside a single-process
reference that every rank computes by itself on all ranks' batches.

The reference takes one step on the mean of the ranks' losses, which is what FSDP's averaged
gradients amount to: (1/N) sum_r grad(loss_r).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from zero_shard import FSDP

VOCAB = 29  # odd sizes everywhere: every sharded tensor needs padding on some rank count
STEPS = 6
CLIP = 4.8  # gradient-norm clip of the fp32 comparison


# ------------------------------------------------------------------ model
class Block(nn.Module):
    """Pre-norm MLP block: (B, T, d) -> (B, T, d)."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class ToyLM(nn.Module):
    """Embedding tied to the head, three blocks in a ModuleList, a final norm.

    tokens (B, T) -> logits (B, T, VOCAB). Units under FSDP: emb, layers.0-2, head.
    `remat` > 0: run each `remat` consecutive blocks under one non-reentrant activation
    checkpoint.
    """

    def __init__(self, d: int = 16, hidden: int = 23, layers: int = 3, remat: int = 0):
        super().__init__()
        self.remat = remat
        self.reverse = False  # run the blocks last to first (not in registration order)
        self.emb = nn.Embedding(VOCAB, d)
        self.layers = nn.ModuleList(Block(d, hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied: one Parameter used by two modules

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)  # (B, T, d)
        blocks = nn.ModuleList(reversed(self.layers)) if self.reverse else self.layers
        step = self.remat or len(blocks)
        for i in range(0, len(blocks), step):
            segment = blocks[i : i + step]
            if self.remat:
                x = checkpoint(_run, segment, x, use_reentrant=False)
            else:
                x = _run(segment, x)
        return self.head(self.norm(x))  # (B, T, VOCAB)


def _run(blocks: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for block in blocks:
        x = block(x)
    return x


def make_model(device: torch.device, seed: int = 0, **kwargs: Any) -> nn.Module:
    torch.manual_seed(seed)
    return ToyLM(**kwargs).to(device)


def batch(step: int, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and targets (4, 8), different on every rank and step."""
    g = torch.Generator().manual_seed(10_007 * step + 101 * rank + 7)
    tokens = torch.randint(0, VOCAB, (4, 8), generator=g)
    targets = torch.randint(0, VOCAB, (4, 8), generator=g)
    return tokens.to(device), targets.to(device)


def loss_of(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    tokens, targets = data
    logits = model(tokens).float()  # (B, T, V), upcast from the compute dtype
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def make_opt(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":  # scale-sensitive: a gradient summed instead of averaged shows
        return torch.optim.SGD(params, lr=0.2, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


# ------------------------------------------------------------------ training loops
def fsdp_step(
    fsdp: FSDP, opt: torch.optim.Optimizer, step: int, rank: int, device, clip: float = 0.0
) -> float:
    """One step; with `clip` > 0 the global gradient norm is clipped to it first."""
    loss = loss_of(fsdp, batch(step, rank, device))
    loss.backward()
    fsdp.finish_gradient_synchronization()
    if clip:
        fsdp.last_norm = fsdp.clip_grad_norm_(clip).item()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def reference_step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    step: int,
    world: int,
    device: torch.device,
    dtype: torch.dtype | None = None,
    clip: float = 0.0,
) -> list[float]:
    """One step on the mean of every rank's loss. `dtype`: run forward and backward on a copy
    cast to it (fp32 master weights, as mixed precision does); `clip`: clip the gradient norm
    to it (torch.nn.utils.clip_grad_norm_). Returns each rank's loss."""
    work = model if dtype is None else copy.deepcopy(model).to(dtype)
    losses = [loss_of(work, batch(step, r, device)) for r in range(world)]
    (sum(losses) / world).backward()
    if work is not model:
        for p, q in zip(model.parameters(), work.parameters()):
            p.grad = q.grad.float()
    if clip:
        model.last_norm = nn.utils.clip_grad_norm_(model.parameters(), clip).item()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return [loss.item() for loss in losses]


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """max over tensors of ||a - b|| / ||b|` (same keys)."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    worst = 0.0
    for k in b:
        x, y = a[k].double().cpu(), b[k].double().cpu()
        assert x.shape == y.shape, (k, x.shape, y.shape)
        worst = max(worst, ((x - y).norm() / y.norm().clamp_min(1e-12)).item())
    return worst


def all_ranks_equal(t: torch.Tensor) -> bool:
    everyone = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, t)
    return all(torch.equal(everyone[0], x) for x in everyone)


# ------------------------------------------------------------------ scenarios
def scenario_matches_fp32(rank: int, world: int, device: torch.device, opt_name: str) -> None:
    """compute_dtype None: FSDP equals single-process training to fp32 round-off, with the
    global gradient norm clipped (the clip is active in some steps).

    Tolerance: both runs do the same fp32 math except the order of a few sums (FSDP adds the
    ranks' gradients in the reduce-scatter and the two uses of the tied weight in the shard's
    .grad; the reference lets autograd accumulate them), i.e. ~1e-7 relative per step; we
    allow 1e-5 relative after STEPS steps. A gradient that is summed instead of averaged, a
    missing tied use or a misplaced row is off by 1e-2 or more.
    """
    reference = make_model(device)
    fsdp = FSDP(make_model(device, seed=0 if rank == 0 else 5))  # rank 0's are broadcast
    opt, ref_opt = make_opt(opt_name, fsdp.parameters()), make_opt(opt_name, reference.parameters())
    assert len(list(fsdp.parameters())) == len(list(reference.parameters())), "one shard per tie"
    start = fsdp.gather_full_params()
    assert max_rel_diff(start, reference.state_dict()) == 0.0, "rank 0 weights broadcast"
    clipped, norms = 0, []
    for step in range(STEPS):
        loss = fsdp_step(fsdp, opt, step, rank, device, clip=CLIP)
        ref_losses = reference_step(reference, ref_opt, step, world, device, clip=CLIP)
        assert abs(loss - ref_losses[rank]) <= 1e-5 * abs(ref_losses[rank]), (step, loss)
        assert abs(fsdp.last_norm - reference.last_norm) <= 1e-5 * reference.last_norm
        clipped += reference.last_norm > CLIP
        norms.append(round(reference.last_norm, 3))
    assert 0 < clipped < STEPS, f"clip active in some steps only: norms {norms}"
    full = fsdp.gather_full_params()
    err = max_rel_diff(full, reference.state_dict())
    assert err < 1e-5, f"{opt_name}: FSDP vs reference, max relative error {err:.2e}"
    assert full["emb.weight"] is full["head.weight"], "tied weight gathered once"
    assert all_ranks_equal(torch.cat([t.reshape(-1) for t in full.values()]))


def scenario_matches_bf16(rank: int, world: int, device: torch.device, opt_name: str) -> None:
    """compute_dtype bf16 against the fp32 reference, with a tolerance taken from a
    same-precision single-process run: bf16 math of a copy of fp32 master weights.

    FSDP's error must be at most 2x that baseline's (it adds one rounding: the bf16 sum of
    the ranks' gradients) and the baseline's error must be well above fp32 round-off, so the
    bound is a real one; an unaveraged gradient (SGD) or an un-synchronized shard is several
    times the baseline error.
    """
    reference = make_model(device)
    baseline = make_model(device)
    fsdp = FSDP(make_model(device), compute_dtype=torch.bfloat16)
    opt = make_opt(opt_name, fsdp.parameters())
    ref_opt, base_opt = (
        make_opt(opt_name, reference.parameters()),
        make_opt(opt_name, baseline.parameters()),
    )
    for step in range(STEPS):
        loss = fsdp_step(fsdp, opt, step, rank, device)
        ref_losses = reference_step(reference, ref_opt, step, world, device)
        reference_step(baseline, base_opt, step, world, device, dtype=torch.bfloat16)
        assert abs(loss - ref_losses[rank]) < 0.05 * abs(ref_losses[rank]), (step, loss)
    for p in fsdp.parameters():
        assert p.dtype == torch.float32, "master weights stay fp32"
    full = fsdp.gather_full_params()
    err = max_rel_diff(full, reference.state_dict())
    base_err = max_rel_diff(baseline.state_dict(), reference.state_dict())
    assert base_err > 1e-4, f"baseline bf16 error {base_err:.2e}: is bf16 really used?"
    assert err <= 2 * base_err, f"{opt_name}: FSDP bf16 error {err:.2e} vs bf16 {base_err:.2e}"
    assert all_ranks_equal(torch.cat([t.reshape(-1) for t in full.values()]))


def scenario_reduce_dtype_fp32(rank: int, world: int, device: torch.device) -> None:
    """bf16 compute with an fp32 reduce-scatter: gradient rows travel in fp32."""
    fsdp = FSDP(make_model(device), compute_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert fsdp._reduce_dtype == torch.float32
    reference = make_model(device)
    opt, ref_opt = make_opt("sgd", fsdp.parameters()), make_opt("sgd", reference.parameters())
    for step in range(2):
        fsdp_step(fsdp, opt, step, rank, device)
        reference_step(reference, ref_opt, step, world, device)
    err = max_rel_diff(fsdp.gather_full_params(), reference.state_dict())
    assert err < 0.05, f"bf16 compute, fp32 reduce: relative error {err:.2e}"


def scenario_fallback_collectives(rank: int, world: int, device: torch.device) -> None:
    """The list all-gather and all-reduce-then-slice paths (for backends without the tensor
    forms, e.g. older gloo) train exactly like the tensor forms."""
    runs = []
    for fallback in (False, True):
        fsdp = FSDP(make_model(device), compute_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if fallback:
            fsdp._comm.tensor_gather = fsdp._comm.tensor_scatter = False
        opt = make_opt("sgd", fsdp.parameters())
        for step in range(2):
            fsdp_step(fsdp, opt, step, rank, device)
        runs.append(fsdp.gather_full_params())
    assert runs[0].keys() == runs[1].keys()
    for k in runs[0]:  # fp32 sums of two ranks are order-independent: bitwise equal
        assert torch.equal(runs[0][k], runs[1][k]), k


def scenario_gather_schedule(rank: int, world: int, device: torch.device) -> None:
    """Weights are gathered just in time, one unit prefetched, at most two units in memory,
    and freed (storage size 0) after each unit's forward and backward."""
    fsdp = FSDP(make_model(device))
    units = fsdp.unit_names
    assert units == ["emb", "layers.0", "layers.1", "layers.2", "head"], units
    n = len(units)
    seen: list[list[str]] = []  # gathered units while each unit runs, in call order

    def inside(module: nn.Module, args: Any) -> None:
        seen.append(fsdp.gathered_units())

    def after(name: str, module: nn.Module, args: Any, out: Any) -> None:
        if name != "head":  # the last unit stays gathered for backward
            assert name not in fsdp.gathered_units(), f"{name} not freed after forward"

    roots = dict(fsdp.module.named_modules())
    for name in units:
        roots[name].register_forward_pre_hook(inside)
        roots[name].register_forward_hook(lambda m, a, o, name=name: after(name, m, a, o))

    for step in range(2):  # step 0 guesses the order, step 1 follows the recorded one
        fsdp.reset_stats()
        seen.clear()
        loss = loss_of(fsdp, batch(step, rank, device))
        assert fsdp.gathered_units() == ["head"]
        assert [s[0] for s in seen] == units, seen  # each unit gathered when it runs
        assert all(len(s) <= 2 for s in seen)
        assert seen[0] == ["emb", "layers.0"], "the next unit is prefetched"
        loss.backward()
        assert fsdp.gathered_units() == []
        for u in fsdp._units:
            assert all(b.untyped_storage().size() == 0 for b in u.padded), u.name
        fsdp.finish_gradient_synchronization()
        stats = fsdp.stats
        assert stats["peak_gathered_units"] == 2, stats
        # forward gathers every unit once and keeps the last; backward re-gathers the others
        assert stats["all_gathers"] == 2 * n - 1, stats
        assert stats["prefetches"] == 2 * n - 2, stats
        assert stats["reduce_scatters"] == n, stats

    with torch.no_grad():
        fsdp(batch(0, rank, device)[0])
    assert fsdp.gathered_units() == [], "nothing kept without autograd"
    for p in fsdp.parameters():  # shards: ceil(numel / N); replicated: full
        assert p.dim() == 1
    shards = {n: p for n, p in fsdp.named_parameters() if "emb" in n or "up" in n}
    assert shards["module.emb.weight"].numel() == -(-VOCAB * 16 // world)
    assert shards["module.layers.0.up.bias"].numel() == -(-23 // world)
    assert fsdp.full_shape(shards["module.layers.0.up.weight"]) == torch.Size([23, 16])


def scenario_gather_waits(rank: int, world: int, device: torch.device) -> None:
    """record_gather_waits: one record per all-gather waited for, with its unit, phase and
    whether it was prefetched; a peer that joins late shows as a long wait on the ranks that
    were on time (and only there); nothing is recorded unless asked."""
    import time

    fsdp = FSDP(make_model(device))
    units = fsdp.unit_names
    n = len(units)
    loss_of(fsdp, batch(0, rank, device)).backward()
    fsdp.finish_gradient_synchronization()
    assert fsdp.gather_waits() == [], "off by default"
    fsdp.record_gather_waits()
    for step in range(2):
        fsdp.reset_stats()
        if rank == 1 and step == 1:
            time.sleep(0.6)  # rank 0 reaches the first all-gather 0.6 s before rank 1
        loss = loss_of(fsdp, batch(step, rank, device))
        loss.backward()
        fsdp.finish_gradient_synchronization()
        timing_sync(device)
        waits = fsdp.gather_waits()
        assert fsdp.gather_waits() == [], "read once"
        # every all-gather is waited for once: forward all units, backward all but the last
        assert len(waits) == fsdp.stats["all_gathers"] == 2 * n - 1, waits
        fwd = [w for w in waits if w.phase == "forward"]
        bwd = [w for w in waits if w.phase == "backward"]
        assert [w.unit for w in fwd] == units
        assert [w.unit for w in bwd] == units[-2::-1]
        assert [w.prefetched for w in fwd] == [False] + [True] * (n - 1)
        assert all(w.prefetched for w in bwd)
        assert all(w.ms >= 0 for w in waits)
        first = fwd[0].ms
        if step == 1 and rank == 0:
            assert first >= 300, f"rank 0 waited {first:.1f} ms for the late rank"
        else:
            assert first < 300, f"rank {rank}, step {step}: {first:.1f} ms with nobody late"
    fsdp.record_gather_waits(False)
    loss_of(fsdp, batch(2, rank, device)).backward()
    fsdp.finish_gradient_synchronization()
    assert fsdp.gather_waits() == []


def timing_sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def scenario_order_changes(rank: int, world: int, device: torch.device) -> None:
    """Blocks run in another order than registered: the first step's prefetch guesses are
    wrong (evicted, cap kept), the next step follows the recorded order; FSDP still equals
    the reference."""
    reference = make_model(device)
    fsdp = FSDP(make_model(device))
    for model in (reference, fsdp.module):
        model.reverse = True
    opt, ref_opt = make_opt("sgd", fsdp.parameters()), make_opt("sgd", reference.parameters())
    n = len(fsdp.unit_names)
    for step in range(3):
        fsdp.reset_stats()
        fsdp_step(fsdp, opt, step, rank, device)
        reference_step(reference, ref_opt, step, world, device)
        assert fsdp.stats["peak_gathered_units"] <= 2, (step, fsdp.stats)
        if step > 0:  # recorded order: every prefetch is used, nothing gathered twice
            assert fsdp.stats["all_gathers"] == 2 * n - 1, (step, fsdp.stats)
    assert [u.name for u in fsdp._fwd_order] == ["emb", "layers.2", "layers.1", "layers.0", "head"]
    err = max_rel_diff(fsdp.gather_full_params(), reference.state_dict())
    assert err < 1e-5, f"blocks in reverse order: relative error {err:.2e}"


def scenario_checkpointed_blocks(rank: int, world: int, device: torch.device, dtype: str) -> None:
    """Blocks under non-reentrant activation checkpointing, one or two per segment: the
    recompute in backward finds its weights gathered (also for a block whose own backward
    has not started, and when the recompute stops early) and its norms cast, gradients equal
    the plain run's bitwise, at most two units are gathered and all are freed at the end."""
    compute_dtype = getattr(torch, dtype) if dtype != "none" else None
    plain = FSDP(make_model(device), compute_dtype)
    loss_of(plain, batch(0, rank, device)).backward()
    plain.finish_gradient_synchronization()
    for per_segment in (1, 2):
        remat = FSDP(make_model(device, remat=per_segment), compute_dtype)
        for _ in range(2):
            remat.zero_grad(set_to_none=True)
            loss_of(remat, batch(0, rank, device)).backward()
            remat.finish_gradient_synchronization()
            assert remat.gathered_units() == []
        assert remat.stats["peak_gathered_units"] <= 2, (per_segment, remat.stats)
        for (name, p), q in zip(plain.named_parameters(), remat.parameters()):
            assert p.grad is not None, name
            assert torch.equal(p.grad, q.grad), (per_segment, name)
        for (name, p), q in zip(plain.module.named_parameters(), remat.module.parameters()):
            assert type(q) is nn.Parameter, f"{name}: the slot holds the parameter again"
            assert p.dtype == q.dtype == torch.float32, name


def scenario_load_and_accumulate(rank: int, world: int, device: torch.device) -> None:
    """load_full_params round-trips; two backwards before one finish sum their gradients."""
    fsdp = FSDP(make_model(device))
    other = make_model(device, seed=3)
    fsdp.load_full_params(other.state_dict())
    assert max_rel_diff(fsdp.gather_full_params(), other.state_dict()) == 0.0
    # accumulation: grad(loss_a) + grad(loss_b) == grad(loss_a + loss_b)
    loss_of(fsdp, batch(0, rank, device)).backward()
    loss_of(fsdp, batch(1, rank, device)).backward()
    fsdp.finish_gradient_synchronization()
    accumulated = [p.grad.clone() for p in fsdp.parameters()]
    fsdp.zero_grad(set_to_none=True)
    (loss_of(fsdp, batch(0, rank, device)) + loss_of(fsdp, batch(1, rank, device))).backward()
    fsdp.finish_gradient_synchronization()
    for a, p in zip(accumulated, fsdp.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=1e-5, atol=1e-7)


def scenario_lm_core(rank: int, world: int, device: torch.device) -> None:
    """lm_core's TransformerLM (tiny) under FSDP equals single-process training (fp32)."""
    lm_core = pytest.importorskip("lm_core")
    config = lm_core.ModelConfig(
        vocab_size=VOCAB, context_length=16, d_model=16, num_layers=2, num_heads=2, d_ff=24
    )
    torch.manual_seed(0)
    reference = lm_core.TransformerLM(config).to(device)
    fsdp = FSDP(copy.deepcopy(reference))
    assert fsdp.unit_names == ["token_embeddings", "layers.0", "layers.1", "lm_head"]
    opt = lm_core.AdamW(fsdp.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = lm_core.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(3):
        fsdp_step(fsdp, opt, step, rank, device)
        reference_step(reference, ref_opt, step, world, device)
    err = max_rel_diff(fsdp.gather_full_params(), reference.state_dict())
    assert err < 1e-5, f"lm_core TransformerLM: relative error {err:.2e}"


def _expect(exc: type[BaseException], text: str, fn: Callable[[], Any]) -> None:
    with pytest.raises(exc, match=re.escape(text)):
        fn()


def scenario_errors(rank: int, world: int, device: torch.device) -> None:
    """Misuse that needs a process group fails clearly, on every rank, without hanging."""
    fsdp = FSDP(make_model(device))
    _expect(RuntimeError, "before any backward", fsdp.finish_gradient_synchronization)
    loss_of(fsdp, batch(0, rank, device)).backward()
    _expect(
        RuntimeError, "finish_gradient_synchronization() first", lambda: fsdp.clip_grad_norm_(1)
    )
    fsdp.finish_gradient_synchronization()
    _expect(RuntimeError, "called twice", fsdp.finish_gradient_synchronization)
    _expect(ValueError, "max_norm: expected a positive", lambda: fsdp.clip_grad_norm_(0.0))
    full = fsdp.gather_full_params()
    _expect(ValueError, "missing ['emb.weight'", lambda: fsdp.load_full_params({}))
    full["layers.0.up.weight"] = full["layers.0.up.weight"].t()
    _expect(
        ValueError, "'layers.0.up.weight' has shape (16, 23)", lambda: fsdp.load_full_params(full)
    )
    _expect(ValueError, "already (partly) wrapped", lambda: FSDP(fsdp.module))
    different = make_model(device, hidden=23 if rank == 0 else 25)
    _expect(ValueError, "differ across ranks", lambda: FSDP(different))
    plan = (nn.Linear,) if rank == 0 else (nn.Embedding,)
    _expect(ValueError, "sharding plan differs", lambda: FSDP(make_model(device), None, plan))
    if device.type == "cuda":
        _expect(ValueError, "NCCL", lambda: FSDP(make_model(torch.device("cpu"))))
    # after the refusals the wrapper still trains and the ranks agree
    loss_of(fsdp, batch(1, rank, device)).backward()
    fsdp.finish_gradient_synchronization()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in fsdp.parameters())
