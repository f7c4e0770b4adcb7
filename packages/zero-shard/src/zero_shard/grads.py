"""FSDP's gradient math outside the units: the replicated parameters' all-reduce and the
global gradient-norm clip (shards and replicated parameters together)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from zero_shard._comm import Comm


@torch.no_grad()
def allreduce_replicated(params: list[nn.Parameter], comm: Comm) -> None:
    """Collective: average the replicated parameters' grads over the ranks, with one
    all-reduce per dtype of the grads plus a has-grad flag each (a parameter no rank gave a
    gradient keeps None)."""
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for p in params:
        if p.requires_grad:
            by_dtype.setdefault(p.dtype, []).append(p)
    for dtype, group in by_dtype.items():
        device = group[0].device
        grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in group]
        flags = torch.tensor([p.grad is not None for p in group], dtype=dtype, device=device)
        flat = torch.cat([*grads, flags])  # (sum numel + n_params,)
        what = ("all_reduce of the replicated parameters' gradients (%s)", (dtype,))
        comm.all_reduce(flat, dist.ReduceOp.SUM, what).wait()
        has = None if all(p.grad is not None for p in group) else flat[-len(group) :].tolist()
        offset = 0
        for i, p in enumerate(group):
            avg = flat[offset : offset + p.numel()].view_as(p) / comm.world_size
            offset += p.numel()
            if has is None or has[i] > 0:
                p.grad = avg


@torch.no_grad()
def clip_grad_norm(
    shards: list[nn.Parameter], replicated: list[nn.Parameter], max_norm: float, comm: Comm
) -> torch.Tensor:
    """Collective: scale every gradient so that the global 2-norm of the full gradients is at
    most `max_norm`; returns the norm before clipping (0-dim fp32). The shards are disjoint
    (their squares are summed over ranks); replicated grads are equal on every rank (counted
    once)."""
    local = torch.zeros((), dtype=torch.float32, device=shards[0].device)
    for p in shards:
        if p.grad is not None:
            local += p.grad.float().square().sum()
    what = ("all_reduce of the squared gradient norm", ())
    comm.all_reduce(local, dist.ReduceOp.SUM, what).wait()
    for p in replicated:
        if p.grad is not None:
            local += p.grad.float().square().sum()
    total = local.sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)  # as torch.nn.utils.clip_grad_norm_
    for p in [*shards, *replicated]:
        if p.grad is not None:
            p.grad.mul_(coef.to(p.grad.dtype))
    return total
