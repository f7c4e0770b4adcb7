"""d=128 forward tiles: current table entry vs wider programs (256 rows, 2 warpgroups)."""

import json
import statistics
import sys

import torch
import torch.nn.functional as F
import triton

import flashattn_triton as fa
from flashattn_triton.options import use_options

dev = "cuda"
rows = []


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median")


specs = ["", "fwd=256,64,8,2,tma", "fwd=256,32,8,3,tma", "fwd=128,128,8,2,tma", "fwd=128,64,4,2"]
for b, h, n, causal in [
    (1, 16, 16384, True),
    (4, 32, 4096, True),
    (2, 16, 8192, False),
    (1, 32, 32768, True),
]:
    q, k, v = (torch.randn(b, h, n, 128, device=dev, dtype=torch.bfloat16) for _ in range(3))
    ref = fa.flash_attention(q, k, v, causal)
    res = {}
    for _r in range(3):
        for spec in specs:
            with use_options(tile_configs=spec):
                try:
                    o = fa.flash_attention(q, k, v, causal)
                    err = (o.float() - ref.float()).abs().max().item()
                    t = bench(lambda: fa.flash_attention(q, k, v, causal))
                except Exception as e:
                    t, err = float("nan"), repr(e)[:100]
            res.setdefault(spec or "table", []).append((t, err))
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            res.setdefault("cudnn", []).append(
                (bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)), 0)
            )
    for name, ts in res.items():
        row = {
            "shape": f"{b}x{h}x{n}",
            "causal": causal,
            "spec": name,
            "ms": round(statistics.median(t for t, _ in ts), 4),
            "err": ts[-1][1],
        }
        rows.append(row)
        print(row, flush=True)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
