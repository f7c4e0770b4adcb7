"""The bench step with lm_core's SwiGLU kernels off and on, interleaved in one process.

    python packages/perf-tools/scripts/swiglu_ab.py OUT_DIR ROUNDS -- BENCH_ARGS...

Each round runs `perf_tools.bench` (BENCH_ARGS, plus --quiet) first with the plain
expression (`lm_core.swiglu`'s "auto" held to torch), then with the kernels, resetting
dynamo before each so every variant compiles its own graphs; one CSV per run in OUT_DIR
(swiglu_off_R.csv, swiglu_on_R.csv).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from lm_core import swiglu
from perf_tools import bench


def main(argv: list[str]) -> int:
    if len(argv) < 2 or not argv[1].isdigit():
        print(__doc__)
        return 2
    out, rounds = Path(argv[0]), int(argv[1])
    rest = [a for a in argv[2:] if a != "--"]
    out.mkdir(parents=True, exist_ok=True)
    for r in range(rounds):
        for on in (False, True):
            torch._dynamo.reset()
            swiglu._RUNNABLE["cuda"] = on  # what "auto" decides on CUDA
            name = f"swiglu_{'on' if on else 'off'}_{r}"
            print(f"=== round {r}: SwiGLU kernels {'on' if on else 'off'}", flush=True)
            bench.main([*rest, "--quiet", "--csv", str(out / f"{name}.csv")])
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
