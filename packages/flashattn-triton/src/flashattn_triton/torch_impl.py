"""FlashAttention-2 in plain PyTorch: the readable version of what the Triton kernels do.

Forward (handout Algorithm 1): for each query tile, loop over key tiles keeping a running row
maximum m, a running denominator l and an unnormalized output; finish with O = acc / l and the
log-sum-exp L = m + log(l). Backward (handout equations 13-19) recomputes P = exp(S - L) tile
by tile from Q, K and L, with D = rowsum(dO * O); P is never stored.

Masks are bottom-right aligned (see ``reference``): with a window (left, right) key j is
visible to query i iff i + (Nk - Nq) - left <= j <= i + (Nk - Nq) + right (-1: unbounded),
and causal is right = 0. Key tiles no query of a tile sees are skipped, so the cost grows
with N x window. Grouped-query attention (fewer k/v heads, dim -3) broadcasts each k/v head
over its group of q heads (no copies); dK and dV are summed over the group. Variable-length
batches run sequence by sequence. Runs on any device, in float32 for half-precision inputs
(float64 inputs stay float64).
"""

from __future__ import annotations

import math

import torch

from ._checks import check_qkv, resolve_scale, resolve_window

Q_TILE = 64
K_TILE = 64


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _offsets(causal: bool, window: tuple[int, int], n_q: int, n_k: int):
    """(lo, hi): key j is visible to query i iff i + lo <= j <= i + hi; None = unbounded."""
    left, right = resolve_window(causal, window[0], window[1], n_q, n_k)
    lo = None if left < 0 else n_k - n_q - left
    hi = None if right < 0 else n_k - n_q + right
    return lo, hi


def _key_span(i0: int, i1: int, n_k: int, lo: int | None, hi: int | None) -> tuple[int, int]:
    """Keys [j0, j1) that some query of rows [i0, i1) sees."""
    j0 = 0 if lo is None else max(0, i0 + lo)
    j1 = n_k if hi is None else min(n_k, i1 - 1 + hi + 1)
    return j0, max(j0, j1)


def _tile_mask(
    i0: int, i1: int, j0: int, j1: int, lo: int | None, hi: int | None, device
) -> torch.Tensor | None:
    """(i1-i0, j1-j0) mask of visible pairs for one tile, None when all are visible."""
    full_hi = hi is None or j1 - 1 <= i0 + hi
    full_lo = lo is None or j0 >= i1 - 1 + lo
    if full_hi and full_lo:
        return None
    rows = torch.arange(i0, i1, device=device)[:, None]
    cols = torch.arange(j0, j1, device=device)[None, :]
    keep = torch.ones((i1 - i0, j1 - j0), dtype=torch.bool, device=device)
    if hi is not None:
        keep &= cols <= rows + hi
    if lo is not None:
        keep &= cols >= rows + lo
    return keep


