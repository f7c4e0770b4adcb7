"""Bring every rank's copy of the parameters up to date after each owner's optimizer step.

Each parameter is broadcast from its owner. To keep the number of collectives small without
copying gigabytes, a plan groups the parameters by owner, device and dtype and then:

* a parameter of at least `bucket_cap_bytes` that is contiguous is broadcast in place (no copy);
* smaller (or non-contiguous) ones are packed into flat buckets of up to `bucket_cap_bytes`,
  broadcast once per bucket, and unpacked on the receiving ranks.

All broadcasts are issued asynchronously in the plan's order (identical on every rank, since
the plan is a pure function of the shared assignment) and waited on at the end, so transfers
from different owners overlap. Extra memory is bounded by the total size of the small
parameters (the buckets), never a second copy of the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class SyncUnit:
    """One broadcast: `params` from group rank `src` (global rank `global_src`).

    `packed` is False for a single parameter broadcast in place, True for a flat bucket.
    """

    src: int
    global_src: int
    params: tuple[torch.Tensor, ...]
    packed: bool

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)


def build_plan(
    params: list[torch.Tensor],
    owners: list[int],
    world_size: int,
    bucket_cap_bytes: int,
    process_group: dist.ProcessGroup | None,
) -> list[SyncUnit]:
    """The ordered broadcasts that sync `params` (owner of `params[i]` is `owners[i]`)."""
    plan: list[SyncUnit] = []
    for src in range(world_size):
        global_src = dist.get_global_rank(process_group, src) if process_group is not None else src
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
                    plan.append(SyncUnit(src, global_src, (p,), packed=False))
                    continue
                if bucket and bucket_bytes + nbytes > bucket_cap_bytes:
                    plan.append(SyncUnit(src, global_src, tuple(bucket), packed=True))
                    bucket, bucket_bytes = [], 0
                bucket.append(p)
                bucket_bytes += nbytes
            if bucket:
                plan.append(SyncUnit(src, global_src, tuple(bucket), packed=True))
    return plan


@torch.no_grad()
def broadcast_params(
    plan: list[SyncUnit], rank: int, process_group: dist.ProcessGroup | None
) -> None:
    """Run `plan`: every rank must call this with the same plan (it is a collective)."""
    pending = []
    for unit in plan:
        first = unit.params[0]
        if not unit.packed:
            buf = first.detach()
        elif rank == unit.src:
            buf = torch.cat([p.detach().reshape(-1) for p in unit.params])  # (numel,)
        else:
            buf = torch.empty(unit.numel, dtype=first.dtype, device=first.device)
        work = dist.broadcast(buf, src=unit.global_src, group=process_group, async_op=True)
        pending.append((unit, buf, work))
    for unit, buf, work in pending:
        work.wait()
        if unit.packed and rank != unit.src:
            offset = 0
            for p in unit.params:
                n = p.numel()
                p.detach().copy_(buf[offset : offset + n].view_as(p))  # (numel,) -> p.shape
                offset += n
