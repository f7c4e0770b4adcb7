"""Generation with a KV cache: equal to re-running the prefix, every backend, compile, sampling."""

from __future__ import annotations

import math

import pytest
import torch

from lm_core import TransformerLM, get_config
from lm_core.generation import Decoder, cast_weights, sample_next


def _model(seed: int = 0, **overrides) -> TransformerLM:
    torch.manual_seed(seed)
    return TransformerLM(get_config("tiny", **overrides))


def _graph_counter():
    """(graphs, backend): a torch.compile backend that keeps each graph it is given."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return graphs, capture


def _greedy_by_rerunning(model, prompt, n):
    """Reference: the full prefix through the plain forward at every step; logits too."""
    seq, logits = prompt, []
    with torch.no_grad():
        for _ in range(n):
            last = model(seq)[:, -1]  # (B, V)
            logits.append(last)
            seq = torch.cat([seq, last.argmax(-1, keepdim=True)], dim=1)
    return seq, torch.stack(logits, dim=1)


def test_cached_greedy_equals_rerunning_the_prefix(backend):
    model = _model(1, attention=backend)
    prompt = torch.randint(0, 256, (3, 7), generator=torch.Generator().manual_seed(0))
    n = 64 - 7  # up to the full context: the last step attends over every cache slot
    expected, ref_logits = _greedy_by_rerunning(model, prompt, n)
    decoder = Decoder(model)
    logits = [decoder.prefill(prompt)]
    out = [logits[0].argmax(-1)]
    for _ in range(n - 1):
        logits.append(decoder.step(out[-1]))
        out.append(logits[-1].argmax(-1))
    assert torch.equal(torch.cat([prompt, torch.stack(out, 1)], 1), expected)
    # same math, another reduction order (masked SDPA over the cache): fp32 rounding only
    torch.testing.assert_close(torch.stack(logits, 1), ref_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(model.generate(prompt, n, temperature=0), expected)


@pytest.mark.parametrize(
    "overrides",
    [{"num_kv_heads": 2}, {"num_kv_heads": 1, "sliding_window": 5}, {"sliding_window": 9}],
)
def test_cached_greedy_with_gqa_and_windows_equals_rerunning(backend, overrides):
    """The cache holds the k/v heads only (repeated for the decode's SDPA) and the decode mask
    keeps the sliding window: the same tokens as re-running the full prefix."""
    model = _model(2, attention=backend, **overrides)
    prompt = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(1))
    expected, ref_logits = _greedy_by_rerunning(model, prompt, 30)
    decoder = Decoder(model)
    logits = [decoder.prefill(prompt)]
    out = [logits[0].argmax(-1)]
    for _ in range(29):
        logits.append(decoder.step(out[-1]))
        out.append(logits[-1].argmax(-1))
    assert torch.equal(torch.cat([prompt, torch.stack(out, 1)], 1), expected)
    torch.testing.assert_close(torch.stack(logits, 1), ref_logits, rtol=1e-5, atol=1e-5)


def test_decoder_is_reusable_across_prompts_and_batch_sizes():
    model = _model(2)
    decoder = Decoder(model)
    for batch, length in [(2, 5), (2, 9), (1, 3), (2, 4)]:
        prompt = torch.randint(0, 256, (batch, length))
        expected, _ = _greedy_by_rerunning(model, prompt, 12)
        assert torch.equal(decoder.generate(prompt, 12, temperature=0), expected)


def test_compiled_decode_step_is_one_graph_without_breaks():
    """fullgraph=True fails on any graph break; a capturing backend counts the graphs: one
    for every step, position and prompt (static shapes). Inductor itself: the gpu tests."""
    model = _model(3)
    graphs, capture = _graph_counter()

    torch._dynamo.reset()
    try:
        decoder = Decoder(model, compile=True, compile_options={"backend": capture})
        for length in (5, 2):
            prompt = torch.randint(0, 256, (2, length))
            expected, _ = _greedy_by_rerunning(model, prompt, 20)
            assert torch.equal(decoder.generate(prompt, 20, temperature=0), expected)
    finally:
        torch._dynamo.reset()
    assert len(graphs) == 1


def test_flash_triton_decodes_over_the_filled_cache_rows(monkeypatch):
    """With the flash-triton backend the decode step runs `flash_attention_kvcache` over the
    cache's filled rows (the lengths computed on the device), storing the step's keys and
    values in the same call, GQA and windows included, and generates the tokens of
    re-running the prefix; compiled, the step stays one graph."""
    fa = pytest.importorskip("flashattn_triton")
    calls = []
    real = fa.flash_attention_kvcache

    def spy(q, k_cache, v_cache, lengths, *args, **kwargs):
        assert kwargs["k"].shape == kwargs["v"].shape == (2, 2, 1, k_cache.shape[-1])
        calls.append(lengths.clone())
        return real(q, k_cache, v_cache, lengths, *args, **kwargs)

    monkeypatch.setattr(fa, "flash_attention_kvcache", spy)
    model = _model(5, attention="flash-triton", num_kv_heads=2, sliding_window=6)
    prompt = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(2))
    expected, _ = _greedy_by_rerunning(model, prompt, 12)
    assert torch.equal(Decoder(model).generate(prompt, 12, temperature=0), expected)
    layers = model.config.num_layers
    assert len(calls) == 11 * layers  # every decode step of every layer (not the prefill)
    assert calls[0].tolist() == [5, 5]  # the prompt's rows; the first new token goes next
    assert calls[-1].tolist() == [15, 15]
    monkeypatch.setattr(fa, "flash_attention_kvcache", real)  # the spy would break the graph
    graphs, capture = _graph_counter()

    torch._dynamo.reset()
    try:
        decoder = Decoder(model, compile=True, compile_options={"backend": capture})
        assert torch.equal(decoder.generate(prompt, 12, temperature=0), expected)
    finally:
        torch._dynamo.reset()
    assert len(graphs) == 1


@pytest.mark.parametrize(
    "overrides", [{}, {"num_kv_heads": 2, "sliding_window": 4}], ids=["mha", "gqa-window"]
)
def test_prompts_of_different_lengths_decode_as_each_alone(backend, overrides):
    """Right-padded prompts with `prompt_lengths`: every row stands at its own position (its
    own RoPE angles, cache rows and mask, or flash_attention_kvcache length), so each row
    generates what its prompt generates alone; the result puts each row's new tokens right
    after its prompt and its padding after them."""
    model = _model(6, attention=backend, **overrides)
    gen = torch.Generator().manual_seed(3)
    lengths = [7, 3, 5, 1]
    tokens = torch.randint(0, 256, (4, 7), generator=gen)  # the padding: random ids
    out = model.generate(tokens, 9, temperature=0, prompt_lengths=lengths)
    assert out.shape == (4, 7 + 9)
    for b, n in enumerate(lengths):
        alone = model.generate(tokens[b : b + 1, :n], 9, temperature=0)[0]  # (n + 9,)
        assert torch.equal(out[b, : n + 9], alone), (b, n)
        assert torch.equal(out[b, n + 9 :], tokens[b, n:])  # the padding, moved after
    # streamed, with the lengths as a tensor: the same tokens
    decoder = Decoder(model, max_len=16)
    steps = list(decoder.stream(tokens, 9, temperature=0, prompt_lengths=torch.tensor(lengths)))
    new = torch.stack(steps, 1)
    for b, n in enumerate(lengths):
        assert torch.equal(new[b], out[b, n : n + 9])


def test_compiled_decode_with_prompts_of_different_lengths_is_one_graph():
    model = _model(7)
    graphs, capture = _graph_counter()

    tokens = torch.randint(0, 256, (3, 6), generator=torch.Generator().manual_seed(4))
    lengths = [6, 2, 4]
    expected = model.generate(tokens, 8, temperature=0, prompt_lengths=lengths)
    torch._dynamo.reset()
    try:
        decoder = Decoder(model, compile=True, compile_options={"backend": capture})
        got = decoder.generate(tokens, 8, temperature=0, prompt_lengths=lengths)
        assert torch.equal(
            decoder.generate(tokens, 8, temperature=0), model.generate(tokens, 8, temperature=0)
        )
    finally:
        torch._dynamo.reset()
    assert torch.equal(got, expected)
    assert len(graphs) == 1


@pytest.mark.parametrize(
    ("lengths", "match"),
    [
        ([3, 2], "expected 3 ints"),
        ([3, 0, 2], "each must lie in 1..4"),
        ([3, 5, 2], "each must lie in 1..4"),
        ([3, 2.0, 1], "expected 3 ints"),
        (torch.tensor([1.0, 2.0, 3.0]), "1-D integer tensor"),
    ],
)
def test_bad_prompt_lengths_are_refused_by_name(lengths, match):
    model = _model(8)
    with pytest.raises(ValueError, match=f"prompt_lengths: .*{match}"):
        model.generate(torch.zeros(3, 4, dtype=torch.long), 2, prompt_lengths=lengths)


def test_same_seed_same_tokens_and_other_seeds_differ():
    model = _model(4)
    prompt = torch.randint(0, 256, (2, 4))

    def run(seed):
        gen = torch.Generator().manual_seed(seed)
        return model.generate(prompt, 40, temperature=1.0, top_k=50, top_p=0.9, generator=gen)

    assert torch.equal(run(0), run(0))
    assert not torch.equal(run(0), run(1))


def test_eos_stops_generation_and_pads_finished_rows():
    model = _model(5)
    prompt = torch.randint(0, 256, (2, 4))
    greedy = model.generate(prompt, 10, temperature=0)
    eos = int(greedy[0, 6])  # row 0 produces it at its third new token
    out = model.generate(prompt, 10, temperature=0, eos_id=eos)
    first = {r: (greedy[r, 4:] == eos).nonzero()[0].item() if (greedy[r, 4:] == eos).any()
             else None for r in range(2)}  # fmt: skip
    stop = max(v if v is not None else 9 for v in first.values()) + 1
    assert out.shape == (2, 4 + stop)
    for r in range(2):
        end = 4 + (first[r] if first[r] is not None else stop)
        assert torch.equal(out[r, :end], greedy[r, :end])
        assert (out[r, end:] == eos).all()


def _allowed(logits: torch.Tensor, top_k: int | None, top_p: float | None) -> set[int]:
    """The kept set, computed independently in float64 with a plain loop."""
    probs = torch.softmax(logits.double(), -1)
    order = sorted(range(len(probs)), key=lambda i: -float(probs[i]))
    if top_k is not None:
        order = order[:top_k]
        probs = probs / probs[order].sum()
    kept, mass = [], 0.0
    for i in order:
        if top_p is not None and mass >= top_p:
            break
        kept.append(i)
        mass += float(probs[i])
    return set(kept)


@pytest.mark.parametrize(("top_k", "top_p"), [(5, None), (None, 0.5), (8, 0.7), (1, None)])
def test_top_k_top_p_never_sample_outside_their_set(top_k, top_p):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, generator=gen) * 2  # one row, repeated as a batch of draws
    allowed = _allowed(logits, top_k, top_p)
    assert 1 <= len(allowed) < 64
    draws = sample_next(logits.expand(4000, 64), 1.0, top_k, top_p, gen)
    seen = set(draws.tolist())
    assert seen <= allowed
    assert len(seen) == len(allowed)  # and every kept id does come up
    # frequencies follow the renormalized probabilities of the kept set
    probs = torch.softmax(logits.double(), -1)
    total = sum(float(probs[i]) for i in allowed)
    for i in allowed:
        expected = float(probs[i]) / total
        freq = (draws == i).double().mean().item()
        assert abs(freq - expected) < 4 * math.sqrt(expected * (1 - expected) / 4000) + 1e-3


def test_temperature_zero_is_argmax_and_low_temperature_approaches_it():
    logits = torch.randn(16, 100, generator=torch.Generator().manual_seed(1))
    assert torch.equal(sample_next(logits, 0.0), logits.argmax(-1))
    gen = torch.Generator().manual_seed(2)
    assert torch.equal(sample_next(logits, 1e-4, generator=gen), logits.argmax(-1))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_new_tokens": 70}, "exceeds context_length 64"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_k": 0}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"eos_id": 256}, "eos_id"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, match):
    model = _model()
    args = {"max_new_tokens": 4, **kwargs}
    with pytest.raises((ValueError, TypeError), match=match):
        model.generate(torch.zeros(1, 3, dtype=torch.long), **args)
    with pytest.raises(ValueError, match="tokens"):
        model.generate(torch.zeros(3, dtype=torch.long), 4)


def test_cuda_graph_needs_cuda_and_bf16_weights_keep_fp32_rope():
    model = _model()
    with pytest.raises(ValueError, match="cuda_graph"):
        Decoder(model, cuda_graph=True)
    cast_weights(model, torch.bfloat16)
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert model.layers[0].attn.rope.cos.dtype == torch.float32
    out = model.generate(torch.zeros(1, 2, dtype=torch.long), 5, temperature=0)
    assert out.shape == (1, 7)


def _teacher_forced_logits(decoder: Decoder, prompt, tokens):
    """Step logits (B, n, V) when feeding `tokens` (B, n) after `prompt`."""
    logits = [decoder.prefill(prompt)]
    for i in range(tokens.shape[1] - 1):
        logits.append(decoder.step(tokens[:, i]))
    return torch.stack(logits, dim=1)


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["sdpa", "flash-triton"])
def test_gpu_compiled_and_cuda_graph_decode_match_rerunning(attention):
    """Eager, CUDA graph, inductor and inductor + CUDA graph decode steps give the logits of
    re-running the full prefix, along the same token sequence (fp32, small's width)."""
    torch.manual_seed(0)
    config = get_config("small", attention=attention, context_length=256, num_layers=2)
    model = TransformerLM(config).cuda()
    prompt = torch.randint(0, config.vocab_size, (4, 16), device="cuda")
    seq, reference = _greedy_by_rerunning(model, prompt, 48)
    tokens = seq[:, 16:]
    for kwargs in (
        {},
        {"cuda_graph": True},
        {"compile": True},
        {"compile": True, "cuda_graph": True},
    ):
        logits = _teacher_forced_logits(Decoder(model, **kwargs), prompt, tokens)
        # fp32 kernels in another order (cache-masked SDPA, inductor fusion): rounding only
        torch.testing.assert_close(logits, reference, rtol=1e-3, atol=1e-3, msg=str(kwargs))


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["sdpa", "flash-triton"])
def test_gpu_prompts_of_different_lengths_in_graphs(attention):
    """Right-padded prompts of different lengths, decoded eagerly, in a CUDA graph, compiled
    and compiled in a graph (the positions a device buffer advanced between replays): the
    same tokens as each prompt alone (fp32, greedy)."""
    torch.manual_seed(0)
    config = get_config("small", attention=attention, context_length=256, num_layers=2)
    model = TransformerLM(config).cuda()
    lengths = [16, 5, 11, 1]
    tokens = torch.randint(0, config.vocab_size, (4, 16), device="cuda")
    alone = [model.generate(tokens[b : b + 1, :n], 24, temperature=0)[0] for b, n in
             enumerate(lengths)]  # fmt: skip
    for kwargs in (
        {},
        {"cuda_graph": True},
        {"compile": True},
        {"compile": True, "cuda_graph": True},
    ):
        out = Decoder(model, max_len=40, **kwargs).generate(
            tokens, 24, temperature=0, prompt_lengths=lengths
        )
        for b, n in enumerate(lengths):
            assert torch.equal(out[b, : n + 24], alone[b]), (kwargs, b)


def test_generate_flags_become_a_checked_config(tmp_path, capsys):
    """`lm_core.generate.parse_args` maps the flags onto a GenerateConfig; made from Python, it
    rejects a bad value with a ValueError naming the field (the command line names the flag)."""
    from lm_core.generate import GenerateConfig, parse_args

    ckpt = tmp_path / "checkpoint.pt"
    ckpt.touch()  # the config only checks that the file is there
    flags = ["--checkpoint", str(ckpt), "--prompt", "a", "--prompt", "b c", "--top-k", "5"]
    cfg = parse_args([*flags, "--device", "cpu", "--ignore-eot"])
    assert cfg == GenerateConfig(
        checkpoint=ckpt, prompts=("a", "b c"), top_k=5, device="cpu", ignore_eot=True
    )
    assert cfg.device == torch.device("cpu")
    assert (cfg.max_new_tokens, cfg.temperature, cfg.dtype, cfg.tokenizer) == (
        200,
        1.0,
        "fp32",
        None,
    )
    with pytest.raises(ValueError, match=r"^max_new_tokens must be positive, got 0"):
        GenerateConfig(checkpoint=ckpt, max_new_tokens=0)
    with pytest.raises(ValueError, match=r"^top_p: expected None or a number in \(0, 1\]"):
        GenerateConfig(checkpoint=ckpt, top_p=1.5)
    with pytest.raises(SystemExit):
        parse_args(["--checkpoint", str(ckpt), "--max-new-tokens", "0"])
    assert "error: --max-new-tokens must be positive, got 0" in capsys.readouterr().err
