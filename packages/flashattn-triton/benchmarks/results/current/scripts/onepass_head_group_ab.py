"""GPU time of the one-pass d = 128 backward with its head-group cap against without it.

    python onepass_head_group_ab.py OUT.json [--check]

``gluon_bwd.MAX_HEAD_GROUP`` = 2 (the shipped cap: two k/v heads' programs at a time where
the L2 rule keeps the plain order, not on causal grids under ``CAUSAL_MIN_WAVES`` waves)
against 10**9 (no cap: the rule as before). Forward + backward through ``flash_attention``,
captured in a CUDA graph and replayed (``do_bench`` medians of three interleaved rounds), with
SDPA cuDNN (SDPA flash for grouped-query heads) alongside. ``--check``: five shapes only.
"""

import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashattn_triton as fa
from flashattn_triton import gluon_bwd
from flashattn_triton.launch_plans import clear_plans

T0 = time.time()
# (batch, q heads, k/v heads, tokens, causal)
SHAPES = [
    (1, 32, 32, 2048, True),
    (1, 16, 16, 4096, True),
    (1, 8, 8, 8192, True),
    (2, 16, 16, 4096, True),
    (8, 16, 16, 2048, True),
    (2, 16, 16, 8192, True),
    (4, 32, 32, 4096, True),
    (1, 16, 16, 16384, True),
    (1, 32, 32, 2048, False),
    (1, 16, 16, 4096, False),
    (8, 16, 16, 2048, False),
    (2, 16, 16, 8192, False),
    (1, 16, 16, 16384, False),
]
CHECK = [SHAPES[i] for i in (6, 4, 0, 12, 10)]
if "--check" in sys.argv:
    SHAPES = CHECK
CAPS = {"cap 2 (new)": 2, "no cap (before)": 10**9}
rows = []
for b, h, hkv, n, causal in SHAPES:
    g = torch.Generator(device="cuda").manual_seed(n + h)
    q, do = (
        torch.randn(b, h, n, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        for _ in range(2)
    )
    k, v = (
        torch.randn(b, hkv, n, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        for _ in range(2)
    )
    for t in (q, k, v):
        t.requires_grad_(True)
    gqa = hkv != h
    backend = SDPBackend.FLASH_ATTENTION if gqa else SDPBackend.CUDNN_ATTENTION

    def sdpa():
        with sdpa_kernel(backend):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
        return torch.autograd.grad(o, (q, k, v), do)

    def ours():
        return torch.autograd.grad(fa.flash_attention(q, k, v, causal), (q, k, v), do)

    ref = sdpa()
    times = {}
    for r in range(3):
        for name, cap in CAPS.items():
            gluon_bwd.MAX_HEAD_GROUP = cap
            clear_plans()
            if r == 0:
                err = max((a.float() - b_.float()).abs().max().item() for a, b_ in zip(ours(), ref))
                assert err < 0.1, (name, err)
            ours()
            ours()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                ours()
            times.setdefault(name, []).append(
                triton.testing.do_bench(graph.replay, warmup=25, rep=200)
            )
            del graph
        gluon_bwd.MAX_HEAD_GROUP = 2
        clear_plans()
        sdpa()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            sdpa()
        times.setdefault("sdpa", []).append(
            triton.testing.do_bench(graph.replay, warmup=25, rep=200)
        )
        del graph
    med = {k_: statistics.median(v_) for k_, v_ in times.items()}
    row = {
        "shape": f"{b} x {h}" + (f" ({hkv})" if gqa else "") + f" x {n}",
        "causal": causal,
        "sdpa": "flash" if gqa else "cudnn",
        **{k_: round(v_, 4) for k_, v_ in med.items()},
        "rounds": times,
        "new_over_before": med["cap 2 (new)"] / med["no cap (before)"],
        "new_over_sdpa": med["cap 2 (new)"] / med["sdpa"],
    }
    rows.append(row)
    print(
        f"[{time.time() - T0:6.1f}s] {row['shape']:22s} causal={causal!s:5s} new {med['cap 2 (new)']:8.3f} "
        f"before {med['no cap (before)']:8.3f} sdpa {med['sdpa']:8.3f}  new/before {row['new_over_before']:.3f} "
        f"new/sdpa {row['new_over_sdpa']:.3f}",
        flush=True,
    )
    json.dump(
        {"device": torch.cuda.get_device_name(), "rows": rows}, open(sys.argv[1], "w"), indent=1
    )
