"""The short-split decode rule: default (rule) vs the old 3-stage tile vs SDPA."""

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


for b, h, hkv, nk in [
    (1, 32, 8, 65536),
    (2, 32, 8, 16384),
    (1, 32, 8, 16384),
    (4, 32, 8, 32768),
    (1, 32, 32, 8192),
    (1, 32, 32, 131072),
    (8, 32, 32, 8192),
    (8, 32, 8, 65536),
]:
    q = torch.randn(b, h, 1, 128, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(b, hkv, nk, 128, device=dev, dtype=torch.bfloat16) for _ in range(2))
    ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=hkv != h)
    res = {}
    for _r in range(3):
        for name, tc in (("rule", ""), ("old_3_stages", "decode=16,64,4,3")):
            with use_options(tile_configs=tc):
                o = fa.flash_attention(q, k, v, True)
                err = (o.float() - ref.float()).abs().max().item()
                res.setdefault(name, []).append(bench(lambda: fa.flash_attention(q, k, v, True)))
        res.setdefault("sdpa", []).append(
            bench(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=hkv != h))
        )
    for name, ts in res.items():
        row = {
            "shape": f"B{b} H{h}/{hkv} Nk{nk}",
            "variant": name,
            "ms": round(statistics.median(ts), 4),
            "err": err,
        }
        rows.append(row)
        print(row, flush=True)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
