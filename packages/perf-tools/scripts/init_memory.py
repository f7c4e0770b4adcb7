"""Memory of building a sharded model: the meta-device build against a full build.

Under torchrun, each rank builds lm_core's model and shards it with `--fsdp ours`
(`zero_shard.FSDP`) or `--fsdp torch` (`fully_shard` per block, then the root), built
- `meta`: on the meta device, each rank materializing only its shards (what `lm_core.train
  --fsdp` and `perf_tools.bench --nprocs` do),
- `cpu`: whole on the host first, then sharded onto the device,
- `device`: whole on the device first, then sharded.
Rank 0 prints one JSON row per rank: peak host RSS of the process (`ru_maxrss`, the whole
process, Python and torch included), peak and final device memory allocated by torch, and
the build time. Run each build in its own torchrun (a process's peak RSS never goes down):

    torchrun --nproc-per-node 2 packages/perf-tools/scripts/init_memory.py --size 8B \\
        --fsdp ours --build meta
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

import torch
import torch.distributed as dist

from zero_shard._comm import install_exit_guard


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="tiny", help="an lm_core preset (default tiny)")
    p.add_argument("--fsdp", choices=("ours", "torch"), default="ours")
    p.add_argument("--build", choices=("meta", "cpu", "device"), default="meta")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="bf16")
    p.add_argument("--device", default="auto", help="auto: cuda:LOCAL_RANK if any, else cpu")
    return p.parse_args(argv)


def _shard(model: torch.nn.Module, fsdp: str, device: torch.device, bf16: bool) -> None:
    """Shard `model` as the benchmark's FSDP rows do (materializing it if on meta)."""
    if fsdp == "ours":
        from zero_shard import FSDP

        FSDP(model, compute_dtype=torch.bfloat16 if bf16 else None, device=device)
        return
    from lm_core.fsdp import materialize_fully_sharded, torch_fsdp_api

    fully_shard, policy_cls = torch_fsdp_api()
    kwargs = {}
    if bf16:
        kwargs["mp_policy"] = policy_cls(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if next(model.parameters()).device.type == "cpu" and device.type != "cpu":
        model.to(device)  # fully_shard shards where the parameters are: move them first
    for block in model.layers:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    if next(model.parameters()).device.type == "meta":
        materialize_fully_sharded(model, device)


def main(argv: list[str] | None = None) -> int:
    from perf_tools.models import build_model, resolve_config

    args = _parse(sys.argv[1:] if argv is None else argv)
    cuda = args.device != "cpu" and torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(f"cuda:{local}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    # gloo's worker threads can abort the process at exit unless they finish first
    install_exit_guard()
    config = resolve_config(args.size, context_length=512)
    start = time.perf_counter()
    torch.manual_seed(0)
    model = build_model(config, {"meta": "meta", "cpu": "cpu", "device": device}[args.build])
    _shard(model, args.fsdp, device, args.precision == "bf16")
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    row = {
        "rank": dist.get_rank(),
        "size": args.size,
        "fsdp": args.fsdp,
        "build": args.build,
        "build_s": round(time.perf_counter() - start, 3),
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "peak_device_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
        "device_gib": torch.cuda.memory_allocated() / 2**30 if cuda else 0.0,
    }
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        for r in rows:
            print(json.dumps(r))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
