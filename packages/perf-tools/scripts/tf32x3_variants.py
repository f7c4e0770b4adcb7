"""Where lm_core's 3xTF32 GEMM spends its time: variants of `tf32x3_triton.mm_kernel` on the
products of one small-model train step (GPU).

    python packages/perf-tools/scripts/tf32x3_variants.py OUT.json

VARIANT 0 is the shipped kernel (per K tile, three TF32 products into a fresh accumulator,
added to the float32 total in registers); 1 accumulates all three in the matrix unit's
accumulator across K (fast, inaccurate); 2 runs the hi x hi product only (the price of one
TF32 GEMM); 3 carries the two small cross terms in the accumulator and adds only hi x hi per
tile in registers; 4 loads all four parts but runs one product. Each variant is autotuned
over the shipped configs and a few wider ones, timed in CUDA graphs (`do_bench_cudagraph`)
on the pre-split operands (the split kernel is the same for all), with its relative
Frobenius error against a float64 product beside cuBLAS SGEMM's. Per-step totals weigh each
product by its count.
"""

import json
import sys

import torch
import triton
import triton.language as tl

from lm_core import tf32x3_triton as tt


@triton.jit
def mmv(
    A,
    B,
    C,
    M,
    N,
    K,
    half_a,
    half_b,
    stride_c,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    VARIANT: tl.constexpr,
):
    """`tf32x3_triton.mm_kernel` with its K loop replaced by variant VARIANT (module doc)."""
    m0, n0 = tt.tile_origin(tl.program_id(0), M, N, BM, BN, GROUP_M)
    offs_k = tl.arange(0, BK)
    a_ptrs = A + m0.to(tl.int64) * K + (tl.arange(0, BM)[:, None] * K + offs_k[None, :])
    b_ptrs = B + n0.to(tl.int64) * K + (tl.arange(0, BN)[:, None] * K + offs_k[None, :])
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    accx = tl.zeros((BM, BN), dtype=tl.float32)
    for _ in tl.range(0, K, BK):
        a_hi = tl.load(a_ptrs)
        b_hi = tl.load(b_ptrs)
        if VARIANT == 0:  # shipped: 3 dots fresh, add
            a_lo = tl.load(a_ptrs + half_a)
            b_lo = tl.load(b_ptrs + half_b)
            part = tl.dot(a_lo, b_hi.T, input_precision="tf32")
            part = tl.dot(a_hi, b_lo.T, part, input_precision="tf32")
            part = tl.dot(a_hi, b_hi.T, part, input_precision="tf32")
            acc += part
        elif VARIANT == 1:  # 3 dots carried (inaccurate)
            a_lo = tl.load(a_ptrs + half_a)
            b_lo = tl.load(b_ptrs + half_b)
            acc = tl.dot(a_lo, b_hi.T, acc, input_precision="tf32")
            acc = tl.dot(a_hi, b_lo.T, acc, input_precision="tf32")
            acc = tl.dot(a_hi, b_hi.T, acc, input_precision="tf32")
        elif VARIANT == 2:  # 1 dot carried, hi only
            acc = tl.dot(a_hi, b_hi.T, acc, input_precision="tf32")
        elif VARIANT == 3:  # cross terms carried, hi*hi fresh + add
            a_lo = tl.load(a_ptrs + half_a)
            b_lo = tl.load(b_ptrs + half_b)
            accx = tl.dot(a_lo, b_hi.T, accx, input_precision="tf32")
            accx = tl.dot(a_hi, b_lo.T, accx, input_precision="tf32")
            acc += tl.dot(a_hi, b_hi.T, input_precision="tf32")
        else:  # 4: 4 loads, 1 dot fresh + add
            a_lo = tl.load(a_ptrs + half_a)
            b_lo = tl.load(b_ptrs + half_b)
            acc += tl.dot(a_hi + a_lo, b_hi.T + b_lo.T, input_precision="tf32")
        a_ptrs += BK
        b_ptrs += BK
    acc += accx
    offs_m = m0 + tl.arange(0, BM)
    offs_n = n0 + tl.arange(0, BN)
    tl.store(
        C + offs_m[:, None].to(tl.int64) * stride_c + offs_n[None, :],
        acc,
        mask=(offs_m[:, None] < M) & (offs_n[None, :] < N),
    )


