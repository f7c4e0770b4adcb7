"""FlashAttention-2 in plain PyTorch: the readable version of what the Triton kernels do.

Forward (handout Algorithm 1): for each query tile, loop over key tiles keeping a running row
maximum m, a running denominator l and an unnormalized output; finish with O = acc / l and the
log-sum-exp L = m + log(l). Backward (handout equations 13-19) recomputes P = exp(S - L) tile
by tile from Q, K and L, with D = rowsum(dO * O); P is never stored.

Causal masking is bottom-right aligned (see ``reference``): key j is visible to query i iff
j <= i + (Nk - Nq). Fully masked key tiles are skipped. Runs on any device, in float32 for
half-precision inputs (float64 inputs stay float64).
"""

from __future__ import annotations

import math

import torch

from ._checks import check_qkv, resolve_scale

Q_TILE = 64
K_TILE = 64


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _tile_mask(i0: int, i1: int, j0: int, j1: int, offset: int, device) -> torch.Tensor | None:
    """(i1-i0, j1-j0) mask of visible pairs for one causal tile, None when all are visible."""
    if j1 - 1 <= i0 + offset:
        return None
    rows = torch.arange(i0, i1, device=device)[:, None]
    cols = torch.arange(j0, j1, device=device)[None, :]
    return cols <= rows + offset


