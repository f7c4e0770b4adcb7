"""GQA fwd+bwd on the H100: the one-pass backward's head group, split vs onepass, SDPA.
python gqa_head_group_probe.py OUT.json"""

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
ORIG = gluon_bwd.head_group_args
gluon_bwd.GQA_POW2_GROUPS = False  # the rule as it ran: groups exactly as set below


def set_group(s):
    if s == "auto":
        gluon_bwd.head_group_args = ORIG
    else:
        gluon_bwd.head_group_args = lambda t, bh, n_rows, block_d: {
            "head_group": min(s, bh),
            "GROUPED": min(s, bh) < bh,
        }
    clear_plans()


rows = []
for b, h, hkv, n in ((4, 32, 8, 4096), (1, 32, 8, 16384), (8, 32, 8, 2048)):
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

    ours_fwd = lambda: fa.flash_attention(q.detach(), k.detach(), v.detach(), causal=True)
    sdpa_fwd = lambda: F.scaled_dot_product_attention(
        q.detach(), k.detach(), v.detach(), is_causal=True, enable_gqa=True
    )
    settings = ["auto", 1, 2, 4, 8, 32]
    times = {}
    for _ in range(5):
        for s in settings:
            set_group(s)
            times.setdefault(f"onepass group={s}", []).append(
                triton.testing.do_bench(ours, warmup=25, rep=200)
            )
        set_group("auto")
        fa.set_options(backward="split")
        clear_plans()
        times.setdefault("split", []).append(triton.testing.do_bench(ours, warmup=25, rep=200))
        fa.set_options(backward="auto")
        clear_plans()
        times.setdefault("sdpa", []).append(triton.testing.do_bench(sdpa, warmup=25, rep=200))
        times.setdefault("fwd ours", []).append(
            triton.testing.do_bench(ours_fwd, warmup=25, rep=200)
        )
        times.setdefault("fwd sdpa", []).append(
            triton.testing.do_bench(sdpa_fwd, warmup=25, rep=200)
        )
    base = statistics.median(times["sdpa"])
    print(f"[{time.time() - T0:6.1f}s] == {(b, h, hkv, n)} causal d128", flush=True)
    for name, ts in sorted(times.items(), key=lambda kv: statistics.median(kv[1])):
        med = statistics.median(ts)
        print(
            f"   {name:20s} {med:8.3f} ms  /sdpa {med / base:6.3f}  rounds {' '.join(f'{x:.3f}' for x in ts)}",
            flush=True,
        )
        rows.append({"shape": [b, h, hkv, n, 128, True], "setting": name, "ms": med, "rounds": ts})
    json.dump(rows, open(sys.argv[1], "w"), indent=1)
print("done", flush=True)
