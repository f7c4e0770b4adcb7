"""Autoregressive generation for `TransformerLM`: a static KV cache, sampling, and `Decoder`,
which prefills the prompt once and then feeds one token per step.

Life of a `generate` call:
1. prefill: the prompt (B, T) runs through the model once at positions 0..T-1; every block
   attends among the prompt's tokens with the model's own attention backend (naive, sdpa,
   flash-torch, flash-triton: all causal on equal lengths) and writes its keys and values at
   those positions of the cache. Prompts of different lengths come right-padded with
   `prompt_lengths`; row b then continues at position prompt_lengths[b] (positions are
   (B, T): a row each), and its padding in the cache is overwritten or masked.
2. decode: each step feeds the B tokens just sampled, (B, 1), at position p. A block writes its
   key and value at p and attends over the cache: with the "flash-triton" backend one
   `flash_attention_kvcache` call does both, over its first p + 1 rows (the count computed on
   the device), else an `index_put` per tensor and one `F.scaled_dot_product_attention` over
   all of it under a mask that hides positions > p.
   Either way the shapes are static, so the step compiles once (`torch.compile(fullgraph=True,
   dynamic=False)`) and can be captured in a CUDA graph and replayed for every token.
3. sample: `sample_next` on the last logits (greedy at temperature 0, else top-k / top-p).

The cache (`KVCache`) holds, per block, keys and values of shape (B, H, S, Dh), S = `max_len`
positions (default context_length; `generate` sizes it to prompt + new tokens), allocated at
the first write with the keys' shape, dtype and device (an autocast model caches bf16) and
never moved afterwards. Positions beyond the current one keep stale values that the mask
hides.

Shapes: B batch, T new tokens, S cache positions, H heads, Dh head dim, V vocab.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class KVCache:
    """Keys and values of every block, each (B, H, max_len, Dh), allocated at first write."""

    def __init__(self, num_layers: int, max_len: int) -> None:
        self.max_len = max_len
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers

    @property
    def batch_size(self) -> int | None:
        """The batch the buffers were allocated for (None before the first write)."""
        return None if self.k[0] is None else self.k[0].shape[0]

    def allocate(self, index: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Buffers of block `index` shaped like k / v (B, H, T, Dh) with max_len positions."""
        b, h, _, dk = k.shape
        self.k[index] = k.new_zeros(b, h, self.max_len, dk)  # (B, H, S, Dh)
        self.v[index] = v.new_zeros(b, h, self.max_len, v.shape[-1])  # (B, H, S, Dh)


class LayerCache:
    """What one block's attention sees of a cached forward: where its new keys go, and how to
    attend. Made by `CacheStep.layer(i)`."""

    def __init__(self, step: CacheStep, index: int) -> None:
        self.step = step
        self.index = index

    @property
    def positions(self) -> torch.Tensor:
        """Positions (T,) int64 of the tokens being fed, for RoPE."""
        return self.step.positions

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_fn: AttentionFn,
        window: int | None = None,
    ) -> torch.Tensor:
        """Store k, v (B, Hkv, T, Dh) at the step's positions, then attend: (B, H, T, Dh).

        Prefill: `attn_fn` (the model's backend, causal, with the sliding `window` if any)
        over the new keys only. Decode: the backend's `kv_cache` function where it has one
        (over the filled rows only, see `lm_core.attention`), else SDPA over the whole cache
        under the step's mask (key position <= query position, and >= query position -
        window); fewer k/v heads than query heads (grouped-query attention) are repeated for
        it.
        """
        cache, i, step = self.step.cache, self.index, self.step
        if cache.k[i] is None:
            cache.allocate(i, k, v)
        k_all, v_all = cache.k[i], cache.v[i]  # (B, Hkv, S, Dh) each
        if step.prefill:  # every row at positions 0..T-1
            k_all.index_copy_(2, step.positions[0], k.to(k_all.dtype))
            v_all.index_copy_(2, step.positions[0], v.to(v_all.dtype))
            return attn_fn(q, k, v) if window is None else attn_fn(q, k, v, window)
        over_cache = getattr(attn_fn, "kv_cache", None)
        if over_cache is not None and not (torch.is_grad_enabled() and q.requires_grad):
            # stores each row's keys from its first new position on, and attends, in one call
            k, v = k.to(k_all.dtype), v.to(v_all.dtype)
            return over_cache(q, k_all, v_all, step.starts(), k, v, window)
        rows = step.rows()  # (B, 1)
        # each row's keys at its own positions: (B, T, Hkv, Dh) into k_all[b, :, positions[b]]
        k_all[rows, :, step.positions] = k.transpose(1, 2).to(k_all.dtype)
        v_all[rows, :, step.positions] = v.transpose(1, 2).to(v_all.dtype)
        mask = step.mask(window)  # (B, 1, T, S)
        group = q.shape[1] // k_all.shape[1]
        if group > 1:
            k_all = k_all.repeat_interleave(group, dim=1)  # (B, H, S, Dh)
            v_all = v_all.repeat_interleave(group, dim=1)
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)


