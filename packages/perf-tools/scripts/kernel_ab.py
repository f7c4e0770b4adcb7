"""The bench step with one of lm_core's CUDA kernel pairs off and on (or inductor's GEMM
autotuning), interleaved in one process.

    python packages/perf-tools/scripts/kernel_ab.py OUT_DIR ROUNDS KERNELS -- BENCH_ARGS...

KERNELS: `swiglu` (`lm_core.swiglu`), `qkv_rope` (`lm_core.qkv_rope`), `rmsnorm`
(`lm_core.rmsnorm`), `gemm_autotune` (torch inductor's `max_autotune_gemm`: compiled
matmuls pick the fastest of cuBLAS and inductor's Triton templates per shape),
`tf32x3_gluon` (`lm_core.tf32x3_gluon`, the Hopper GEMM of `--matmul tf32x3`),
`tf32x3_plans` (that GEMM's plans with A split in registers and split K), `defer_add`
(`lm_core.model.DEFER_RESIDUAL_ADD`: each block's last residual add in the next block's
first norm kernel instead of a separate add), or `node_priorities`
(`lm_core.graph_step.NODE_PRIORITIES`: the step's CUDA graph replayed with the backward's
kernels at high priority and the overlapped optimizer's at low). Each round
runs `perf_tools.bench` (BENCH_ARGS, plus --quiet) first with the switch off (the module's
"auto" held to the plain ops; autotuning off), then on, resetting dynamo before each so every
variant compiles its own graphs; one CSV per run in OUT_DIR (KERNELS_off_R.csv,
KERNELS_on_R.csv).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import torch

from perf_tools import bench

KERNELS = (
    "swiglu",
    "qkv_rope",
    "rmsnorm",
    "gemm_autotune",
    "tf32x3_gluon",
    "tf32x3_plans",
    "defer_add",
    "node_priorities",
)


def _switch(kernels: str, on: bool) -> None:
    if kernels == "gemm_autotune":
        import torch._inductor.config as inductor_config

        inductor_config.max_autotune_gemm = on
        return
    if kernels == "tf32x3_gluon":
        from lm_core import tf32x3_gluon, tf32x3_triton

        tf32x3_gluon.ENABLED = on
        tf32x3_triton._best.clear()  # each shape's first call chooses again
        return
    if kernels == "node_priorities":
        from lm_core import graph_step

        graph_step.NODE_PRIORITIES = on
        return
    if kernels == "defer_add":
        from lm_core import model

        model.DEFER_RESIDUAL_ADD = on
        return
    if kernels == "tf32x3_plans":
        from lm_core import tf32x3_gluon, tf32x3_triton

        tf32x3_gluon.RAW_A = tf32x3_gluon.SPLIT_K = on
        tf32x3_triton._best.clear()
        return
    module = importlib.import_module(f"lm_core.{kernels}")
    module._RUNNABLE["cuda"] = on  # what "auto" decides on CUDA


def main(argv: list[str]) -> int:
    if len(argv) < 3 or not argv[1].isdigit() or argv[2] not in KERNELS:
        print(__doc__)
        return 2
    out, rounds, kernels = Path(argv[0]), int(argv[1]), argv[2]
    rest = [a for a in argv[3:] if a != "--"]
    out.mkdir(parents=True, exist_ok=True)
    for r in range(rounds):
        for on in (False, True):
            torch._dynamo.reset()
            _switch(kernels, on)
            name = f"{kernels}_{'on' if on else 'off'}_{r}"
            print(f"=== round {r}: {kernels} {'on' if on else 'off'}", flush=True)
            bench.main([*rest, "--quiet", "--csv", str(out / f"{name}.csv")])
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
