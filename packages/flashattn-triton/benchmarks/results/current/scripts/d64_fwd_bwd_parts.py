"""Head dim 64, where the time goes: the Gluon forward (``gluon_fwd``, shipped for d = 128 only)
at d = 64 in seven variants (two math warpgroups, or three with 192 query rows) against the
package's Triton forward and SDPA cuDNN (forward alone), and the backward alone of ours
against cuDNN's. bf16, one process, three interleaved
rounds, ``do_bench`` medians in ms.

    python d64_fwd_bwd_parts.py OUT.json

Each Gluon variant is first checked against a float32 reference on awkward shapes.
"""

import json
import math
import statistics
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashattn_triton as fa
from flashattn_triton import gluon_fwd
from flashattn_triton.reference import attention_reference

D = 64
out = sys.argv[1]
torch.manual_seed(0)


VARIANTS = {
    "g_n128_s2": {"block_n": 128, "stages": 2, "head_group": 4},
    "g_n128_s3": {"block_n": 128, "stages": 3, "head_group": 4},
    "g_n64_s3": {"block_n": 64, "stages": 3, "head_group": 4},
    "g_n128_s2_pp": {"block_n": 128, "stages": 2, "head_group": 4, "pingpong": True},
    # three math warpgroups, 192 query rows (FlashAttention-3's d = 64 shape)
    "g3_n128_s2": {"block_m": 192, "block_n": 128, "stages": 2, "head_group": 4,
                   "consumer_regs": 160},
    "g3_n128_s3": {"block_m": 192, "block_n": 128, "stages": 3, "head_group": 4,
                   "consumer_regs": 160},
    "g3_n128_s2_plain": {"block_m": 192, "block_n": 128, "stages": 2, "consumer_regs": 160},
}  # fmt: skip


def gl(q, k, v, causal, **kw):
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], device=q.device, dtype=torch.float32)
    gluon_fwd.launch_fwd(q, k, v, o, lse, causal, 1 / math.sqrt(D), **kw)
    return o, lse


# correctness
ok = {}
for name, kw in VARIANTS.items():
    errs = []
    try:
        for b, h, nq, nk, causal in [
            (1, 2, 300, 300, True),
            (2, 3, 1000, 1000, False),
            (1, 2, 129, 777, True),
            (1, 4, 2048, 2048, False),
        ]:
            q = torch.randn(b, h, nq, D, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(b, h, nk, D, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(b, h, nk, D, device="cuda", dtype=torch.bfloat16)
            o, lse = gl(q, k, v, causal, **kw)
            ro, rl = attention_reference(q, k, v, causal, 1 / math.sqrt(D))
            errs.append(((o.float() - ro).abs().max().item(), (lse - rl).abs().max().item()))
        ok[name] = max(e[0] for e in errs) < 2e-2 and max(e[1] for e in errs) < 1e-3
        print(name, "errors", errs, "ok" if ok[name] else "BAD", flush=True)
    except Exception as e:
        ok[name] = False
        print(name, "failed:", type(e).__name__, str(e)[:400], flush=True)


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100)


shapes = [
    (1, 16, 16384, False),
    (1, 16, 16384, True),
    (1, 8, 8192, False),
    (1, 16, 4096, False),
    (1, 32, 2048, False),
    (1, 8, 8192, True),
]
rows = []
for b, h, n, causal in shapes:
    q, k, v = (torch.randn(b, h, n, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    do = torch.randn_like(q)
    fns = {}
    fns["triton_fwd"] = lambda: fa.flash_attention(q, k, v, causal=causal)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def cudnn_fwd():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    fns["cudnn_fwd"] = cudnn_fwd
    for name, kw in VARIANTS.items():
        if ok[name]:
            fns[name] = lambda kw=kw: gl(q, k, v, causal, **kw)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    o_ours = fa.flash_attention(qg, kg, vg, causal=causal)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o_cud = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
    fns["ours_bwd"] = lambda: torch.autograd.grad(o_ours, (qg, kg, vg), do, retain_graph=True)
    fns["cudnn_bwd"] = lambda: torch.autograd.grad(o_cud, (qg, kg, vg), do, retain_graph=True)
    times = {n_: [] for n_ in fns}
    for _ in range(3):
        for n_, f in fns.items():
            times[n_].append(bench(f))
    row = {
        "shape": f"{b}x{h}x{n}",
        "causal": causal,
        **{n_: statistics.median(t) for n_, t in times.items()},
    }
    rows.append(row)
    print(json.dumps(row), flush=True)
json.dump(rows, open(out, "w"), indent=1)
