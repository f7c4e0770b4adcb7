"""Sharded (DCP) checkpoints against the single file, timed in a real run.

Under torchrun: trains a few steps with the given `lm_core.train` flags, then times, with
every rank synchronized before and after each:
- `dcp_save_s`: `lm_core.dcp_checkpoint.save_dcp_checkpoint` (each rank writes its own
  shards, checksums);
- `dcp_load_s`: `lm_core.dcp_checkpoint.load_dcp_checkpoint` of it (verified, loaded in place);
- `full_save_s`: what `--checkpoint-format full` does (parameters gathered and optimizer state
  consolidated on rank 0, which writes one file).
The sharded checkpoint is measured and deleted before the single file is written, so that a
disk that holds one copy of the state (the 8B model's is ~91 GiB) holds the run.
Rank 0 reports each phase on stderr as it starts and ends (a large model's phases take
minutes), then prints one JSON line with the times, the peak GPU memory and both sizes. The
output folder must be visible to every rank. Without `--out-dir` the trainer itself saves
nothing (with one, it also saves at its last step, which the timings do not include).

    torchrun --nproc-per-node 2 packages/perf-tools/scripts/checkpoint_timing.py OUT_DIR \\
        --size large --bf16 --fsdp ours --steps 2 --synthetic random --no-progress
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from zero_shard._comm import install_exit_guard


def _size_gib(path: Path) -> float:
    files = path.iterdir() if path.is_dir() else [path]
    return sum(f.stat().st_size for f in files) / 2**30


def _progress(message: str) -> None:
    """One line on rank 0's stderr, flushed (torchrun interleaves the ranks' output)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"[checkpoint_timing] {message}", file=sys.stderr, flush=True)


def main() -> int:
    from lm_core import save_checkpoint
    from lm_core.dcp_checkpoint import load_dcp_checkpoint, save_dcp_checkpoint
    from lm_core.train import main as train

    if len(sys.argv) < 3:
        print(__doc__)
        return 2
    out, argv = Path(sys.argv[1]), sys.argv[2:]
    existing = [p for p in (out / "ck.dcp", out / "ck.pt") if p.exists()]
    if existing:  # the timings write, then delete, these two: never over a user's files
        print(f"checkpoint_timing: {', '.join(map(str, existing))} exists; give an empty OUT_DIR",
              file=sys.stderr)  # fmt: skip
        return 2
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")  # the trainer then joins this group
    # gloo's worker threads can abort the process at exit unless they finish first
    install_exit_guard()
    t0 = time.perf_counter()
    _progress(f"training {' '.join(argv)}")
    result = train(argv)
    engine, optimizer, config = result.parallel, result.optimizer, result.model.config
    _progress(f"trained {result.step} step(s) in {time.perf_counter() - t0:.1f} s")

    def timed(name: str, fn: Callable[[], None]) -> float:
        _progress(f"{name} ...")
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        seconds = time.perf_counter() - start
        _progress(f"{name}: {seconds:.1f} s")
        return seconds

    def full_save() -> None:
        model_state = engine.full_state_dict()
        optim_state = engine.full_optimizer_state_dict(optimizer)
        if dist.get_rank() == 0:
            save_checkpoint(out / "ck.pt", model_state, optim_state, result.step, config=config)

    row = {
        "dcp_save_s": timed(
            "sharded save",
            lambda: save_dcp_checkpoint(out / "ck.dcp", engine, optimizer, result.step, config),
        ),
        "dcp_load_s": timed(
            "sharded load", lambda: load_dcp_checkpoint(out / "ck.dcp", engine, optimizer)
        ),
    }
    if dist.get_rank() == 0:
        row["dcp_gib"] = _size_gib(out / "ck.dcp")
        shutil.rmtree(out / "ck.dcp")
    row["full_save_s"] = timed("single-file save", full_save)
    row["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    if dist.get_rank() == 0:
        row["file_gib"] = _size_gib(out / "ck.pt")
        print(json.dumps(row))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
