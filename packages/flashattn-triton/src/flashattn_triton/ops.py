"""The Triton launchers as ``torch.library`` custom ops, so torch.compile has no graph break.

- ``flashattn_triton::fwd(q, k, v, causal, softmax_scale) -> (o, lse)``
- ``flashattn_triton::bwd(do, q, k, v, o, lse, causal, softmax_scale) -> (dq, dk, dv)``

All tensors are (B, H, N, d) (lse: (B, H, Nq) float32). The fake implementations give
compile the output shapes and strides without running anything; ``fwd`` is differentiable
through ``bwd`` (``register_autograd``), and the log-sum-exp output is non-differentiable.
"""

from __future__ import annotations

import torch

from . import launch


@torch.library.custom_op("flashattn_triton::fwd", mutates_args=())
def attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, H, Nq, d), k, v (B, H, Nk, d) -> o (B, H, Nq, d), lse (B, H, Nq) float32."""
    return launch.forward(q, k, v, causal, softmax_scale)


@attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, causal, softmax_scale):
    lse = q.new_empty(q.shape[:-1], dtype=torch.float32)  # (B, H, Nq)
    return launch.out_like(q), lse


@torch.library.custom_op("flashattn_triton::bwd", mutates_args=())
def attention_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dO (B, H, Nq, d) and the forward's q, k, v, o, lse -> dq, dk, dv (shaped like q, k, v)."""
    return launch.backward(do, q, k, v, o, lse, causal, softmax_scale)


@attention_bwd.register_fake
def _attention_bwd_fake(do, q, k, v, o, lse, causal, softmax_scale):
    return launch.out_like(q), launch.out_like(k), launch.out_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, causal, softmax_scale = inputs
    o, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.causal = causal
    ctx.softmax_scale = softmax_scale


def _backward(ctx, do, _dlse):
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = attention_bwd(do, q, k, v, o, lse, ctx.causal, ctx.softmax_scale)
    return dq, dk, dv, None, None


attention_fwd.register_autograd(_backward, setup_context=_setup_context)
