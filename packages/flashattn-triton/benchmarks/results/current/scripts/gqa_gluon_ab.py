"""A/B on one GPU: grouped-query d=128 with the Gluon backward kernels vs the Triton ones,
forward tile 8 vs 4 warps; plus plain d=128 causal (Gluon dK/dV changed) vs cuDNN."""

import json
import statistics
import sys

import torch
import torch.nn.functional as F
import triton

import flashattn_triton as fa
from flashattn_triton.options import use_options

dev = "cuda"
torch.manual_seed(0)
VARIANTS = {
    "triton_bwd": {"gluon": False},
    "gluon_bwd": {"gluon": True},
    "gluon_bwd_fwd4w": {"gluon": True, "tile_configs": "fwd=128,64,4,2,tma"},
    "gluon_bwd_fwd4w3s": {"gluon": True, "tile_configs": "fwd=128,64,4,3,tma"},
}
rows = []


def bench(fn, rep=200):
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def case(b, hq, hkv, n, d=128, causal=True, rounds=3):
    mk = lambda h: torch.randn(b, h, n, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    q, k, v = mk(hq), mk(hkv), mk(hkv)
    do = torch.randn_like(q)

    def fwd_bwd(f):
        def run():
            o = f()
            torch.autograd.grad(o, (q, k, v), do)

        return run

    ours = lambda: fa.flash_attention(q, k, v, causal)
    if hkv != hq:
        sdpa = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        sdpa_name = "sdpa_gqa"
    else:

        def sdpa():
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        sdpa_name = "sdpa_cudnn"
    # correctness of each variant vs the Triton path
    with use_options(gluon=False):
        o0 = ours()
        g0 = torch.autograd.grad(o0, (q, k, v), do)
    for name, opts in VARIANTS.items():
        with use_options(**opts):
            o1 = ours()
            g1 = torch.autograd.grad(o1, (q, k, v), do)
        errs = [
            ((a.float() - c.float()).norm() / c.float().norm()).item()
            for a, c in zip((o1, *g1), (o0, *g0))
        ]
        print(
            f"check {name} {b},{hq},{hkv},{n} rel diff o/dq/dk/dv "
            + " ".join(f"{e:.1e}" for e in errs),
            flush=True,
        )
    res = {}
    for _r in range(rounds):
        for name, opts in [*VARIANTS.items(), (sdpa_name, None)]:
            if opts is None:
                f, fb = sdpa, fwd_bwd(sdpa)
                t_f, t_fb = bench(f), bench(fb)
            else:
                with use_options(**opts):
                    t_f, t_fb = bench(ours), bench(fwd_bwd(ours))
            res.setdefault(name, []).append((t_f, t_fb))
    for name, ts in res.items():
        f = statistics.median(t[0] for t in ts)
        fb = statistics.median(t[1] for t in ts)
        row = {
            "shape": f"{b}x{hq}/{hkv}x{n}x{d}",
            "causal": causal,
            "variant": name,
            "fwd_ms": round(f, 4),
            "fwd_bwd_ms": round(fb, 4),
        }
        rows.append(row)
        print(row, flush=True)


print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
case(4, 32, 8, 4096)
case(1, 32, 8, 16384)
case(2, 16, 2, 8192, causal=False)
case(1, 16, 16, 16384)  # plain d=128 leaderboard-like
case(4, 32, 32, 4096)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
