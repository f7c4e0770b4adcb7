"""The bench step with one of lm_core's CUDA kernel pairs off and on, interleaved in one
process.

    python packages/perf-tools/scripts/kernel_ab.py OUT_DIR ROUNDS KERNELS -- BENCH_ARGS...

KERNELS: `swiglu` (`lm_core.swiglu`), `qkv_rope` (`lm_core.qkv_rope`) or `rmsnorm`
(`lm_core.rmsnorm`). Each round runs
`perf_tools.bench` (BENCH_ARGS, plus --quiet) first with the module's "auto" held to the
plain ops, then with the kernels, resetting dynamo before each so every variant compiles
its own graphs; one CSV per run in OUT_DIR (KERNELS_off_R.csv, KERNELS_on_R.csv).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import torch

from perf_tools import bench

KERNELS = ("swiglu", "qkv_rope", "rmsnorm")


def main(argv: list[str]) -> int:
    if len(argv) < 3 or not argv[1].isdigit() or argv[2] not in KERNELS:
        print(__doc__)
        return 2
    out, rounds, kernels = Path(argv[0]), int(argv[1]), argv[2]
    module = importlib.import_module(f"lm_core.{kernels}")
    rest = [a for a in argv[3:] if a != "--"]
    out.mkdir(parents=True, exist_ok=True)
    for r in range(rounds):
        for on in (False, True):
            torch._dynamo.reset()
            module._RUNNABLE["cuda"] = on  # what "auto" decides on CUDA
            name = f"{kernels}_{'on' if on else 'off'}_{r}"
            print(f"=== round {r}: {kernels} kernels {'on' if on else 'off'}", flush=True)
            bench.main([*rest, "--quiet", "--csv", str(out / f"{name}.csv")])
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
