"""Float32 GEMM speed and accuracy on the small model's shapes: cuBLAS vs Triton variants.

The goal "small fp32 train step <= 36 ms" is bound by float32 matmuls (~37 ms of the 41.6 ms
strict-fp32 step on an H100 run in cuBLAS SGEMM at ~40 TFLOP/s). This experiment measures, on
the products one train step of the small model makes (batch 4 x 512 tokens), each way of
computing a float32 matmul, and its error against a float64 product:

- ``cublas`` / ``cublaslt``: strict IEEE fp32 (torch.mm, TF32 off), each BLAS library;
- ``cublas-tf32``: TF32 tensor cores (10-bit mantissas, ~1e-3 error);
- ``triton-ieee``: a Triton GEMM on the FMA units;
- ``triton-tf32x3``: a Triton GEMM that splits each operand into a TF32 high part and a low
  part and runs three TF32 products per K tile (Triton's ``input_precision="tf32x3"``),
  accumulating in the matrix unit's accumulator;
- ``triton-tf32x3-kmajor``: ``triton-tf32x3`` after copying the operands K-major (the copy
  is timed with it);
- ``lm-core-tf32x3``: lm_core's `tf32x3_mm` (`ModelConfig(matmul="tf32x3")`): the operands
  are split into TF32 hi and lo parts once, K-major, by a separate kernel (timed with the
  product), and the GEMM runs three plain TF32 products per K tile on those buffers, adding
  each tile's sum to the running total in registers;
- ``triton-tf32x3-kahan``: the same products, but each K tile's result is added to the
  running float32 total outside the matrix unit with Kahan compensation (a cuBLAS TF32 GEMM's
  own accumulation error grows with K: measured 2e-6 at K = 768 to 3e-5 at K = 12288).

    PYTHONPATH=packages/perf-tools/src python3 packages/perf-tools/scripts/fp32_gemm.py \
        --json $OUT/fp32_gemm.json

Prints one table (ms, TFLOP/s counting 2MNK, relative Frobenius error, speed-up over cuBLAS
SGEMM) and each variant's matmul time for a whole step (every product times its count).
``TRITON_INTERPRET=1 python3 .../fp32_gemm.py --dry-run`` checks the Triton kernels on tiny
shapes on a CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import triton
import triton.language as tl

# The products of one small-model train step (tokens T = 4 x 512, d_model 768, d_ff 3072,
# vocab 10000, 12 layers), as (name, M, N, K, layout, count). A linear layer y = x W^T with
# W (out, in) makes three: forward (T, in) @ W^T ("nt": B is W read transposed), input
# gradient dy @ W (T, out) @ (out, in) ("nn"), weight gradient dy^T @ x (out, T) @ (T, in)
# ("tn": A is dy read transposed). Attention's own products (SDPA) are not included.
T, D, F, V, LAYERS = 2048, 768, 3072, 10000, 12


def _linear(name: str, d_in: int, d_out: int, count: int) -> list[tuple]:
    return [
        (f"{name} fwd", T, d_out, d_in, "nt", count),
        (f"{name} dx", T, d_in, d_out, "nn", count),
        (f"{name} dW", d_out, d_in, T, "tn", count),
    ]


SHAPES = [
    *_linear("qkv", D, 3 * D, LAYERS),
    *_linear("out", D, D, LAYERS),
    *_linear("w13", D, 2 * F, LAYERS),
    *_linear("w2", F, D, LAYERS),
    *_linear("head", D, V, 1),
]

CONFIGS = [
    triton.Config({"BM": 128, "BN": 128, "BK": 32}, num_warps=8, num_stages=3),
    triton.Config({"BM": 128, "BN": 128, "BK": 32}, num_warps=4, num_stages=3),
    triton.Config({"BM": 128, "BN": 64, "BK": 32}, num_warps=4, num_stages=4),
    triton.Config({"BM": 64, "BN": 128, "BK": 32}, num_warps=4, num_stages=4),
    triton.Config({"BM": 128, "BN": 256, "BK": 32}, num_warps=8, num_stages=3),
    triton.Config({"BM": 128, "BN": 128, "BK": 16}, num_warps=8, num_stages=4),
    triton.Config({"BM": 128, "BN": 128, "BK": 32}, num_warps=8, num_stages=4),
    triton.Config({"BM": 256, "BN": 128, "BK": 32}, num_warps=8, num_stages=3),
]


@triton.jit
def _gemm_kernel(
    A, B, C, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    PRECISION: tl.constexpr, KAHAN: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """C (M, N) = A (M, K) @ B (K, N) in float32; grouped tile order for L2 reuse."""
    pid = tl.program_id(0)
    n_m, n_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    group = pid // (GROUP_M * n_n)
    first_m = group * GROUP_M
    size_m = min(n_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * n_n)) % size_m
    pid_n = (pid % (GROUP_M * n_n)) // size_m
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    a_ptrs = A + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = B + offs_k[:, None] * stride_bk + offs_n[None, :].to(tl.int64) * stride_bn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    comp = tl.zeros((BM, BN), dtype=tl.float32)  # Kahan compensation
    for k0 in tl.range(0, K, BK):
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] + k0 < K), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] + k0 < K) & (offs_n[None, :] < N), other=0.0)
        if KAHAN:
            part = tl.dot(a, b, input_precision=PRECISION)
            y = part - comp
            t = acc + y
            comp = (t - acc) - y
            acc = t
        else:
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BK * stride_ak
        b_ptrs += BK * stride_bk
    c_ptrs = C + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


_tuned = triton.autotune(configs=CONFIGS, key=["M", "N", "K", "PRECISION", "KAHAN"])(_gemm_kernel)


def triton_mm(a: torch.Tensor, b: torch.Tensor, precision: str, kahan: bool, tune: bool = True):
    """a (M, K) @ b (K, N) float32 through the Triton kernel (any strides)."""
    m, k = a.shape
    n = b.shape[1]
    c = torch.empty((m, n), dtype=torch.float32, device=a.device)
    args = (a, b, c, m, n, k, *a.stride(), *b.stride(), *c.stride())
    if tune:

        def grid(meta):
            return (triton.cdiv(m, meta["BM"]) * triton.cdiv(n, meta["BN"]),)

        _tuned[grid](*args, PRECISION=precision, KAHAN=kahan, GROUP_M=8)
    else:  # the interpreter: one small config
        grid = (triton.cdiv(m, 32) * triton.cdiv(n, 32),)
        _gemm_kernel[grid](*args, precision, kahan, 32, 32, 16, 4)
    return c


def set_backend(lib: str = "cublas", tf32: bool = False) -> None:
    """torch's CUDA BLAS library and TF32 switch, set once before a variant runs (not inside
    the timed calls)."""
    torch.backends.cuda.matmul.allow_tf32 = tf32
    if torch.cuda.is_available():
        torch.backends.cuda.preferred_blas_library(lib)


def _torch_mm(a, b):
    return a @ b


def variants(tune: bool):
    """name -> (backend settings for set_backend, fn(a, b) -> a @ b float32)."""
    out = {}
    if torch.cuda.is_available():
        out["cublas"] = ({"lib": "cublas"}, _torch_mm)
        out["cublaslt"] = ({"lib": "cublaslt"}, _torch_mm)
        out["cublas-tf32"] = ({"lib": "cublas", "tf32": True}, _torch_mm)
    for prec, kahan, name in (
        ("ieee", False, "triton-ieee"),
        ("tf32x3", False, "triton-tf32x3"),
        ("tf32x3", True, "triton-tf32x3-kahan"),
    ):
        out[name] = ({}, lambda a, b, p=prec, kh=kahan: triton_mm(a, b, p, kh, tune))
    out["triton-tf32x3-kmajor"] = (
        {},
        lambda a, b: triton_mm(*k_major(a, b), "tf32x3", False, tune),
    )
    try:
        from lm_core.matmul import tf32x3_mm
    except ImportError:
        pass
    else:
        out["lm-core-tf32x3"] = ({}, tf32x3_mm)
    return out


def k_major(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies (timed with the product) that make both operands K-major: 32-bit matrix-unit
    operands (wgmma tf32) must be K-major in shared memory, so Triton otherwise transposes
    the other layouts on the way (the "nn" and "tn" products)."""
    if a.stride(1) != 1:
        a = a.contiguous()  # (M, K) row-major
    if b.stride(0) != 1:
        b = b.t().contiguous().t()  # (K, N) with K contiguous
    return a, b


