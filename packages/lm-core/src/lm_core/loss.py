"""Cross-entropy over next-token logits."""

from __future__ import annotations

import torch


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood of `targets` under softmax(`logits`), over all positions.

    logits: (..., V) float, e.g. (B, T, V) or (N, V); targets: (...) integer ids in [0, V).
    Returns a 0-dim fp32 tensor. Computed in fp32 as logsumexp(logits) - logits[target];
    logsumexp subtracts the row max before exponentiating, so logits of any size (1e4 and
    beyond) give finite results. Equal to `F.cross_entropy(logits.view(-1, V), targets.view(-1))`.

    Target values are range-checked (ValueError) for CPU tensors outside `torch.compile`; on
    a GPU that check would stall the host every step, so an out-of-range target there fails
    in the device-side index assert of the gather instead.
    """
    if logits.dim() < 1 or not logits.dtype.is_floating_point:
        raise TypeError(
            f"logits: expected a floating tensor of shape (..., V), got {logits.dtype} "
            f"{tuple(logits.shape)}"
        )
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise TypeError(f"targets: expected an integer dtype, got {targets.dtype}")
    if targets.shape != logits.shape[:-1]:
        raise ValueError(
            f"targets: expected shape {tuple(logits.shape[:-1])} (logits without the vocab dim), "
            f"got {tuple(targets.shape)}"
        )
    if targets.device.type == "cpu" and targets.numel() > 0 and not torch.compiler.is_compiling():
        lo, hi, v = int(targets.min()), int(targets.max()), logits.shape[-1]
        if lo < 0 or hi >= v:
            raise ValueError(
                f"targets: values must lie in [0, V={v}) (V = logits.shape[-1]), "
                f"got min {lo}, max {hi}"
            )
    logits = logits.float()
    log_norm = torch.logsumexp(logits, dim=-1)  # (...)
    target_logit = logits.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)  # (...)
    return (log_norm - target_logit).mean()
