"""Triton kernels of the float32-accurate "3xTF32" matmul (`lm_core.matmul`).

A float32 x is split into two TF32 numbers, hi = tf32(x) and lo = tf32(x - hi), so that
x = hi + lo to about 2^-22 relative. A product a @ b is then a_lo @ b_hi + a_hi @ b_lo +
a_hi @ b_hi, three products on the TF32 tensor cores accumulated in float32; the dropped
a_lo @ b_lo term is ~2^-22 of the result. Two kernels:

- `split_kernel` writes hi and lo of a 2-D operand with any strides as one (2, R, C) buffer,
  rows contiguous (C padded to a multiple of 4 with zeros so TMA can read it): the matrix
  unit reads 32-bit operands only K-major, so each operand is split once here, in the layout
  the product needs, instead of once per output tile inside the GEMM (which is what Triton's
  own `input_precision="tf32x3"` does, and what made it slow on the H100).
- `mm_kernel` C (M, N) = A (M, K) @ B (N, K)^T over the split buffers, three TF32 `tl.dot`s
  per K tile, grouped tile order for L2 reuse, TMA loads where available.

This module imports triton at the top; `lm_core.matmul` imports it lazily at the first
GPU call, so lm_core itself does not depend on triton. TRITON_INTERPRET=1 must be set
before that import to run the kernels on a CPU (tests only: slow, small shapes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SPLIT_BLOCK = 64  # (rows, columns) tile of the split kernel
K_ALIGN = 4  # split buffers' row length is padded to this many floats (16 bytes, for TMA)


@triton.jit
def _round_tf32(x):
    """x rounded to the nearest TF32 number (10 stored mantissa bits; ties away from zero),
    by integer arithmetic on the bits so it runs in the interpreter too."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x1000) & 0xFFFFE000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def split_kernel(
    X, OUT, n_rows, n_cols, n_cols_pad, half, stride_r, stride_c,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """OUT[0] = tf32(X), OUT[1] = tf32(X - OUT[0]); OUT is (2, n_rows, n_cols_pad) contiguous
    (half = n_rows * n_cols_pad) and its columns n_cols..n_cols_pad-1 are zero."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    rows = offs_r[:, None].to(tl.int64)
    x = tl.load(
        X + rows * stride_r + offs_c[None, :].to(tl.int64) * stride_c,
        mask=(offs_r[:, None] < n_rows) & (offs_c[None, :] < n_cols),
        other=0.0,
    )
    hi = _round_tf32(x)
    lo = _round_tf32(x - hi)
    out = OUT + rows * n_cols_pad + offs_c[None, :]
    mask = (offs_r[:, None] < n_rows) & (offs_c[None, :] < n_cols_pad)
    tl.store(out, hi, mask=mask)
    tl.store(out + half, lo, mask=mask)


@triton.jit
def _load_tile(desc, ptr, row0, k0, n_rows, K, stride, BR: tl.constexpr, BK: tl.constexpr,
               USE_TMA: tl.constexpr):  # fmt: skip
    """The (BR, BK) tile at (row0, k0) of a row-major (n_rows, K) operand, zero past the ends."""
    if USE_TMA:
        tile = desc.load([row0, k0])
    else:
        offs_r = row0 + tl.arange(0, BR)
        offs_k = k0 + tl.arange(0, BK)
        tile = tl.load(
            ptr + offs_r[:, None].to(tl.int64) * stride + offs_k[None, :],
            mask=(offs_r[:, None] < n_rows) & (offs_k[None, :] < K),
            other=0.0,
        )
    return tile


@triton.jit
def mm_kernel(
    A_HI, A_LO, B_HI, B_LO, C, M, N, K, stride_c,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    USE_TMA: tl.constexpr,
):  # fmt: skip
    """C (M, N) float32 = A @ B^T from split operands: A_* (M, K), B_* (N, K), rows of K
    contiguous floats (TMA descriptors with USE_TMA, else pointers)."""
    pid = tl.program_id(0)
    n_m, n_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    per_group = GROUP_M * n_n
    first_m = (pid // per_group) * GROUP_M
    size_m = min(n_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    m0, n0 = pid_m * BM, pid_n * BN
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in tl.range(0, K, BK):
        a_hi = _load_tile(A_HI, A_HI, m0, k0, M, K, K, BM, BK, USE_TMA)
        a_lo = _load_tile(A_LO, A_LO, m0, k0, M, K, K, BM, BK, USE_TMA)
        b_hi = _load_tile(B_HI, B_HI, n0, k0, N, K, K, BN, BK, USE_TMA)
        b_lo = _load_tile(B_LO, B_LO, n0, k0, N, K, K, BN, BK, USE_TMA)
        # This K tile's three products (small terms first) in a fresh matrix-unit accumulator,
        # then added to the running sum in registers: the H100's TF32 MMA adds into its
        # accumulator with truncation, so accumulating all of K there measured errors growing
        # with K (5e-6 at K = 768 to 7e-5 at K = 10,000, 10-100x cuBLAS SGEMM's).
        part = tl.dot(a_lo, b_hi.T, input_precision="tf32")
        part = tl.dot(a_hi, b_lo.T, part, input_precision="tf32")
        part = tl.dot(a_hi, b_hi.T, part, input_precision="tf32")
        acc += part
    offs_m = m0 + tl.arange(0, BM)
    offs_n = n0 + tl.arange(0, BN)
    tl.store(
        C + offs_m[:, None].to(tl.int64) * stride_c + offs_n[None, :],
        acc,
        mask=(offs_m[:, None] < M) & (offs_n[None, :] < N),
    )


# Tile configs tried per (M, N, K) on the first call with that shape. Shared memory per stage
# is 4 * 2 * (BM + BN) * BK bytes (hi and lo of both operands); all fit the H100's 227 KB.
# Two (BM, BN) float32 accumulators per thread rule out 128 x 256 tiles (they spill).
def _config(bm: int, bn: int, bk: int, warps: int, stages: int) -> triton.Config:
    return triton.Config({"BM": bm, "BN": bn, "BK": bk}, num_warps=warps, num_stages=stages)


CONFIGS = [
    _config(128, 128, 32, 8, 3),
    _config(128, 128, 16, 8, 4),
    _config(128, 128, 16, 8, 5),
    _config(64, 256, 16, 8, 4),
    _config(128, 64, 32, 4, 4),
    _config(64, 128, 32, 4, 4),
    _config(64, 64, 32, 4, 5),
]
INTERPRETER_CONFIG = {"BM": 32, "BN": 32, "BK": 16}

_tuned_mm = triton.autotune(configs=CONFIGS, key=["M", "N", "K", "USE_TMA"])(mm_kernel)


def interpreting() -> bool:
    """True when the kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1 was
    set before this module was first imported)."""
    try:
        import triton.runtime.interpreter as interp
    except ImportError:
        return False
    return isinstance(mm_kernel, interp.InterpretedFunction)


def split(x: torch.Tensor) -> torch.Tensor:
    """(R, C) float32, any strides -> (2, R, C') contiguous: [tf32 hi, tf32 lo] of x, C' = C
    rounded up to a multiple of 4 (zero columns)."""
    n_rows, n_cols = x.shape
    n_pad = -(-n_cols // K_ALIGN) * K_ALIGN
    out = torch.empty((2, n_rows, n_pad), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n_rows, SPLIT_BLOCK), triton.cdiv(n_pad, SPLIT_BLOCK))
    split_kernel[grid](
        x, out, n_rows, n_cols, n_pad, n_rows * n_pad, x.stride(0), x.stride(1),
        SPLIT_BLOCK, SPLIT_BLOCK,
    )  # fmt: skip
    return out


def _use_tma(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device)[0] >= 9
    return interpreting()


def _operands(split_buf: torch.Tensor, use_tma: bool):
    """The hi and lo halves of a split buffer: tensors, or TMA descriptors (their block shape
    is set per launch config by `_set_blocks`)."""
    hi, lo = split_buf[0], split_buf[1]
    if not use_tma:
        return hi, lo
    from triton.tools.tensor_descriptor import TensorDescriptor

    return tuple(TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1]) for t in (hi, lo))


def _set_blocks(nargs: dict) -> None:
    """Autotune pre-hook: give the TMA descriptors the launch config's block shapes."""
    if not nargs.get("USE_TMA"):
        return
    for names, rows in ((("A_HI", "A_LO"), nargs["BM"]), (("B_HI", "B_LO"), nargs["BN"])):
        for name in names:
            nargs[name].block_shape = [rows, nargs["BK"]]


for _cfg in CONFIGS:
    _cfg.pre_hook = _set_blocks


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a (M, K) @ b (K, N) float32, any strides, through the split operands: (M, N) float32."""
    m, k = a.shape
    n = b.shape[1]
    if m == 0 or n == 0 or k == 0:
        return torch.zeros((m, n), dtype=torch.float32, device=a.device)
    a_split = split(a)  # (2, M, K')
    b_split = split(b.t())  # (2, N, K'): b read transposed, so its rows are K-contiguous
    k_pad = a_split.shape[2]
    c = torch.empty((m, n), dtype=torch.float32, device=a.device)
    use_tma = _use_tma(a.device)
    a_hi, a_lo = _operands(a_split, use_tma)
    b_hi, b_lo = _operands(b_split, use_tma)
    args = (a_hi, a_lo, b_hi, b_lo, c, m, n, k_pad, c.stride(0))
    if interpreting():
        cfg = INTERPRETER_CONFIG
        nargs = {"A_HI": a_hi, "A_LO": a_lo, "B_HI": b_hi, "B_LO": b_lo, "USE_TMA": use_tma}
        _set_blocks({**nargs, **cfg})
        grid = (triton.cdiv(m, cfg["BM"]) * triton.cdiv(n, cfg["BN"]),)
        mm_kernel[grid](*args, cfg["BM"], cfg["BN"], cfg["BK"], 8, use_tma)
        return c

    def grid(meta):
        return (triton.cdiv(m, meta["BM"]) * triton.cdiv(n, meta["BN"]),)

    _tuned_mm[grid](*args, GROUP_M=8, USE_TMA=use_tma)
    return c
