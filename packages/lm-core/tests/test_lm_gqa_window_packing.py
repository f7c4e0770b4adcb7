"""Grouped-query attention (`num_kv_heads`), sliding windows (`sliding_window`) and packed
documents (`cu_seqlens`) in every attention backend, the model, FLOPs, the data helper and
the trainer CLI (CPU)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from lm_core import (
    MODEL_SIZES,
    ModelConfig,
    TransformerLM,
    apply_activation_checkpointing,
    document_offsets,
    forward_flops,
    get_attention,
    get_config,
    synthetic_tokens,
)
from lm_core.flops import matmul_params
from lm_core.train import main, parse_args


def _reference(q, k, v, window=None, doc=None):
    """Float64 causal attention written out: k/v expanded over each group of query heads,
    mask built pair by pair (j <= i, i - j <= window, same document)."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    b, _, t, d = q.shape
    keep = torch.zeros(b, 1, t, t, dtype=torch.bool)
    for n in range(b):
        for i in range(t):
            for j in range(i + 1):
                same = doc is None or doc[n, i] == doc[n, j]
                keep[n, 0, i, j] = same and (window is None or i - j <= window)
    s = (q @ k.transpose(-1, -2) / math.sqrt(d)).masked_fill(~keep, -math.inf)
    return s.softmax(-1) @ v


@pytest.mark.parametrize(
    ("h_kv", "window", "packed"),
    [(1, None, False), (2, 3, False), (4, None, True), (2, 5, True)],
)
def test_backends_honour_kv_heads_window_and_documents(backend, h_kv, window, packed):
    torch.manual_seed(0)
    b, h, t, d = 2, 4, 13, 16
    q = torch.randn(b, h, t, d, requires_grad=True)
    k, v = (torch.randn(b, h_kv, t, d, requires_grad=True) for _ in range(2))
    cu, doc = None, None
    if packed:  # documents of 5, 8 | 1, 4, 8 tokens
        cu = torch.tensor([0, 5, 13, 14, 18, 26], dtype=torch.int32)
        doc = torch.tensor([[0] * 5 + [1] * 8, [2] + [3] * 4 + [4] * 8])
    out = get_attention(backend)(q, k, v, window, cu, None)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = _reference(q64, k64, v64, window, doc)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    for ours, theirs in zip(grads, torch.autograd.grad(ref, (q64, k64, v64), g.double())):
        assert ours.shape == theirs.shape
        torch.testing.assert_close(ours.double(), theirs, rtol=1e-4, atol=1e-4)


def test_config_fields_default_off_and_are_checked():
    for cfg in MODEL_SIZES.values():
        assert (cfg.num_kv_heads, cfg.sliding_window) == (None, None)
        assert cfg.kv_heads == cfg.num_heads
    base = {"vocab_size": 10, "context_length": 8, "d_model": 32, "num_layers": 1}
    base.update(num_heads=4, d_ff=8)
    with pytest.raises(ValueError, match=r"num_kv_heads=3 must divide num_heads=4"):
        ModelConfig(**base, num_kv_heads=3)
    for name in ("num_kv_heads", "sliding_window"):
        with pytest.raises(ValueError, match=name):
            ModelConfig(**base, **{name: 0})
        with pytest.raises(TypeError, match=name):
            ModelConfig(**base, **{name: 2.0})
    cfg = ModelConfig(**base, num_kv_heads=2, sliding_window=3)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("h_kv", [1, 2, 4])
def test_gqa_parameter_count_and_init(h_kv):
    cfg = get_config("tiny", num_kv_heads=h_kv)  # D 64, 4 heads of 16
    model = TransformerLM(cfg)
    d, f, v, layers, kv = 64, 128, 256, 2, h_kv * 16
    expected = v * d + layers * (2 * d * d + 2 * d * kv + 3 * d * f + 2 * d) + d + d * v
    assert model.num_params() == expected
    assert matmul_params(cfg) == layers * (2 * d * d + 2 * d * kv + 3 * d * f) + d * v
    w = model.layers[0].attn.qkv_proj.weight
    assert w.shape == (d + 2 * kv, d)
    # course init per part: std sqrt(2 / (fan_in + fan_out)), truncated at 3 sd (~0.986 sd)
    for part in w.detach().split((d, kv, kv)):
        std = math.sqrt(2 / (d + part.shape[0])) * 0.986
        assert abs(part.std().item() - std) < 0.15 * std


def test_gqa_model_flops_match_the_flop_counter():
    cfg = get_config("tiny", attention="naive", num_kv_heads=2)
    model = TransformerLM(cfg)
    ids = torch.randint(0, 256, (2, 16))
    with FlopCounterMode(display=False) as counter:
        model(ids)
    assert counter.get_total_flops() == forward_flops(cfg, 2, 16)


def test_window_flops_count_the_keys_a_query_sees():
    cfg = get_config("xl", sliding_window=127)
    full = forward_flops(get_config("xl"), 4, 512)
    attn_full = 48 * 4 * 4 * 512 * 512 * 1600
    assert forward_flops(cfg, 4, 512) == full - attn_full + attn_full * 128 // 512
    assert forward_flops(get_config("xl", sliding_window=4096), 4, 512) == full