def rel_err(c: torch.Tensor, ref: torch.Tensor) -> float:
    return ((c.double() - ref).norm() / ref.norm()).item()


def bench_ms(fn, reps: int, repeats: int = 5) -> float:
    """GPU ms per call: `reps` calls back to back between two CUDA events (so the GPU is not
    left idle waiting for each launch, whose host cost differs between cuBLAS and Triton's
    autotuned launcher), median over `repeats` such batches, after warm-up."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return statistics.median(times)


def make_operands(m, n, k, layout, device, seed=0):
    """A (M, K), B (K, N) float32 with the strides of the product they stand for."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    if layout == "tn":  # A = dy^T: dy (K=T, M) contiguous
        a = torch.randn((k, m), generator=g).to(device).t()
    else:
        a = torch.randn((m, k), generator=g).to(device)
    if layout == "nt":  # B = W^T: W (N, K) contiguous
        b = (torch.randn((n, k), generator=g) / k**0.5).to(device).t()
    else:
        b = (torch.randn((k, n), generator=g) / k**0.5).to(device)
    return a, b


def run(shapes, device, reps, tune, only=None) -> list[dict]:
    rows = []
    fns = {k: v for k, v in variants(tune).items() if not only or k in only}
    for name, m, n, k, layout, count in shapes:
        a, b = make_operands(m, n, k, layout, device)
        ref = a.double() @ b.double()
        for vname, (backend, fn) in fns.items():
            row = {"shape": name, "M": m, "N": n, "K": k, "layout": layout, "count": count}
            row["variant"] = vname
            try:
                set_backend(**backend)
                row["rel_err"] = rel_err(fn(a, b), ref)
                if device == "cuda":
                    row["ms"] = bench_ms(lambda fn=fn, a=a, b=b: fn(a, b), reps)
                    row["tflops"] = 2 * m * n * k / row["ms"] / 1e9
            except Exception as e:  # report and go on
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
        set_backend()
    return rows


