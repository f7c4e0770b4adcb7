"""FLOP counts for the model benchmarks, the profiler and the attention sweep.

The formulas have one home each, in the package whose code they describe; this module only
applies them to the benchmarks' modes and passes:
- the model: `lm_core.flops` (matmul FLOPs of a forward pass, attention over the full T x T
  matrix, backward = 2 x forward, the usual MFU definition: PaLM, Chowdhery et al. 2022,
  appendix B);
- one attention call: `flashattn_triton.flops` (the FlashAttention benchmarks' convention:
  QK^T and PV forward, five matmuls backward = 2.5 x forward, causal pairs counted exactly).
Only the softmax count of the profiler's attention sub-steps is defined here.
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
    """Matmul FLOPs of one forward pass of a model with `config` on `batch` x `seq` tokens:
    `lm_core.forward_flops` for an lm_core ModelConfig, the same formula on the dims of any
    other config (`formula_forward_flops`)."""
    import lm_core

    if isinstance(config, lm_core.ModelConfig):
        return float(lm_core.forward_flops(config, batch, seq))
    return formula_forward_flops(config, batch, seq)


def formula_forward_flops(config: Any, batch: int, seq: int) -> float:
    """lm_core's forward formula on any object with d_model, d_ff, num_layers, vocab_size."""
    from lm_core.flops import forward_flops_of_dims

    d, f, n_layers, _, vocab = _dims(config)
    return float(
        forward_flops_of_dims(
            d_model=d, d_ff=f, num_layers=n_layers, vocab_size=vocab, batch=batch, seq=seq
        )
    )


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
    # each of the two forward matmuls is half of a non-causal attention call's forward
    mm = n_layers * attention_flops(batch, heads, seq, seq, d_head, False, "fwd") / 2
    soft = float(SOFTMAX_FLOPS_PER_ELEMENT) * batch * heads * seq * seq * n_layers
    return {"scores": mm, "softmax": soft, "weighted_sum": mm}


def attention_flops(
    batch: int, heads: int, seq_q: int, seq_k: int, d_head: int, causal: bool, pass_: str
) -> float:
    """Matmul FLOPs of one attention call: `flashattn_triton.attention_flops` over
    batch x heads independent heads. forward: QK^T and PV, 4 * d FLOPs per visible (query,
    key) pair (causal: N(N+1)/2 pairs for N queries and keys, bottom-right aligned);
    backward: 2.5x forward (five matmuls: recompute S, dV, dP, dQ, dK). `pass_` is 'fwd',
    'bwd' or 'fwd_bwd' (3.5x forward).
    """
    from flashattn_triton.flops import MODES
    from flashattn_triton.flops import attention_flops as flops_of_attention

    if pass_ not in MODES:
        raise ValueError(f"pass_: expected one of {sorted(MODES)}, got {pass_!r}")
    return flops_of_attention(batch * heads, seq_q, seq_k, d_head, causal, pass_)
