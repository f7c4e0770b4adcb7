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


def poison_cuda_cache() -> None:
    """Fill free blocks of the CUDA caching allocator (its large and small pools) with NaN.
    A kernel that reads memory no one wrote then sees NaN on every run, not whatever the
    last user left there (often zeros, which can hide such a read)."""
    big = torch.full((2**26,), float("nan"), device="cuda")  # 256 MB: the large pool
    sizes = (256, 1024, 4096, 16384, 65536, 200_000)  # up to 1 MB: the small pool
    small = [torch.full((m,), float("nan"), device="cuda") for m in sizes for _ in range(32)]
    del big, small


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


def window_mask(n_q: int, n_k: int, causal: bool, window: tuple[int, int]) -> torch.Tensor:
    """(Nq, Nk) bool, True where query i sees key j, written out pair by pair from the rule
    i + Nk - Nq - left <= j <= i + Nk - Nq + right (-1: unbounded; causal: right = 0)."""
    left, right = window
    if causal:
        right = 0
    keep = torch.ones(n_q, n_k, dtype=torch.bool)
    for i in range(n_q):
        for j in range(n_k):
            if left >= 0 and j < i + n_k - n_q - left:
                keep[i, j] = False
            if right >= 0 and j > i + n_k - n_q + right:
                keep[i, j] = False
    return keep


def reference_features(q, k, v, do, causal=False, window=(-1, -1), scale=None):
    """Float64 o, lse, dq, dk, dv of naive attention with grouped k/v heads (k, v expanded to
    q's heads by repeat_interleave along dim -3) and an explicit window mask. Rows that see
    no key: o = 0, lse = -inf."""
    d = q.shape[-1]
    scale = d**-0.5 if scale is None else scale
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    group = q.shape[-3] // k.shape[-3] if q.dim() >= 3 else 1
    kx = k64.repeat_interleave(group, dim=-3) if group > 1 else k64
    vx = v64.repeat_interleave(group, dim=-3) if group > 1 else v64
    s = q64 @ kx.transpose(-1, -2) * scale  # (..., Hq, Nq, Nk)
    keep = window_mask(q.shape[-2], k.shape[-2], causal, window).to(s.device)
    s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    lse_safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    o = torch.exp(s - lse_safe[..., None]) @ vx
    (o * do.detach().double()).sum().backward()
    return {"o": o.detach(), "lse": lse.detach(), "dq": q64.grad, "dk": k64.grad, "dv": v64.grad}


def reference_varlen(q, k, v, do, cu_q, cu_k, causal=False, window=(-1, -1), scale=None):
    """``reference_features`` one packed sequence at a time: q (total_q, Hq, d), k, v
    (total_k, Hkv, d), offsets as lists -> o (total_q, Hq, d), lse (Hq, total_q) and the
    gradients, float64."""
    outs = {name: [] for name in ("o", "lse", "dq", "dk", "dv")}
    for s in range(len(cu_q) - 1):
        a, b, c, e = cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]
        ref = reference_features(
            q[a:b].transpose(0, 1), k[c:e].transpose(0, 1), v[c:e].transpose(0, 1),
            do[a:b].transpose(0, 1), causal, window, scale,
        )  # fmt: skip
        for name in ("o", "dq", "dk", "dv"):
            outs[name].append(ref[name].transpose(0, 1))
        outs["lse"].append(ref["lse"])
    out = {name: torch.cat(outs[name], dim=0) for name in ("o", "dq", "dk", "dv")}
    out["lse"] = torch.cat(outs["lse"], dim=1)
    return out


def offsets(lengths: list[int]) -> torch.Tensor:
    """int32 cumulative offsets [0, l0, l0 + l1, ...] of sequence lengths."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32)


def check_against(out: dict, ref: dict, tol: float, lse_tol: float) -> None:
    """Relative errors of o, dq, dk, dv below ``tol``, finite; lse -inf exactly where the
    reference's is and within ``lse_tol`` elsewhere."""
    for name in ("o", "dq", "dk", "dv"):
        assert torch.isfinite(out[name]).all(), name
        err = rel_err(out[name], ref[name])
        assert err < tol, (name, err)
    fin = torch.isfinite(ref["lse"])
    assert torch.equal(torch.isfinite(out["lse"]), fin), "rows without keys must have lse -inf"
    assert torch.isneginf(out["lse"][~fin]).all()
    if fin.any():
        err = (out["lse"][fin].double() - ref["lse"][fin]).abs().max().item()
        assert err < lse_tol, ("lse", err)


def assert_within_bf16(outs, refs) -> None:
    """Each of ``outs`` within bf16 rounding of its reference: max abs error at most 2% of the
    reference's largest magnitude plus 2e-3 (outputs and gradients of 16-bit attention)."""
    for i, (a, r) in enumerate(zip(outs, refs, strict=True)):
        err = (a.float() - r.float()).abs().max().item()
        assert err <= 2e-2 * r.float().abs().max().item() + 2e-3, (i, err)