def test_sliding_window_limits_the_receptive_field(backend):
    """Two layers with a window of 3: position t depends on tokens t-6..t only."""
    torch.manual_seed(1)
    model = TransformerLM(get_config("tiny", attention=backend, sliding_window=3))
    ids = torch.randint(0, 256, (1, 20))
    changed = ids.clone()
    changed[0, 5] = (changed[0, 5] + 1) % 256
    base, out = model(ids), model(changed)
    torch.testing.assert_close(out[:, 12:], base[:, 12:], rtol=0, atol=1e-6)  # 12 - 6 > 5
    assert not torch.allclose(out[:, 5:12], base[:, 5:12])


def test_document_offsets():
    ids = torch.tensor([[9, 1, 2, 0, 3, 0], [4, 0, 0, 5, 6, 7]])
    cu, longest = document_offsets(ids, eot_id=0)
    # rows start documents; each eot (0) opens one
    assert cu.tolist() == [0, 3, 5, 6, 7, 8, 12]
    assert cu.dtype == torch.int32
    assert longest == 4
    assert document_offsets(np.array([0, 1, 2]), 0)[0].tolist() == [0, 3]
    with pytest.raises(ValueError, match="eot_id"):
        document_offsets(ids, -1)
    with pytest.raises(ValueError, match="token_ids"):
        document_offsets(ids.float(), 0)


@pytest.mark.parametrize("attention", ["sdpa", "flash-torch"])
def test_packed_documents_equal_separate_sequences(attention):
    """Each document of a packed row gives the logits it gets alone: nothing leaks across
    documents. RoPE is relative, so a document's offset in its row changes only rounding: the
    cos/sin tables are fp32 (6e-8 relative), logits agree to ~3e-8 in float64 (a leak: 1e-2)."""
    torch.manual_seed(2)
    model = TransformerLM(get_config("tiny", attention=attention, num_kv_heads=2)).double()
    ids = torch.randint(1, 256, (2, 24))
    ids[0, 7] = ids[0, 15] = ids[1, 3] = 0
    cu, longest = document_offsets(ids, 0)
    packed = model(ids, cu_seqlens=cu, max_seqlen=longest)
    flat_ids, flat_out = ids.reshape(-1), packed.reshape(-1, 256)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        alone = model(flat_ids[a:b][None])[0]
        torch.testing.assert_close(flat_out[a:b], alone, rtol=1e-5, atol=1e-6)


def test_packed_loss_and_checkpointing_and_compile():
    torch.manual_seed(3)
    cfg = get_config("tiny", num_kv_heads=1, sliding_window=8)
    model = TransformerLM(cfg)
    ids = torch.randint(1, 256, (2, 32))
    ids[:, 10] = 0
    cu, _ = document_offsets(ids, 0)
    loss = model(ids, ids, cu_seqlens=cu)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    ckpt = TransformerLM(cfg)
    ckpt.load_state_dict(model.state_dict())
    apply_activation_checkpointing(ckpt, 1)
    loss2 = ckpt(ids, ids, cu_seqlens=cu)
    torch.testing.assert_close(loss2, loss)
    for a, b in zip(torch.autograd.grad(loss2, list(ckpt.parameters())), grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(ids, ids, cu_seqlens=cu), loss, rtol=1e-5, atol=1e-6)


def test_bad_packing_is_refused_by_name():
    model = TransformerLM(get_config("tiny"))
    ids = torch.randint(0, 256, (2, 8))

    def run(cu, max_seqlen=None):
        return model(ids, cu_seqlens=cu, max_seqlen=max_seqlen)

    def cu(*values, dtype=torch.int32):
        return torch.tensor(values, dtype=dtype)

    with pytest.raises(ValueError, match="cu_seqlens: expected a 1-D int32"):
        run(cu(0, 8, 16, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"row start .* missing \[8\]"):
        run(cu(0, 4, 12, 16))
    with pytest.raises(ValueError, match="from 0 to batch \\* seq = 16"):
        run(cu(0, 8, 15))
    with pytest.raises(ValueError, match="never decrease"):
        run(cu(0, 8, 6, 8, 16))
    with pytest.raises(ValueError, match="max_seqlen=3 is less than the longest document, 8"):
        run(cu(0, 8, 16), 3)
    with pytest.raises(ValueError, match="max_seqlen"):
        run(cu(0, 8, 16), 9)
    with pytest.raises(ValueError, match="device"):
        run(cu(0, 8, 16).to("meta"))


def test_trainer_packs_documents(tmp_path):
    fast = ["--size", "tiny", "--context-length", "32", "--batch-size", "4", "--no-progress"]
    flags = ["--steps", "3", "--log-every", "1", "--num-kv-heads", "2", "--sliding-window", "8"]
    eot = str(synthetic_tokens(1, 256, "pattern")[0])  # a token of the synthetic cycle
    packed = main([*fast, *flags, "--pack-documents", "--eot-id", eot, "--eval-every", "3"])
    assert packed.model.config.num_kv_heads == 2
    assert all(np.isfinite(h["loss"]) for h in packed.history)
    assert np.isfinite(packed.evals[-1]["val_loss"])
    plain = main([*fast, *flags])
    assert packed.history[0]["loss"] != plain.history[0]["loss"]  # the offsets reached the model


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--pack-documents"], "--eot-id"),
        (["--eot-id", "3"], "--pack-documents"),
        (["--pack-documents", "--eot-id", "256"], "--eot-id"),
        (["--num-kv-heads", "3"], "num_kv_heads=3"),
        (["--sliding-window", "0"], "sliding_window"),
    ],
)
def test_bad_packing_flags(argv, flag, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--size", "tiny", *argv])
    assert flag in capsys.readouterr().err
