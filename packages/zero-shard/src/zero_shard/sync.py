"""Bring every rank's copy of the parameters up to date after each owner's optimizer step.

Two strategies (`ShardedOptimizer(param_sync=...)`):

"broadcast" (default): each parameter is broadcast from its owner. To keep the number of
collectives small without copying gigabytes, a plan groups the parameters by owner, device and
dtype and then:

* a parameter of at least `bucket_cap_bytes` that is contiguous is broadcast in place (no copy);
* smaller (or non-contiguous) ones are packed into flat buckets of up to `bucket_cap_bytes`,
  broadcast once per bucket, and unpacked on the receiving ranks.

All broadcasts are issued asynchronously in the plan's order (identical on every rank, since
the plan is a pure function of the shared assignment) and waited on at the end. Extra memory
is bounded by the total size of the small parameters (the buckets), never a second copy of
the model. One owner sends at a time: a broadcast uses the links out of its root only.

"allgather": per device and dtype, each rank's owned parameters form a virtual flat shard
(in global order); shards are exchanged in chunks of `bucket_cap_bytes` per rank with one
all-gather each (every rank sends and receives at once), two chunks in flight. Each chunk
costs a copy in (pack) and out (unpack), and the shards are padded to the longest one.
Non-contiguous parameters fall back to the broadcast plan.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import torch

from zero_shard._comm import Comm


@dataclass(frozen=True)
class SyncUnit:
    """One broadcast: `params` from group rank `src`.

    `packed` is False for a single parameter broadcast in place, True for a flat bucket.
    """

    src: int
    params: tuple[torch.Tensor, ...]
    packed: bool

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)


def build_plan(
    params: list[torch.Tensor], owners: list[int], world_size: int, bucket_cap_bytes: int
) -> list[SyncUnit]:
    """The ordered broadcasts that sync `params` (owner of `params[i]` is `owners[i]`)."""
    plan: list[SyncUnit] = []
    for src in range(world_size):
        by_kind: dict[tuple[str, torch.dtype], list[torch.Tensor]] = {}
        for p, owner in zip(params, owners):
            if owner == src and p.numel() > 0:
                by_kind.setdefault((str(p.device), p.dtype), []).append(p)
        for key in sorted(by_kind, key=lambda k: (k[0], str(k[1]))):
            bucket: list[torch.Tensor] = []
            bucket_bytes = 0
            for p in by_kind[key]:
                nbytes = p.numel() * p.element_size()
                if nbytes >= bucket_cap_bytes and p.is_contiguous():
                    plan.append(SyncUnit(src, (p,), packed=False))
                    continue
                if bucket and bucket_bytes + nbytes > bucket_cap_bytes:
                    plan.append(SyncUnit(src, tuple(bucket), packed=True))
                    bucket, bucket_bytes = [], 0
                bucket.append(p)
                bucket_bytes += nbytes
            if bucket:
                plan.append(SyncUnit(src, tuple(bucket), packed=True))
    return plan


@torch.no_grad()
def broadcast_params(plan: list[SyncUnit], rank: int, comm: Comm) -> None:
    """Run `plan`: every rank must call this with the same plan (it is a collective)."""
    pending = []
    for i, unit in enumerate(plan):
        first = unit.params[0]
        if not unit.packed:
            buf = first.detach()
        elif rank == unit.src:
            buf = torch.cat([p.detach().reshape(-1) for p in unit.params])  # (numel,)
        else:
            buf = torch.empty(unit.numel, dtype=first.dtype, device=first.device)
        what = ("broadcast %d of %d of updated parameters from rank %d", (i, len(plan), unit.src))
        work = comm.broadcast(buf, unit.src, what)
        pending.append((unit, buf, work))
    for unit, buf, work in pending:
        work.wait()
        if unit.packed and rank != unit.src:
            offset = 0
            for p in unit.params:
                n = p.numel()
                p.detach().copy_(buf[offset : offset + n].view_as(p))  # (numel,) -> p.shape
                offset += n


@dataclass(frozen=True)
class GatherGroup:
    """Parameters of one device and dtype, laid out as one virtual flat shard per rank.

    `shards[r]` lists (param, offset) in rank r's shard, by offset; `starts[r]` the offsets.
    """

    shards: tuple[tuple[tuple[torch.Tensor, int], ...], ...]
    starts: tuple[tuple[int, ...], ...]
    lengths: tuple[int, ...]
    chunk: int  # elements per rank and all-gather
    dtype: torch.dtype
    device: torch.device


def build_gather_plan(
    params: list[torch.Tensor], owners: list[int], world_size: int, bucket_cap_bytes: int
) -> list[GatherGroup]:
    """The all-gather groups for the contiguous `params` (owner of `params[i]`: `owners[i]`)."""
    kinds: dict[tuple[str, torch.dtype], list[tuple[torch.Tensor, int]]] = {}
    for p, owner in zip(params, owners):
        if p.numel() > 0:
            kinds.setdefault((str(p.device), p.dtype), []).append((p, owner))
    plan = []
    for key in sorted(kinds, key=lambda k: (k[0], str(k[1]))):
        members = kinds[key]
        shards: list[list[tuple[torch.Tensor, int]]] = [[] for _ in range(world_size)]
        lengths = [0] * world_size
        for p, owner in members:
            shards[owner].append((p, lengths[owner]))
            lengths[owner] += p.numel()
        first = members[0][0]
        chunk = max(1, min(max(lengths), bucket_cap_bytes // first.element_size()))
        plan.append(
            GatherGroup(
                shards=tuple(tuple(s) for s in shards),
                starts=tuple(tuple(off for _, off in s) for s in shards),
                lengths=tuple(lengths),
                chunk=chunk,
                dtype=first.dtype,
                device=first.device,
            )
        )
    return plan


def _overlaps(group: GatherGroup, rank: int, lo: int, hi: int):
    """(param, slice in the param, slice in the chunk) for rank's elements in [lo, hi)."""
    starts, shard = group.starts[rank], group.shards[rank]
    i = max(0, bisect.bisect_right(starts, lo) - 1)
    while i < len(shard):
        p, off = shard[i]
        if off >= hi:
            break
        a, b = max(off, lo), min(off + p.numel(), hi)
        if a < b:
            yield p, slice(a - off, b - off), slice(a - lo, b - lo)
        i += 1


