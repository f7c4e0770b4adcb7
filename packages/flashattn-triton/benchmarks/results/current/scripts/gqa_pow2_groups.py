"""GQA fwd+bwd on the H100: the shipped rule (GQA groups rounded to powers of two) against
the L2 rule unrounded, and SDPA enable_gqa. python gqa_pow2_groups.py OUT.json"""

import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F
import triton

import flashattn_triton as fa
from flashattn_triton import gluon_bwd
from flashattn_triton.launch_plans import clear_plans

T0 = time.time()
rows = []
for b, h, hkv, n in ((4, 32, 8, 4096), (8, 32, 8, 2048), (1, 32, 8, 16384), (2, 32, 8, 4096)):
    g = torch.Generator(device="cuda").manual_seed(n)
    mk = lambda hh: torch.randn(b, hh, n, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    q, do = mk(h), mk(h)
    k, v = mk(hkv), mk(hkv)
    for t in (q, k, v):
        t.requires_grad_(True)
    ours = lambda: torch.autograd.grad(fa.flash_attention(q, k, v, causal=True), (q, k, v), do)

    def sdpa():
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return torch.autograd.grad(o, (q, k, v), do)

    groups = {}
    for flag in (True, False):
        gluon_bwd.GQA_POW2_GROUPS = flag
        clear_plans()
        groups[flag] = gluon_bwd.head_group(q.detach(), k.detach(), True)
    times = {"rounded": [], "unrounded": [], "sdpa": []}
    for r in range(7):
        order = [("rounded", True), ("unrounded", False), ("sdpa", None)]
        if r % 2:
            order.reverse()
        for name, flag in order:
            if flag is None:
                times[name].append(triton.testing.do_bench(sdpa, warmup=25, rep=200))
            else:
                gluon_bwd.GQA_POW2_GROUPS = flag
                clear_plans()
                times[name].append(triton.testing.do_bench(ours, warmup=25, rep=200))
    gluon_bwd.GQA_POW2_GROUPS = True
    clear_plans()
    base = statistics.median(times["sdpa"])
    print(
        f"[{time.time() - T0:6.1f}s] == {(b, h, hkv, n)} causal d128 groups rounded {groups[True]} unrounded {groups[False]}",
        flush=True,
    )
    for name, ts in times.items():
        med = statistics.median(ts)
        ratios = [a / c for a, c in zip(ts, times["sdpa"])]
        print(
            f"   {name:10s} {med:8.3f} ms  /sdpa {med / base:6.3f}  per-round {' '.join(f'{x:.3f}' for x in ratios)}",
            flush=True,
        )
        rows.append(
            {
                "shape": [b, h, hkv, n, 128, True],
                "setting": name,
                "group": groups.get(name == "rounded") if name != "sdpa" else None,
                "ms": med,
                "rounds": ts,
            }
        )
    json.dump(rows, open(sys.argv[1], "w"), indent=1)
print("done", flush=True)
