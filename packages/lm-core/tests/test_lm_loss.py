"""cross_entropy against F.cross_entropy, including huge logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lm_core import cross_entropy


@pytest.mark.parametrize("shape", [(6, 11), (2, 5, 11)])
def test_matches_torch_value_and_grad(shape):
    torch.manual_seed(0)
    logits = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, shape[-1], shape[:-1])
    ours = cross_entropy(logits, targets)
    (g_ours,) = torch.autograd.grad(ours, logits)
    ref = F.cross_entropy(logits.reshape(-1, shape[-1]), targets.reshape(-1))
    (g_ref,) = torch.autograd.grad(ref, logits)
    # computed in fp32 (the function's precision) vs torch in fp64
    torch.testing.assert_close(ours.double(), ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(g_ours.double(), g_ref, rtol=1e-5, atol=1e-6)


def test_huge_logits_stay_finite():
    torch.manual_seed(1)
    logits = (torch.randn(4, 7, 50) * 1e4).requires_grad_()
    targets = torch.randint(0, 50, (4, 7))
    ours = cross_entropy(logits, targets)
    ours.backward()
    assert torch.isfinite(ours)
    assert torch.isfinite(logits.grad).all()
    ref = F.cross_entropy(logits.detach().double().reshape(-1, 50), targets.reshape(-1))
    torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-2)
    # a naive exp/sum/log overflows at this scale: the test data does exercise stability
    naive = torch.log(torch.exp(logits.detach()).sum(-1))
    assert not torch.isfinite(naive).all()


def test_bf16_logits_give_fp32_loss():
    logits = torch.randn(3, 4, 9).bfloat16()
    targets = torch.randint(0, 9, (3, 4))
    out = cross_entropy(logits, targets)
    assert out.dtype == torch.float32
    ref = F.cross_entropy(logits.float().reshape(-1, 9), targets.reshape(-1))
    torch.testing.assert_close(out, ref)


def test_validation():
    with pytest.raises(ValueError, match=r"targets: expected shape \(2, 3\)"):
        cross_entropy(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(TypeError, match="integer"):
        cross_entropy(torch.zeros(2, 5), torch.zeros(2))
    with pytest.raises(TypeError, match="floating"):
        cross_entropy(torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, dtype=torch.long))


def test_out_of_range_targets_are_refused_on_cpu():
    logits = torch.randn(2, 3, 5)
    for bad in (5, -1):
        targets = torch.zeros(2, 3, dtype=torch.long)
        targets[1, 2] = bad
        with pytest.raises(ValueError, match=rf"targets: values must lie in \[0, V=5\).*{bad}"):
            cross_entropy(logits, targets)
    # the check is skipped while dynamo traces (no graph break, no host sync in a graph)
    compiled = torch.compile(cross_entropy, fullgraph=True, backend="eager")
    good = torch.randint(0, 5, (2, 3))
    torch.testing.assert_close(compiled(logits, good), cross_entropy(logits, good))