def _grouped(q: torch.Tensor, k: torch.Tensor) -> tuple[int, int]:
    """(Z, G): k/v heads (all leading dims) and q heads per k/v head."""
    z = math.prod(k.shape[:-2])  # explicit: reshape(-1, 0, d) of an empty tensor is ambiguous
    zq = math.prod(q.shape[:-2])
    return z, (zq // z if z else 1)


def flash_forward_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    q_tile: int = Q_TILE,
    k_tile: int = K_TILE,
    window: tuple[int, int] = (-1, -1),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiled forward. q (..., Hq, Nq, d), k, v (..., Hkv, Nk, d) (Hkv divides Hq) ->
    o (..., Hq, Nq, d), lse (..., Hq, Nq).

    Empty sequences are allowed: Nq = 0 gives empty outputs, Nk = 0 zero outputs and
    lse = -inf (no key is visible), as the Triton kernels do."""
    lead, (n_q, d), n_k = q.shape[:-2], q.shape[-2:], k.shape[-2]
    cdt = _compute_dtype(q.dtype)
    z, g = _grouped(q, k)
    qf = q.reshape(z, g, n_q, d).to(cdt)  # (Z, G, Nq, d)
    kf = k.reshape(z, 1, n_k, d).to(cdt)  # (Z, 1, Nk, d): broadcast over the group
    vf = v.reshape(z, 1, n_k, d).to(cdt)  # (Z, 1, Nk, d)
    o = torch.zeros((z, g, n_q, d), dtype=cdt, device=q.device)
    lse = torch.full((z, g, n_q), float("-inf"), dtype=cdt, device=q.device)
    lo, hi = _offsets(causal, window, n_q, n_k)
    for i0 in range(0, n_q, q_tile):
        i1 = min(i0 + q_tile, n_q)
        qi = qf[:, :, i0:i1] * softmax_scale  # (Z, G, bq, d)
        m = torch.full((z, g, i1 - i0), float("-inf"), dtype=cdt, device=q.device)
        l_run = torch.zeros((z, g, i1 - i0), dtype=cdt, device=q.device)
        acc = torch.zeros((z, g, i1 - i0, d), dtype=cdt, device=q.device)
        k_start, k_end = _key_span(i0, i1, n_k, lo, hi)
        for j0 in range(k_start // k_tile * k_tile, k_end, k_tile):
            j1 = min(j0 + k_tile, n_k)
            s = qi @ kf[:, :, j0:j1].transpose(-1, -2)  # (Z, G, bq, bk)
            mask = _tile_mask(i0, i1, j0, j1, lo, hi, q.device)
            if mask is not None:
                s = s.masked_fill(~mask, float("-inf"))
            m_new = torch.maximum(m, s.amax(dim=-1))
            # A row with no visible key so far keeps m = -inf; subtract 0 there to avoid NaN.
            m_sub = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
            p = torch.exp(s - m_sub[..., None])  # (Z, G, bq, bk)
            alpha = torch.exp(m - m_sub)
            l_run = alpha * l_run + p.sum(dim=-1)
            acc = alpha[..., None] * acc + p @ vf[:, :, j0:j1]
            m = m_new
        l_safe = torch.where(l_run == 0, torch.ones_like(l_run), l_run)
        o[:, :, i0:i1] = acc / l_safe[..., None]
        lse[:, :, i0:i1] = m + torch.log(l_run)  # -inf + -inf = -inf for empty rows
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
    window: tuple[int, int] = (-1, -1),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tiled backward by recomputation. Shapes as in the forward; returns dq, dk, dv (dk and
    dv summed over each group of q heads that shares a k/v head)."""
    n_q, d, n_k = q.shape[-2], q.shape[-1], k.shape[-2]
    cdt = _compute_dtype(q.dtype)
    z, g = _grouped(q, k)
    qf = q.reshape(z, g, n_q, d).to(cdt)  # (Z, G, Nq, d)
    kf = k.reshape(z, 1, n_k, d).to(cdt)  # (Z, 1, Nk, d)
    vf = v.reshape(z, 1, n_k, d).to(cdt)  # (Z, 1, Nk, d)
    of = o.reshape(z, g, n_q, d).to(cdt)  # (Z, G, Nq, d)
    dof = do.reshape(z, g, n_q, d).to(cdt)  # (Z, G, Nq, d)
    lf = lse.reshape(z, g, n_q).to(cdt)  # (Z, G, Nq)
    # Empty rows have L = -inf: use +inf so that exp(S - L) = 0 there.
    lf = torch.where(torch.isneginf(lf), torch.full_like(lf, float("inf")), lf)
    delta = (dof * of).sum(dim=-1)  # (Z, G, Nq) = rowsum(dO * O) = rowsum(P * dP)
    dq = torch.zeros_like(qf)
    dk = torch.zeros((z, n_k, d), dtype=cdt, device=q.device)
    dv = torch.zeros((z, n_k, d), dtype=cdt, device=q.device)
    lo, hi = _offsets(causal, window, n_q, n_k)
    for j0 in range(0, n_k, k_tile):
        j1 = min(j0 + k_tile, n_k)
        kj, vj = kf[:, :, j0:j1], vf[:, :, j0:j1]  # (Z, 1, bk, d)
        # Queries that see some key of this tile: i >= j0 - hi and i <= j1 - 1 - lo.
        i_start = 0 if hi is None else max(0, j0 - hi)
        i_end = n_q if lo is None else max(0, min(n_q, j1 - 1 - lo + 1))
        for i0 in range(i_start // q_tile * q_tile, i_end, q_tile):
            i1 = min(i0 + q_tile, n_q)
            s = (qf[:, :, i0:i1] @ kj.transpose(-1, -2)) * softmax_scale  # (Z, G, bq, bk)
            p = torch.exp(s - lf[:, :, i0:i1, None])  # eq. 14
            mask = _tile_mask(i0, i1, j0, j1, lo, hi, q.device)
            if mask is not None:
                p = p.masked_fill(~mask, 0.0)
            doi = dof[:, :, i0:i1]
            dv[:, j0:j1] += (p.transpose(-1, -2) @ doi).sum(1)  # eq. 15, summed over G
            dp = doi @ vj.transpose(-1, -2)  # eq. 16
            ds = p * (dp - delta[:, :, i0:i1, None])  # eq. 17
            dq[:, :, i0:i1] += (ds @ kj) * softmax_scale  # eq. 18
            dk[:, j0:j1] += (ds.transpose(-1, -2) @ qf[:, :, i0:i1]).sum(1) * softmax_scale
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


class TorchAttention(torch.autograd.Function):
    """``flash_attention(..., backend='torch')`` with a window or the log-sum-exp:
    ``TorchAttention.apply(q, k, v, causal, scale, window_left, window_right)`` on checked
    inputs -> (o, lse); lse is not differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, causal, softmax_scale, window_left, window_right):
        window = (window_left, window_right)
        o, lse = flash_forward_torch(q, k, v, causal, softmax_scale, window=window)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.args = (causal, softmax_scale, window)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        causal, scale, window = ctx.args
        dq, dk, dv = flash_backward_torch(do, q, k, v, o, lse, causal, scale, window=window)
        return dq, dk, dv, None, None, None, None


def varlen_attention_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets_q: list[int],
    offsets_k: list[int],
    causal: bool,
    softmax_scale: float,
    window: tuple[int, int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed sequences one at a time: q (total_q, Hq, d), k, v (total_k, Hkv, d), offsets
    as Python lists (checked) -> o (total_q, Hq, d), lse (Hq, total_q); differentiable
    through o."""
    outs, lses = [], []
    for s in range(len(offsets_q) - 1):
        q0, q1, k0, k1 = offsets_q[s], offsets_q[s + 1], offsets_k[s], offsets_k[s + 1]
        o, lse = TorchAttention.apply(
            q[q0:q1].transpose(0, 1),  # (Hq, n_q, d)
            k[k0:k1].transpose(0, 1),  # (Hkv, n_k, d)
            v[k0:k1].transpose(0, 1),  # (Hkv, n_k, d)
            causal, softmax_scale, *window,
        )  # fmt: skip
        outs.append(o.transpose(0, 1))  # (n_q, Hq, d)
        lses.append(lse)  # (Hq, n_q)
    return torch.cat(outs, dim=0), torch.cat(lses, dim=1)


def kvcache_attention_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seqlens: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    window: tuple[int, int],
    q_tile: int = Q_TILE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over a KV cache: q (B, Hq, Nq, d), k, v (B, Hkv, S, d), seqlens (B,) int;
    batch element b sees its first seqlens[b] keys (clamped to [0, S]), masks aligned to that
    count -> o (B, Hq, Nq, d), lse (B, Hq, Nq). A masked softmax over all S keys per tile of
    ``q_tile`` queries (the mask is built on the device: no host read of seqlens; memory
    bounded by one tile's scores); float32 inside for half precision."""
    b, h_q, n_q, d = q.shape
    h_kv, n_k = k.shape[1], k.shape[2]
    cdt = _compute_dtype(q.dtype)
    lens = seqlens.to(device=q.device, dtype=torch.int64).clamp(0, n_k).view(b, 1, 1, 1, 1)
    qf = q.reshape(b, h_kv, h_q // h_kv, n_q, d).to(cdt) * softmax_scale  # (B, Hkv, G, Nq, d)
    kf = k.to(cdt)[:, :, None]  # (B, Hkv, 1, S, d): broadcast over the group
    vf = v.to(cdt)[:, :, None]
    cols = torch.arange(n_k, device=q.device).view(1, 1, 1, 1, n_k)
    left, right = window
    if causal:
        right = 0
    o = torch.empty(qf.shape, dtype=cdt, device=q.device)
    lse = torch.empty(qf.shape[:-1], dtype=cdt, device=q.device)
    for i0 in range(0, n_q, q_tile):
        i1 = min(i0 + q_tile, n_q)
        s = qf[..., i0:i1, :] @ kf.transpose(-1, -2)  # (B, Hkv, G, tile, S)
        rows = torch.arange(i0, i1, device=q.device).view(1, 1, 1, i1 - i0, 1)
        keep = cols < lens
        if left >= 0:
            keep = keep & (cols >= rows + lens - n_q - left)
        if right >= 0:
            keep = keep & (cols <= rows + lens - n_q + right)
        s = s.masked_fill(~keep, float("-inf"))
        tile_lse = torch.logsumexp(s, dim=-1)  # -inf for rows that see no key
        lse_safe = torch.where(torch.isneginf(tile_lse), torch.zeros_like(tile_lse), tile_lse)
        o[..., i0:i1, :] = torch.exp(s - lse_safe[..., None]) @ vf
        lse[..., i0:i1] = tile_lse
    return o.to(q.dtype).reshape(q.shape), lse.reshape(b, h_q, n_q)


def append_kv_torch(
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seqlens: torch.Tensor,
) -> torch.Tensor:
    """Store k_new, v_new (B, Hkv, n_new, d) into the caches (B, Hkv, S, d) from row
    seqlens[b] on (clamped to [0, S]; rows past S dropped; ``launch_common.append_kv`` in
    PyTorch), without reading the lengths on the host: every cache row takes its new row
    where one lands there (a pass over the whole cache, as the PyTorch attention over it
    is). Returns the int32 (B,) key counts the attention then sees: the clamped lengths
    plus n_new, as the kernels' KV_ADD counts them."""
    n_new, s = k_new.shape[2], k_cache.shape[2]
    start = seqlens.to(device=k_cache.device, dtype=torch.int64).clamp(0, s)[:, None]  # (B, 1)
    seen = (start[:, 0] + n_new).to(torch.int32)
    if n_new == 0 or s == 0:
        return seen
    src = torch.arange(s, device=k_cache.device) - start  # (B, S): new row landing at each row
    lands = ((src >= 0) & (src < n_new))[:, None, :, None]  # (B, 1, S, 1)
    index = src.clamp(0, n_new - 1)[:, None, :, None]  # (B, 1, S, 1)
    for new, cache in ((k_new, k_cache), (v_new, v_cache)):
        moved = new.to(cache.dtype).gather(2, index.expand(*new.shape[:2], s, new.shape[3]))
        cache.copy_(torch.where(lands, moved, cache))
    return seen
