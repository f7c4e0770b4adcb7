"""What FSDP's accumulation without sync and `reshard_after_forward=False` buy.

Under torchrun, each rank builds lm_core's model on the meta device, shards it with
`--fsdp ours` (`zero_shard.FSDP`) or `--fsdp torch` (`fully_shard` per block, then the root)
and times optimizer steps of `--accum` micro-steps each, in four variants:
- `sync`: every micro-step's backward reduce-scatters its gradients;
- `no_sync`: the non-final micro-steps keep unsharded gradients (`FSDP.no_sync()` /
  `set_requires_gradient_sync(False)`), one reduce-scatter per step (what `lm_core.train
  --grad-accum-steps` does);
- `keep_gathered` / `keep_gathered_no_sync`: the same with `reshard_after_forward=False`
  (parameters stay gathered from the forward to the backward: one all-gather per micro-step
  instead of two, more memory).
Rank 0 prints one JSON row per variant: median step ms over `--steps` (after `--warmup`),
the slowest rank's, and the peak device memory (GPU only).

    torchrun --nproc-per-node 2 packages/perf-tools/scripts/fsdp_options.py --size xl \\
        --fsdp ours --context 512 --batch 2 --accum 4
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist

from zero_shard._comm import install_exit_guard

VARIANTS = {  # name -> (keep gathered: reshard_after_forward=False, accumulate without sync)
    "sync": (False, False),
    "no_sync": (False, True),
    "keep_gathered": (True, False),
    "keep_gathered_no_sync": (True, True),
}


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="tiny")
    p.add_argument("--fsdp", choices=("ours", "torch"), default="ours")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank and micro-step")
    p.add_argument("--accum", type=int, default=4, help="micro-steps per optimizer step")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--device", default="auto", help="auto: cuda:LOCAL_RANK if any, else cpu")
    return p.parse_args(argv)


def _wrap(model: torch.nn.Module, fsdp: str, device: torch.device, keep: bool, bf16: bool):
    """lm_core's trainer engine for `fsdp` (`lm_core.fsdp`: meta build materialized, no-sync
    context, gradient sync) with `reshard_after_forward=not keep`; returns it and the
    setting the wrapper itself reports (ours) or was given (torch's)."""
    from lm_core.engine import DistEnv
    from lm_core.fsdp import TorchFSDP, ZeroShardFSDP

    env = DistEnv(dist.get_rank(), dist.get_world_size(), device=device)
    engine = ZeroShardFSDP if fsdp == "ours" else TorchFSDP
    pm = engine(model, env, bf16=bf16, reshard_after_forward=not keep)
    reported = pm.fsdp.reshard_after_forward if fsdp == "ours" else not keep
    return pm, reported


def _time_variant(args: argparse.Namespace, name: str, device: torch.device) -> dict:
    from lm_core import AdamW, cross_entropy
    from perf_tools.models import build_model, resolve_config

    keep, skip_sync = VARIANTS[name]
    cuda = device.type == "cuda"
    config = resolve_config(args.size, context_length=args.context)
    torch.manual_seed(0)
    model = build_model(config, "meta")
    pm, reshard = _wrap(model, args.fsdp, device, keep, bf16=cuda)
    opt = AdamW(pm.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randint(0, config.vocab_size, (args.batch, args.context + 1), generator=gen)
    x = x.to(device)
    inputs, targets = x[:, :-1], x[:, 1:]

    def step() -> None:
        for i in range(args.accum):
            last = i == args.accum - 1
            ctx = pm.no_sync if skip_sync and not last else nullcontext
            with ctx(), torch.autocast(device.type, torch.bfloat16, enabled=cuda):
                loss = cross_entropy(pm.module(inputs), targets) / args.accum
                loss.backward()
        pm.finish_sync()
        opt.step()
        opt.zero_grad(set_to_none=True)

    times = []
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for i in range(args.warmup + args.steps):
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append((time.perf_counter() - start) * 1e3)
    mine = statistics.median(times)
    slowest = [None] * dist.get_world_size()
    dist.all_gather_object(slowest, mine)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    return {
        "variant": name, "size": args.size, "fsdp": args.fsdp, "accum": args.accum,
        "reshard_after_forward": reshard, "no_sync": skip_sync,
        "tokens_per_step": args.batch * args.context * args.accum * dist.get_world_size(),
        "median_ms": round(max(slowest), 2), "peak_device_gib": round(peak, 3),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    cuda = args.device != "cpu" and torch.cuda.is_available()
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    # gloo's worker threads can abort the process at exit unless they finish first
    install_exit_guard()
    for name in args.variants:
        row = _time_variant(args, name, device)  # its model and optimizer are freed here
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        if dist.get_rank() == 0:
            print(json.dumps(row), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
