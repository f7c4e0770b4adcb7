"""The Gluon dK/dV kernel with dK, dV stored by TMA (``gluon_dkdv`` ``tma_store``) against
register stores, inside the package's backward at the sweep's d = 128 rows.

    python dkdv_tma_store_probe.py OUT.json [--rounds 3]

Per shape (batch 1, bf16, causal and not): dk and dv of one backward with either setting
must agree bit for bit (the same products and the same rounding, only the stores differ);
then forward + backward through ``flash_attention``, captured in a CUDA graph and replayed
(``do_bench`` medians over interleaved rounds), with either setting, and SDPA cuDNN's.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashattn_triton as fa
from flashattn_triton import gluon_dkdv
from flashattn_triton.launch_plans import clear_plans

# (heads, tokens): below 2048 keys the package's d = 128 backward runs this kernel (the split
# scheme); from 2048 the one-pass kernel, so 32 x 2048 shows no difference.
SHAPES = [(128, 512), (64, 1024), (32, 2048)]


def set_tma_store(on: bool) -> None:
    gluon_dkdv.DEFAULTS[128] = {**gluon_dkdv.DEFAULTS[128], "tma_store": on}
    clear_plans()


def graphed_ms(step) -> float:
    """GPU time of ``step`` replayed from a CUDA graph (as ``gluon_fwd_ab.bench_graph``)."""
    return triton.testing.do_bench_cudagraph(step, rep=100, return_mode="median")


def shape_rows(heads: int, n: int, causal: bool, rounds: int) -> list[dict]:
    q, k, v, do = (
        torch.randn(1, heads, n, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4)
    )

    def grads() -> tuple[torch.Tensor, ...]:
        leaves = tuple(t.detach().requires_grad_() for t in (q, k, v))
        return torch.autograd.grad(fa.flash_attention(*leaves, causal), leaves, do)

    def sdpa() -> None:
        leaves = tuple(t.detach().requires_grad_() for t in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = F.scaled_dot_product_attention(*leaves, is_causal=causal)
        torch.autograd.grad(o, leaves, do)

    set_tma_store(False)
    _, dk_reg, dv_reg = grads()
    set_tma_store(True)
    _, dk_tma, dv_tma = grads()
    same = bool(torch.equal(dk_reg, dk_tma) and torch.equal(dv_reg, dv_tma))
    times: dict[str, list[float]] = {}
    for _ in range(rounds):
        for label, on in (("registers", False), ("tma_store", True)):
            set_tma_store(on)
            times.setdefault(label, []).append(graphed_ms(grads))
        times.setdefault("sdpa_cudnn", []).append(graphed_ms(sdpa))
    base = {"heads": heads, "N": n, "causal": causal, "bitwise_equal": same}
    rows = []
    for label, ts in times.items():
        rows.append({**base, "provider": label, "ms": statistics.median(ts), "rounds": ts})
    print(base, {r["provider"]: round(r["ms"], 4) for r in rows}, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    saved = dict(gluon_dkdv.DEFAULTS[128])
    rows: list[dict] = []
    try:
        for heads, n in SHAPES:
            for causal in (False, True):
                rows += shape_rows(heads, n, causal, args.rounds)
    finally:  # a run stopped part-way keeps its rows
        gluon_dkdv.DEFAULTS[128] = saved
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
