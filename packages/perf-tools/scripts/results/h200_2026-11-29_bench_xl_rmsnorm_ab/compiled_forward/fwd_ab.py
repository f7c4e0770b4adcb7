"""The xl step with the compiled RMSNorm forward as our kernel or as torch ops (inductor).

Ran at commit 611c182, whose `lm_core.rmsnorm.COMPILED_FORWARD` chose between the two; the
result was a tie (lm-core DESIGN), and the switch was removed again."""

import sys
from pathlib import Path

import torch

from lm_core import rmsnorm
from perf_tools import bench

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
args = sys.argv[2:]
for r in range(2):
    for mode in ("kernel", "ops"):
        torch._dynamo.reset()
        rmsnorm.COMPILED_FORWARD = mode
        print(f"=== round {r}: compiled forward {mode}", flush=True)
        bench.main([*args, "--quiet", "--csv", str(out / f"fwd_{mode}_{r}.csv")])
