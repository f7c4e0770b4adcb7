"""Exponentials on the FMA units (``kernels._exp2_fma`` / ``_exp2_mixed``), in Triton's CPU
interpreter: the polynomial's accuracy and clamp, which columns each split sends to it, and
the forward / dQ kernels with the switch on (16-bit inputs) against a float64 reference."""

from __future__ import annotations

import pytest
import torch
from flashattn_testutil import reference_fwd_bwd, rel_err, run_fwd_bwd

from flashattn_triton import FlashAttention2Triton, configs, launch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
from flashattn_triton.kernels import _exp2_fma, _exp2_mixed  # noqa: E402  (after triton)

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or not launch.interpreting(),
    reason="needs TRITON_INTERPRET=1 on a machine without a GPU (set by tests/conftest.py)",
)

ROWS, COLS = 16, 32


@triton.jit
def _apply(X, Y, R: tl.constexpr, C: tl.constexpr, EXP_FMA: tl.constexpr, POLY: tl.constexpr):
    offs = tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]
    x = tl.load(X + offs)
    if POLY:
        y = _exp2_fma(x)
    else:
        y = _exp2_mixed(x, EXP_FMA)
    tl.store(Y + offs, y)


@pytest.fixture
def exp2_kernel():
    def run(x: torch.Tensor, exp_fma: int = 0, poly: bool = False) -> torch.Tensor:
        y = torch.empty_like(x)
        _apply[(1,)](x, y, x.shape[0], x.shape[1], exp_fma, poly)
        return y

    return run


def test_polynomial_accuracy_and_clamp(exp2_kernel):
    torch.manual_seed(0)
    x = torch.empty(ROWS, COLS).uniform_(-40.0, 8.0)
    x[0, :4] = torch.tensor([0.0, -0.5, 0.5, -125.0])
    got = exp2_kernel(x, poly=True).double()
    want = torch.exp2(x.double())
    assert ((got - want).abs() / want).max() < 8e-5
    # At the clamp (-126) the result is a subnormal float32: still within 2e-4.
    edge = exp2_kernel(torch.full((ROWS, COLS), -126.0), poly=True).double()
    assert ((edge - 2.0**-126).abs() / 2.0**-126).max() < 2e-4
    # Far below the clamp (and -inf): a tiny non-negative number, never NaN or negative.
    low = torch.full((ROWS, COLS), -1e4)
    low[1] = float("-inf")
    out = exp2_kernel(low, poly=True)
    assert torch.isfinite(out).all()
    assert (out >= 0).all()
    assert (out < 1.2e-38).all()


@pytest.mark.parametrize(
    ("exp_fma", "on_fma"),
    [
        (2, lambda c: c % 2 == 1),  # the second column of each pair
        (4, lambda c: c % 2 == 1 and (c // 8) % 2 == 1),  # ... of every odd 8-column chunk
    ],
)
def test_split_sends_the_expected_columns(exp2_kernel, exp_fma, on_fma):
    torch.manual_seed(1)
    x = torch.empty(ROWS, COLS).uniform_(-20.0, 0.0)
    exact = exp2_kernel(x, exp_fma=0)
    mixed = exp2_kernel(x, exp_fma=exp_fma)
    poly_cols = torch.tensor([on_fma(c) for c in range(COLS)])
    assert poly_cols.sum() == COLS // exp_fma
    assert torch.equal(mixed[:, ~poly_cols], exact[:, ~poly_cols])
    assert not torch.equal(mixed[:, poly_cols], exact[:, poly_cols])
    assert rel_err(mixed, exact) < 1e-4


# fp16 (bfloat16 goes through the float32 kernels in the interpreter): small tiles so the
# sequences below have unmasked tiles, where the split applies.
FP16_TILES = {
    "fwd": configs.TileConfig(32, 16, 4, 2),
    "dq": configs.TileConfig(32, 16, 4, 2),
    "dkdv": configs.TileConfig(16, 32, 4, 2),
}


@pytest.mark.parametrize("exp_fma", [2, 4])
@pytest.mark.parametrize(("n_q", "n_k", "causal"), [(96, 96, True), (80, 112, False)])
def test_kernels_with_exponentials_on_fma(exp_fma, n_q, n_k, causal, monkeypatch):
    monkeypatch.setattr(configs, "OVERRIDES", dict(FP16_TILES))
    monkeypatch.setenv("FLASHATTN_TRITON_BWD", "split")
    torch.manual_seed(2)
    q = torch.randn(2, n_q, 16, dtype=torch.float16)
    k, v = (torch.randn(2, n_k, 16, dtype=torch.float16) for _ in range(2))
    do = torch.randn(2, n_q, 16, dtype=torch.float16)
    ref = reference_fwd_bwd(q, k, v, do, causal)
    monkeypatch.setenv("FLASHATTN_TRITON_EXP_FMA", "0")
    base = run_fwd_bwd(FlashAttention2Triton.apply, q, k, v, do, causal)
    monkeypatch.setenv("FLASHATTN_TRITON_EXP_FMA", str(exp_fma))
    out = run_fwd_bwd(FlashAttention2Triton.apply, q, k, v, do, causal)
    for name in ("o", "dq", "dk", "dv"):
        assert torch.isfinite(out[name]).all(), name
        # fp16 rounding (2^-11) dominates; the polynomial adds < 1e-4 relative.
        assert rel_err(out[name], ref[name]) < 2 * rel_err(base[name], ref[name]) + 1e-3, name
    # The switch reached the forward (o) and the dQ kernel (dq); dK/dV keeps the unit.
    assert not torch.equal(out["o"], base["o"])
    assert not torch.equal(out["dq"], base["dq"])


def test_switch_values_and_float32(monkeypatch):
    monkeypatch.setenv("FLASHATTN_TRITON_EXP_FMA", "4")
    assert configs.exp_fma(2) == 4
    assert configs.exp_fma(4) == 0  # float32 never uses the polynomial
    monkeypatch.setenv("FLASHATTN_TRITON_EXP_FMA", "3")
    with pytest.raises(ValueError, match="FLASHATTN_TRITON_EXP_FMA"):
        configs.exp_fma(2)