# the shipped configs and a few wider ones (tf32x3_triton's own config helper)
CONFIGS = [
    *tt.CONFIGS,
    tt._config(128, 256, 16, 8, 3),
    tt._config(128, 64, 16, 4, 6),
    tt._config(256, 64, 16, 8, 4),
    tt._config(64, 128, 16, 4, 6),
    tt._config(128, 128, 32, 8, 2),
]
tuned = triton.autotune(configs=CONFIGS, key=["M", "N", "K", "VARIANT"])(mmv)

T, D, F, V = 2048, 768, 3072, 10000  # tokens, d_model, d_ff, vocab of the small step


def _linear(name: str, d_in: int, d_out: int, count: int) -> list[tuple]:
    return [
        (f"{name} fwd", T, d_out, d_in, count),
        (f"{name} dx", T, d_in, d_out, count),
        (f"{name} dW", d_out, d_in, T, count),
    ]


PRODUCTS = [
    *_linear("qkv", D, 3 * D, 12), *_linear("out", D, D, 12), *_linear("w13", D, 2 * F, 12),
    *_linear("w2", F, D, 12), *_linear("head", D, V, 1),
]  # fmt: skip


def _rel_err(c: torch.Tensor, ref: torch.Tensor) -> float:
    return ((c.double() - ref).norm() / ref.norm()).item()


def _variant(a_s, b_s, m: int, n: int, variant: int, ref) -> tuple[float, float, str]:
    """(ms, relative error, best config) of one variant on pre-split operands."""
    c = torch.empty(m, n, device="cuda")
    args = (a_s, b_s, c, m, n, a_s.shape[2], a_s[0].numel(), b_s[0].numel(), c.stride(0))
    tuned[lambda meta: (triton.cdiv(m, meta["BM"]) * triton.cdiv(n, meta["BN"]),)](
        *args, GROUP_M=8, VARIANT=variant
    )
    best = tuned.best_config
    meta = dict(best.kwargs, num_warps=best.num_warps, num_stages=best.num_stages)
    grid = (triton.cdiv(m, meta["BM"]) * triton.cdiv(n, meta["BN"]),)

    def call() -> None:
        mmv[grid](*args, GROUP_M=8, VARIANT=variant, **meta)

    ms = triton.testing.do_bench_cudagraph(call, rep=50)
    return ms, _rel_err(c, ref), str(best)


def main(out: str) -> None:
    rows, per_step = [], {}
    for name, m, n, k, count in PRODUCTS:
        a = torch.randn(m, k, device="cuda")
        b = torch.randn(n, k, device="cuda")
        ref = a.double() @ b.double().T
        a_s, b_s = tt.split_pair(a, b)
        sgemm = a @ b.T
        row = {"product": name, "M": m, "N": n, "K": k, "count": count}
        row["sgemm_err"] = _rel_err(sgemm, ref)
        row["sgemm_ms"] = triton.testing.do_bench_cudagraph(
            lambda a=a, b=b, sgemm=sgemm: torch.mm(a, b.T, out=sgemm), rep=50
        )
        per_step["sgemm"] = per_step.get("sgemm", 0.0) + row["sgemm_ms"] * count
        for variant in range(5):
            ms, err, best = _variant(a_s, b_s, m, n, variant, ref)
            row.update({f"v{variant}_ms": ms, f"v{variant}_err": err, f"v{variant}_cfg": best})
            per_step[variant] = per_step.get(variant, 0.0) + ms * count
        print(json.dumps(row), flush=True)
        rows.append(row)
    print("per step ms:", json.dumps(per_step))
    with open(out, "w") as f:
        json.dump({"rows": rows, "per_step": per_step}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
