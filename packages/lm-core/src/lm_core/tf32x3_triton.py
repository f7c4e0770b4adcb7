"""Triton kernels of the float32-accurate "3xTF32" matmul (`lm_core.matmul`).

A float32 x is split into two TF32 numbers, hi = tf32(x) and lo = tf32(x - hi), so that
x = hi + lo to about 2^-22 relative. A product a @ b is then a_lo @ b_hi + a_hi @ b_lo +
a_hi @ b_hi, three products on the TF32 tensor cores accumulated in float32; the dropped
a_lo @ b_lo term is ~2^-22 of the result. Two kernels:

- `split_kernel` writes hi and lo of a 2-D operand with any strides as one (2, R, C) buffer
  (both operands of a product in one launch),
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

import functools

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
def _split_tile(X, OUT, tile, n_rows, n_cols, n_cols_pad, half, stride_r, stride_c,
                BLOCK: tl.constexpr):  # fmt: skip
    """Tile `tile` (row-major over BLOCK x BLOCK tiles) of one split; half = n_rows *
    n_cols_pad, the offset of the lo part."""
    tiles_c = tl.cdiv(n_cols_pad, BLOCK)
    offs_r = (tile // tiles_c) * BLOCK + tl.arange(0, BLOCK)
    offs_c = (tile % tiles_c) * BLOCK + tl.arange(0, BLOCK)
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
def split_kernel(
    X1, OUT1, rows1, cols1, pad1, half1, stride1_r, stride1_c, tiles1,
    X2, OUT2, rows2, cols2, pad2, half2, stride2_r, stride2_c,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """Splits two operands in one launch (programs 0..tiles1-1 the first, the rest the
    second): OUTi[0] = tf32(Xi), OUTi[1] = tf32(Xi - OUTi[0]), OUTi (2, rowsi, padi)
    contiguous with zeros in columns colsi..padi-1."""
    pid = tl.program_id(0)
    if pid < tiles1:
        _split_tile(X1, OUT1, pid, rows1, cols1, pad1, half1, stride1_r, stride1_c, BLOCK)
    else:
        _split_tile(X2, OUT2, pid - tiles1, rows2, cols2, pad2, half2, stride2_r, stride2_c, BLOCK)


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


def _split_args(x: torch.Tensor) -> tuple[torch.Tensor, tuple, int]:
    """The output buffer of x's split, its kernel arguments, and its number of tiles."""
    n_rows, n_cols = x.shape
    n_pad = -(-n_cols // K_ALIGN) * K_ALIGN
    out = torch.empty((2, n_rows, n_pad), dtype=torch.float32, device=x.device)
    args = (x, out, n_rows, n_cols, n_pad, n_rows * n_pad, x.stride(0), x.stride(1))
    return out, args, triton.cdiv(n_rows, SPLIT_BLOCK) * triton.cdiv(n_pad, SPLIT_BLOCK)


def split_pair(x1: torch.Tensor, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both operands split in one launch: (R, C) float32, any strides -> (2, R, C')
    contiguous, [tf32 hi, tf32 lo], C' = C rounded up to a multiple of 4 (zero columns)."""
    out1, args1, tiles1 = _split_args(x1)
    out2, args2, tiles2 = _split_args(x2)
    split_kernel[(tiles1 + tiles2,)](*args1, tiles1, *args2, SPLIT_BLOCK)
    return out1, out2


def split(x: torch.Tensor) -> torch.Tensor:
    """One operand's split (see `split_pair`)."""
    return split_pair(x, x[:0])[0]


@functools.cache
def _device_has_tma(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def _use_tma(device: torch.device) -> bool:
    if device.type == "cuda":
        return _device_has_tma(device.index if device.index is not None else 0)
    return interpreting()


def _operands(split_buf: torch.Tensor, use_tma: bool, rows: int, bk: int):
    """The hi and lo halves of a split buffer: tensors, or TMA descriptors of (rows, bk)
    blocks."""
    hi, lo = split_buf[0], split_buf[1]
    if not use_tma:
        return hi, lo
    from triton.tools.tensor_descriptor import TensorDescriptor

    return tuple(TensorDescriptor(t, list(t.shape), list(t.stride()), [rows, bk]) for t in (hi, lo))


def _set_blocks(nargs: dict) -> None:
    """Autotune pre-hook: give the TMA descriptors the benchmarked config's block shapes."""
    if not nargs.get("USE_TMA"):
        return
    for names, rows in ((("A_HI", "A_LO"), nargs["BM"]), (("B_HI", "B_LO"), nargs["BN"])):
        for name in names:
            nargs[name].block_shape = [rows, nargs["BK"]]


for _cfg in CONFIGS:
    _cfg.pre_hook = _set_blocks

# (M, N, K', use_tma) -> the autotuned config, looked up here so that later calls launch the
# kernel directly, without the autotuner's per-call work
_best: dict[tuple[int, int, int, bool], triton.Config] = {}


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a (M, K) @ b (K, N) float32, any strides, through the split operands: (M, N) float32."""
    m, k = a.shape
    n = b.shape[1]
    if m == 0 or n == 0 or k == 0:
        return torch.zeros((m, n), dtype=torch.float32, device=a.device)
    # b is read transposed so that both buffers have K-contiguous rows: (2, M, K'), (2, N, K')
    a_split, b_split = split_pair(a, b.t())
    k_pad = a_split.shape[2]
    c = torch.empty((m, n), dtype=torch.float32, device=a.device)
    use_tma = _use_tma(a.device)
    if interpreting():
        cfg, meta = INTERPRETER_CONFIG, {"num_warps": 4, "num_stages": 1}
    else:
        key = (m, n, k_pad, use_tma)
        best = _best.get(key)
        if best is None:  # first call with this shape: autotune
            a_ops = _operands(a_split, use_tma, 1, 1)
            b_ops = _operands(b_split, use_tma, 1, 1)
            _tuned_mm[lambda meta: (triton.cdiv(m, meta["BM"]) * triton.cdiv(n, meta["BN"]),)](
                *a_ops, *b_ops, c, m, n, k_pad, c.stride(0), GROUP_M=8, USE_TMA=use_tma
            )
            _best[key] = _tuned_mm.best_config
            return c
        cfg, meta = best.kwargs, {"num_warps": best.num_warps, "num_stages": best.num_stages}
    bm, bn, bk = cfg["BM"], cfg["BN"], cfg["BK"]
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    mm_kernel[grid](
        *_operands(a_split, use_tma, bm, bk), *_operands(b_split, use_tma, bn, bk),
        c, m, n, k_pad, c.stride(0), bm, bn, bk, 8, use_tma, **meta,
    )  # fmt: skip
    return c
