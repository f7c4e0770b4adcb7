"""`FSDP`: fully sharded data parallelism (ZeRO stage 3) for any `nn.Module`.

Every Linear and Embedding weight (or the parameters of the module classes named in
`shard_module_types`) lives only as this rank's flat fp32 1/N shard (see `shard.py`); the
other parameters (norms) are replicated; `plan.py` decides which and builds the units at
construction. Life of a step, the same on every rank:

1. forward: before a unit (a Transformer block, the embedding, the head; see `units.py`) runs,
   its weights are all-gathered in `compute_dtype` unless a prefetch already did it, and the
   next unit's all-gather is launched asynchronously; after the unit, its weights are freed
   (the last unit stays gathered: backward needs it first).
2. backward: a hook on the unit's outputs re-gathers its weights into the storage autograd
   saved and prefetches the unit that ran before it; when the unit's weight gradients are all
   in, the custom autograd Function that handed out the weights launches one reduce-scatter of
   them (the previous one is completed then: at most one stays in flight) and frees the
   weights. At most two units are gathered at any time.
3. `finish_gradient_synchronization()`: completes the last reduce-scatter (the shards' `.grad`
   now hold the gradient averaged over ranks, in fp32) and all-reduces the replicated
   parameters' gradients.
4. `optimizer.step()` over `fsdp.parameters()`: the shards and the replicated parameters.

Options: a module built on the meta device is materialized shard by shard at construction
(`materialize.py`); `no_sync()` / `set_requires_gradient_sync(False)` accumulate gradients
locally instead of step 2's reduce-scatter (`accumulate.py`); `reshard_after_forward=False`
keeps every unit gathered from its forward to its backward (no re-gather in step 2).

Overlap check: `record_gather_waits()` times how long each unit's forward or backward waits
for its all-gather (CUDA events on the compute stream around the wait, or the host clock on
CPU); `gather_waits()` returns the records. A prefetch that finished in time costs ~0 ms.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zero_shard._comm import Comm, check_timeout
from zero_shard.accumulate import GradAccumulator
from zero_shard.grads import allreduce_replicated, clip_grad_norm
from zero_shard.materialize import InitFn, check_init_args, materialize, on_meta, target_device
from zero_shard.plan import (
    broadcast_from_rank0,
    check_dtype,
    check_same_on_all_ranks,
    check_types,
    check_units,
    comm_device,
    dedup,
    make_unit,
    param_slots,
    plan_units,
    resolve_group,
    sharded_params,
)
from zero_shard.shard import Collectives, ShardedParam
from zero_shard.state_dicts import StateDicts
from zero_shard.tree import cast_float, map_tensors, tensors_in
from zero_shard.units import Unit, cast_slots
from zero_shard.waits import GatherWait, WaitRecorder

__all__ = ["FSDP", "GatherWait"]

MAX_GATHERED = 2  # units holding gathered weights at once (the current one and a prefetch)

_WRAPPED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


class _Gather(torch.autograd.Function):
    """Forward: a unit's gathered weights (already in place) as autograd outputs, aliases of
    its buffers. Backward: hands their gradients to `FSDP._post_backward` and returns no
    gradient to the shards (their `.grad` is set when the reduce-scatter lands)."""

    @staticmethod
    def forward(ctx: Any, owner: FSDP, unit: Unit, *shards: torch.Tensor) -> tuple:
        ctx.owner, ctx.unit = owner, unit
        ctx.set_materialize_grads(False)
        outs = tuple(t.detach() for t in unit.full)
        frozen = [o for o, s in zip(outs, shards) if not s.requires_grad]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return outs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple:
        ctx.owner._post_backward(ctx.unit, grads)
        return (None, None, *(None for _ in grads))


class FSDP(StateDicts, nn.Module):
    """Wrap `module` so that its Linear/Embedding weights are sharded across the ranks.

    Args:
        module: the model (any `nn.Module`), the same on every rank, either on this rank's
            device (CUDA for NCCL; rank 0's parameters and buffers are broadcast first) or
            wholly on the meta device (materialized here, see below).
        compute_dtype: dtype of the gathered weights, of the forward and backward math and of
            the all-gathers (e.g. `torch.bfloat16`); replicated parameters and floating inputs
            are cast to it too. None: the parameters' own dtype.
        shard_module_types: module classes whose directly held parameters are sharded;
            default `(nn.Linear, nn.Embedding)` (subclasses included).
        process_group: the ranks to shard over; None means WORLD.
        reduce_dtype: dtype of the gradient reduce-scatter; None: `compute_dtype` (half the
            traffic in bf16), or the master dtype (fp32) when `compute_dtype` is None.
        units: modules whose sharded parameters are gathered together (one all-gather each);
            default: the children of the outermost `nn.ModuleList`/`nn.Sequential`, then
            each remaining module holding a sharded parameter.
        timeout: a bound on each collective this wrapper issues: None (default) uses the
            process group's timeout; a number of seconds or a `datetime.timedelta` makes a
            collective that some rank does not join raise `zero_shard.CollectiveError` (naming
            it and this rank) after that long. On NCCL an explicit timeout makes every wait
            block the host until the collective is done (see `zero_shard._comm`).
        reshard_after_forward: True (default): free each unit's gathered weights after its
            forward and all-gather them again for its backward. False: keep them from the
            forward to the unit's backward (one all-gather per unit per step instead of two;
            the whole model gathered at the end of forward).
        device: for a module on the meta device, where to materialize it (default: this
            rank's current GPU for an NCCL group, else the CPU). A built module stays where
            it is (`device`, if given, must name that).
        init_fn: for a module on the meta device, `init_fn(m)` initializes the subtree of
            each init root `m` in place, instead of the roots' `reset_parameters()` (see
            `zero_shard.materialize`: which modules are roots, and the random numbers).

    A module built on the meta device (`with torch.device("meta"): model = ...`) is
    materialized here one unit at a time: each rank keeps only its shards, initialized as
    the full module would be (bitwise for a seed when its construction is the roots' inits
    in order; see `zero_shard.materialize`). Rank 0's random generator state is used.

    `fsdp.parameters()` are the local fp32 shards, `(ceil(numel / N),)` each, plus the
    replicated parameters: build any torch optimizer over them. The constructor,
    `finish_gradient_synchronization()` and `gather_full_params()` are collectives, and so is
    every forward and backward: every rank must make the same calls in the same order.
    """

    def __init__(
        self,
        module: nn.Module,
        compute_dtype: torch.dtype | None = None,
        shard_module_types: Iterable[type[nn.Module]] | type[nn.Module] | None = None,
        process_group: dist.ProcessGroup | None = None,
        *,
        reduce_dtype: torch.dtype | None = None,
        units: Iterable[nn.Module] | None = None,
        timeout: float | datetime.timedelta | None = None,
        reshard_after_forward: bool = True,
        device: torch.device | str | None = None,
        init_fn: InitFn | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"FSDP: module: expected a torch.nn.Module, got {type(module)}")
        self._compute_dtype = check_dtype(compute_dtype, "compute_dtype")
        limit = check_timeout(timeout, "FSDP")
        reduce = check_dtype(reduce_dtype, "reduce_dtype")
        types = check_types(shard_module_types)
        if not isinstance(reshard_after_forward, bool):
            what = repr(reshard_after_forward)
            raise TypeError(f"FSDP: reshard_after_forward: expected True or False, got {what}")
        if any(m in _WRAPPED for m in module.modules()):
            raise ValueError("FSDP: module: already (partly) wrapped by an FSDP; wrap it once")
        meta = on_meta(module)
        check_init_args(init_fn, meta)
        slots = param_slots(module)
        sharded = sharded_params(module, slots, types, self._compute_dtype)
        roots = check_units(units, module) if units is not None else None
        group = resolve_group(process_group)
        if meta:
            device = target_device(device, group, None)
        else:
            target_device(device, group, next(module.parameters()).device)
            device = comm_device(module, group)
        assert device is not None

        self.process_group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.module = module
        plan, outside = plan_units(module, slots, sharded, roots)
        self.timeout = limit
        comm = Comm(group, limit, "FSDP")
        check_same_on_all_ranks(module, slots, sharded, plan, comm, device)
        keys: dict[int, str] = {}  # sharded parameter id -> its first state-dict key
        for key, _, _, p in slots:
            if id(p) in sharded:
                keys.setdefault(id(p), key)
        replicated = [(m, attr, p) for _, m, attr, p in slots if id(p) not in sharded]
        if meta:
            made = materialize(module, plan, keys, sharded, device, comm, init_fn)
            rest = {id(p): p for _, _, p in replicated} | {id(b): b for b in module.buffers()}
            broadcast_from_rank0(list(rest.values()), comm)
        else:
            broadcast_from_rank0([*module.parameters(), *module.buffers()], comm)
            made = {}
            for key, _, _, p in slots:
                if id(p) in sharded and id(p) not in made:
                    made[id(p)] = ShardedParam(key, p, self.rank, self.world_size)

        self._comm = Collectives(comm, device)
        self._by_key = {key: made[id(p)] for key, _, _, p in slots if id(p) in sharded}
        first = next(iter(made.values()))
        cast = self._compute_dtype  # replicated parameters are cast to it while in use
        gather_dtype = self._compute_dtype or first.dtype
        self._reduce_dtype = reduce or self._compute_dtype or first.shard.dtype
        self._units = [
            make_unit(name, root, members, made, self._comm, gather_dtype, device, cast)
            for name, root, members in plan
        ]
        for u in self._units:
            u.swap_out()  # from now on the modules hold shards outside forward
        self._outside = outside  # replicated slots outside every unit: cast in forward()
        self._replicated = list({id(p): p for _, _, p in dedup(replicated)}.values())
        self._hooks = []
        for u in self._units:
            self._hooks.append(u.root.register_forward_pre_hook(functools.partial(self._pre, u)))
            self._hooks.append(u.root.register_forward_hook(functools.partial(self._post, u)))
        _WRAPPED.update([module, *(u.root for u in self._units)])

        self._fwd_order: list[Unit] = list(self._units)  # guess until a forward has run
        self._order: list[Unit] = []  # units called in this forward, in order
        self._stack: list[tuple[Unit, int]] = []  # (unit, position) of calls in progress
        self._in_backward = False
        self._reshard = reshard_after_forward
        self._accum = GradAccumulator(first.shard.dtype)  # sync flag, no_sync buffers
        self._finish_calls = 0
        self._reductions: list[tuple] = []
        self._waits = WaitRecorder()
        self.stats = _zero_stats()

    # ----- public API ---------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Call the wrapped module; floating inputs are cast to `compute_dtype` when given.

        Outputs come out in `compute_dtype` (e.g. bf16 logits): upcast before the loss if
        you want it in fp32.
        """
        for u in self._units:  # a unit kept for a backward that never came
            if u.active == 0 and u.holds_memory:
                u.free()
        self._order = []
        if self._compute_dtype is not None:
            cast = functools.partial(cast_float, dtype=self._compute_dtype)
            args, kwargs = map_tensors((args, kwargs), cast)
        self._cast_replicated()
        try:
            out = self.module(*args, **kwargs)
        except BaseException:
            self._reset()
            raise
        finally:
            self._restore_replicated()
        if self._order:
            self._fwd_order = self._order
        return out

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            modules = self.__dict__.get("_modules", {})
            if "module" in modules:
                return getattr(modules["module"], name)
            raise

    def finish_gradient_synchronization(self) -> None:
        """Wait until every gradient is averaged over the ranks; call before `optimizer.step()`.

        Collective: every rank must call it once after the backward pass(es) of a step.
        Afterwards each shard's `.grad` (fp32, `(chunk,)`) is the average over ranks of the
        gradients summed over the backward passes since the last call (those under
        `no_sync()` included), and so is each replicated parameter's `.grad` (None where no
        rank had one). Raises RuntimeError when no backward with gradient sync on ran since
        the last call (called twice, before any backward, or after `no_sync()` ones only).
        """
        name = "FSDP.finish_gradient_synchronization()"
        if self._in_backward:
            raise RuntimeError(f"{name}: called during backward; call it after loss.backward()")
        if not self._accum.sync_seen:
            if self._accum.nosync_seen:
                raise RuntimeError(
                    f"{name}: only backward passes with gradient sync off (inside no_sync(), "
                    "or after set_requires_gradient_sync(False)) ran since the last call; run "
                    "the last micro-batch's backward with sync on, then call it"
                )
            if self._finish_calls:
                raise RuntimeError(
                    f"{name} called twice without a backward pass in between; call it exactly "
                    "once per step, after loss.backward()"
                )
            raise RuntimeError(f"{name} called before any backward pass; call it after backward")
        for unit, rows in self._accum.take_all(self._units):  # ran with sync off only
            self._reduce(unit, rows.to(self._reduce_dtype))
        while self._reductions:
            self._complete_reduction()
        allreduce_replicated(self._replicated, self._comm.comm)
        self._accum.finished()
        self._finish_calls += 1

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: backward passes inside this block communicate
        nothing (every unit's full gradient is added to a local fp32 buffer).

        The next backward outside the block (the last micro-batch) adds its gradients to the
        buffers and reduce-scatters each unit once. Enter it only right after
        `finish_gradient_synchronization()` (or before the first step). Forward passes still
        all-gather the weights. Memory: every unit's full gradient in fp32 on each rank.
        """
        previous = self._accum.sync
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self._accum.sync = previous

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """False: backward passes accumulate gradients locally, as inside `no_sync()`, until
        this is set True again (torch FSDP2's name); the first backward with True reduces
        what was accumulated. Local (no communication); set the same on every rank."""
        if not isinstance(requires_gradient_sync, bool):
            raise TypeError(
                "FSDP.set_requires_gradient_sync(): requires_gradient_sync: expected True or "
                f"False, got {requires_gradient_sync!r}"
            )
        if not requires_gradient_sync and self._accum.sync_seen:
            raise RuntimeError(
                "FSDP: gradient sync turned off (no_sync() / set_requires_gradient_sync(False)) "
                "while a synchronized backward is still waiting for "
                "finish_gradient_synchronization(); call it before accumulating the next step"
            )
        self._accum.sync = requires_gradient_sync

    def zero_grad(self, set_to_none: bool = True) -> None:
        """`nn.Module.zero_grad`, and drop the gradients accumulated under `no_sync()` (an
        optimizer's `zero_grad()` leaves those for the next synchronization)."""
        super().zero_grad(set_to_none)
        self._accum.clear()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale all gradients so that their global 2-norm (that of the full, unsharded
        gradients) is at most `max_norm`; returns the norm before clipping (a 0-dim fp32
        tensor). Collective: call it on every rank after `finish_gradient_synchronization()`.
        """
        if not (isinstance(max_norm, int | float) and 0 < max_norm < float("inf")):
            raise ValueError(f"max_norm: expected a positive finite number, got {max_norm!r}")
        if self._accum.sync_seen or self._accum.nosync_seen:
            raise RuntimeError(
                "FSDP.clip_grad_norm_(): gradients are not synchronized yet; call "
                "finish_gradient_synchronization() first"
            )
        shards = [sp.shard for sp in {id(sp): sp for sp in self._by_key.values()}.values()]
        return clip_grad_norm(shards, self._replicated, max_norm, self._comm.comm)

    @property
    def reshard_after_forward(self) -> bool:
        """Whether each unit frees its gathered weights after its forward (the constructor's
        argument; False keeps them until the unit's backward)."""
        return self._reshard

    @property
    def unit_names(self) -> list[str]:
        """Names (module paths) of the gathering units, in registration order."""
        return [u.name for u in self._units]

    def gathered_units(self) -> list[str]:
        """Units whose full weights are in memory now (or on their way)."""
        return [u.name for u in self._units if u.holds_memory]

    def record_gather_waits(self, enabled: bool = True) -> None:
        """Start (or, with False, stop) timing every wait for a unit's all-gather.

        Each time a unit's forward or backward needs weights that are not gathered yet, the
        wait is bracketed: on CUDA by two timing events on the current (compute) stream, so
        nothing synchronizes during the step; on CPU by the host clock. Read the records with
        `gather_waits()`. Costs two events per all-gather while enabled; off by default.
        Starting or stopping drops the records not yet read.
        """
        self._waits.enable(enabled)

    def gather_waits(self) -> list[GatherWait]:
        """The waits recorded since the last call (oldest first), and forget them.

        On CUDA this blocks until the recorded events have happened: call it after the step
        (e.g. after `torch.cuda.synchronize()`). Empty when not recording.
        """
        return self._waits.read()

    def reset_stats(self) -> None:
        """Zero `stats`: all_gathers, prefetches, reduce_scatters, peak_gathered_units."""
        self.stats = _zero_stats()

    def full_shape(self, param: torch.Tensor) -> torch.Size:
        """The original shape of a parameter of `parameters()` (a shard or a replicated one),
        e.g. to put matrices and vectors in different weight-decay groups."""
        for sp in self._by_key.values():
            if sp.shard is param:
                return torch.Size(sp.shape)
        if any(p is param for p in self._replicated):
            return param.shape
        raise ValueError("param: not a parameter of this FSDP module")

    # ----- forward ------------------------------------------------------------------------
    def _pre(self, unit: Unit, module: nn.Module, args: Any) -> None:
        if self._in_backward:
            # Activation-checkpoint recompute. Non-reentrant checkpointing may stop the
            # recompute early, skipping `_post`: change no count here; `_post_backward` and
            # `_end_backward` put the shards back.
            self._ensure(unit)
        else:
            pos = len(self._order)
            self._order.append(unit)
            self._stack.append((unit, pos))
            self._ensure(unit)
            order = self._fwd_order
            if pos + 1 < len(order) and order[pos] is unit:
                self._prefetch(order[pos + 1])
            unit.active += 1
        unit.swap_in(_Gather.apply(self, unit, *(p.shard for p in unit.params)))

    def _post(self, unit: Unit, module: nn.Module, args: Any, output: Any) -> None:
        unit.swap_out()
        if self._in_backward:  # recompute: its own backward re-gathers if we free it here
            if unit.active == 0 and not unit.kept:
                unit.free()
            return
        _, pos = self._stack.pop()
        unit.active -= 1
        training = torch.is_grad_enabled()
        if training:
            self._hook_outputs(output, unit, self._order[pos - 1] if pos > 0 else None)
        order = self._fwd_order
        last = pos == len(order) - 1 and order[pos] is unit  # backward needs it first
        if training and not self._reshard:
            unit.kept = unit.holds_memory  # outside the cap on gathered units until backward
        elif unit.active == 0 and not (training and last):
            unit.free()

    def _hook_outputs(self, output: Any, unit: Unit, prev: Unit | None) -> None:
        """Re-gather `unit` (and prefetch `prev`) when the first output gradient arrives."""
        tensors = [t for t in tensors_in(output) if t.requires_grad]
        fired = [False]

        def hook(grad: torch.Tensor) -> None:
            if not fired[0]:
                fired[0] = True
                self._pre_backward(unit, prev)

        for t in tensors:
            t.register_hook(hook)

    def _cast_replicated(self) -> None:
        if self._compute_dtype is None:
            return
        cast_slots(self._outside, self._compute_dtype)

    def _restore_replicated(self) -> None:
        for m, attr, p in self._outside:
            m._parameters[attr] = p

    def _reset(self) -> None:
        """After an exception in forward: shards back in place, nothing gathered."""
        for u in self._units:
            u.swap_out()
            u.active = 0
            u.free()
        self._stack.clear()

    # ----- backward -----------------------------------------------------------------------
    def _pre_backward(self, unit: Unit, prev: Unit | None) -> None:
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        self._accum.saw_backward()
        self._ensure(unit)
        unit.active += 1
        if prev is not None:
            self._prefetch(prev)

    def _post_backward(self, unit: Unit, grads: tuple[torch.Tensor | None, ...]) -> None:
        self._accum.saw_backward()
        if any(p.shard.requires_grad for p in unit.params):
            if not self._accum.sync:
                self._accum.add(unit, grads)  # no_sync(): kept locally, unsharded
            else:
                held = self._accum.take(unit)  # what no_sync() backward passes left
                if held is None:
                    rows = unit.grad_rows(grads, self._reduce_dtype)  # (N S,)
                else:
                    rows = held.add_(unit.grad_rows(grads, held.dtype)).to(self._reduce_dtype)
                self._reduce(unit, rows)
        unit.swap_out()
        unit.active = max(0, unit.active - 1)
        if unit.active == 0:
            unit.free()

    def _reduce(self, unit: Unit, rows: torch.Tensor) -> None:
        """Launch the reduce-scatter of `unit`'s gradient rows (N S,) in the reduce dtype."""
        out = torch.empty(unit.row, dtype=self._reduce_dtype, device=rows.device)  # (S,)
        pending = self._comm.reduce_scatter(out, rows, f"unit {unit.name!r}'s gradients")
        self._reductions.append((unit, pending, out, rows))
        self.stats["reduce_scatters"] += 1
        while len(self._reductions) > 1:  # keep one in flight
            self._complete_reduction()

    def _complete_reduction(self) -> None:
        """Wait for the oldest reduce-scatter; add its averaged rows to the shards' grads."""
        unit, pending, out, _ = self._reductions.pop(0)
        pending.wait()
        for p, off in zip(unit.params, unit.offsets):
            if p.shard.requires_grad:
                g = out[off : off + p.chunk].to(p.shard.dtype) / self.world_size  # (chunk,)
                if p.shard.grad is None:
                    p.shard.grad = g
                else:
                    p.shard.grad.add_(g)

    def _end_backward(self) -> None:
        """Runs when the autograd engine finishes: free whatever is still gathered."""
        self._in_backward = False
        for u in self._units:
            u.swap_out()
            u.active = 0
            if u.holds_memory:
                u.free()

    # ----- gathering ----------------------------------------------------------------------
    def _ensure(self, unit: Unit) -> None:
        """Make `unit`'s weights available now (waiting for its prefetch, if any)."""
        if unit.gathered:
            return
        prefetched = unit.holds_memory
        if not prefetched:
            for other in self._units:  # evict stale prefetches to stay within the cap
                if self._n_transient() < MAX_GATHERED:
                    break
                idle = other.active == 0 and not other.kept
                if other is not unit and idle and other.holds_memory:
                    other.free()
            self._start(unit)
        if not self._waits.enabled:
            unit.finish_gather()
        else:
            phase = "backward" if self._in_backward else "forward"
            device = unit.padded[0].device
            timed = functools.partial(self._waits.timed, unit.name, phase, prefetched, device)
            unit.finish_gather(timed)

    def _prefetch(self, unit: Unit) -> None:
        if unit.holds_memory or self._n_transient() >= MAX_GATHERED:
            return
        self._start(unit)
        self.stats["prefetches"] += 1

    def _start(self, unit: Unit) -> None:
        unit.start_gather()
        self.stats["all_gathers"] += 1
        gathered = sum(u.holds_memory for u in self._units)
        self.stats["peak_gathered_units"] = max(self.stats["peak_gathered_units"], gathered)

    def _n_transient(self) -> int:
        """Gathered units that count against MAX_GATHERED (all but those kept for backward)."""
        return sum(u.holds_memory and not u.kept for u in self._units)

    def _check_idle(self, what: str) -> None:
        if self._in_backward or self._stack:
            raise RuntimeError(f"FSDP.{what}: not allowed during forward or backward")


# ----- small helpers --------------------------------------------------------------------------
def _zero_stats() -> dict[str, int]:
    return {"all_gathers": 0, "prefetches": 0, "reduce_scatters": 0, "peak_gathered_units": 0}
