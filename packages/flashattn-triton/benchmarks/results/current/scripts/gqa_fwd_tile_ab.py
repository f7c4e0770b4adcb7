"""GQA forward at d=64: plain tile (now) vs the old feature tile; and d=128 plain vs feature."""

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
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


for b, hq, hkv, n, d, causal, old in [
    (4, 32, 8, 4096, 64, True, "fwd=128,64,8,3,tma"),
    (1, 32, 8, 16384, 64, True, "fwd=128,64,8,3,tma"),
    (4, 32, 8, 4096, 128, True, "fwd=128,64,8,2,tma"),
]:
    q = torch.randn(b, hq, n, d, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(b, hkv, n, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
    res = {}
    for _r in range(3):
        for name, opts in (("now", {}), ("feature_tile", {"tile_configs": old})):
            with use_options(**opts):
                res.setdefault(name, []).append(bench(lambda: fa.flash_attention(q, k, v, causal)))
        res.setdefault("sdpa_gqa", []).append(
            bench(
                lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
            )
        )
    for name, ts in res.items():
        row = {
            "shape": f"{b}x{hq}/{hkv}x{n}x{d}",
            "variant": name,
            "fwd_ms": round(statistics.median(ts), 4),
        }
        rows.append(row)
        print(row, flush=True)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
