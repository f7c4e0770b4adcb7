"""CUDA checks (run by `nox -s gpu_tests` on the GPU machine; skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch

from lm_core import AdamW, TransformerLM, clip_grad_norm, cross_entropy, get_config

pytestmark = pytest.mark.gpu


def _model(**overrides):
    torch.manual_seed(0)
    return TransformerLM(get_config("tiny", **overrides)).cuda()


def test_train_step_has_no_host_sync():
    """Our code in a train step (forward, loss, clip, fused AdamW) under bf16 autocast: CUDA's
    sync debug mode raises on any operation that makes the host wait for the device. Backward
    runs outside the check: it is torch's autograd kernels only (embedding backward may sync
    inside torch on some versions), none of our Python."""
    model = _model()
    opt = AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 256, (4, 64), device="cuda")
    torch.cuda.synchronize()
    for _ in range(2):  # the first step also creates the optimizer state
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(ids[:, :-1])
            loss = cross_entropy(logits, ids[:, 1:])
        finally:
            torch.cuda.set_sync_debug_mode("default")
        loss.backward()
        torch.cuda.set_sync_debug_mode("error")
        try:
            clip_grad_norm(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss).item()


def test_cuda_matches_cpu_fp32():
    torch.manual_seed(1)
    cpu = TransformerLM(get_config("tiny"))
    gpu = TransformerLM(get_config("tiny")).cuda()
    gpu.load_state_dict(cpu.state_dict())
    ids = torch.randint(0, 256, (2, 64))
    # TF32 is off by default for fp32 matmuls; differences are fp32 reassociation only
    torch.testing.assert_close(gpu(ids.cuda()).cpu(), cpu(ids), rtol=1e-4, atol=1e-4)


def test_fused_adamw_matches_torch_on_cuda():
    params = [torch.nn.Parameter(torch.randn(33, 17, device="cuda")) for _ in range(3)]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours = AdamW(params, lr=1e-2, weight_decay=0.1)
    theirs = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, fused=True)
    for _ in range(5):
        for a, b in zip(params, ref):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        ours.step()
        theirs.step()
    for a, b in zip(params, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same fused kernel
    assert ours.state[params[0]]["step"].device.type == "cuda"


def test_adamw_fallbacks_on_cuda(monkeypatch):
    """The fused op passes the feature check on this torch; without the private ops the
    foreach, then the plain update run on CUDA tensors with the same result."""
    from lm_core import optim

    assert optim.implementation(None, torch.device("cuda")) == "fused"

    def run(**kw):
        g = torch.Generator(device="cuda").manual_seed(0)
        params = [torch.nn.Parameter(torch.ones(65, 33, device="cuda")) for _ in range(2)]
        opt = AdamW(params, lr=1e-2, weight_decay=0.1, **kw)
        for _ in range(4):
            for p in params:
                p.grad = torch.randn(p.shape, device="cuda", generator=g)
            opt.step()
        return params

    fused, foreach = run(), run(fused=False)
    monkeypatch.delattr(torch, "_foreach_addcdiv_")
    optim._foreach_available.cache_clear()
    try:
        assert optim.implementation(False, torch.device("cuda")) == "plain"
        plain = run(fused=False)
    finally:
        optim._foreach_available.cache_clear()
    for a, b, c in zip(fused, foreach, plain):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(c, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("attention", ["naive", "flash-torch", "flash-triton"])
def test_backends_agree_with_sdpa_bf16(attention):
    if attention.startswith("flash"):
        pytest.importorskip("flashattn_triton")
    ids = torch.randint(0, 256, (2, 64), device="cuda")
    model = _model()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref = model(ids).float()
        model.set_attention(attention)
        out = model(ids).float()
    # bf16 attention outputs differ by rounding (~2^-8 relative) through two layers
    assert (out - ref).abs().max() < 0.05 * ref.abs().max()


def test_compiled_matches_eager_bf16():
    model = _model()
    ids = torch.randint(0, 256, (4, 64), device="cuda")
    compiled = torch.compile(model, fullgraph=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref = model(ids).float()
        out = compiled(ids).float()
    assert (out - ref).abs().max() < 0.05 * ref.abs().max()


def test_trainer_on_cuda_bf16_compile(tmp_path):
    from lm_core.train import main

    argv = ["--size", "tiny", "--steps", "30", "--bf16", "--compile", "--no-progress"]
    result = main([*argv, "--log-every", "10", "--out-dir", str(tmp_path), "--device", "cuda"])
    assert result.history[-1]["loss"] < result.history[0]["loss"]
    assert (tmp_path / "checkpoint.pt").is_file()
