"""Tile probe on the GPU: d = 64 forward / backward tiles (non-causal gap) and decode tiles.

python tile_probe.py OUT.json [--rounds N] [--only fwd,bwd,decode]
Interleaved rounds in one process, do_bench medians; SDPA cuDNN (or default SDPA for decode)
in every round. Each spec is checked against SDPA's output before timing.
"""

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashattn_triton as fa
from flashattn_triton.options import use_options

T0 = time.time()


def log(msg):
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def bench(fn, rep=200):
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


FWD_SPECS = [
    "",
    "128,128,8,3,tma",
    "128,64,4,3,tma",
    "128,64,4,4,tma",
    "128,128,4,2,tma",
    "64,128,4,3,tma",
    "128,128,4,4,tma",
    "128,64,8,3,tma",
]
DKDV_SPECS = [
    "",
    "64,64,4,3,tma,r160",
    "64,64,4,4,tma,r168",
    "64,128,8,3,tma",
    "128,64,8,3,tma",
    "64,64,4,2,tma,r168",
    "32,64,4,3,tma,r128",
]
DQ_SPECS = [
    "",
    "128,64,8,4,tma",
    "128,128,8,3,tma",
    "64,64,4,3,tma",
    "128,64,4,3,tma",
    "128,32,8,3,tma",
    "64,128,4,3,tma",
]
D64_SHAPES = [
    (1, 16, 16384, False),
    (1, 8, 8192, False),
    (4, 16, 4096, False),
    (1, 16, 16384, True),
]
DECODE_SPECS = ["", "16,128,8,3", "16,128,4,3", "16,128,4,2", "16,128,8,2", "16,64,8,3"]
DECODE_SHAPES = [(8, 32, 32, 8192), (8, 32, 32, 65536), (1, 32, 8, 65536), (4, 32, 8, 32768)]


def qkv(b, h, n, d=64, grad=False):
    g = torch.Generator(device="cuda").manual_seed(b * 1000 + h + n)
    t = [
        torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4)
    ]
    if grad:
        for x in t[:3]:
            x.requires_grad_(True)
    return t


def probe_fwd(rounds, rows):
    for b, h, n, causal in D64_SHAPES:
        q, k, v, _ = qkv(b, h, n)
        with torch.no_grad(), sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        times = {}
        for r in range(rounds):
            for spec in FWD_SPECS:
                with torch.no_grad(), use_options(tile_configs=f"fwd={spec}" if spec else ""):
                    try:
                        if r == 0:
                            err = (
                                (fa.flash_attention(q, k, v, causal).float() - ref.float())
                                .abs()
                                .max()
                                .item()
                            )
                            assert err < 2e-2, err
                        t = bench(lambda: fa.flash_attention(q, k, v, causal))
                    except Exception as e:
                        log(f"fwd {spec}: {e!r:.120}")
                        t = float("nan")
                times.setdefault(spec or "default", []).append(t)
            with torch.no_grad(), sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                times.setdefault("cudnn", []).append(
                    bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
                )
        emit(rows, "fwd", (b, h, n, causal), times)


def probe_bwd(rounds, rows):
    for b, h, n, causal in D64_SHAPES:
        q, k, v, do = qkv(b, h, n, grad=True)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            ref = torch.autograd.grad(o, (q, k, v), do)

        def step():
            o = fa.flash_attention(q, k, v, causal)
            return torch.autograd.grad(o, (q, k, v), do)

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            return torch.autograd.grad(o, (q, k, v), do)

        specs = [""] + [f"dkdv={s}" for s in DKDV_SPECS[1:]] + [f"dq={s}" for s in DQ_SPECS[1:]]
        times = {}
        for r in range(rounds):
            for spec in specs:
                with use_options(tile_configs=spec, backward="split"):
                    try:
                        if r == 0:
                            g = step()
                            err = max(
                                (a.float() - b_.float()).abs().max().item() for a, b_ in zip(g, ref)
                            )
                            assert err < 5e-2, err
                        t = bench(step)
                    except Exception as e:
                        log(f"bwd {spec}: {e!r:.120}")
                        t = float("nan")
                times.setdefault(spec or "default", []).append(t)
            times.setdefault("cudnn", []).append(bench(cudnn))
        emit(rows, "fwd+bwd", (b, h, n, causal), times)


def probe_decode(rounds, rows):
    for b, h, hkv, nk in DECODE_SHAPES:
        q = torch.randn(b, h, 1, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, hkv, nk, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=hkv != h)
        times = {}
        for r in range(rounds):
            for spec in DECODE_SPECS:
                with torch.no_grad(), use_options(tile_configs=f"decode={spec}" if spec else ""):
                    try:
                        if r == 0:
                            err = (
                                (fa.flash_attention(q, k, v, True).float() - ref.float())
                                .abs()
                                .max()
                                .item()
                            )
                            assert err < 1e-2, err
                        t = bench(lambda: fa.flash_attention(q, k, v, True), rep=300)
                    except Exception as e:
                        log(f"decode {spec}: {e!r:.120}")
                        t = float("nan")
                times.setdefault(spec or "default", []).append(t)
            times.setdefault("sdpa", []).append(
                bench(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=hkv != h), rep=300)
            )
        emit(rows, "decode", (b, h, hkv, nk), times)


def emit(rows, what, shape, times):
    ref = statistics.median(times["cudnn" if "cudnn" in times else "sdpa"])
    base = statistics.median(times["default"])
    log(f"== {what} {shape}")
    for name, ts in sorted(times.items(), key=lambda kv: statistics.median(kv[1])):
        med = statistics.median(ts)
        log(
            f"   {name:28s} {med:9.4f} ms  /ref {med / ref:6.4f}  /default {med / base:6.4f}  rounds {' '.join(f'{t:.4f}' for t in ts)}"
        )
        rows.append(
            {
                "what": what,
                "shape": list(shape),
                "spec": name,
                "ms": med,
                "rounds": ts,
                "vs_ref": med / ref,
                "vs_default": med / base,
            }
        )


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--only", default="fwd,bwd,decode")
    a = p.parse_args()
    rows = []
    parts = a.only.split(",")
    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
    }
    for name, fn in (("decode", probe_decode), ("fwd", probe_fwd), ("bwd", probe_bwd)):
        if name in parts:
            fn(a.rounds + (2 if name == "decode" else 0), rows)
            json.dump({"meta": meta, "rows": rows}, open(a.out, "w"), indent=1)
    log("done")


if __name__ == "__main__":
    main()
