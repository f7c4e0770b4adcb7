"""FLOP counts of the model, for MFU.

Counted: every matmul of a linear layer and the two attention matmuls. A matmul of an (m, k)
by a (k, n) matrix costs 2*m*k*n FLOPs (multiply + add). With N = batch * seq tokens, D d_model,
F d_ff, L layers, V vocab, T seq:

    linear  = 2 * N * (L * (2*D*D + 2*D*Dkv + 3*D*F) + D*V)
              (per layer: q D*D, k and v D*Dkv each, output 1*D*D, w1 and w3 2*D*F, w2 1*D*F;
              LM head D*V; Dkv = num_kv_heads * head_dim, D without grouped-query attention)
    attn    = L * 2 * (2 * batch * T * K * D)
              (QK^T and PV, each 2*batch*H*T*K*Dh = 2*batch*T*K*D, K = T: the full T x T
              matrix; with a sliding window W, K = min(T, W + 1), the keys a query can see)
    forward = linear + attn
    backward = 2 * forward          (gradients w.r.t. inputs and w.r.t. weights)
    train step = 3 * forward

Not counted: the embedding lookup (no matmul), norms, softmax, RoPE, elementwise ops and the
optimizer (all O(N*D) or O(params), small next to the matmuls). Attention is counted over the
full T x T matrix, not the causal half, the convention of Megatron-LM and PaLM MFU figures.
"""

from __future__ import annotations

from lm_core.config import ModelConfig


def _check(config: ModelConfig, batch: int, seq: int) -> None:
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config: expected a ModelConfig, got {type(config).__name__}")
    for name, value in (("batch", batch), ("seq", seq)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")


def matmul_params(config: ModelConfig) -> int:
    """Weights that take part in a matmul per token: L*(2D^2 + 2D*Dkv + 3DF) + DV (no
    embedding; Dkv = D without grouped-query attention: L*(4D^2 + 3DF) + DV)."""
    d, f = config.d_model, config.d_ff
    d_kv = config.kv_heads * config.head_dim
    return config.num_layers * (2 * d * d + 2 * d * d_kv + 3 * d * f) + d * config.vocab_size


def forward_flops(config: ModelConfig, batch: int, seq: int) -> int:
    """FLOPs of one forward pass on `batch` sequences of length `seq` (see module formula)."""
    _check(config, batch, seq)
    tokens = batch * seq
    linear = 2 * tokens * matmul_params(config)
    keys = seq if config.sliding_window is None else min(seq, config.sliding_window + 1)
    attention = config.num_layers * 2 * (2 * batch * seq * keys * config.d_model)
    return linear + attention


def forward_flops_of_dims(
    *, d_model: int, d_ff: int, num_layers: int, vocab_size: int, batch: int, seq: int
) -> int:
    """The module formula on bare dimensions (multi-head attention, no window), for models
    that are not a ModelConfig (e.g. a Hugging Face Llama of the same shape)."""
    d, f = int(d_model), int(d_ff)
    linear = 2 * batch * seq * (num_layers * (4 * d * d + 3 * d * f) + d * vocab_size)
    attention = num_layers * 2 * (2 * batch * seq * seq * d)
    return linear + attention


def backward_flops(config: ModelConfig, batch: int, seq: int) -> int:
    """FLOPs of one backward pass: 2 x forward."""
    return 2 * forward_flops(config, batch, seq)


def train_step_flops(config: ModelConfig, batch: int, seq: int) -> int:
    """FLOPs of forward + backward (optimizer not counted): 3 x forward."""
    return 3 * forward_flops(config, batch, seq)
