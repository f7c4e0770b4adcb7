"""The Transformer language model: pre-norm blocks of RMSNorm, causal attention with RoPE and a
SwiGLU feed-forward, as in the CS336 course model, written for speed.

Same parameters and math as the course model, laid out for fewer, larger kernels:
- q, k, v projections are one (3*d_model, d_model) matrix `qkv_proj` (rows: q, then k, then v;
  within each, head-major; with `num_kv_heads` the k and v parts have num_kv_heads heads) and
  the SwiGLU's w1 and w3 are one (2*d_ff, d_model) matrix `w13` (rows: w1, then w3). Each part
  is initialized as the separate course matrix would be.
- attention goes through a backend chosen by name (default: PyTorch SDPA, a fused kernel);
- RoPE rotates q and k in one pass from precomputed cos/sin tables (non-persistent buffers),
  on CUDA in the Triton kernel that also splits q, k, v out of the projection
  (`lm_core.qkv_rope`);
- RMSNorm computes in fp32 (as the course does) and rounds once to the dtype the next linear
  layer multiplies in (autocast's, else the input's); the second norm of a block takes the
  residual add with it (`RMSNorm.add_forward`), on CUDA as Triton kernels (`lm_core.rmsnorm`);
- the SwiGLU activation runs as two Triton kernels on CUDA (`lm_core.swiglu`): its backward
  writes the gradient of w13's output in one pass instead of concatenating two halves.
Nothing here syncs with the device or breaks a `torch.compile` graph. Parallelism, activation
checkpointing (`lm_core.activation_ckpt`), compilation and mixed precision are applied from
outside (see `lm_core.train`). `model(token_ids, targets)` returns the loss through the fused
LM-head + cross-entropy (`lm_core.fused_loss`), without the (B, T, V) logits; it runs inside a
call of the `lm_head` module (`LMHead`), so wrappers that gather sharded weights in module hooks
(zero_shard.FSDP, torch's fully_shard) see the head's weight used. `model.generate(...)` decodes
with a KV cache (`lm_core.generation`): forward passes given a `kv_cache` read RoPE positions
from it and let it store keys and values and pick the attention.

Packed documents: `model(token_ids, cu_seqlens=...)` with int32 offsets of the documents in
the B*T tokens (every row start among them, e.g. from `lm_core.data.document_offsets`) lets
each token attend within its own document only; every attention backend honours it, and
`sliding_window` / `num_kv_heads` (grouped-query attention) as well.

Shapes: B batch, T sequence, D d_model, H heads, Hkv k/v heads, Dh head dim, F d_ff, V vocab.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from lm_core.annotate import annotate
from lm_core.attention import get_attention
from lm_core.config import MODEL_SIZES, ModelConfig, get_config
from lm_core.data import check_packing
from lm_core.fused_loss import fused_linear_cross_entropy
from lm_core.generation import CacheStep, LayerCache, generate
from lm_core.matmul import Linear, check_matmul
from lm_core.qkv_rope import rotate_pairs, split_rotate
from lm_core.rmsnorm import rms_norm
from lm_core.swiglu import swiglu

__all__ = [
    "MODEL_SIZES",
    "LMHead",
    "ModelConfig",
    "RMSNorm",
    "TokenEmbedding",
    "TransformerLM",
    "get_config",
]


def _is_compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    if compiler is not None and hasattr(compiler, "is_compiling"):
        return compiler.is_compiling()
    return False


def _matmul_dtype(x: torch.Tensor) -> torch.dtype | None:
    """Autocast's dtype for x's device when autocast is on (what a linear layer casts its
    input to), else None: x's own dtype."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


def _trunc_normal_(weight: torch.Tensor, std: float) -> None:
    """Course init: normal(0, std) truncated to [-3 std, 3 std]."""
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3.0 * std, b=3.0 * std)


