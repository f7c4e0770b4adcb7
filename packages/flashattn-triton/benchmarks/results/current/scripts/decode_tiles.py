"""Decode tiles: the split-KV kernel's key tile, warps and stages at B8 H32 Nq1 d128."""

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


specs = [
    "",
    "16,32,4,3",
    "16,64,4,2",
    "16,64,4,4",
    "16,64,8,3",
    "16,128,4,2",
    "16,128,4,3",
    "16,128,8,3",
    "16,128,8,4",
    "16,256,8,2",
    "16,32,4,4",
]
for b, h, hkv, nk in [(8, 32, 32, 8192), (8, 32, 32, 65536), (1, 32, 8, 65536), (2, 32, 8, 16384)]:
    q = torch.randn(b, h, 1, 128, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(b, hkv, nk, 128, device=dev, dtype=torch.bfloat16) for _ in range(2))
    ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=hkv != h)
    res = {}
    for _r in range(2):
        for spec in specs:
            with use_options(tile_configs=f"decode={spec}" if spec else ""):
                try:
                    o = fa.flash_attention(q, k, v, True)
                    err = (o.float() - ref.float()).abs().max().item()
                    t = bench(lambda: fa.flash_attention(q, k, v, True))
                except Exception as e:
                    t, err = float("nan"), repr(e)[:80]
            res.setdefault(spec or "default", []).append((t, err))
        res.setdefault("sdpa", []).append(
            (bench(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=hkv != h)), 0)
        )
    for name, ts in res.items():
        row = {
            "shape": f"B{b} H{h}/{hkv} Nk{nk}",
            "spec": name,
            "ms": round(statistics.median(t for t, _ in ts), 4),
            "err": ts[-1][1],
        }
        rows.append(row)
        print(row, flush=True)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
