"""Per-parameter flat shards, and the two flat collectives FSDP runs on them.

Layout. A parameter of `numel` elements is flattened, zero-padded to `N * chunk` elements
(`chunk = ceil(numel / N)`, N ranks) and viewed as N rows of `chunk`; rank r keeps row r as its
master shard, an `nn.Parameter` of shape `(chunk,)` in fp32 (fp64 stays fp64). A unit (a group
of modules gathered together) sends the rows of all its parameters back to back, a `(S,)`
buffer with `S = sum(chunk)`, and one all-gather returns `(N, S)`: the columns
`[offset, offset + chunk)` of that are one parameter's padded flat value, row by row. Gradients
travel the same layout backwards through one reduce-scatter.

`Collectives` runs `all_gather_into_tensor` / `reduce_scatter_tensor` (`*_single` in newer
torch) and falls back to the list
all-gather / an all-reduce plus a slice where the backend lacks the tensor forms (older gloo).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def master_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a shard is kept in: fp32 for fp16/bf16/fp32 parameters, fp64 for fp64."""
    return torch.promote_types(dtype, torch.float32)


class ShardedParam:
    """One original parameter, kept as this rank's flat 1/N shard.

    Attributes: `name` (its first qualified name), `shape`, `numel`, `dtype` (the original
    one), `chunk` (elements per rank), `shard` (`nn.Parameter` of shape `(chunk,)`, dtype
    `master_dtype(dtype)`: what the optimizer updates).
    """

    def __init__(self, name: str, param: torch.Tensor, rank: int, world: int) -> None:
        self.name = name
        self.shape = tuple(param.shape)
        self.numel = param.numel()
        self.dtype = param.dtype
        self.chunk = max(1, math.ceil(self.numel / world))
        row = self.rows(param.detach(), world)[rank]  # (chunk,)
        self.shard = nn.Parameter(
            row.to(master_dtype(param.dtype), copy=True), requires_grad=param.requires_grad
        )

    def rows(self, full: torch.Tensor, world: int) -> torch.Tensor:
        """`full` (shape) flattened, zero-padded and viewed as `(N, chunk)`."""
        flat = full.reshape(-1)  # (numel,)
        return F.pad(flat, (0, world * self.chunk - self.numel)).view(world, self.chunk)

    def write_rows(self, dst: torch.Tensor, grad: torch.Tensor | None) -> None:
        """Copy `grad` (shape, or None for zeros) into `dst` (N, chunk) with zero padding."""
        if grad is None:
            dst.zero_()
            return
        flat = grad.reshape(-1)  # (numel,)
        full_rows, rem = divmod(self.numel, self.chunk)
        dst[:full_rows].copy_(flat[: full_rows * self.chunk].view(full_rows, self.chunk))
        if full_rows < dst.shape[0]:
            dst[full_rows:].zero_()
            if rem:
                dst[full_rows, :rem].copy_(flat[full_rows * self.chunk :])


class Pending:
    """An asynchronous collective; `wait()` blocks (gloo) or orders the stream (NCCL)."""

    def __init__(self, work: dist.Work | None, then: Callable[[], None] | None = None) -> None:
        self._work = work
        self._then = then

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._then is not None:
            self._then()
            self._then = None


# torch 2.13 renamed the tensor forms (the old names warn); 2.11 has only the old ones.
_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _supported(fn: Callable[[], object]) -> bool:
    try:
        fn()
    except (RuntimeError, NotImplementedError, ValueError):
        return False
    return True


class Collectives:
    """Flat all-gather and reduce-scatter (sum) over `group`, each asynchronous.

    Construction is a collective (it probes once, on tiny tensors, which tensor forms the
    backend has; the outcome is the same on every rank).
    """

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        one = torch.zeros(self.world, device=device)  # (N,)
        self.tensor_gather = _supported(
            lambda: _gather_single(torch.empty_like(one), one[:1], group=group)
        )
        self.tensor_scatter = _supported(
            lambda: _scatter_single(one[:1].clone(), one.clone(), group=group)
        )

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> Pending:
        """`out` (N * S,) <- every rank's `inp` (S,), by rank."""
        if self.tensor_gather:
            return Pending(_gather_single(out, inp, group=self.group, async_op=True))
        rows = list(out.view(self.world, -1).unbind(0))  # N x (S,), contiguous views
        return Pending(dist.all_gather(rows, inp, group=self.group, async_op=True))

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor) -> Pending:
        """`out` (S,) <- row `rank` of the sum over ranks of `inp` (N * S,)."""
        if self.tensor_scatter:
            work = _scatter_single(out, inp, group=self.group, async_op=True)
            return Pending(work)
        work = dist.all_reduce(inp, group=self.group, async_op=True)
        return Pending(work, lambda: out.copy_(inp.view(self.world, -1)[self.rank]))
