"""Shared helpers of the flashattn-triton tests: float64 references and error measures."""

from __future__ import annotations

import torch

from flashattn_triton.reference import causal_mask


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (0 when both are 0)."""
    a, b = a.detach().double(), b.detach().double()
    den = b.norm()
    if den == 0:
        return float((a - b).norm())
    return float((a - b).norm() / den)


def reference_fwd_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    causal: bool,
    scale: float | None = None,
    chunk: int = 2048,
) -> dict[str, torch.Tensor]:
    """Float64 o, lse, dq, dk, dv of naive attention, in query chunks (bounded memory).

    q (..., Nq, d), k, v (..., Nk, d), do like q. Rows that see no key: o = 0, lse = -inf.
    """
    d = q.shape[-1]
    scale = d**-0.5 if scale is None else scale
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    do64 = do.detach().double()
    n_q, n_k = q.shape[-2], k.shape[-2]
    mask = causal_mask(n_q, n_k, q.device) if causal else None
    outs, lses = [], []
    for i0 in range(0, n_q, chunk):
        i1 = min(i0 + chunk, n_q)
        s = q64[..., i0:i1, :] @ k64.transpose(-1, -2) * scale  # (..., c, Nk)
        if mask is not None:
            s = s.masked_fill(~mask[i0:i1], float("-inf"))
        lse = torch.logsumexp(s, dim=-1)  # (..., c)
        lse_safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
        o = torch.exp(s - lse_safe[..., None]) @ v64  # (..., c, d)
        (o * do64[..., i0:i1, :]).sum().backward()
        outs.append(o.detach())
        lses.append(lse.detach())
    return {
        "o": torch.cat(outs, dim=-2),
        "lse": torch.cat(lses, dim=-1),
        "dq": q64.grad,
        "dk": k64.grad,
        "dv": v64.grad,
    }


def run_fwd_bwd(fn, q, k, v, do, causal):
    """o, dq, dk, dv of ``fn(q, k, v, causal)`` (fresh leaf copies, dO given)."""
    qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = fn(qq, kk, vv, causal)
    o.backward(do)
    return {"o": o.detach(), "dq": qq.grad, "dk": kk.grad, "dv": vv.grad}


def saved_lse(o: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The log-sum-exp an autograd.Function saved: the saved tensor shaped like q[..., 0]."""
    found = [t for t in o.grad_fn.saved_tensors if t.shape == q.shape[:-1]]
    assert len(found) == 1, [tuple(t.shape) for t in o.grad_fn.saved_tensors]
    return found[0]