def summarize(rows) -> None:
    base = {r["shape"]: r["ms"] for r in rows if r["variant"] == "cublas" and "ms" in r}
    print("\n| shape | M x N x K | variant | ms | TFLOP/s | rel err | x cuBLAS |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['shape']} | | {r['variant']} | failed: {r['error'][:80]} | | | |")
            continue
        ms, speed = r.get("ms"), ""
        if ms and r["shape"] in base:
            speed = f"{base[r['shape']] / ms:.2f}"
        print(
            f"| {r['shape']} | {r['M']}x{r['N']}x{r['K']} | {r['variant']} | "
            f"{ms or 0:.4f} | {r.get('tflops', 0):.1f} | {r['rel_err']:.2e} | {speed} |"
        )
    per_step: dict[str, float] = {}
    for r in rows:
        if "ms" in r:
            per_step[r["variant"]] = per_step.get(r["variant"], 0.0) + r["ms"] * r["count"]
    if per_step:
        print("\nmatmul ms per small-model train step (weighted sum):")
        for v, ms in per_step.items():
            print(f"  {v:22s} {ms:7.2f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", default="", help="write rows to this JSON file")
    ap.add_argument("--variants", nargs="+", help="run only these variants (default: all)")
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="tiny shapes, no timing; on a CPU run with TRITON_INTERPRET=1",
    )
    a = ap.parse_args(argv)
    if a.dry_run:
        shapes = [("tiny " + lay, 40, 48, 72, lay, 1) for lay in ("nt", "nn", "tn")]
        device = "cuda" if torch.cuda.is_available() else "cpu"
        rows = run(shapes, device, 1, tune=device == "cuda")
        bad = [r for r in rows if "error" in r or r["rel_err"] > 1e-5]
        print("dry run:", "ok" if not bad else f"FAILED {bad}")
        return 1 if bad else 0
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (or --dry-run)", file=sys.stderr)
        return 2
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    t0 = time.time()
    rows = run(SHAPES, "cuda", a.reps, tune=True, only=a.variants)
    summarize(rows)
    print(f"({time.time() - t0:.0f} s)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