class CacheStep:
    """One cached forward: the cache, the positions (B, T) of the new tokens (a row each: the
    rows of a batch may stand at different positions), and whether it is a prefill from
    position 0 (the new keys are all the keys) or a decode step over the cache."""

    def __init__(self, cache: KVCache, positions: torch.Tensor, prefill: bool) -> None:
        self.cache = cache
        self.positions = positions
        self.prefill = prefill
        self._masks: dict[int | None, torch.Tensor] = {}
        self._starts: torch.Tensor | None = None
        self._rows: torch.Tensor | None = None

    def layer(self, index: int) -> LayerCache:
        return LayerCache(self, index)

    def rows(self) -> torch.Tensor:
        """(B, 1) row indices for the per-row cache writes, made once per step."""
        if self._rows is None:
            self._rows = torch.arange(self.positions.shape[0], device=self.positions.device)[
                :, None
            ]
        return self._rows

    def mask(self, window: int | None = None) -> torch.Tensor:
        """(B, 1, T, S) bool: the cache rows each new token may see (key position <= its
        position, and >= its position - `window`), for the backends without a `kv_cache`
        function; made once per step, and only by those."""
        if window not in self._masks:
            keys = torch.arange(self.cache.max_len, device=self.positions.device)  # (S,)
            pos = self.positions[..., None]  # (B, T, 1)
            seen = keys <= pos if window is None else (keys <= pos) & (keys >= pos - window)
            self._masks[window] = seen[:, None]
        return self._masks[window]

    def starts(self) -> torch.Tensor:
        """int32 (B,): each row's first new position, i.e. its cache rows filled before this
        step (a row's new positions are consecutive), on the device: computed from
        `positions` without a host sync, once per step for all the layers."""
        if self._starts is None:
            self._starts = self.positions[:, 0].to(torch.int32)
        return self._starts


