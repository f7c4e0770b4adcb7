"""Forward + backward through ``flash_attention`` at head dim 128 with the package default
(the one-pass backward from 2048 keys on Hopper) against ``Options.backward="split"`` and
SDPA's cuDNN and flash backends, two interleaved rounds in one process (``do_bench``
medians, bf16). Produced ``h200_onepass_pkg_time.json`` (the default shapes),
``h200_onepass_4k_8k.json`` and ``h200_onepass_min_keys.json`` (with ``--min-keys``).

    python onepass_pkg_time.py OUT_DIR
    python onepass_pkg_time.py OUT_DIR 4,32,32,4096,1 2,16,16,8192,1 --min-keys 4096

Shapes as B,H,HKV,N,CAUSAL (0/1); ``--min-keys`` lowers ``gluon_bwd.MIN_KEYS`` so that the
one-pass kernel runs below the package's threshold (to place that threshold).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashattn_triton import flash_attention, use_options

SHAPES = [  # B, H, H_kv, N, causal
    (1, 16, 16, 16384, True),
    (1, 32, 32, 32768, True),
    (1, 16, 16, 16384, False),
    (1, 32, 8, 16384, True),
    (2, 16, 16, 16384, True),
]


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=300, return_mode="median")


def measure(b: int, h: int, h_kv: int, n: int, causal: bool) -> dict:
    """One row: ms per forward + backward of each provider, two rounds."""
    q = torch.randn(b, h, n, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (
        torch.randn(b, h_kv, n, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(2)
    )
    do = torch.randn_like(q)

    def ours():
        o = flash_attention(q, k, v, causal=causal)
        torch.autograd.grad(o, (q, k, v), do)

    def sdpa():
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=h_kv != h)
        torch.autograd.grad(o, (q, k, v), do)

    row: dict = {"shape": [b, h, h_kv, n, 128], "causal": causal}
    for again in ("", " again"):
        row["ours (onepass)" + again] = bench(ours)
        with use_options(backward="split"):
            row["ours split" + again] = bench(ours)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            row["sdpa cudnn" + again] = bench(sdpa)
        if not again:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                row["sdpa flash"] = bench(sdpa)
    return row


def main(argv: list[str]) -> None:
    import argparse

    from flashattn_triton import gluon_bwd, launch_plans

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("shapes", nargs="*", help="B,H,HKV,N,CAUSAL(0/1); default: the table's")
    ap.add_argument("--min-keys", type=int, default=None, help="override gluon_bwd.MIN_KEYS")
    a = ap.parse_args(argv)
    if a.min_keys is not None:
        gluon_bwd.MIN_KEYS = a.min_keys
        launch_plans.clear_plans()
    shapes = SHAPES
    if a.shapes:
        shapes = [tuple(int(x) for x in s.split(",")) for s in a.shapes]
        shapes = [(b, h, hkv, n, bool(c)) for b, h, hkv, n, c in shapes]
    out = a.out
    rows = []
    for shape in shapes:
        rows.append(measure(*shape))
        print(" | ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                         for k, v in rows[-1].items()), flush=True)  # fmt: skip
        torch.cuda.empty_cache()
    os.makedirs(out, exist_ok=True)
    with open(f"{out}/onepass_pkg_time.json", "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
