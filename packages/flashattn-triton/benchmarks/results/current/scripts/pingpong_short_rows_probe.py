"""Ping-pong at short rows: the per-tile Gluon forward with and without it, beside the
persistent forward and SDPA cuDNN, d = 128, bf16, batch 1 (forward alone, GPU time).

    python pingpong_short_rows_probe.py OUT.json   # from the repository root

Each variant is first compared with a float32 reference (``err``: max |o - o_ref|), then
timed in three interleaved rounds of ``do_bench_cudagraph`` (ms, median over rounds; the
kernel variants launch through Triton's dispatch, so CUDA graphs keep the host out).
"""

from __future__ import annotations

import json
import math
import statistics
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, "packages/flashattn-triton/benchmarks")
from gluon_fwd_ab import reference, run

VARIANTS = {
    "tile": {"block_m": 128, "head_group": 4},
    "tile_pp": {"block_m": 128, "head_group": 4, "pingpong": True},
    "tile_pp_plain": {"block_m": 128, "pingpong": True},
    "persistent": {"block_m": 128, "persistent": -1},
    "persistent_s3": {"block_m": 128, "stages": 3, "persistent": -1},
}


def main() -> None:
    rows = []
    for h, n in [(128, 512), (64, 1024), (32, 2048), (16, 4096)]:
        for causal in (False, True):
            q, k, v = (
                torch.randn(1, h, n, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3)
            )
            o_ref, _ = reference(q, k, v, causal, 1 / math.sqrt(128))
            fns = {
                name: (lambda kw=kw: run(q, k, v, causal, **kw)) for name, kw in VARIANTS.items()
            }

            def cudnn(q=q, k=k, v=v, causal=causal):
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

            fns["cudnn"] = cudnn
            errs = {}
            for name, fn in fns.items():
                out = fn()
                o = out[0] if isinstance(out, tuple) else out
                errs[name] = round((o.float() - o_ref).abs().max().item(), 4)
            times: dict[str, list[float]] = {}
            for _ in range(3):
                for name, fn in fns.items():
                    ms = triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
                    times.setdefault(name, []).append(ms)
            row = {"shape": f"1x{h}x{n}", "causal": causal, "err": errs}
            row.update({name: round(statistics.median(t), 4) for name, t in times.items()})
            rows.append(row)
            print(row, flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
