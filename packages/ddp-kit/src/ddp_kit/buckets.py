"""Which gradients travel together (the plan), and the buffers they travel in (the buckets).

`plan_buckets` is pure: it maps parameter sizes to groups of parameter indices, so it can be
tested and printed without any process group. `GradBucket` holds one group's communication
state. A bucket of several parameters owns one flat, preallocated buffer and makes each
parameter's `.grad` a view into it, so gradients are reduced in place with no copy back; a
bucket of one parameter reduces that parameter's `.grad` directly. The bucket sent last also
carries the usage flags (one element per trainable parameter) after its gradients.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

MIB = 1024 * 1024  # bucket sizes are in MiB, as in torch DDP's bucket_cap_mb


@dataclass(frozen=True)
class ParamInfo:
    """What planning needs to know about one trainable parameter."""

    name: str
    numel: int
    element_size: int
    dtype: torch.dtype
    device: torch.device

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size

    @classmethod
    def of(cls, name: str, param: torch.Tensor) -> ParamInfo:
        return cls(name, param.numel(), param.element_size(), param.dtype, param.device)


def plan_buckets(infos: Sequence[ParamInfo], cap_bytes: float | None) -> list[list[int]]:
    """Group parameter indices into buckets, in the order their gradients are expected.

    Parameters are taken in reverse registration order (backward produces the last layers'
    gradients first). Each (device, dtype) pair fills its own open bucket; a bucket closes when
    the next parameter would push it past `cap_bytes`, so a bucket holds at most `cap_bytes`
    unless a single parameter is larger (it then travels alone). `cap_bytes=None` means one
    bucket per (device, dtype); `cap_bytes=0` means one bucket per parameter.
    Returns a list of buckets, each a list of indices into `infos`, ordered by creation.
    """
    if cap_bytes is not None and (math.isnan(cap_bytes) or cap_bytes < 0):
        raise ValueError(f"cap_bytes: expected None or a number >= 0, got {cap_bytes!r}")
    buckets: list[list[int]] = []
    open_bucket: dict[tuple[torch.device, torch.dtype], tuple[int, int]] = {}  # -> (idx, bytes)
    for i in reversed(range(len(infos))):
        info = infos[i]
        key = (info.device, info.dtype)
        current = open_bucket.get(key)
        if current is not None and (cap_bytes is None or current[1] + info.nbytes <= cap_bytes):
            buckets[current[0]].append(i)
            open_bucket[key] = (current[0], current[1] + info.nbytes)
            continue
        buckets.append([i])
        open_bucket[key] = (len(buckets) - 1, info.nbytes)
    return buckets


def per_parameter_plan(n: int) -> list[list[int]]:
    """One bucket per parameter, last parameter first."""
    return [[i] for i in reversed(range(n))]


class GradBucket:
    """Gradients of `params` (same device and dtype) reduced by one collective per step.

    Per-step state: which parameters have delivered their gradient in the current synchronized
    backward (`ready`), whether the collective was launched, its handle, and which parameters
    had no local gradient when the bucket was completed (`missing`).
    """

    def __init__(
        self,
        index: int,
        params: Sequence[nn.Parameter],
        names: Sequence[str],
        flag_slots: int = 0,
    ) -> None:
        if not params:
            raise ValueError("params: a bucket needs at least one parameter")
        self.index = index
        self.params = list(params)
        self.names = list(names)
        self.dtype = params[0].dtype
        self.device = params[0].device
        self.numel = sum(p.numel() for p in params)
        self.buffer: torch.Tensor | None = None
        self.views: list[torch.Tensor] = []
        self.flags: torch.Tensor | None = None  # (flag_slots,) usage flags after the gradients
        if len(params) > 1 or flag_slots > 0:
            # (numel + flag_slots,) flat storage; each view has its parameter's shape.
            total = self.numel + flag_slots
            self.buffer = torch.zeros(total, dtype=self.dtype, device=self.device)
            offset = 0
            for p in params:
                self.views.append(self.buffer[offset : offset + p.numel()].view(p.shape))
                offset += p.numel()
            if flag_slots:
                self.flags = self.buffer[self.numel :]
        self.ready = [False] * len(params)
        self.pending = len(params)
        self.launched = False
        self.handle: Any = None  # the launched collective (ddp_kit._comm.Pending)
        self.reduced: torch.Tensor | None = None  # the gradients the collective averages
        # with a reduce_dtype: the (numel,) copy that travels, kept from step to step, and
        # whether it was divided by the world size before a summing collective
        self.wire: torch.Tensor | None = None
        self._wire_buffer: torch.Tensor | None = None
        self.predivided = False
        self.missing: list[int] = []
        self._zeros: torch.Tensor | None = None  # stand-in for a single missing gradient

    @property
    def nbytes(self) -> int:
        return self.numel * self.params[0].element_size()

    def adopt(self, pos: int) -> None:
        """Make parameter `pos`'s gradient live in this bucket's storage.

        Several parameters: the gradient becomes a view of the flat buffer (copied in once if
        autograd created a fresh tensor, e.g. after `zero_grad(set_to_none=True)`; later
        accumulations then happen in place). One parameter: its gradient is made contiguous,
        as collectives require.
        """
        p = self.params[pos]
        grad = p.grad
        if grad is None:
            return
        if grad.is_sparse:
            raise RuntimeError(
                f"parameter {self.names[pos]!r} has a sparse gradient; ddp_kit reduces dense "
                "gradients only (use nn.Embedding(sparse=False))"
            )
        if self.buffer is None:
            if not grad.is_contiguous():
                p.grad = grad.contiguous()
            return
        view = self.views[pos]
        if grad.data_ptr() != view.data_ptr():
            view.copy_(grad)
            p.grad = view

    def complete(self) -> None:
        """Close the bucket at the end of backward: gradients not delivered in this backward
        (accumulated under no_sync, or absent) join as they are; absent ones count as zero."""
        self.missing = []
        for pos, done in enumerate(self.ready):
            if done:
                continue
            if self.params[pos].grad is None:
                self.missing.append(pos)
                if self.buffer is not None:
                    self.views[pos].zero_()
            else:
                self.adopt(pos)
            self.ready[pos] = True
        self.pending = 0

    def tensor_for_reduction(self) -> torch.Tensor:
        """The contiguous tensor to all-reduce; zeros for a lone parameter without gradient
        (every rank sends every bucket, whatever its backward reached)."""
        if self.buffer is not None:
            return self.buffer
        grad = self.params[0].grad
        if grad is not None:
            return grad
        if self._zeros is None:
            self._zeros = torch.zeros(self.params[0].shape, dtype=self.dtype, device=self.device)
        else:
            self._zeros.zero_()
        return self._zeros

    def wire_copy(self, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`tensor` (this step's `tensor_for_reduction()`) cast into this bucket's flat buffer
        of `dtype`, allocated at the first use; it becomes `wire` for this step."""
        if self._wire_buffer is None:  # a bucket's size and the wrapper's dtype are fixed
            self._wire_buffer = torch.empty(tensor.numel(), dtype=dtype, device=self.device)
        self.wire = self._wire_buffer.copy_(tensor.reshape(-1))
        return self.wire

    def assign_missing(self, used_anywhere: Sequence[bool]) -> None:
        """After the reduction: give parameters that had no local gradient the reduced value
        where some rank had one (`used_anywhere[pos]`); the rest keep `.grad = None`."""
        for pos in self.missing:
            if not used_anywhere[pos]:
                continue
            p = self.params[pos]
            if self.buffer is not None:
                p.grad = self.views[pos]
            else:
                assert self._zeros is not None
                p.grad = self._zeros
                self._zeros = None

    def reset(self) -> None:
        """Forget the finished step."""
        self.ready = [False] * len(self.params)
        self.pending = len(self.params)
        self.launched = False
        self.handle = None
        self.reduced = None
        self.wire = None
        self.predivided = False
        self.missing = []
