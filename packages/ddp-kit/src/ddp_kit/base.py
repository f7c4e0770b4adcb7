"""The data-parallel engine all four wrappers share; they differ only in their bucket plan and
in whether a bucket is sent during backward (overlap) or after it.

Life of a step (every rank runs the same one):
1. forward through the wrapper (plain call of the wrapped module);
2. backward: each trainable parameter's post-accumulate-grad hook marks it ready; an
   overlapping wrapper launches a bucket's asynchronous all-reduce once its last gradient is in
   and every bucket before it in the launch order has been launched;
3. `finish_gradient_synchronization()`: completes the buckets still open (parameters that got
   no gradient this backward count as zeros), launches them in launch order, waits for every
   collective, averages, and gives each parameter that some rank used the average;
4. `optimizer.step()`.
Under `no_sync()` the hooks only keep gradients in bucket storage; nothing is communicated and
the next synchronized backward reduces the accumulated sums.

Uneven inputs: the wrapper is a torch `Joinable`; inside `Join([model])` a rank that ran out of
data shadows the others' steps (see `ddp_kit._join`).

Why every rank makes the same calls whatever its backward reached: buckets are sent in one
fixed launch order (by expected completion: the bucket whose earliest-registered parameter is
registered latest goes first), every bucket is sent every step (absent gradients as zeros), and
the bucket sent last carries one usage flag per parameter. So ranks that take different
branches (data-dependent control flow) still reduce the same buckets in the same order, the
result is the whole-batch gradient, and no rank can pair one bucket with another rank's
different bucket (which gloo answers with a size-mismatch abort, or, for equal sizes, silently
mixes).
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from ddp_kit._checks import (
    ProcessGroup,
    broadcast_from,
    broadcast_from_rank0,
    check_same_structure,
    comm_device,
    is_nccl,
    module_tensors,
    resolve_group,
    validate_reduce_dtype,
)
from ddp_kit._comm import Comm, _DistError, check_timeout
from ddp_kit._join import JoinState, WrapperJoinHook, divide_flag
from ddp_kit.buckets import GradBucket, ParamInfo

# module -> its live wrapper, so that a second wrapper (whose hooks would also fire) is refused.
_OWNERS: weakref.WeakKeyDictionary[nn.Module, weakref.ref[DataParallelBase]] = (
    weakref.WeakKeyDictionary()
)


class DataParallelBase(nn.Module, Joinable):
    """Wraps `module` for data-parallel training; subclasses choose `_plan` and `_overlap`.

    Collective calls: the constructor, every synchronized backward, `finish_gradient_
    synchronization()` and `sync_buffers()` communicate, so every rank of the group must make
    them, in the same order. `no_sync()` backwards and `forward` do not communicate. For ranks
    with different numbers of batches, train inside `torch.distributed.algorithms.Join([model])`
    (the wrapper is a `Joinable`; see `join_hook`).

    Args:
        module: the model (any nn.Module), already on this rank's device.
        process_group: the group to average over; None means WORLD.
        find_unused_parameters: accepted for torch DDP compatibility; both values behave the
            same. Ranks whose backwards reach different parameters (data-dependent branches)
            are always handled: a parameter some rank used gets the whole-batch average on
            every rank (zeros from the ranks that did not use it), a parameter no rank used
            keeps `.grad = None`.
        timeout: a bound on each collective this wrapper issues: None (default) uses the
            process group's timeout (`init_process_group(timeout=...)`); a number of seconds
            or a `datetime.timedelta` makes a collective that some rank does not join raise
            `ddp_kit.CollectiveError` (naming it and this rank) after that long. On NCCL an
            explicit timeout makes every wait block the host until the collective is done.
        reduce_dtype: the dtype gradients travel in (torch DDP's `bf16_compress_hook` /
            `fp16_compress_hook`): None (default) sends each in its own dtype; e.g.
            torch.bfloat16 sends float32 gradients at half the bytes, each bucket cast into a
            buffer of that dtype kept beside it, divided by the world size before a summing
            collective (so float16 sums stay in range), and cast back into `.grad` after.
            Changes the numerics: the average is rounded to `reduce_dtype`.
    """

    _overlap: bool = True  # send buckets from the hooks (True) or after backward (False)

    def __init__(
        self,
        module: nn.Module,
        *,
        process_group: ProcessGroup | None = None,
        find_unused_parameters: bool = False,
        timeout: float | datetime.timedelta | None = None,
        reduce_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        Joinable.__init__(self)
        owner = type(self).__name__
        if not isinstance(module, nn.Module):
            raise TypeError(f"{owner}: module: expected a torch.nn.Module, got {type(module)}")
        if not isinstance(find_unused_parameters, bool):
            raise TypeError(
                f"{owner}: find_unused_parameters: expected a bool, got {find_unused_parameters!r}"
            )
        limit = check_timeout(timeout, owner)
        self.reduce_dtype = validate_reduce_dtype(reduce_dtype, owner)
        ref = _OWNERS.get(module)
        previous = ref() if ref is not None else None
        if previous is not None and not previous._closed:
            raise RuntimeError(
                f"{owner}: module is already wrapped by a live {type(previous).__name__}; "
                "call .close() on that wrapper first (its hooks would fire too)"
            )
        group = resolve_group(process_group, owner)
        self.module = module
        self.process_group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.find_unused_parameters = find_unused_parameters
        self.timeout = limit
        device = comm_device(module, group)
        self._device = device
        self._comm = Comm(group, limit, owner)
        self._nccl = is_nccl(group)
        check_same_structure(module, self._comm, device)
        broadcast_from_rank0(module_tensors(module), self._comm, "parameter or buffer")

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        infos = [ParamInfo.of(n, p) for n, p in named]
        self._buckets: list[GradBucket] = []
        self._slot: dict[int, tuple[GradBucket, int]] = {}  # id(param) -> (bucket, position)
        # Buckets in launch order: by expected completion, i.e. by the bucket's earliest-
        # registered parameter, whose gradient backward produces last (the same on every rank;
        # it reorders only plans that interleave dtypes).
        plan = sorted(self._plan(infos), key=lambda members: -min(members))
        for b_idx, members in enumerate(plan):
            bucket = GradBucket(
                b_idx,
                [self._params[i] for i in members],
                [self._names[i] for i in members],
                flag_slots=len(self._params) if b_idx == len(plan) - 1 else 0,
            )
            self._buckets.append(bucket)
            for pos, i in enumerate(members):
                self._slot[id(self._params[i])] = (bucket, pos)
        if len(self._slot) != len(self._params):
            raise AssertionError("bucket plan must place every trainable parameter once")

        self._sync_enabled = True
        self._sync_backward_seen = False  # a synchronized backward ran since the last finish
        self._nosync_backward_seen = False
        self._finish_calls = 0
        self._next_launch = 0  # index of the next bucket to launch
        self._launched: list[GradBucket] = []
        self._lock = threading.Lock()
        self._closed = False
        self._join_state = JoinState()
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self._params
        ]
        self._bucket_offset: dict[int, int] = {}
        total = 0
        for b in self._buckets:
            self._bucket_offset[b.index] = total
            total += len(b.params)
        _OWNERS[module] = weakref.ref(self)

    # ----- subclass interface -------------------------------------------------------------
    def _plan(self, infos: Sequence[ParamInfo]) -> list[list[int]]:
        """Buckets as lists of indices into the trainable parameters."""
        raise NotImplementedError

    # ----- public API ---------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Call the wrapped module (no communication)."""
        return self.module(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            modules = self.__dict__.get("_modules", {})
            if "module" in modules:
                return getattr(modules["module"], name)
            raise

    @property
    def num_buckets(self) -> int:
        """Number of collectives per synchronized step (before skipping absent lone params)."""
        return len(self._buckets)

    def bucket_assignment(self) -> list[list[str]]:
        """Parameter names of each bucket, in launch order (last layers first)."""
        return [list(b.names) for b in self._buckets]

    def bucket_sizes_bytes(self) -> list[int]:
        """Bytes of each bucket (gradients only), in launch order."""
        return [b.nbytes for b in self._buckets]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: backwards inside this block communicate nothing.

        The next backward outside the block (the last micro-batch) reduces the accumulated
        gradients. Enter it only right after `finish_gradient_synchronization()` (or before the
        first step), never between a synchronized backward and its finish.
        """
        if self._sync_backward_seen:
            raise RuntimeError(
                f"{type(self).__name__}.no_sync(): a synchronized backward is still waiting for "
                "finish_gradient_synchronization(); call it before accumulating the next step"
            )
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def finish_gradient_synchronization(self) -> None:
        """Wait until every gradient is averaged across ranks; call before `optimizer.step()`.

        Collective: every rank must call it once after each synchronized backward. Launches
        the buckets still open (parameters without a gradient this step count as zeros), waits
        for all all-reduces, and resets the per-step state. Raises RuntimeError if no
        synchronized backward ran since the last call (called twice, before any backward, or
        after a backward inside `no_sync()` only): that is a bug in the training loop, not a
        no-op. Raises `CollectiveError` when a collective fails or times out (see `timeout`).
        """
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} was closed")
        if not self._params:
            return  # nothing trainable: nothing to average
        if not self._sync_backward_seen:
            raise RuntimeError(self._finish_error())
        try:
            with self._lock:
                for bucket in self._buckets:
                    if not bucket.launched and bucket.pending > 0:
                        bucket.complete()
                self._launch_ready()
            divisor = self._divisor()
            for bucket in self._launched:
                bucket.handle.wait()
                if bucket.wire is not None:  # travelled in reduce_dtype: back into .grad
                    bucket.reduced.view(-1).copy_(bucket.wire)
                averaged = self._averages_in_collective(bucket) or bucket.predivided
                if not averaged and self.world_size > 1:
                    bucket.reduced.div_(divisor)
            self._assign_missing()
        finally:
            self._reset_step()
        self._finish_calls += 1

    def sync_buffers(self) -> None:
        """Collective: copy rank 0's buffers (e.g. BatchNorm running stats) to every rank.

        Not inside a `Join` block (RuntimeError): a rank that has run out of data could not
        match it. Join's exit copies the last-joining rank's buffers to every rank.
        """
        if self._join_active():
            raise RuntimeError(
                f"{type(self).__name__}.sync_buffers() inside a Join block: a rank that has run "
                "out of data cannot match it. Call it after the block (leaving Join copies the "
                "last rank's parameters and buffers to every rank)."
            )
        broadcast_from_rank0(self.module.buffers(), self._comm, "buffer")

    # ----- uneven inputs: torch's Joinable interface ---------------------------------------
    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook `torch.distributed.algorithms.Join` runs on a rank that has run out of
        data (called by Join's constructor, on every rank; local).

        While some rank still trains, the hook makes the same collectives as one synchronized
        step with zero gradients from this rank, and leaves the averaged gradient in this
        rank's `.grad`; when all ranks are done, every rank takes the parameters and buffers
        of the last rank to finish. Keyword (forwarded from `Join(..., **kwargs)`):
        `divide_by_initial_world_size` (bool, default True): divide the summed gradients by
        the initial world size, so every sample weighs the same (as torch DDP); False divides
        by the number of ranks still training (one more small all-reduce per step).
        Pass the wrapper first to Join (`Join([model, optimizer])`): the first joinable
        announces each step, and the wrapper's step starts with its gradient collectives.
        """
        owner = type(self).__name__
        divide = divide_flag(owner, kwargs)
        if self._sync_backward_seen:
            raise RuntimeError(
                f"{owner}: entering Join between a synchronized backward and its "
                "finish_gradient_synchronization(); enter it between steps"
            )
        self._join_state = JoinState(open=True, divide_by_initial_world_size=divide)
        return WrapperJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        """Device of Join's own control tensors (this rank's device)."""
        return self._device

    @property
    def join_process_group(self) -> ProcessGroup:
        """The group Join counts the ranks still training over: the wrapper's group."""
        return self.process_group

    def close(self) -> None:
        """Remove the hooks so the module can be used bare or wrapped again (local)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._closed = True

    # ----- hooks and launching ------------------------------------------------------------
    def _on_grad_ready(self, param: torch.Tensor) -> None:
        bucket, pos = self._slot[id(param)]
        with self._lock:
            if not self._sync_enabled:
                if self._sync_backward_seen:
                    raise RuntimeError(
                        "backward inside no_sync() after a synchronized backward: call "
                        "finish_gradient_synchronization() first"
                    )
                self._nosync_backward_seen = True
                bucket.adopt(pos)
                return
            if bucket.launched or bucket.ready[pos]:
                raise RuntimeError(
                    f"parameter {bucket.names[pos]!r} received a second gradient before "
                    "finish_gradient_synchronization(): call it after every synchronized "
                    "backward, and accumulate micro-batches inside no_sync()"
                )
            self._sync_backward_seen = True
            bucket.adopt(pos)
            bucket.ready[pos] = True
            bucket.pending -= 1
            if bucket.pending == 0 and self._overlap:
                self._launch_ready()

    def _launch_ready(self) -> None:
        """Launch every consecutive complete bucket from the next one in launch order (the
        same order on every rank, whichever parameters its backward reached)."""
        while self._next_launch < len(self._buckets):
            nxt = self._buckets[self._next_launch]
            if nxt.pending > 0:
                return
            self._launch(nxt)
            self._next_launch += 1

    def _launch(self, bucket: GradBucket) -> None:
        if not self._launched:
            self._begin_step_collectives()
        bucket.launched = True
        tensor = bucket.tensor_for_reduction()
        if bucket.flags is not None:  # sent last: every other bucket's `missing` is final
            self._write_usage_flags(bucket.flags)
        averages = self._averages_in_collective(bucket)
        op = dist.ReduceOp.AVG if averages else dist.ReduceOp.SUM
        bucket.reduced = tensor
        sent = tensor
        if self.reduce_dtype is not None and tensor.dtype != self.reduce_dtype:
            sent = bucket.wire_copy(tensor, self.reduce_dtype)
            if not averages and not self._counts_ranks() and self.world_size > 1:
                sent.div_(self.world_size)  # a sum of N low-precision terms stays in range
                bucket.predivided = True
        bucket.handle = self._comm.all_reduce(
            sent, op, ("all_reduce of gradient bucket %d of %d", (bucket.index, self.num_buckets))
        )
        self._launched.append(bucket)

    def _write_usage_flags(self, flags: torch.Tensor) -> None:
        """1 for each parameter (in bucket order) that has a gradient on this rank, else 0.
        Summed (or averaged) over ranks, a flag is 0 exactly when no rank used the parameter,
        in any float dtype."""
        flags.fill_(1)
        absent = [self._bucket_offset[b.index] + pos for b in self._buckets for pos in b.missing]
        if absent:
            flags[torch.tensor(absent, device=flags.device)] = 0

    def _assign_missing(self) -> None:
        """Give each parameter without a local gradient the reduced one if some rank used it
        (reads the reduced usage flags: only a rank that lacks a gradient waits for them)."""
        if not any(b.missing for b in self._buckets):
            return
        flags = self._buckets[-1].flags
        assert flags is not None
        used = (flags != 0).tolist()
        for bucket in self._buckets:
            if bucket.missing:
                base = self._bucket_offset[bucket.index]
                bucket.assign_missing(used[base : base + len(bucket.params)])

    def _averages_in_collective(self, bucket: GradBucket) -> bool:
        # NCCL averages in the collective itself; gloo sums and we divide once per bucket (so
        # does NCCL when the divisor is the number of ranks still training).
        return self._nccl and bucket.device.type == "cuda" and not self._counts_ranks()

    def _reset_step(self) -> None:
        """Forget the per-step state (after a finish, or a step that failed to start)."""
        for bucket in self._buckets:
            bucket.reset()
        self._launched = []
        self._next_launch = 0
        self._sync_backward_seen = False
        self._nosync_backward_seen = False
        self._join_state.clear_step()

    # ----- uneven inputs (see ddp_kit._join) ----------------------------------------------
    def _join_active(self) -> bool:
        return self._join_state.open and self._join_config.enable

    def _counts_ranks(self) -> bool:
        """The average divides by the ranks still training, counted every step."""
        return self._join_active() and not self._join_state.divide_by_initial_world_size

    def _begin_step_collectives(self) -> None:
        """Inside Join, before a step's first bucket: announce the step (ranks still
        training) and launch the count of ranks still training (when it is the divisor)."""
        state = self._join_state
        if not self._join_active():
            return
        try:
            if not state.joined:
                if not self._join_config.is_first_joinable:
                    raise RuntimeError(
                        f"{type(self).__name__}: pass the wrapper first to Join "
                        "(Join([model, optimizer])): the first joinable announces each step, "
                        "and the wrapper's gradient collectives come first in a step"
                    )
                # With throw_on_early_termination this raises RuntimeError on every rank still
                # training once some rank has run out of data.
                what = ("Join's all_reduce announcing this rank's step", ())
                try:
                    state.notify_work = Join.notify_join_context(self)
                except _DistError as exc:  # torch's call: name it as ours are named
                    raise self._comm.error(what, exc) from exc
            if not state.divide_by_initial_world_size:
                mine = 0.0 if state.joined else 1.0
                state.count = torch.full((1,), mine, dtype=torch.float32, device=self._device)
                state.count_handle = self._comm.all_reduce(
                    state.count,
                    dist.ReduceOp.SUM,
                    ("all_reduce of the number of ranks still training (Join)", ()),
                )
        except BaseException:
            self._reset_step()  # the step never started: the wrapper stays usable
            raise

    def _divisor(self) -> int | torch.Tensor:
        """What the summed gradients are divided by: the world size, or (0-dim, so that
        every bucket keeps its dtype) the number of ranks still training."""
        state = self._join_state
        if state.notify_work is not None:
            what = ("Join's all_reduce announcing this rank's step", ())
            self._comm.wait_work(state.notify_work, what)
            state.notify_work = None
        if state.count_handle is None or state.count is None:
            return self.world_size
        state.count_handle.wait()
        return state.count[0]

    def _shadow_step(self) -> None:
        """Join's main hook on a rank that has run out of data: one synchronized step with
        no local gradient (zeros and usage flags 0 in every bucket, in launch order)."""
        if not self._params:
            return
        if self._sync_backward_seen:
            raise RuntimeError(
                f"{type(self).__name__}: this rank left its Join block after a synchronized "
                "backward without finish_gradient_synchronization(); finish every step"
            )
        self._join_state.joined = True
        for p in self._params:
            p.grad = None  # contributes nothing; a no_sync() remainder is dropped (as torch)
        self._sync_backward_seen = True
        self.finish_gradient_synchronization()

    def _finish_join(self, is_last_joiner: bool) -> None:
        """Join's post hook, on every rank: take the last joiner's parameters and buffers
        (the highest rank among those that joined in the last round)."""
        self._join_state = JoinState()
        mine = self.rank if is_last_joiner else -1
        src = torch.tensor([mine], dtype=torch.int64, device=self._device)  # (1,)
        what = ("all_reduce choosing the last rank to join (Join)", ())
        self._comm.all_reduce(src, dist.ReduceOp.MAX, what).wait()
        broadcast_from(module_tensors(self.module), self._comm, "parameter or buffer", int(src))

    def _finish_error(self) -> str:
        name = f"{type(self).__name__}.finish_gradient_synchronization()"
        if self._nosync_backward_seen:
            return (
                f"{name}: the backward passes since the last call all ran inside no_sync(), "
                "so no gradient was communicated; run the last micro-batch's backward outside "
                "no_sync() before finishing"
            )
        if self._finish_calls:
            return (
                f"{name} called twice without a backward pass in between; call it exactly "
                "once per step, after loss.backward()"
            )
        return f"{name} called before any backward pass; call it after loss.backward()"
