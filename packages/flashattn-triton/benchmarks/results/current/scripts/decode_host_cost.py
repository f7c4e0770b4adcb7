"""Host time of one decode call (B1 x 32 q / 8 kv heads x 16K keys, d 128, bf16): ours against
SDPA and four bare allocations, as a host-side loop of 3000 calls (microseconds per call,
before and after the final synchronize), then a cProfile of 2000 calls of ours.

    python decode_host_cost.py OUT.txt
"""

import cProfile
import io
import pstats
import sys
import time

import torch
import torch.nn.functional as F

import flashattn_triton as fa
from flashattn_triton.options import use_options

out = sys.argv[1]
q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
k, v = (torch.randn(1, 8, 16384, 128, device="cuda", dtype=torch.bfloat16) for _ in "kv")


def per_call(fn, n=3000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    total = (time.perf_counter() - t) / n * 1e6
    return round(host, 1), round(total, 1)


res = {}
for _round in range(2):
    res.setdefault("ours", []).append(per_call(lambda: fa.flash_attention(q, k, v, True)))
    with use_options(tile_configs=""):
        res.setdefault("ours_in_use_options", []).append(
            per_call(lambda: fa.flash_attention(q, k, v, True))
        )
    res.setdefault("sdpa", []).append(
        per_call(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    )
    res.setdefault("torch_empty_x4", []).append(
        per_call(lambda: [torch.empty(1024, device="cuda") for _ in range(4)])
    )
print("us per call (host loop, with final sync):", res)
pr = cProfile.Profile()
pr.enable()
for _ in range(2000):
    fa.flash_attention(q, k, v, True)
pr.disable()
torch.cuda.synchronize()
s = io.StringIO()
pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
txt = s.getvalue()
open(out, "w").write(str(res) + "\n" + txt)
print(txt[:6000])