def flash_forward_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    q_tile: int = Q_TILE,
    k_tile: int = K_TILE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiled forward. q (..., Nq, d), k, v (..., Nk, d) -> o (..., Nq, d), lse (..., Nq).

    Empty sequences are allowed: Nq = 0 gives empty outputs, Nk = 0 zero outputs and
    lse = -inf (no key is visible), as the Triton kernels do."""
    lead, (n_q, d), n_k = q.shape[:-2], q.shape[-2:], k.shape[-2]
    cdt = _compute_dtype(q.dtype)
    z = math.prod(lead)  # explicit: reshape(-1, 0, d) of an empty tensor is ambiguous
    qf = q.reshape(z, n_q, d).to(cdt)  # (Z, Nq, d)
    kf = k.reshape(z, n_k, d).to(cdt)  # (Z, Nk, d)
    vf = v.reshape(z, n_k, d).to(cdt)  # (Z, Nk, d)
    o = torch.zeros((z, n_q, d), dtype=cdt, device=q.device)
    lse = torch.full((z, n_q), float("-inf"), dtype=cdt, device=q.device)
    offset = n_k - n_q if causal else 0
    for i0 in range(0, n_q, q_tile):
        i1 = min(i0 + q_tile, n_q)
        qi = qf[:, i0:i1] * softmax_scale  # (Z, bq, d)
        m = torch.full((z, i1 - i0), float("-inf"), dtype=cdt, device=q.device)
        l_run = torch.zeros((z, i1 - i0), dtype=cdt, device=q.device)
        acc = torch.zeros((z, i1 - i0, d), dtype=cdt, device=q.device)
        k_end = min(n_k, i1 + offset) if causal else n_k
        for j0 in range(0, max(k_end, 0), k_tile):
            j1 = min(j0 + k_tile, n_k)
            s = qi @ kf[:, j0:j1].transpose(1, 2)  # (Z, bq, bk)
            mask = _tile_mask(i0, i1, j0, j1, offset, q.device) if causal else None
            if mask is not None:
                s = s.masked_fill(~mask, float("-inf"))
            m_new = torch.maximum(m, s.amax(dim=-1))
            # A row with no visible key so far keeps m = -inf; subtract 0 there to avoid NaN.
            m_sub = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
            p = torch.exp(s - m_sub[..., None])  # (Z, bq, bk)
            alpha = torch.exp(m - m_sub)
            l_run = alpha * l_run + p.sum(dim=-1)
            acc = alpha[..., None] * acc + p @ vf[:, j0:j1]
            m = m_new
        l_safe = torch.where(l_run == 0, torch.ones_like(l_run), l_run)
        o[:, i0:i1] = acc / l_safe[..., None]
        lse[:, i0:i1] = m + torch.log(l_run)  # -inf + -inf = -inf for empty rows
    return o.to(q.dtype).reshape(q.shape), lse.reshape(*lead, n_q)


def flash_backward_torch(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    q_tile: int = Q_TILE,
    k_tile: int = K_TILE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tiled backward by recomputation. Shapes as in the forward; returns dq, dk, dv."""
    n_q, d, n_k = q.shape[-2], q.shape[-1], k.shape[-2]
    cdt = _compute_dtype(q.dtype)
    z = math.prod(q.shape[:-2])
    qf = q.reshape(z, n_q, d).to(cdt)  # (Z, Nq, d)
    kf = k.reshape(z, n_k, d).to(cdt)  # (Z, Nk, d)
    vf = v.reshape(z, n_k, d).to(cdt)  # (Z, Nk, d)
    of = o.reshape(z, n_q, d).to(cdt)  # (Z, Nq, d)
    dof = do.reshape(z, n_q, d).to(cdt)  # (Z, Nq, d)
    lf = lse.reshape(z, n_q).to(cdt)  # (Z, Nq)
    # Empty rows have L = -inf: use +inf so that exp(S - L) = 0 there.
    lf = torch.where(torch.isneginf(lf), torch.full_like(lf, float("inf")), lf)
    delta = (dof * of).sum(dim=-1)  # (Z, Nq) = rowsum(dO * O) = rowsum(P * dP)
    dq = torch.zeros_like(qf)
    dk = torch.zeros_like(kf)
    dv = torch.zeros_like(vf)
    offset = n_k - n_q if causal else 0
    for j0 in range(0, n_k, k_tile):
        j1 = min(j0 + k_tile, n_k)
        kj, vj = kf[:, j0:j1], vf[:, j0:j1]  # (Z, bk, d)
        i_start = max(0, j0 - offset) // q_tile * q_tile if causal else 0
        for i0 in range(i_start, n_q, q_tile):
            i1 = min(i0 + q_tile, n_q)
            s = (qf[:, i0:i1] @ kj.transpose(1, 2)) * softmax_scale  # (Z, bq, bk)
            p = torch.exp(s - lf[:, i0:i1, None])  # eq. 14
            mask = _tile_mask(i0, i1, j0, j1, offset, q.device) if causal else None
            if mask is not None:
                p = p.masked_fill(~mask, 0.0)
            doi = dof[:, i0:i1]
            dv[:, j0:j1] += p.transpose(1, 2) @ doi  # eq. 15
            dp = doi @ vj.transpose(1, 2)  # eq. 16
            ds = p * (dp - delta[:, i0:i1, None])  # eq. 17
            dq[:, i0:i1] += (ds @ kj) * softmax_scale  # eq. 18
            dk[:, j0:j1] += (ds.transpose(1, 2) @ qf[:, i0:i1]) * softmax_scale  # eq. 19
    return (
        dq.to(q.dtype).reshape(q.shape),
        dk.to(k.dtype).reshape(k.shape),
        dv.to(v.dtype).reshape(v.shape),
    )


class FlashAttention2Torch(torch.autograd.Function):
    """FlashAttention-2 in PyTorch: ``FlashAttention2Torch.apply(q, k, v, is_causal=False)``.

    q (..., Nq, d), k and v (..., Nk, d) -> o (..., Nq, d). Saves q, k, v, o and the
    log-sum-exp L (..., Nq) (e.g. (batch, seq) for 3-D inputs) for the backward; never P.
    An optional fifth argument ``softmax_scale`` defaults to 1/sqrt(d).
    """

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False, softmax_scale=None):
        check_qkv(q, k, v, is_causal)
        scale = resolve_scale(softmax_scale, q.shape[-1])
        o, lse = flash_forward_torch(q, k, v, is_causal, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.is_causal = is_causal
        ctx.softmax_scale = scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = flash_backward_torch(do, q, k, v, o, lse, ctx.is_causal, ctx.softmax_scale)
        return dq, dk, dv, None, None
