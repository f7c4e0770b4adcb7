"""FlashAttention2Torch (tiled PyTorch) against a float64 naive reference, on CPU.

Tolerances: float32 inputs run in float32, whose rounding (2^-24 per operation, grown by
sums over <= 130 terms) stays far below 1e-5 relative; float64 inputs stay below 1e-12.
"""

from __future__ import annotations

import pytest
import torch
from flashattn_testutil import reference_fwd_bwd, rel_err, run_fwd_bwd, saved_lse

from flashattn_triton import FlashAttention2Torch, attention_reference
from flashattn_triton.torch_impl import flash_backward_torch, flash_forward_torch

CASES = [
    # lead dims, Nq, Nk, d, causal
    ((2,), 1, 1, 16, True),
    ((2, 3), 17, 17, 16, True),
    ((1,), 97, 97, 32, False),
    ((2,), 130, 130, 64, True),
    ((3,), 40, 70, 16, False),
    ((2,), 40, 70, 32, True),  # causal, Nq < Nk: bottom-right aligned
    ((3,), 70, 40, 16, True),  # causal, Nq > Nk: first 30 rows see no key
    ((), 33, 33, 8, True),  # 2-D input
]


def _inputs(lead, n_q, n_k, d, dtype=torch.float32):
    q = torch.randn(*lead, n_q, d, dtype=dtype)
    k = torch.randn(*lead, n_k, d, dtype=dtype)
    v = torch.randn(*lead, n_k, d, dtype=dtype)
    do = torch.randn(*lead, n_q, d, dtype=dtype)
    return q, k, v, do


@pytest.mark.parametrize(("lead", "n_q", "n_k", "d", "causal"), CASES)
def test_forward_lse_backward_match_reference(lead, n_q, n_k, d, causal):
    q, k, v, do = _inputs(lead, n_q, n_k, d)
    ref = reference_fwd_bwd(q, k, v, do, causal)
    out = run_fwd_bwd(FlashAttention2Torch.apply, q, k, v, do, causal)
    for name in ("o", "dq", "dk", "dv"):
        assert torch.isfinite(out[name]).all(), name
        assert rel_err(out[name], ref[name]) < 1e-5, name
    o = FlashAttention2Torch.apply(q.requires_grad_(), k, v, causal)
    lse = saved_lse(o, q)
    assert lse.shape == q.shape[:-1]
    fin = torch.isfinite(ref["lse"])
    assert torch.equal(torch.isneginf(lse), ~fin)
    assert torch.allclose(lse[fin].double(), ref["lse"][fin], rtol=0, atol=1e-5)


@pytest.mark.parametrize(("q_tile", "k_tile"), [(16, 16), (16, 48), (64, 16)])
@pytest.mark.parametrize("causal", [False, True])
def test_tile_sizes_do_not_change_results(q_tile, k_tile, causal):
    q, k, v, do = _inputs((2,), 75, 75, 16, torch.float64)
    o, lse = flash_forward_torch(q, k, v, causal, 0.3, q_tile, k_tile)
    ro, rl = attention_reference(q, k, v, causal, 0.3)
    assert rel_err(o, ro) < 1e-12
    assert torch.allclose(lse, rl, atol=1e-12)
    grads = flash_backward_torch(do, q, k, v, o, lse, causal, 0.3, q_tile, k_tile)
    ref = reference_fwd_bwd(q, k, v, do, causal, 0.3)
    for g, name in zip(grads, ("dq", "dk", "dv")):
        assert rel_err(g, ref[name]) < 1e-12, name


@pytest.mark.parametrize(("n_q", "n_k", "causal"), [(5, 5, False), (5, 5, True), (4, 7, True)])
def test_gradcheck_float64(n_q, n_k, causal):
    q = torch.randn(1, 2, n_q, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, n_k, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, n_k, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda q, k, v: FlashAttention2Torch.apply(q, k, v, causal), (q, k, v)
    )


def test_half_precision_inputs_computed_in_float32():
    q, k, v, do = _inputs((2,), 50, 50, 32)
    ref = reference_fwd_bwd(q.bfloat16(), k.bfloat16(), v.bfloat16(), do.bfloat16(), True)
    out = run_fwd_bwd(
        FlashAttention2Torch.apply, q.bfloat16(), k.bfloat16(), v.bfloat16(), do.bfloat16(), True
    )
    assert out["o"].dtype == torch.bfloat16
    for name in ("o", "dq", "dk", "dv"):  # bf16 output rounding: 2^-9 relative
        assert rel_err(out[name], ref[name]) < 1e-2, name


def test_empty_rows_give_zero_output_and_finite_grads():
    q, k, v, do = _inputs((1,), 10, 4, 16)
    out = run_fwd_bwd(FlashAttention2Torch.apply, q, k, v, do, True)
    assert torch.equal(out["o"][:, :6], torch.zeros_like(out["o"][:, :6]))
    assert torch.equal(out["dq"][:, :6], torch.zeros_like(out["dq"][:, :6]))
    for t in out.values():
        assert torch.isfinite(t).all()


@pytest.mark.parametrize("lead", [(2,), (1, 2), ()])
def test_empty_sequences_as_the_triton_backend(lead):
    # Nq = 0: an empty output; Nk = 0: no key is visible, so zero output, lse -inf, zero grads
    # (the Triton kernels' behaviour; a reshape(-1, 0, d) used to raise inside torch).
    q, k, v, _ = _inputs(lead, 0, 5, 16)
    assert FlashAttention2Torch.apply(q, k, v, True).shape == (*lead, 0, 16)
    q, k, v, do = _inputs(lead, 4, 0, 16)
    out = run_fwd_bwd(FlashAttention2Torch.apply, q, k, v, do, False)
    for name in ("o", "dq", "dk", "dv"):
        assert torch.equal(out[name], torch.zeros_like(out[name])), name
    o, lse = flash_forward_torch(q, k, v, False, 0.25)
    assert o.shape == q.shape
    assert torch.isneginf(lse).all()
