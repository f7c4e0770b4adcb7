"""Plain-PyTorch attention that materializes the score matrix: the ground truth for tests.

Masking convention used by every implementation in this package (as in FlashAttention-2):
causal masking is aligned to the bottom-right corner, so query row i may attend to key j iff
j <= i + (Nk - Nq). With Nq == Nk this is the usual lower-triangular mask. When Nq > Nk the
first Nq - Nk query rows see no key at all: their output is 0 and their log-sum-exp is -inf.
"""

from __future__ import annotations

import torch

from ._checks import check_qkv, resolve_scale


def causal_mask(n_q: int, n_k: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Boolean (Nq, Nk) mask, True where query i may attend to key j (bottom-right aligned)."""
    rows = torch.arange(n_q, device=device)[:, None]
    cols = torch.arange(n_k, device=device)[None, :]
    return cols <= rows + (n_k - n_q)


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    softmax_scale: float | None = None,
    upcast: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Naive attention: returns o (..., Nq, d) and the log-sum-exp lse (..., Nq).

    q (..., Nq, d), k and v (..., Nk, d). With ``upcast`` the math runs in float64 and the
    results stay float64 (a reference to compare lower-precision kernels against).
    Rows that see no key get o = 0 and lse = -inf (never NaN).
    """
    check_qkv(q, k, v, causal)
    scale = resolve_scale(softmax_scale, q.shape[-1])
    if upcast:
        q, k, v = q.double(), k.double(), v.double()
    s = torch.matmul(q, k.transpose(-1, -2)) * scale  # (..., Nq, Nk)
    if causal:
        s = s.masked_fill(~causal_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (..., Nq); -inf for empty rows
    lse_safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - lse_safe[..., None])  # exp(-inf) = 0 for masked and empty rows
    return torch.matmul(p, v), lse
