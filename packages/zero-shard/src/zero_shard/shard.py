"""Per-parameter flat shards, and the two flat collectives FSDP runs on them.

Layout. A parameter of `numel` elements is flattened, zero-padded to `N * chunk` elements
(`chunk = ceil(numel / N)`, N ranks) and viewed as N rows of `chunk`; rank r keeps row r as its
master shard, an `nn.Parameter` of shape `(chunk,)` in fp32 (fp64 stays fp64). A unit (a group
of modules gathered together) sends the rows of all its parameters back to back, a `(S,)`
buffer with `S = sum(chunk)`, and one all-gather returns `(N, S)`: the columns
`[offset, offset + chunk)` of that are one parameter's padded flat value, row by row. Gradients
travel the same layout backwards through one reduce-scatter.

`Collectives` runs the process group's tensor-form all-gather and reduce-scatter and falls back
to the list all-gather / an all-reduce plus a slice where the backend lacks the tensor forms
(older gloo); every call goes through `zero_shard._comm.Comm` (timeout, errors that name it).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from zero_shard._comm import Comm
from zero_shard._comm import Pending as CommPending


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
    """An asynchronous collective; `wait()` blocks (gloo) or orders the stream (NCCL), then
    runs `then` (the fallback's copy out)."""

    def __init__(self, work: CommPending | None, then: Callable[[], None] | None = None) -> None:
        self._work = work
        self._then = then

    def wait(self) -> None:
        work, then = self._work, self._then
        self._work = self._then = None  # a failed wait is not retried (e.g. by Unit.free)
        if work is not None:
            work.wait()
        if then is not None:
            then()


def _supported(fn: Callable[[], object]) -> bool:
    try:
        fn()
    except (RuntimeError, NotImplementedError, ValueError):
        return False
    return True


class Collectives:
    """Flat all-gather and reduce-scatter (sum) over `comm`'s group, each asynchronous and
    bounded by `comm`'s timeout.

    Construction is a collective (it probes once, on tiny tensors, which tensor forms the
    backend has; the outcome is the same on every rank).
    """

    def __init__(self, comm: Comm, device: torch.device) -> None:
        self.comm = comm
        self.rank = comm.rank
        self.world = comm.world_size
        one = torch.zeros(self.world, device=device)  # (N,)
        probe = ("all-gather probe", ())
        self.tensor_gather = _supported(
            lambda: comm.all_gather_into(torch.empty_like(one), one[:1], probe).wait()
        )
        probe = ("reduce-scatter probe", ())
        self.tensor_scatter = _supported(
            lambda: comm.reduce_scatter_into(one[:1].clone(), one.clone(), probe).wait()
        )

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, what: str) -> Pending:
        """`out` (N * S,) <- every rank's `inp` (S,), by rank (`what` names it in errors)."""
        name = ("all-gather of %s", (what,))
        if self.tensor_gather:
            return Pending(self.comm.all_gather_into(out, inp, name))
        rows = list(out.view(self.world, -1).unbind(0))  # N x (S,), contiguous views
        return Pending(self.comm.all_gather(rows, inp, name))

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, what: str) -> Pending:
        """`out` (S,) <- row `rank` of the sum over ranks of `inp` (N * S,)."""
        name = ("reduce-scatter of %s", (what,))
        if self.tensor_scatter:
            return Pending(self.comm.reduce_scatter_into(out, inp, name))
        work = self.comm.all_reduce(inp, dist.ReduceOp.SUM, name)
        return Pending(work, lambda: out.copy_(inp.view(self.world, -1)[self.rank]))
