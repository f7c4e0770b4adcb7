"""The data-parallel engine all four wrappers share; they differ only in their bucket plan and
in whether a bucket is sent during backward (overlap) or after it.

Life of a step (every rank runs the same one):
1. forward through the wrapper (plain call of the wrapped module);
2. backward: each trainable parameter's post-accumulate-grad hook marks it ready; an
   overlapping wrapper launches a bucket's asynchronous all-reduce once its last gradient is in;
3. `finish_gradient_synchronization()`: completes the buckets still open (parameters that got
   no gradient this backward), launches them, waits for every collective, and averages;
4. `optimizer.step()`.
Under `no_sync()` the hooks only keep gradients in bucket storage; nothing is communicated and
the next synchronized backward reduces the accumulated sums.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddp_kit._checks import (
    ProcessGroup,
    broadcast_from_rank0,
    check_same_structure,
    comm_device,
    is_nccl,
    resolve_group,
)
from ddp_kit.buckets import GradBucket, ParamInfo

# module -> its live wrapper, so that a second wrapper (whose hooks would also fire) is refused.
_OWNERS: weakref.WeakKeyDictionary[nn.Module, weakref.ref[DataParallelBase]] = (
    weakref.WeakKeyDictionary()
)


class DataParallelBase(nn.Module):
    """Wraps `module` for data-parallel training; subclasses choose `_plan` and `_overlap`.

    Collective calls: the constructor, every synchronized backward, `finish_gradient_
    synchronization()` and `sync_buffers()` communicate, so every rank of the group must make
    them, in the same order. `no_sync()` backwards and `forward` do not communicate.

    Args:
        module: the model (any nn.Module), already on this rank's device.
        process_group: the group to average over; None means WORLD.
        find_unused_parameters: False (default) assumes that every rank's backward reaches the
            same parameters in a step (a static graph, as torch DDP assumes by default). A
            parameter with no gradient on this rank is then taken to have none anywhere: its
            `.grad` stays None and, where it travels alone, it is not communicated. True allows
            the ranks to differ: buckets are launched in one fixed order on every rank, absent
            gradients count as zeros, and one extra small all-reduce per step tells which
            parameters some rank used; those get the average on every rank, parameters no rank
            used keep `.grad = None`.
    """

    _overlap: bool = True  # send buckets from the hooks (True) or after backward (False)

    def __init__(
        self,
        module: nn.Module,
        *,
        process_group: ProcessGroup | None = None,
        find_unused_parameters: bool = False,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        if not isinstance(module, nn.Module):
            raise TypeError(f"{owner}: module: expected a torch.nn.Module, got {type(module)}")
        if not isinstance(find_unused_parameters, bool):
            raise TypeError(
                f"{owner}: find_unused_parameters: expected a bool, got {find_unused_parameters!r}"
            )
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
        device = comm_device(module, group)
        self._device = device
        check_same_structure(module, group, device, owner)
        broadcast_from_rank0(module, group)

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        infos = [ParamInfo.of(n, p) for n, p in named]
        self._buckets: list[GradBucket] = []
        self._slot: dict[int, tuple[GradBucket, int]] = {}  # id(param) -> (bucket, position)
        for b_idx, members in enumerate(self._plan(infos)):
            bucket = GradBucket(
                b_idx, [self._params[i] for i in members], [self._names[i] for i in members]
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
        self._next_launch = 0  # in-order launching (find_unused_parameters=True)
        self._launched: list[GradBucket] = []
        self._lock = threading.Lock()
        self._closed = False
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
        """Parameter names of each bucket, in launch-plan order (last layers first)."""
        return [list(b.names) for b in self._buckets]

    def bucket_sizes_bytes(self) -> list[int]:
        """Bytes of each bucket, in plan order."""
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
        the buckets still open (parameters without a gradient this step), waits for all
        all-reduces, and resets the per-step state. Raises RuntimeError if no synchronized
        backward ran since the last call (called twice, before any backward, or after a
        backward inside `no_sync()` only): that is a bug in the training loop, not a no-op.
        """
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} was closed")
        if not self._params:
            return  # nothing trainable: nothing to average
        if not self._sync_backward_seen:
            raise RuntimeError(self._finish_error())
        with self._lock:
            for bucket in self._buckets:
                if not bucket.launched and bucket.pending > 0:
                    bucket.complete()
                if not bucket.launched:
                    self._bucket_ready(bucket)
        used = self._usage_mask() if self.find_unused_parameters else None
        for bucket in self._launched:
            if bucket.handle is not None:
                bucket.handle.wait()
                if not self._averages_in_collective(bucket) and self.world_size > 1:
                    bucket.reduced.div_(self.world_size)
        if used is not None:
            counts = used.tolist()  # reads the mask reduction: waits for it
            for bucket in self._buckets:
                if bucket.missing:
                    base = self._bucket_offset[bucket.index]
                    bucket.assign_missing([counts[base + k] > 0 for k in range(len(bucket.params))])
        for bucket in self._buckets:
            bucket.reset()
        self._launched = []
        self._next_launch = 0
        self._sync_backward_seen = False
        self._nosync_backward_seen = False
        self._finish_calls += 1

    def sync_buffers(self) -> None:
        """Collective: copy rank 0's buffers (e.g. BatchNorm running stats) to every rank."""
        with torch.no_grad():
            src = dist.get_global_rank(self.process_group, 0)
            for buf in self.module.buffers():
                tmp = buf if buf.is_contiguous() else buf.contiguous()
                dist.broadcast(tmp, src=src, group=self.process_group)
                if tmp is not buf:
                    buf.copy_(tmp)

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
                self._bucket_ready(bucket)

    def _bucket_ready(self, bucket: GradBucket) -> None:
        """Launch `bucket`, or (fixed-order mode) every consecutive ready bucket from the next."""
        if not self.find_unused_parameters:
            self._launch(bucket)
            return
        while self._next_launch < len(self._buckets):
            nxt = self._buckets[self._next_launch]
            if nxt.pending > 0:
                return
            self._launch(nxt)
            self._next_launch += 1

    def _launch(self, bucket: GradBucket) -> None:
        bucket.launched = True
        tensor = bucket.tensor_for_reduction(include_missing=self.find_unused_parameters)
        if tensor is None:
            return  # a lone parameter with no gradient: every rank skips it (static graph)
        op = dist.ReduceOp.AVG if self._averages_in_collective(bucket) else dist.ReduceOp.SUM
        bucket.reduced = tensor
        bucket.handle = dist.all_reduce(tensor, op=op, group=self.process_group, async_op=True)
        self._launched.append(bucket)

    def _averages_in_collective(self, bucket: GradBucket) -> bool:
        # NCCL averages in the collective itself; gloo sums and we divide once per bucket.
        return bucket.device.type == "cuda" and is_nccl(self.process_group)

    def _usage_mask(self) -> torch.Tensor:
        """All-reduced count of ranks with a local gradient, per parameter in bucket order."""
        flags = []
        for b in self._buckets:
            missing = set(b.missing)
            flags.extend(0 if k in missing else 1 for k in range(len(b.params)))
        mask = torch.tensor(flags, dtype=torch.int32, device=self._device)  # (n_params,)
        dist.all_reduce(mask, op=dist.ReduceOp.SUM, group=self.process_group)
        return mask

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