def _decode_logits(
    model: nn.Module, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Logits (B, V) of the last of `tokens` (B, T) fed at `positions` (B, T) against the
    cache. Static shapes for a fixed B and T: what `Decoder` compiles and captures."""
    h = model.hidden_states(tokens, kv_cache=CacheStep(cache, positions, prefill=False))
    return model.lm_head(h[:, -1])  # (B, V)


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Next token ids (B,) int64 from logits (B, V).

    temperature 0: argmax. Else softmax(logits / temperature) restricted to the `top_k` most
    likely ids and/or the nucleus of `top_p` (the smallest set of most likely ids whose
    probability reaches top_p; after top-k when both are given), renormalized, sampled with
    `generator`. Ids outside the kept set are never drawn.
    """
    if temperature == 0:
        return logits.argmax(dim=-1)
    scaled = logits.float() / temperature  # (B, V)
    ids = None  # the vocabulary ids of the columns of `scaled`, when not 0..V-1
    if top_k is not None and top_k < scaled.shape[-1]:
        scaled, ids = torch.topk(scaled, top_k, dim=-1)  # (B, k), descending
    elif top_p is not None and top_p < 1:
        scaled, ids = torch.sort(scaled, dim=-1, descending=True)  # (B, V)
    if top_p is not None and top_p < 1:
        probs = torch.softmax(scaled, dim=-1)
        # drop an id when the more likely ones already reach top_p (the first is always kept)
        beyond = probs.cumsum(dim=-1) - probs >= top_p
        scaled = scaled.masked_fill(beyond, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    choice = torch.multinomial(probs, 1, generator=generator)  # (B, 1) column index
    if ids is not None:
        choice = ids.gather(-1, choice)
    return choice.squeeze(-1)


def check_sampling(
    temperature: float, top_k: int | None, top_p: float | None, eos_id: int | None, vocab: int
) -> None:
    """ValueError naming the argument when a sampling option is out of range."""
    if isinstance(temperature, bool) or not isinstance(temperature, int | float):
        raise TypeError(f"temperature: expected a number, got {temperature!r}")
    if not temperature >= 0:
        raise ValueError(f"temperature: expected >= 0 (0: greedy), got {temperature}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k: expected None or an int >= 1, got {top_k!r}")
    if top_p is not None and not (isinstance(top_p, int | float) and 0 < top_p <= 1):
        raise ValueError(f"top_p: expected None or a number in (0, 1], got {top_p!r}")
    if eos_id is not None and not (isinstance(eos_id, int) and 0 <= eos_id < vocab):
        raise ValueError(f"eos_id: expected None or an id in [0, {vocab}), got {eos_id!r}")


class Decoder:
    """Generation with a KV cache for one `TransformerLM`, reused across calls.

    max_len: cache positions (prompt + new tokens must fit), default the model's
        context_length. A decode step attends over all of them (masked; with "flash-triton"
        over the filled ones only), so a cache sized to the work at hand (as gpt-fast does)
        decodes faster.
    compile: `torch.compile` the decode step (fullgraph, static shapes; `compile_options` are
        passed on, e.g. {"backend": "aot_eager"} or {"mode": "max-autotune-no-cudagraphs"}).
        The prefill runs eagerly (prompt lengths vary).
    cuda_graph: capture the decode step (eager or compiled) in a CUDA graph per batch size and
        replay it for every token (CUDA only): no per-op launch cost.
    The cache is allocated at the first prefill for the batch size and kept while the batch
    size stays the same.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        max_len: int | None = None,
        compile: bool = False,
        cuda_graph: bool = False,
        compile_options: dict[str, Any] | None = None,
    ) -> None:
        self.model = model
        self.config = model.config
        context = self.config.context_length
        self.max_len = context if max_len is None else max_len
        if isinstance(self.max_len, bool) or not isinstance(self.max_len, int):
            raise TypeError(f"max_len: expected an int or None, got {max_len!r}")
        if not 1 <= self.max_len <= context:
            raise ValueError(f"max_len: expected 1..context_length={context}, got {max_len}")
        self.device = model.lm_head.weight.device
        if cuda_graph and self.device.type != "cuda":
            raise ValueError(f"cuda_graph: needs a model on a CUDA device, got {self.device}")
        self.cuda_graph = cuda_graph
        self.step_fn: Callable[..., torch.Tensor] = _decode_logits
        if compile:
            options = {"fullgraph": True, "dynamic": False, **(compile_options or {})}
            self.step_fn = torch.compile(_decode_logits, **options)
        self.cache = KVCache(self.config.num_layers, self.max_len)
        self._furthest = -1  # the furthest row's next position (-1: no prefill yet)
        self._token = torch.zeros(1, 1, dtype=torch.long, device=self.device)  # (B, 1)
        self._pos = torch.zeros(1, 1, dtype=torch.long, device=self.device)  # (B, 1)
        self._graph: Any = None
        self._graph_logits: torch.Tensor | None = None

    @torch.no_grad()
    def prefill(
        self, tokens: torch.Tensor, prompt_lengths: Sequence[int] | torch.Tensor | None = None
    ) -> torch.Tensor:
        """Run the prompt tokens (B, T) from position 0; logits (B, V) of each row's last
        prompt token. `prompt_lengths`: row b's prompt is its first prompt_lengths[b] tokens
        (right-padded rows; default all T): its next token goes to that position, and the
        padding left in the cache beyond it is overwritten or masked, never attended to."""
        b, t = tokens.shape
        checked = check_prompt_lengths(prompt_lengths, b, t)
        lengths = [t] * b if checked is None else checked
        if self.cache.batch_size != b:
            self.cache = KVCache(self.config.num_layers, self.max_len)
            self._token = torch.zeros(b, 1, dtype=torch.long, device=self.device)
            self._pos = torch.zeros(b, 1, dtype=torch.long, device=self.device)
            self._graph = None
        positions = torch.arange(t, device=self.device).expand(b, t)  # (B, T)
        step = CacheStep(self.cache, positions, prefill=True)
        h = self.model.hidden_states(tokens, kv_cache=step)  # (B, T, D)
        self._furthest = max(lengths)
        if prompt_lengths is None:
            self._pos.fill_(t)
            return self.model.lm_head(h[:, -1])  # (B, V)
        last = torch.tensor(lengths, device=self.device)  # (B,): the next positions
        self._pos.copy_(last[:, None])
        return self.model.lm_head(h[torch.arange(b, device=self.device), last - 1])  # (B, V)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed tokens (B,) at each row's next position; logits (B, V) for the one after."""
        if self._furthest < 0:
            raise RuntimeError("step: call prefill first")
        if self._furthest >= self.cache.max_len:
            raise ValueError(
                f"the cache is full: all max_len={self.cache.max_len} positions are used"
            )
        self._token.copy_(tokens.view(-1, 1))
        self._furthest += 1
        if not self.cuda_graph:
            logits = self.step_fn(self.model, self.cache, self._token, self._pos)
        else:
            if self._graph is None:
                self._capture()
            self._graph.replay()
            logits = self._graph_logits.clone()
        self._pos.add_(1)  # the next positions, on the device (no host-to-device copy)
        return logits

    def _capture(self) -> None:
        """Warm up on a side stream (compilation, cuBLAS workspaces), then capture one step.
        The warm-up writes the same key and value at the same position as the replay will."""
        args = (self.model, self.cache, self._token, self._pos)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.step_fn(*args)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._graph_logits = self.step_fn(*args)
        self._graph = graph

    def stream(
        self,
        tokens: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_id: int | None = None,
        generator: torch.Generator | None = None,
        prompt_lengths: Sequence[int] | torch.Tensor | None = None,
    ) -> Iterator[torch.Tensor]:
        """Yield each step's new tokens (B,) as they are sampled (see `generate`)."""
        lengths = self._check(tokens, max_new_tokens, generator, prompt_lengths)
        check_sampling(temperature, top_k, top_p, eos_id, self.config.vocab_size)
        with torch.no_grad():
            logits = self.prefill(tokens, lengths)
            finished = None  # (B,) bool: rows that produced eos_id (they repeat it)
            for i in range(max_new_tokens):
                nxt = sample_next(logits, temperature, top_k, top_p, generator)  # (B,)
                if eos_id is not None:
                    if finished is not None:
                        nxt = torch.where(finished, eos_id, nxt)
                    finished = nxt == eos_id
                yield nxt
                if finished is not None and bool(finished.all()):  # syncs with the device
                    return
                if i + 1 < max_new_tokens:
                    logits = self.step(nxt)

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
        """The prompt tokens (B, T) continued by up to `max_new_tokens`: (B, T + n) int64.

        Stops early once every row has produced `eos_id` (rows that finished earlier are
        padded with it). Greedy at temperature 0. `prompt_lengths` (B ints in 1..T): prompts
        of different lengths, right-padded to T; row b of the result is its prompt, its n new
        tokens, then the T - prompt_lengths[b] padding tokens it came with.
        """
        steps = list(
            self.stream(
                tokens, max_new_tokens, temperature, top_k, top_p, eos_id, generator,
                prompt_lengths,
            )
        )  # fmt: skip
        out = torch.cat([tokens.long(), *(s[:, None] for s in steps)], dim=1)  # (B, T + n)
        lengths = check_prompt_lengths(prompt_lengths, *tokens.shape)  # checked by stream
        if lengths is None:
            return out
        return out.gather(1, _after_prompts(lengths, tokens.shape[1], len(steps)).to(out.device))

    def _check(
        self,
        tokens: torch.Tensor,
        max_new_tokens: int,
        generator: torch.Generator | None,
        prompt_lengths: Sequence[int] | torch.Tensor | None = None,
    ) -> list[int] | None:
        """Errors naming the argument; the prompt lengths as ints (None: all T)."""
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.shape[1] < 1:
            shape = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens)
            raise ValueError(f"tokens: expected a (batch, seq >= 1) tensor, got {shape}")
        if tokens.device != self.device:
            raise ValueError(f"tokens: on {tokens.device}, the model on {self.device}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
            raise TypeError(f"max_new_tokens: expected an int, got {max_new_tokens!r}")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens: expected >= 0, got {max_new_tokens}")
        total = tokens.shape[1] + max_new_tokens
        if total > self.max_len:
            limit = (
                f"context_length {self.max_len}"
                if self.max_len == self.config.context_length
                else f"the Decoder's max_len {self.max_len}"
            )
            raise ValueError(
                f"max_new_tokens: prompt ({tokens.shape[1]}) + max_new_tokens "
                f"({max_new_tokens}) = {total} exceeds {limit}"
            )
        if generator is not None and torch.device(generator.device).type != self.device.type:
            raise ValueError(
                f"generator: on {generator.device}, but sampling runs on {self.device}"
            )
        return check_prompt_lengths(prompt_lengths, *tokens.shape)


def generate(
    model: nn.Module,
    tokens: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
    prompt_lengths: Sequence[int] | torch.Tensor | None = None,
) -> torch.Tensor:
    """Eager decoding with a KV cache sized to the prompt and `max_new_tokens` (see `Decoder`;
    a length beyond context_length is refused there, naming max_new_tokens)."""
    max_len = None  # the full context, where the arguments are invalid: Decoder names them
    if isinstance(tokens, torch.Tensor) and tokens.dim() == 2 and isinstance(max_new_tokens, int):
        needed = tokens.shape[1] + max_new_tokens
        if 1 <= needed <= model.config.context_length:
            max_len = needed
    return Decoder(model, max_len=max_len).generate(
        tokens, max_new_tokens, temperature, top_k, top_p, eos_id, generator, prompt_lengths
    )


def check_prompt_lengths(
    prompt_lengths: Sequence[int] | torch.Tensor | None, batch: int, seq: int
) -> list[int] | None:
    """`prompt_lengths` as B ints in 1..T (a tensor is read once, on the host); None stays."""
    if prompt_lengths is None:
        return None
    if isinstance(prompt_lengths, torch.Tensor):
        if prompt_lengths.dim() != 1 or prompt_lengths.is_floating_point():
            raise ValueError(
                f"prompt_lengths: expected a 1-D integer tensor, got {prompt_lengths.dtype} "
                f"of shape {tuple(prompt_lengths.shape)}"
            )
        prompt_lengths = prompt_lengths.tolist()
    lengths = list(prompt_lengths)
    if len(lengths) != batch or not all(
        isinstance(n, int) and not isinstance(n, bool) for n in lengths
    ):
        raise ValueError(f"prompt_lengths: expected {batch} ints (one per row), got {lengths!r}")
    bad = [n for n in lengths if not 1 <= n <= seq]
    if bad:
        raise ValueError(
            f"prompt_lengths: each must lie in 1..{seq} (the prompts' width), got {bad[0]}"
        )
    return lengths


def _after_prompts(lengths: list[int], seq: int, new: int) -> torch.Tensor:
    """(B, T + n) gather index into [prompts | new tokens] putting row b's new tokens right
    after its first lengths[b] tokens, its padding after them."""
    index = []
    for n in lengths:
        row = list(range(n)) + [seq + i for i in range(new)] + list(range(n, seq))
        index.append(row)
    return torch.tensor(index, dtype=torch.long)


def cast_weights(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast the parameters (not the buffers: RoPE tables stay fp32) to `dtype`, in place."""
    for param in model.parameters():
        param.data = param.data.to(dtype)
    return model
