"""Triton kernels of RMSNorm, optionally after a residual add (`lm_core.rmsnorm`).

Rows of width D, each normalized in float32: s = x (+ r), rstd = 1 / sqrt(mean(s^2) + eps),
y = s * rstd * w. Forward: one program per block of ROWS rows writes s (when there is a
residual), y in the caller's dtype and rstd (one float per row, for the backward). Backward,
with g = w * dy and xhat = s * rstd:
    ds = rstd * (g - xhat * mean(xhat * g)) + ds_in      (ds_in: s's gradient from later use)
    dw = sum over rows of dy * xhat
A fixed number of programs walk the row blocks; each keeps its dw sum in registers and
writes one row of partial sums, which the caller adds up. Why not inductor's kernels: in
the compiled xl block the two norms' backward took three reduction kernels (17.4 + 16.4 +
13.5 us per layer on an H200) where one pass per norm reads s, dy, ds_in and writes ds.

This module imports triton at the top; `lm_core.rmsnorm` imports it lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lm_core._triton_util import is_interpreted

MAX_D = 4096  # widest row tested in registers (8B's d_model); wider rows take the plain ops
# Tiles from a sweep at the xl block's shape (2048 x 1600, H200; lm-core DESIGN.md): 4096
# elements, 8 warps, 132 backward programs were the fastest backward (14.3 us alone, before
# the weight gradient's partial sums are added up); the forward tiled alike within 0.4 us.
ELEMENTS = 4096  # row elements per program (ROWS = ELEMENTS // next_pow2(D), at least 1)
WARPS = 8
BWD_PROGRAMS = 132  # programs walking the row blocks in the backward (one per SM)


@triton.jit
def _load_rows(PTR, rows, cols, stride, mask):
    return tl.load(PTR + rows[:, None] * stride + cols[None, :], mask=mask, other=0.0).to(
        tl.float32
    )


@triton.jit
def rms_norm_fwd_kernel(
    X, R, S, W, Y, RSTD, n_rows, D, stride_x, stride_r, stride_s, stride_y, eps,
    HAS_RESIDUAL: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    in_d = cols < D
    mask = (rows < n_rows)[:, None] & in_d[None, :]
    s = _load_rows(X, rows, cols, stride_x, mask)
    if HAS_RESIDUAL:
        s += _load_rows(R, rows, cols, stride_r, mask)
        s_stored = s.to(S.dtype.element_ty)
        tl.store(S + rows[:, None] * stride_s + cols[None, :], s_stored, mask=mask)
        s = s_stored.to(tl.float32)  # normalize the sum as stored, as the plain ops do
    rstd = 1.0 / tl.sqrt(tl.sum(s * s, axis=1) / D + eps)
    w = tl.load(W + cols, mask=in_d, other=0.0).to(tl.float32)
    y = s * rstd[:, None] * w[None, :]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=rows < n_rows)


@triton.jit
def _bwd_loads(S, RSTD, DY, DS_IN, rows, cols, in_d, n_rows, stride_s, stride_dy, stride_ds_in,
               HAS_DS_IN: tl.constexpr):  # fmt: skip
    """s, dy, the incoming ds (zeros without one) in float32 and rstd of these rows."""
    in_rows = rows < n_rows
    mask = in_rows[:, None] & in_d[None, :]
    rstd = tl.load(RSTD + rows, mask=in_rows, other=0.0)
    s = _load_rows(S, rows, cols, stride_s, mask)
    dy = _load_rows(DY, rows, cols, stride_dy, mask)
    if HAS_DS_IN:
        ds_in = _load_rows(DS_IN, rows, cols, stride_ds_in, mask)
    else:
        ds_in = tl.zeros_like(s)
    return s, dy, ds_in, rstd


@triton.jit
def rms_norm_bwd_kernel(
    S, W, RSTD, DY, DS_IN, DS, DS2, DW_PART, n_rows, D,
    stride_s, stride_dy, stride_ds_in, stride_ds, stride_ds2,
    HAS_DS_IN: tl.constexpr, HAS_DS2: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    # Each program walks row blocks pid, pid + programs, ...; the next block's loads are
    # issued before this block's arithmetic and stores, so that memory stays busy.
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_D)
    in_d = cols < D
    w = tl.load(W + cols, mask=in_d, other=0.0).to(tl.float32)
    dw = tl.zeros((ROWS, BLOCK_D), dtype=tl.float32)  # summed over rows once, at the end
    rows = (pid * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    s, dy, ds_in, rstd = _bwd_loads(
        S, RSTD, DY, DS_IN, rows, cols, in_d, n_rows, stride_s, stride_dy, stride_ds_in,
        HAS_DS_IN,
    )  # fmt: skip
    for _ in range(pid, tl.cdiv(n_rows, ROWS), programs):
        next_rows = rows + programs * ROWS
        s_n, dy_n, ds_in_n, rstd_n = _bwd_loads(
            S, RSTD, DY, DS_IN, next_rows, cols, in_d, n_rows, stride_s, stride_dy,
            stride_ds_in, HAS_DS_IN,
        )  # fmt: skip
        xhat = s * rstd[:, None]
        g = dy * w[None, :]
        mean_xg = tl.sum(xhat * g, axis=1) / D
        ds = (g - xhat * mean_xg[:, None]) * rstd[:, None] + ds_in
        mask = (rows < n_rows)[:, None] & in_d[None, :]
        tl.store(DS + rows[:, None] * stride_ds + cols[None, :], ds.to(DS.dtype.element_ty),
                 mask=mask)  # fmt: skip
        if HAS_DS2:
            offs2 = rows[:, None] * stride_ds2 + cols[None, :]
            tl.store(DS2 + offs2, ds.to(DS2.dtype.element_ty), mask=mask)
        dw += dy * xhat
        rows, s, dy, ds_in, rstd = next_rows, s_n, dy_n, ds_in_n, rstd_n
    tl.store(DW_PART + pid * D + cols, tl.sum(dw, axis=0), mask=in_d)


# Decided once: the kernels are plain or interpreted for the life of the process.
INTERPRETED = is_interpreted(rms_norm_fwd_kernel)


def _tiles(d: int) -> tuple[int, int, int]:
    """(rows per program, padded row width, warps) for rows of width d."""
    block_d = triton.next_power_of_2(d)
    rows = max(1, (64 if INTERPRETED else ELEMENTS) // block_d)
    return rows, block_d, WARPS


def forward(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out_dtype: torch.dtype,
    sum_dtype: torch.dtype,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """(s or None, y, rstd) of x (rows, D) and residual (rows, D) or None, both with a unit
    last stride: s = x + residual in sum_dtype, y in out_dtype, rstd float32 (rows,)."""
    n_rows, d = x.shape
    y = torch.empty(n_rows, d, dtype=out_dtype, device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    s = None if residual is None else torch.empty(n_rows, d, dtype=sum_dtype, device=x.device)
    rows, block_d, warps = _tiles(d)
    if n_rows:
        r = x if residual is None else residual
        s_out = y if s is None else s
        rms_norm_fwd_kernel[(triton.cdiv(n_rows, rows),)](
            x, r, s_out, weight, y, rstd, n_rows, d,
            x.stride(0), r.stride(0), s_out.stride(0), y.stride(0), eps,
            HAS_RESIDUAL=residual is not None, ROWS=rows, BLOCK_D=block_d, num_warps=warps,
        )  # fmt: skip
    return s, y, rstd


def backward(
    s: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    dy: torch.Tensor,
    ds_in: torch.Tensor | None,
    ds2_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(ds, ds2, dw): the gradient of the normalized rows s (rows, D) in s's dtype, the same
    rounded to ds2_dtype (None: not written), and the weight's gradient in float32 (D,).
    dy (rows, D) and ds_in (rows, D) or None have unit last strides."""
    n_rows, d = s.shape
    ds = torch.empty_like(s)
    ds2 = None if ds2_dtype is None else torch.empty(n_rows, d, dtype=ds2_dtype, device=s.device)
    rows, block_d, warps = _tiles(d)
    programs = max(1, min(triton.cdiv(n_rows, rows), 4 if INTERPRETED else BWD_PROGRAMS))
    dw_part = torch.empty(programs, d, dtype=torch.float32, device=s.device)
    if n_rows:
        ds_in_arg = dy if ds_in is None else ds_in
        ds2_arg = ds if ds2 is None else ds2
        rms_norm_bwd_kernel[(programs,)](
            s, weight, rstd, dy, ds_in_arg, ds, ds2_arg, dw_part, n_rows, d,
            s.stride(0), dy.stride(0), ds_in_arg.stride(0), ds.stride(0), ds2_arg.stride(0),
            HAS_DS_IN=ds_in is not None, HAS_DS2=ds2 is not None, ROWS=rows, BLOCK_D=block_d,
            num_warps=warps,
        )  # fmt: skip
    else:
        dw_part.zero_()
    return ds, ds2, dw_part.sum(0)
