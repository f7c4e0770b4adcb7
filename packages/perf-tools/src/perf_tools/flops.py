"""FLOP counts, written out, for the model benchmarks, the profiler and the attention sweep.

Only matrix-multiply FLOPs are counted (2 FLOPs per multiply-add); elementwise work, norms,
softmax and the optimizer are left out, as in the usual MFU definition (PaLM, Chowdhery et al.
2022, appendix B). For a decoder-only model with L layers, width d, feed-forward width f,
vocabulary V, batch B and sequence length T, one forward pass costs

    F_fwd = 2 * B * T * (L * (4 d^2 + 3 d f) + d V)      projections: q, k, v, o (4 d^2),
                                                        SwiGLU w1, w2, w3 (3 d f), LM head
          + 4 * B * L * T^2 * d                          attention: Q K^T and P V, each
                                                        2 * B * T^2 * d (all heads together)

Attention is counted over the full T x T matrix (the naive and SDPA-math implementations do
compute all of it; this is also the PaLM convention), so MFU of a causal kernel that skips the
masked half is not overstated. Backward costs twice the forward (a gradient for the input and
one for the weight of every matmul), so a forward+backward pass or a training step costs
3 * F_fwd.
"""

from __future__ import annotations

from typing import Any

# mode name -> multiple of the forward FLOPs
MODE_FACTOR = {"forward": 1.0, "fwd-bwd": 3.0, "train": 3.0}

# FLOPs per score element counted for a softmax: max, subtract, exp, sum, divide.
SOFTMAX_FLOPS_PER_ELEMENT = 5


def _dims(config: Any) -> tuple[int, int, int, int, int]:
    return (
        int(config.d_model),
        int(config.d_ff),
        int(config.num_layers),
        int(config.num_heads),
        int(config.vocab_size),
    )


def forward_flops(config: Any, batch: int, seq: int) -> float:
    """Matmul FLOPs of one forward pass of a model with `config` on `batch` x `seq` tokens.

    Uses lm_core's own count (`lm_core.forward_flops`, the same formula) when `config` is an
    lm_core ModelConfig, else the formula above.
    """
    try:
        import lm_core

        if isinstance(config, lm_core.ModelConfig) and hasattr(lm_core, "forward_flops"):
            return float(lm_core.forward_flops(config, batch, seq))
    except ImportError:
        pass
    return formula_forward_flops(config, batch, seq)


def formula_forward_flops(config: Any, batch: int, seq: int) -> float:
    """The module docstring's forward formula, written out (any object with the dim fields)."""
    d, f, n_layers, _, vocab = _dims(config)
    dense = 2.0 * batch * seq * (n_layers * (4 * d * d + 3 * d * f) + d * vocab)
    attn = 4.0 * batch * n_layers * seq * seq * d
    return dense + attn


def step_flops(config: Any, batch: int, seq: int, mode: str) -> float:
    """Matmul FLOPs of one step in `mode` ('forward', 'fwd-bwd' or 'train')."""
    try:
        factor = MODE_FACTOR[mode]
    except KeyError:
        raise ValueError(f"mode: expected one of {sorted(MODE_FACTOR)}, got {mode!r}") from None
    return factor * forward_flops(config, batch, seq)


def attention_substep_flops(config: Any, batch: int, seq: int) -> dict[str, float]:
    """Forward FLOPs of the three attention sub-steps, summed over all layers.

    scores (Q K^T) and weighted_sum (P V): 2 * B * H * T * T * d_head each per layer;
    softmax: SOFTMAX_FLOPS_PER_ELEMENT per score element (B * H * T * T per layer).
    """
    d, _, n_layers, heads, _ = _dims(config)
    d_head = d // heads
    mm = 2.0 * batch * heads * seq * seq * d_head * n_layers
    soft = float(SOFTMAX_FLOPS_PER_ELEMENT) * batch * heads * seq * seq * n_layers
    return {"scores": mm, "softmax": soft, "weighted_sum": mm}


def attention_flops(
    batch: int, heads: int, seq_q: int, seq_k: int, d_head: int, causal: bool, pass_: str
) -> float:
    """Matmul FLOPs of one attention call (the FlashAttention benchmarks' convention).

    forward: Q K^T and P V, 2 * B * H * Nq * Nk * d each, halved when causal (the masked half
    need not be computed). backward: 2.5x forward (five matmuls: recompute S, dV, dP, dQ, dK).
    `pass_` is 'fwd', 'bwd' or 'fwd_bwd' (3.5x forward).
    """
    fwd = 4.0 * batch * heads * seq_q * seq_k * d_head
    if causal:
        fwd *= 0.5
    factor = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}
    try:
        return fwd * factor[pass_]
    except KeyError:
        raise ValueError(f"pass_: expected one of {sorted(factor)}, got {pass_!r}") from None
