"""CUDA checks of grouped-query attention, sliding windows and packed documents in the model
(run by `nox -s gpu_tests`; skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch

from lm_core import TransformerLM, document_offsets, get_config

pytestmark = pytest.mark.gpu

FEATURES = {"num_kv_heads": 2, "sliding_window": 16}


def _ids_and_offsets():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 256, (4, 64), generator=gen)
    ids[0, 20] = ids[1, 5] = ids[1, 40] = ids[3, 63] = 0
    cu, longest = document_offsets(ids, 0)
    return ids.cuda(), cu.cuda(), longest


@pytest.mark.parametrize("attention", ["naive", "flash-torch", "flash-triton"])
def test_backends_agree_with_sdpa_bf16(attention):
    """Every backend with GQA, a window and packed documents: the same logits as SDPA (which
    gets them as a boolean mask), within bf16 rounding."""
    ids, cu, longest = _ids_and_offsets()
    torch.manual_seed(0)
    sdpa = TransformerLM(get_config("tiny", **FEATURES)).cuda()
    other = TransformerLM(get_config("tiny", attention=attention, **FEATURES)).cuda()
    other.load_state_dict(sdpa.state_dict())
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want = sdpa(ids, cu_seqlens=cu, max_seqlen=longest).float()
        got = other(ids, cu_seqlens=cu, max_seqlen=longest).float()
    err = (got - want).norm() / want.norm()
    assert err < 2e-2, err


def test_compiled_packed_flash_triton_matches_eager():
    """torch.compile(fullgraph=True) of the packed model on our kernels: one graph, the same
    loss and gradients as eager (offsets unchecked under compile, checked in eager)."""
    ids, cu, _ = _ids_and_offsets()
    torch.manual_seed(0)
    model = TransformerLM(get_config("tiny", attention="flash-triton", **FEATURES)).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        eager = model(ids, ids, cu_seqlens=cu)
    grads = torch.autograd.grad(eager, list(model.parameters()))
    compiled = torch.compile(model, fullgraph=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = compiled(ids, ids, cu_seqlens=cu)
    torch.testing.assert_close(got, eager, rtol=1e-3, atol=1e-3)
    for a, b in zip(torch.autograd.grad(got, list(model.parameters())), grads):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)


def test_trainer_packs_documents_on_cuda(tmp_path):
    from lm_core.train import main

    result = main([
        "--size", "tiny", "--context-length", "64", "--batch-size", "8", "--steps", "20",
        "--no-progress", "--bf16", "--attention", "flash-triton", "--num-kv-heads", "2",
        "--sliding-window", "32", "--pack-documents", "--eot-id", "0", "--synthetic", "random",
        "--device", "cuda", "--log-every", "5",
    ])  # fmt: skip
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in result.history)
