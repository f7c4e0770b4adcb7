"""The SDPA drop-in inside a Hugging Face model (the ``hf`` extra): with
``attn_implementation="sdpa"`` under ``sdpa_replaced``, and with the registered
``attn_implementation="fa-triton"`` (``hf_attention``), HF's attention calls take our path
and give HF's logits and gradients; calls with a padding mask stay torch's. On the CPU our
path is the package's PyTorch implementation (the drop-in is widened to CPU float32 here),
which checks what HF passes (grouped heads with ``enable_gqa``, its scale, ``is_causal``)
and how it is mapped.
"""

from __future__ import annotations

import pytest
import torch

from flashattn_triton import flash_attention, hf_attention, sdpa, sdpa_replaced

transformers = pytest.importorskip("transformers")


def _llama(attn_implementation: str = "sdpa"):
    config = transformers.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        use_cache=False, attn_implementation=attn_implementation,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).float()


@pytest.fixture
def hf_model():
    return _llama()


@pytest.fixture
def ours_on_cpu(monkeypatch):
    """The drop-in's path widened to CPU float32; the calls it makes, counted."""
    calls = []

    def counted(*args):
        calls.append(args)
        return flash_attention(*args)

    monkeypatch.setattr(sdpa, "_kernels_run_on", lambda t: True)
    monkeypatch.setattr(sdpa, "DTYPES", (*sdpa.DTYPES, torch.float32))
    monkeypatch.setattr(sdpa, "flash_attention", counted)
    return calls


def _loss_and_grads(model, tokens, **kwargs):
    model.zero_grad()
    out = model(input_ids=tokens, labels=tokens, **kwargs)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_hf_calls_take_our_path(hf_model, ours_on_cpu):
    tokens = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    ref_logits, ref_grads = _loss_and_grads(hf_model, tokens)
    with sdpa_replaced():
        logits, grads = _loss_and_grads(hf_model, tokens)
    assert len(ours_on_cpu) == 3  # one call per layer, each ours
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], atol=1e-4, rtol=1e-3, msg=name)


def test_hf_float32_model_under_autocast_takes_our_path(hf_model, ours_on_cpu):
    """The usual mixed-precision setup: float32 weights, bf16 autocast. HF's RoPE hands SDPA
    float32 q and k and a bf16 v; the drop-in takes them in bf16, as SDPA's autocast does,
    so every layer's call is ours (in bf16), and the logits are SDPA's within bf16."""
    tokens = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_logits, ref_grads = _loss_and_grads(hf_model, tokens)
        with sdpa_replaced():
            logits, grads = _loss_and_grads(hf_model, tokens)
    assert [tuple(t.dtype for t in call[:3]) for call in ours_on_cpu] == [(torch.bfloat16,) * 3] * 3
    torch.testing.assert_close(logits, ref_logits, atol=3e-2, rtol=3e-2)
    for name, grad in grads.items():
        assert grad.dtype == torch.float32, name
        torch.testing.assert_close(grad, ref_grads[name], atol=3e-2, rtol=5e-2, msg=name)


def test_hf_calls_with_a_padding_mask_stay_torchs(hf_model, ours_on_cpu):
    tokens = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(tokens)
    mask[0, :5] = 0  # left padding: HF passes SDPA a mask
    ref_logits, _ = _loss_and_grads(hf_model, tokens, attention_mask=mask)
    with sdpa_replaced():
        logits, _ = _loss_and_grads(hf_model, tokens, attention_mask=mask)
    assert ours_on_cpu == []
    assert torch.equal(logits, ref_logits)


@pytest.mark.parametrize("name", ["flash-triton", "", None])
def test_register_rejects_names_transformers_would_misread(name):
    with pytest.raises(ValueError, match="name: expected a non-empty str without 'flash'"):
        hf_attention.register(name)


def test_registered_implementation(ours_on_cpu):
    """``attn_implementation="fa-triton"`` after ``hf_attention.register()``: the same
    weights give the SDPA model's logits and gradients, every layer's call ours; a padded
    batch gets SDPA's mask and stays torch's."""
    assert hf_attention.register() == "fa-triton"
    ref_model, model = _llama("sdpa"), _llama("fa-triton")
    assert model.config._attn_implementation == "fa-triton"
    tokens = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(3))
    ref_logits, ref_grads = _loss_and_grads(ref_model, tokens)
    logits, grads = _loss_and_grads(model, tokens)
    assert len(ours_on_cpu) == 3
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], atol=1e-4, rtol=1e-3, msg=name)
    mask = torch.ones_like(tokens)
    mask[1, :7] = 0
    ref_logits, _ = _loss_and_grads(ref_model, tokens, attention_mask=mask)
    logits, _ = _loss_and_grads(model, tokens, attention_mask=mask)
    assert len(ours_on_cpu) == 3  # no more of ours
    assert torch.equal(logits, ref_logits)
