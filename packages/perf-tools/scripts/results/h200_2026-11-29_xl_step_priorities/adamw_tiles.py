"""`python adamw_tiles.py OUT.json` (one GPU): adamw_master_kernel variants (elements per
program, warps, eviction hints, several tiles per program) at the xl block's four weight
sizes (bf16 parameter and gradient, fp32 master and moments), timed in CUDA graphs, with a
plain copy's bandwidth beside them."""

import json
import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench_cudagraph

from lm_core import adamw_triton as A


@triton.jit
def kern(
    W,
    P,
    G,
    M,
    V,
    STEP,
    lr,
    beta1,
    beta2,
    log2_beta1,
    log2_beta2,
    eps,
    weight_decay,
    n,
    BLOCK: tl.constexpr,
    EVICT: tl.constexpr,
    LOOP: tl.constexpr,
):
    pid = tl.program_id(0)
    step = tl.load(STEP)
    for it in range(LOOP):
        offs = (pid.to(tl.int64) * LOOP + it) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        if EVICT:
            p = tl.load(P + offs, mask=mask, other=0.0, eviction_policy="evict_first")
            g = A._bf16_bits_to_f32(
                tl.load(G + offs, mask=mask, other=0, eviction_policy="evict_first")
            )
            m = tl.load(M + offs, mask=mask, other=0.0, eviction_policy="evict_first")
            v = tl.load(V + offs, mask=mask, other=0.0, eviction_policy="evict_first")
        else:
            p = tl.load(P + offs, mask=mask, other=0.0)
            g = A._bf16_bits_to_f32(tl.load(G + offs, mask=mask, other=0))
            m = tl.load(M + offs, mask=mask, other=0.0)
            v = tl.load(V + offs, mask=mask, other=0.0)
        p, m, v = A.adamw_update(
            p, g, m, v, step, lr, beta1, beta2, log2_beta1, log2_beta2, eps, weight_decay
        )
        idx = offs.to(tl.uint32)
        if EVICT:
            tl.store(P + offs, p, mask=mask, cache_modifier=".cs")
            tl.store(
                W + offs, A._f32_to_bf16_bits(p, idx, 0, False), mask=mask, cache_modifier=".cs"
            )
            tl.store(M + offs, m, mask=mask, cache_modifier=".cs")
            tl.store(V + offs, v, mask=mask, cache_modifier=".cs")
        else:
            tl.store(P + offs, p, mask=mask)
            tl.store(W + offs, A._f32_to_bf16_bits(p, idx, 0, False), mask=mask)
            tl.store(M + offs, m, mask=mask)
            tl.store(V + offs, v, mask=mask)


def main():
    out = sys.argv[1]
    dev = "cuda"
    sizes = [4800 * 1600, 1600 * 1600, 12800 * 1600, 1600 * 6400]  # qkv, wo, w13, w2
    bufs = []
    for n in sizes:
        bufs.append(
            {
                "w": torch.randn(n, device=dev).bfloat16(),
                "p": torch.randn(n, device=dev),
                "g": torch.randn(n, device=dev).bfloat16(),
                "m": torch.randn(n, device=dev) * 0.01,
                "v": torch.rand(n, device=dev) * 0.01,
            }
        )
    step = torch.tensor(3.0, device=dev)
    hp = {"lr": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}
    total_bytes = sum(sizes) * 28

    def shipped():
        for b in bufs:
            A.adamw_master_step(
                b["w"], b["p"], b["g"], b["m"], b["v"], step, stochastic=False, **hp
            )

    def variant(block, warps, evict, loop):
        def f():
            for b, n in zip(bufs, sizes):
                kern[(triton.cdiv(n, block * loop),)](
                    b["w"].view(torch.int16),
                    b["p"],
                    b["g"].view(torch.int16),
                    b["m"],
                    b["v"],
                    step,
                    hp["lr"],
                    hp["beta1"],
                    hp["beta2"],
                    A._log2(0.9),
                    A._log2(0.95),
                    hp["eps"],
                    hp["weight_decay"],
                    n,
                    BLOCK=block,
                    EVICT=evict,
                    LOOP=loop,
                    num_warps=warps,
                )

        return f

    src = torch.empty(2 * 1024**3 // 4, device=dev)
    dst = torch.empty_like(src)
    results = {}
    copy_ms = do_bench_cudagraph(lambda: dst.copy_(src), rep=200)
    results["copy_2GiB_TBps"] = 2 * src.numel() * 4 / copy_ms / 1e9
    print(f"copy: {results['copy_2GiB_TBps']:.3f} TB/s", flush=True)
    variants = {"shipped": shipped}
    for block in (1024, 2048, 4096):
        for warps in (4, 8):
            for evict in (False, True):
                variants[f"b{block}_w{warps}_e{int(evict)}"] = variant(block, warps, evict, 1)
    for loop in (2, 4):
        variants[f"b1024_w4_e0_loop{loop}"] = variant(1024, 4, False, loop)
        variants[f"b2048_w8_e0_loop{loop}"] = variant(2048, 8, False, loop)
    for r in range(3):
        for name, f in variants.items():
            f()
            torch.cuda.synchronize()
            ms = do_bench_cudagraph(f, rep=100)
            results.setdefault(name, []).append(ms)
            print(f"round {r} {name}: {ms:.4f} ms {total_bytes / ms / 1e9:.3f} TB/s", flush=True)
    print("median per variant (ms for the four tensors of one xl block; x48 per step):")
    for name, v in results.items():
        if isinstance(v, list):
            med = sorted(v)[1]
            print(
                f"{name:28s} {med:.4f} ms  {total_bytes / med / 1e9:.3f} TB/s"
                f"  step {48 * med:.2f} ms"
            )
    with open(out, "w") as f:
        json.dump(results, f, indent=1)


main()
