"""GPU time at the sweep's short rows where ours trails cuDNN eager: which part, which choice.

    python short_rows_probe.py OUT.json [--rounds 2] [--gluon-fwd]

For each shape (batch 1, bf16): the forward alone and forward + backward, captured in a CUDA
graph and replayed (``do_bench`` medians over interleaved rounds), for SDPA cuDNN, ours with
the defaults, and ours under option variants (Gluon kernels off, other backward schemes,
other forward tiles; with ``--gluon-fwd``, d = 128 at 512 to 2048 keys with the Gluon forward
allowed from any length instead). A variant that fails (e.g. a tile that does not fit) is recorded as
such. Every variant's gradients are checked against cuDNN's first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashattn_triton as fa
from flashattn_triton import gluon_fwd
from flashattn_triton.launch_plans import clear_plans
from flashattn_triton.options import use_options

# (heads, tokens, head dim, causal)
SHAPES = [
    (128, 512, 128, False),
    (64, 1024, 128, False),
    (32, 2048, 128, False),
    (16, 4096, 64, False),
    (128, 512, 64, True),
]
GLUON_FWD_SHAPES = [
    (128, 512, 128, False),
    (64, 1024, 128, False),
    (128, 512, 128, True),
    (64, 1024, 128, True),
    (32, 2048, 128, False),
]
VARIANTS: dict[str, dict] = {
    "default": {},
    "gluon off": {"gluon": False},
    "bwd split": {"backward": "split"},
    "bwd fused": {"backward": "fused"},
    "bwd onepass": {"backward": "onepass"},
    "fwd 64,64,4,3,tma": {"tile_configs": "fwd=64,64,4,3,tma"},
    "fwd 128,128,8,2,tma": {"tile_configs": "fwd=128,128,8,2,tma"},
    "fwd 128,64,8,2,tma": {"tile_configs": "fwd=128,64,8,2,tma"},
    "fwd 64,128,4,2,tma": {"tile_configs": "fwd=64,128,4,2,tma"},
}


def gluon_fwd_from(min_keys: int) -> None:
    gluon_fwd.DEFAULTS[128]["min_keys"] = min_keys
    clear_plans()


def graphed_ms(fn) -> float:
    fn()
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    ms = triton.testing.do_bench(graph.replay, warmup=25, rep=150)
    del graph
    return ms


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--gluon-fwd", action="store_true")
    a = ap.parse_args()
    shapes, variants = SHAPES, VARIANTS
    shipped_min_keys = gluon_fwd.DEFAULTS[128]["min_keys"]
    if a.gluon_fwd:
        shapes = GLUON_FWD_SHAPES
        variants = {"default": {}, "gluon fwd from any length": {"min_keys": 0}}
    t0 = time.time()
    rows = []
    for h, n, d, causal in shapes:
        g = torch.Generator(device="cuda").manual_seed(h * n + d)
        q, k, v, do = (
            torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(4)
        )
        for t in (q, k, v):
            t.requires_grad_(True)

        def sdpa_fwd():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), torch.no_grad():
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        def sdpa_both():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            return torch.autograd.grad(o, (q, k, v), do)

        def ours_fwd():
            with torch.no_grad():
                return fa.flash_attention(q, k, v, causal)

        def ours_both():
            return torch.autograd.grad(fa.flash_attention(q, k, v, causal), (q, k, v), do)

        ref = sdpa_both()
        times: dict[str, list[float]] = {}
        errors: dict[str, str] = {}
        for r in range(a.rounds):
            times.setdefault("cudnn fwd", []).append(graphed_ms(sdpa_fwd))
            times.setdefault("cudnn fwd+bwd", []).append(graphed_ms(sdpa_both))
            for name, opts in variants.items():
                if name in errors:
                    continue
                opts = dict(opts)
                gluon_fwd_from(opts.pop("min_keys", shipped_min_keys))
                try:
                    with use_options(**opts):
                        if r == 0:
                            err = max(
                                (x.float() - y.float()).abs().max().item()
                                for x, y in zip(ours_both(), ref, strict=True)
                            )
                            if err > 0.1:
                                raise AssertionError(f"max error {err:.3g} against cuDNN")
                        times.setdefault(f"{name} fwd", []).append(graphed_ms(ours_fwd))
                        times.setdefault(f"{name} fwd+bwd", []).append(graphed_ms(ours_both))
                except Exception as e:  # recorded, the probe goes on
                    errors[name] = f"{type(e).__name__}: {str(e)[:200]}"
        med = {key: round(statistics.median(vals), 4) for key, vals in times.items()}
        row = {"heads": h, "N": n, "d": d, "causal": causal, "ms": med, "errors": errors}
        rows.append(row)
        best = min((v_, k_) for k_, v_ in med.items() if k_.endswith("fwd+bwd"))
        print(
            f"[{time.time() - t0:5.0f}s] {h}x{n} d={d} causal={causal}: cudnn "
            f"{med['cudnn fwd']:.4f}/{med['cudnn fwd+bwd']:.4f} ours "
            f"{med['default fwd']:.4f}/{med['default fwd+bwd']:.4f} best {best[1]} {best[0]:.4f}"
            f" errors {sorted(errors)}",
            flush=True,
        )
        for key, val in med.items():
            print(f"    {key:28s} {val:.4f}")
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