def _linear_std(fan_in: int, fan_out: int) -> float:
    """Course init std for a (fan_out, fan_in) weight: sqrt(2 / (fan_in + fan_out))."""
    return math.sqrt(2.0 / (fan_in + fan_out))


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, computed in fp32.

    (..., D) -> (..., D) in the input dtype (or out_dtype), like the course RMSNorm (eps 1e-5,
    weight ones).
    """

    def __init__(self, d_model: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.weight.fill_(1.0)

    def forward(
        self, x: torch.Tensor, out_dtype: torch.dtype | None = None, backend: str = "auto"
    ) -> torch.Tensor:
        """out_dtype: the result's dtype (default x's); backend: as `lm_core.rms_norm`'s,
        which says when "auto" runs Triton kernels."""
        return rms_norm(x, self.weight, self.eps, out_dtype=out_dtype, backend=backend)

    def add_forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        out_dtype: torch.dtype | None = None,
        backend: str = "auto",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(s, self(s)) for s = x + residual, or s = x passed through without a residual (its
        later gradient then joins the norm's backward kernel): one fused kernel pair where
        `rms_norm` runs its kernels. A module with forward hooks (tensor parallelism's
        sequence-parallel layouts) is called instead, so that its hooks see s."""
        if self._forward_pre_hooks or self._forward_hooks:
            s = x if residual is None else x + residual
            return s, self(s, out_dtype=out_dtype, backend=backend)
        return rms_norm(
            x,
            self.weight,
            self.eps,
            residual=residual,
            out_dtype=out_dtype,
            return_sum=True,
            backend=backend,
        )