@torch.no_grad()
def allgather_params(plan: list[GatherGroup], rank: int, world_size: int, comm: Comm) -> None:
    """Run the all-gather plan: every rank must call it with the same plan (a collective)."""
    for group in plan:
        c = group.chunk
        n_chunks = math.ceil(max(group.lengths) / c)
        in_flight = None
        for k in range(n_chunks):
            send = torch.empty(c, dtype=group.dtype, device=group.device)
            for p, src, dst in _overlaps(group, rank, k * c, (k + 1) * c):
                send[dst].copy_(p.detach().view(-1)[src])
            out = torch.empty(world_size * c, dtype=group.dtype, device=group.device)
            what = ("all-gather %d of %d of updated parameters (%s)", (k, n_chunks, group.dtype))
            work = comm.all_gather_into(out, send, what)
            if in_flight is not None:
                _unpack(group, rank, world_size, *in_flight)
            in_flight = (k, out, work, send)
        if in_flight is not None:
            _unpack(group, rank, world_size, *in_flight)


def _unpack(group: GatherGroup, rank: int, world_size: int, k: int, out, work, send) -> None:
    work.wait()
    c = group.chunk
    for r in range(world_size):
        if r == rank:
            continue
        seg = out[r * c : (r + 1) * c]  # rank r's elements [k c, (k+1) c)
        for p, dst, src in _overlaps(group, r, k * c, (k + 1) * c):
            p.detach().view(-1)[dst].copy_(seg[src])
