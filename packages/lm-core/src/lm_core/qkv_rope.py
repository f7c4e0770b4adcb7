"""The attention inputs out of the fused q/k/v projection: q and k rotated by RoPE, and v.

`split_rotate(qkv, cos, sin, n_q, n_kv)` takes the projection's output seen as
(B, T, n_q + 2 n_kv, Dh) and returns q (B, T, n_q, Dh), k and v (B, T, n_kv, Dh), the pairs
(2i, 2i+1) of q and k at position t rotated by the tables' row t (`rotate_pairs`, the
course RoPE, in float32, rounded once). On CUDA (float32 / float16 / bfloat16, triton
importable) two Triton kernels (`lm_core.qkv_rope_triton`) do it: the forward writes q, k, v
in one pass, the backward reads dq, dk, dv and writes the whole dqkv in one pass, where
autograd through slices and `stack` takes three to four element-wise kernels. Elsewhere,
or with `backend="torch"`, the plain ops (q, k, v are then views). `backend="triton"` asks
for the kernels (on CPU under Triton's interpreter, TRITON_INTERPRET=1 set before the first
call).
"""

from __future__ import annotations

import torch

from lm_core._triton_util import auto_gate, why_kernels_cannot_run

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# device type -> whether "auto" runs the Triton kernels; _triton_runs reads it
_RUNNABLE, _triton_runs = auto_gate("qkv_rope_triton")


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, T, ..., Dh) with pairs (2i, 2i+1) rotated by cos, sin (T, 1.., Dh / 2) in the
    tables' dtype, rounded once to x's dtype."""
    pairs = x.unflatten(-1, (-1, 2))  # (B, T, ..., Dh/2, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]  # (B, T, ..., Dh/2) each
    rotated = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return rotated.flatten(-2).to(x.dtype)  # (B, T, ..., Dh)


def split_rotate_reference(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_q: int, n_kv: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`split_rotate` in plain ops; q, k, v are views of one rotated buffer and of qkv."""
    seq = qkv.shape[1]
    qk = rotate_pairs(qkv[:, :, : n_q + n_kv], cos[:seq, None], sin[:seq, None])
    return qk[:, :, :n_q], qk[:, :, n_q:], qkv[:, :, n_q + n_kv :]


def split_rotate(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    n_q: int,
    n_kv: int,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k (rotated) and v of qkv (B, T, n_q + 2 n_kv, Dh); cos, sin: float32 (>= T, Dh / 2)
    tables of positions 0.. . backend: "auto" (the kernels on CUDA where they run), "triton"
    or "torch"."""
    if n_q < 1 or n_kv < 1:
        raise ValueError(f"n_q, n_kv: expected at least one head each, got {n_q}, {n_kv}")
    if qkv.dim() != 4 or qkv.shape[2] != n_q + 2 * n_kv or qkv.shape[3] % 2:
        raise ValueError(
            f"qkv: expected (B, T, n_q + 2 n_kv = {n_q + 2 * n_kv}, even Dh), got "
            f"{tuple(qkv.shape)}"
        )
    if cos.shape != sin.shape or cos.shape[0] < qkv.shape[1] or 2 * cos.shape[1] != qkv.shape[3]:
        raise ValueError(
            f"cos, sin: expected (>= {qkv.shape[1]}, {qkv.shape[3] // 2}) tables, got "
            f"{tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    if backend == "torch":
        return split_rotate_reference(qkv, cos, sin, n_q, n_kv)
    tables_ok = cos.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()
    if backend == "auto":
        use = (
            type(qkv) is torch.Tensor
            and qkv.dtype in _DTYPES
            and tables_ok
            and _triton_runs(qkv.device.type)
        )
        if not use:
            return split_rotate_reference(qkv, cos, sin, n_q, n_kv)
    elif backend != "triton":
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    elif qkv.dtype not in _DTYPES or not tables_ok:
        raise TypeError(
            "backend='triton' takes float32, float16 or bfloat16 qkv and contiguous float32 "
            f"tables, got {qkv.dtype} and {cos.dtype}"
        )
    elif why := _why_not(qkv.device.type):
        raise RuntimeError(f"backend='triton': {why}")
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    return _SplitRotate.apply(qkv, cos, sin, n_q, n_kv)


def _why_not(device_type: str) -> str:
    """Why the kernels cannot run on this device type here ("" if they can)."""
    return why_kernels_cannot_run(device_type, "qkv_rope_triton")


class _SplitRotate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, cos, sin, n_q: int, n_kv: int):
        from lm_core import qkv_rope_triton

        ctx.save_for_backward(cos, sin)
        ctx.qkv_shape, ctx.dtype, ctx.heads = qkv.shape, qkv.dtype, (n_q, n_kv)
        return qkv_rope_triton.forward(qkv, cos, sin, n_q, n_kv)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        from lm_core import qkv_rope_triton

        cos, sin = ctx.saved_tensors
        b, t, _, d = ctx.qkv_shape
        n_q, n_kv = ctx.heads
        grads = []
        for g, heads in ((dq, n_q), (dk, n_kv), (dv, n_kv)):
            if g is None:  # an output that took no part in the loss
                g = torch.zeros(b, t, heads, d, dtype=ctx.dtype, device=cos.device)
            grads.append(g if g.stride(-1) == 1 else g.contiguous())
        dqkv = qkv_rope_triton.backward(*grads, cos, sin)
        return dqkv, None, None, None, None