class RotaryEmbedding(nn.Module):
    """RoPE tables and their application to interleaved feature pairs (2i, 2i+1).

    Pair i of position p is rotated by angle p * theta^(-2i/Dh), as in the course RoPE.
    """

    def __init__(self, head_dim: int, context_length: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        # (T_max, Dh/2) each; fp32, computed by reset_parameters (at construction, and again
        # after `to_empty()` or a sharded materialization), not saved in checkpoints.
        half = head_dim // 2
        self.register_buffer("cos", torch.empty(context_length, half), persistent=False)
        self.register_buffer("sin", torch.empty(context_length, half), persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Recompute the cos/sin tables in place (no parameters; on the tables' device)."""
        if self.cos.is_meta:
            return
        device = self.cos.device
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float64, device=device)
        inv_freq = self.theta ** (-exponents / self.head_dim)  # (Dh/2,)
        positions = torch.arange(self.cos.shape[0], dtype=torch.float64, device=device)
        angles = torch.outer(positions, inv_freq)  # (T_max, Dh/2)
        self.cos.copy_(angles.cos().float())
        self.sin.copy_(angles.sin().float())

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate x of shape (B, T, ..., Dh) by position along dim 1; same shape and dtype.

        Positions are 0..T-1, or `positions` int64 (decoding with a KV cache): (T,) shared by
        the batch, or (B, T), a row each. Computed in fp32 (the tables' dtype) and rounded
        once to x's dtype.
        """
        seq = x.shape[1]
        extra = x.dim() - 3  # dims between T and Dh, e.g. (2, H) for stacked q/k
        rows = slice(seq) if positions is None else positions
        lead = (seq,) if positions is None or positions.dim() == 1 else tuple(positions.shape)
        cos = self.cos[rows].view(*lead, *([1] * extra), -1)  # ([B,] T, 1.., Dh/2)
        sin = self.sin[rows].view(*lead, *([1] * extra), -1)  # ([B,] T, 1.., Dh/2)
        return rotate_pairs(x, cos, sin)


class CausalSelfAttention(nn.Module):
    """Causal self-attention with RoPE on q and k: (B, T, D) -> (B, T, D). Multi-head, or
    grouped-query with `num_kv_heads` k/v heads; `sliding_window` bounds the keys."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d = config.d_model
        self.num_heads = config.num_heads
        self.num_kv_heads = config.kv_heads
        self.head_dim = config.head_dim
        self.window = config.sliding_window
        kv = self.num_kv_heads * self.head_dim  # k (and v) rows of qkv_proj
        self.qkv_proj = Linear(d, d + 2 * kv, bias=False, matmul=config.matmul)
        self.output_proj = Linear(d, d, bias=False, matmul=config.matmul)
        self.rope = RotaryEmbedding(config.head_dim, config.context_length, config.rope_theta)
        self.attn_fn = get_attention(config.attention)

    def reset_parameters(self) -> None:
        """Course init of q, k, v (each its own std) and the output projection; RoPE tables."""
        d = self.output_proj.in_features
        kv = self.num_kv_heads * self.head_dim
        for part in self.qkv_proj.weight.data.split((d, kv, kv), dim=0):  # q (D, D), k, v
            _trunc_normal_(part, _linear_std(d, part.shape[0]))
        _trunc_normal_(self.output_proj.weight.data, _linear_std(d, d))
        self.rope.reset_parameters()

    def forward(
        self,
        x: torch.Tensor,
        kv_cache: LayerCache | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        # heads from the projection's width: under tensor parallelism (lm_core.parallel) a
        # rank computes its share of the q and k/v heads
        qkv = self.qkv_proj(x)
        n = qkv.shape[-1] // self.head_dim
        h = n * self.num_heads // (self.num_heads + 2 * self.num_kv_heads)
        h_kv = (n - h) // 2
        qkv = qkv.view(b, t, n, self.head_dim)  # (B, T, H + 2Hkv, Dh)
        if kv_cache is None:  # q, k rotated and v in one pass (one kernel on CUDA)
            q, k, v = split_rotate(qkv, self.rope.cos, self.rope.sin, h, h_kv)
        else:  # positions from the cache
            qk = self.rope(qkv[:, :, : h + h_kv], kv_cache.positions)  # (B, T, H + Hkv, Dh)
            q, k, v = qk[:, :, :h], qk[:, :, h:], qkv[:, :, h + h_kv :]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, Dh)
        if kv_cache is not None:  # stores k and v, attends over the cached keys
            out = kv_cache.attend(q, k, v, self.attn_fn, self.window)  # (B, H, T, Dh)
        elif self.window is None and cu_seqlens is None:
            out = self.attn_fn(q, k, v)  # (B, H, T, Dh)
        else:
            out = self.attn_fn(q, k, v, self.window, cu_seqlens, max_seqlen)  # (B, H, T, Dh)
        out = out.transpose(1, 2).reshape(b, t, -1)  # (B, T, H * Dh)
        return self.output_proj(out)


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x) with w1 and w3 stored as one matrix: (B, T, D) -> (B, T, D)."""

    def __init__(self, d_model: int, d_ff: int, matmul: str = "default") -> None:
        super().__init__()
        self.d_ff = d_ff
        self.w13 = Linear(d_model, 2 * d_ff, bias=False, matmul=matmul)
        self.w2 = Linear(d_ff, d_model, bias=False, matmul=matmul)

    def reset_parameters(self) -> None:
        d_model = self.w13.in_features
        for part in self.w13.weight.data.chunk(2, dim=0):  # w1, w3: (F, D) each
            _trunc_normal_(part, _linear_std(d_model, self.d_ff))
        _trunc_normal_(self.w2.weight.data, _linear_std(self.d_ff, d_model))

    def forward(self, x: torch.Tensor, backend: str = "auto") -> torch.Tensor:
        """backend: the activation's, as `lm_core.swiglu`'s."""
        # silu(gate) * up of (B, T, 2F) -> (B, T, F)
        return self.w2(swiglu(self.w13(x), backend=backend))


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + ffn(norm(x)). (B, T, D) -> (B, T, D).

    Called with `branch` (the previous block's feed-forward output, not yet added) the
    block's input is x + branch, summed inside its first norm's kernel; `defer_add=True`
    returns (x, ffn output) instead of their sum, so the next block's first norm takes that
    add too. `TransformerLM.run_blocks` chains blocks this way: per block one kernel each
    way fewer than a separate add (and, backward, the cast of its gradient to the branch's
    dtype)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.ln1 = RMSNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln2 = RMSNorm(config.d_model)
        self.ffn = SwiGLU(config.d_model, config.d_ff, config.matmul)

    def reset_parameters(self) -> None:
        """Norms at one, attention and feed-forward by their course init (this order)."""
        self.ln1.reset_parameters()
        self.attn.reset_parameters()
        self.ln2.reset_parameters()
        self.ffn.reset_parameters()

    def forward(
        self,
        x: torch.Tensor,
        kv_cache: LayerCache | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        *,
        branch: torch.Tensor | None = None,
        defer_add: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        with annotate("attention"):
            # the norms round to the dtype the linear layers after them multiply in; decoding
            # (a few rows a call) keeps the plain norms and activation, as it keeps the plain
            # RoPE: lm_core's kernels were measured on training steps only
            dtype = _matmul_dtype(x)
            kernels = "torch" if kv_cache is not None else "auto"
            x, h = self.ln1.add_forward(x, branch, out_dtype=dtype, backend=kernels)
            # extra arguments only when given: module hooks (tensor parallelism's input
            # layouts) see one input in plain training
            if kv_cache is not None:
                a = self.attn(h, kv_cache=kv_cache)
            elif cu_seqlens is not None:
                a = self.attn(h, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
            else:
                a = self.attn(h)
        with annotate("ffn"):
            x, h = self.ln2.add_forward(x, a, out_dtype=dtype, backend=kernels)
            # module hooks see one input in plain training, as above
            f = self.ffn(h) if kv_cache is None else self.ffn(h, backend="torch")
        return (x, f) if defer_add else x + f


# Whether `chain_block` defers each block's last residual add to the next block's first norm
# (an A/B switch for benchmarks; the math is the same either way).
DEFER_RESIDUAL_ADD = True


def chain_block(
    block: nn.Module, x: torch.Tensor, branch: torch.Tensor | None, **packing: object
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One block of a chain: (x, branch) -> (x', branch'), the stream being x + branch
    (branch None: x alone). Through the module call, so that wrappers' hooks run."""
    if not DEFER_RESIDUAL_ADD:
        if branch is not None:
            x = x + branch
        return block(x, **packing), None
    return block(x, branch=branch, defer_add=True, **packing)


def run_chain(blocks: Iterable[nn.Module], x: torch.Tensor, **packing: object) -> torch.Tensor:
    """The residual stream x through `blocks` in order (`chain_block`), the last block's
    branch added at the end: (B, T, D) -> (B, T, D). `packing`: cu_seqlens, max_seqlen."""
    branch = None
    for block in blocks:
        x, branch = chain_block(block, x, branch, **packing)
    return x if branch is None else x + branch


class TokenEmbedding(nn.Embedding):
    """`nn.Embedding(vocab_size, d_model)` with the course init: token ids (...) -> (..., D).

    `weight` (V, D), its state-dict key and `isinstance(emb, nn.Embedding)` are those of a
    plain Embedding; only `reset_parameters` differs (normal truncated at 3 std, std 1)."""

    @torch.no_grad()
    def reset_parameters(self) -> None:
        _trunc_normal_(self.weight, 1.0)


class LMHead(Linear):
    """The output projection, and with targets the fused LM head + cross-entropy.

    An `nn.Linear(d_model, vocab_size, bias=False)` (through `lm_core.matmul.Linear`):
    `weight` (V, D), its state-dict key and `isinstance(head, nn.Linear)` are those of a
    plain Linear. `head(h)` -> logits (..., V);
    `head(h, targets)` -> the mean cross-entropy (0-dim fp32) by `fused_linear_cross_entropy`
    on `self.weight`, without the (..., V) logits. Both run inside this module's call, so its
    forward hooks fire around the loss too: a wrapper that gathers sharded weights in module
    hooks (zero_shard.FSDP, torch's fully_shard applied to the head) gathers `weight` for it.
    """

    def __init__(self, d_model: int, vocab_size: int, matmul: str = "default") -> None:
        super().__init__(d_model, vocab_size, bias=False, matmul=matmul)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Course init: truncated normal, std sqrt(2 / (D + V))."""
        _trunc_normal_(self.weight, _linear_std(self.in_features, self.out_features))

    def forward(self, h: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """h (..., D) -> logits (..., V); with targets (...) int ids: the mean loss (0-dim)."""
        if targets is None:
            return super().forward(h)
        return fused_linear_cross_entropy(h, self.weight, targets)


class TransformerLM(nn.Module):
    """Decoder-only Transformer LM: token ids (B, T) int -> logits (B, T, V).

    Token embedding, `num_layers` pre-norm blocks, final RMSNorm, untied LM head (as in the
    course). Parameters: `token_embeddings.weight` (V, D); per block `ln1.weight`,
    `attn.qkv_proj.weight` (D + 2 Hkv Dh, D): (3D, D) without `num_kv_heads`,
    `attn.output_proj.weight` (D, D), `ln2.weight`,
    `ffn.w13.weight` (2F, D), `ffn.w2.weight` (D, F); `ln_final.weight`, `lm_head.weight` (V, D).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if not isinstance(config, ModelConfig):
            raise TypeError(f"TransformerLM: config must be a ModelConfig, got {type(config)}")
        self.config = config
        device = torch.empty(0).device  # where tensors go now (a `torch.device(...)` context)
        # The modules are built on the meta device, then given memory and initialized by
        # reset_parameters alone: the random numbers drawn after `torch.manual_seed(s)` are
        # exactly those of reset_parameters, so a sharded materialization of a meta-device
        # build (zero_shard.FSDP, lm_core.fsdp) reproduces this model bitwise.
        with torch.device("meta"):
            self.token_embeddings = TokenEmbedding(config.vocab_size, config.d_model)
            self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.num_layers))
            self.ln_final = RMSNorm(config.d_model)
            self.lm_head = LMHead(config.d_model, config.vocab_size, config.matmul)
        if device.type != "meta":
            self.to_empty(device=device)
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Course initialization (truncated normals, std 1 for the embedding, norms at one)
        and the RoPE tables, by each child's own `reset_parameters()` in registration order:
        token_embeddings, every block, ln_final, lm_head. A wrapper that initializes one
        child at a time in this order (zero_shard.FSDP over a meta-device model) draws the
        same random numbers."""
        self.token_embeddings.reset_parameters()
        for block in self.layers:
            block.reset_parameters()
        self.ln_final.reset_parameters()
        self.lm_head.reset_parameters()

    def forward(
        self,
        token_ids: torch.Tensor,
        targets: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
    ) -> torch.Tensor:
        """Logits (B, T, V) for token ids (B, T) int64 or int32, 1 <= T <= context_length.

        With `targets` (B, T) (next-token ids in [0, V)): the mean cross-entropy instead, a
        0-dim fp32 tensor, computed by `fused_linear_cross_entropy` from the final hidden
        states and `lm_head.weight` without materializing the (B, T, V) logits. Either way the
        `lm_head` module is called (`LMHead.forward(h, targets)`): its hooks fire.

        `cu_seqlens`: packed documents, int32 (S + 1,) offsets into the B*T tokens taken row
        after row, 0 first and B*T last, every row start k*T among them
        (`lm_core.data.document_offsets`); each token then attends within its document only.
        `max_seqlen`: the longest document (an int; default T, always enough).
        """
        h = self.hidden_states(token_ids, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)  # (B, T, D)
        return self.lm_head(h, targets)  # logits (B, T, V), or the loss (0-dim fp32)

    def hidden_states(
        self,
        token_ids: torch.Tensor,
        kv_cache: CacheStep | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
    ) -> torch.Tensor:
        """The LM head's input, (B, T, D): embeddings, every block, final RMSNorm.

        With `kv_cache` (decoding, `lm_core.generation`), the tokens sit at the cache step's
        positions and attend to the cached keys; the blocks run one by one, without
        activation checkpointing (nothing is saved for a backward). With `cu_seqlens`
        (packed documents) each token attends within its own document."""
        self._check_input(token_ids)
        x = self.token_embeddings(token_ids)  # (B, T, D)
        if kv_cache is not None:
            for i, block in enumerate(self.layers):
                x = block(x, kv_cache.layer(i))  # (B, T, D)
        elif cu_seqlens is None:
            x = self.run_blocks(x)  # (B, T, D)
        else:
            check_packing(cu_seqlens, max_seqlen, *token_ids.shape, token_ids.device)
            x = self.run_blocks(x, cu_seqlens, max_seqlen)  # (B, T, D)
        return self.ln_final(x, backend="torch" if kv_cache is not None else "auto")

    @torch.no_grad()
    def generate(
        self,
        tokens: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_id: int | None = None,
        generator: torch.Generator | None = None,
        prompt_lengths: Sequence[int] | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Continue prompts `tokens` (B, T) by up to `max_new_tokens`: (B, T + n) int64.

        Prefills the prompt once, then decodes one token per step from a KV cache sized to
        `context_length` (T + max_new_tokens must fit). temperature 0 is greedy; top_k /
        top_p restrict sampling; generation stops once every row has produced `eos_id`;
        `generator` makes sampling reproducible. `prompt_lengths`: prompts of different
        lengths right-padded to T (see `lm_core.generation.Decoder.generate`). For a
        compiled or CUDA-graph decode step, or token-by-token streaming, use
        `lm_core.generation.Decoder`.
        """
        return generate(
            self, tokens, max_new_tokens, temperature, top_k, top_p, eos_id, generator,
            prompt_lengths,
        )  # fmt: skip

    def run_blocks(
        self,
        x: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
    ) -> torch.Tensor:
        """The residual stream through every block in order: (B, T, D) -> (B, T, D).

        `lm_core.apply_activation_checkpointing` replaces this on an instance."""
        if cu_seqlens is None:
            return run_chain(self.layers, x)
        return run_chain(self.layers, x, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)

    def _check_input(self, token_ids: torch.Tensor) -> None:
        # Shape and dtype checks read metadata only. The value-range check reads the data, which
        # on a GPU would stall the host until the device catches up, so it runs only for CPU
        # tensors in eager mode; on CUDA an out-of-range id still fails (embedding's assert).
        if token_ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(
                f"token_ids: expected an integer dtype, int64 or int32 (the embedding's index "
                f"types), got {token_ids.dtype}; convert with .long()"
            )
        if token_ids.dim() != 2:
            raise ValueError(
                f"token_ids: expected shape (batch, seq), got {tuple(token_ids.shape)}"
            )
        if token_ids.shape[0] == 0 or token_ids.shape[1] == 0:
            raise ValueError(
                f"token_ids: expected at least one sequence of at least one token, got shape "
                f"{tuple(token_ids.shape)}"
            )
        seq = token_ids.shape[1]
        if seq > self.config.context_length:
            raise ValueError(
                f"token_ids: sequence length {seq} exceeds the model's "
                f"context_length {self.config.context_length}"
            )
        if token_ids.device.type == "cpu" and token_ids.numel() > 0 and not _is_compiling():
            lo, hi = int(token_ids.min()), int(token_ids.max())
            if lo < 0 or hi >= self.config.vocab_size:
                raise ValueError(
                    f"token_ids: values must lie in [0, vocab_size={self.config.vocab_size}), "
                    f"got min {lo}, max {hi}"
                )

    def num_params(self, non_embedding: bool = False) -> int:
        """Number of parameters; `non_embedding=True` leaves out the token embedding table
        (a lookup, no FLOPs) but keeps the LM head (a matmul)."""
        total = sum(p.numel() for p in self.parameters())
        if non_embedding:
            total -= self.token_embeddings.weight.numel()
        return total

    def set_matmul(self, name: str) -> None:
        """Switch every linear layer to matmul backend `name` (weights unchanged)."""
        import dataclasses

        check_matmul(name)
        self.config = dataclasses.replace(self.config, matmul=name)
        for module in self.modules():
            if isinstance(module, Linear):
                module.matmul = name

    def set_attention(self, name: str) -> None:
        """Switch every block to attention backend `name` (weights unchanged)."""
        import dataclasses

        fn = get_attention(name)  # validates the name first
        self.config = dataclasses.replace(self.config, attention=name)
        for block in self.layers:
            block.attn.attn_fn = fn
