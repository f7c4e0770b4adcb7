"""AdamW against torch.optim.AdamW; cosine_lr; clip_grad_norm against torch's."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from lm_core import AdamW, clip_grad_norm, cosine_lr


def _params(seed: int, dtype=torch.float64) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(5, 7), (7,), (3, 2, 4), (1,)]
    return [torch.nn.Parameter(torch.randn(s, generator=g, dtype=dtype)) for s in shapes]


def _groups(params, lr2=3e-2):
    # two groups with different lr, betas, eps and weight decay
    return [
        {"params": params[:2]},
        {"params": params[2:], "lr": lr2, "weight_decay": 0.3, "betas": (0.8, 0.99), "eps": 1e-6},
    ]


def _run(opt_factory, params, steps, seed, skip_grad_for=None):
    opt = opt_factory(_groups(params))
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        for i, p in enumerate(params):
            if skip_grad_for is not None and i == skip_grad_for and step % 2 == 0:
                p.grad = None  # a parameter without a gradient this step is skipped
            else:
                p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
        opt.step()
    return opt


@pytest.mark.parametrize("fused", [False, True, None])
def test_adamw_matches_torch(fused):
    ours, ref = _params(0), _params(0)
    kw = {"lr": 1e-2, "weight_decay": 0.1, "betas": (0.9, 0.95), "eps": 1e-8}
    _run(lambda g: AdamW(g, fused=fused, **kw), ours, 7, seed=1, skip_grad_for=1)
    _run(lambda g: torch.optim.AdamW(g, foreach=False, **kw), ref, 7, seed=1, skip_grad_for=1)
    for a, b in zip(ours, ref):
        # float64 on both sides: the two update orders agree to ~1e-15.
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert not torch.equal(ours[0], _params(0)[0])  # the parameters did move


def test_adamw_fp32_and_bf16_params_in_one_optimizer():
    p32 = torch.nn.Parameter(torch.randn(16))
    p16 = torch.nn.Parameter(torch.randn(16).bfloat16())
    r32, r16 = (torch.nn.Parameter(p.detach().clone()) for p in (p32, p16))
    ours = AdamW([p32, p16], lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW([r32, r16], lr=1e-2, weight_decay=0.1, foreach=False)
    for _ in range(3):
        for a, b in ((p32, r32), (p16, r16)):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        ours.step()
        ref.step()
    torch.testing.assert_close(p32, r32, rtol=1e-6, atol=1e-6)
    # bf16: both round each op to bf16 but in a different order; 1 bf16 ulp (2^-8) relative
    torch.testing.assert_close(p16.float(), r16.float(), rtol=8e-3, atol=8e-3)


def test_state_dict_round_trip_continues_identically():
    a, b = _params(2), _params(2)
    opt_a = _run(lambda g: AdamW(g, lr=1e-2), a, 3, seed=3)
    # b: same three steps, then a fresh optimizer restored from a's state dict
    _run(lambda g: AdamW(g, lr=1e-2), b, 3, seed=3)
    opt_b = AdamW(_groups(b), lr=1e-2)
    # deepcopy: like torch's, load_state_dict keeps the given tensors (no copy) when it can
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    assert opt_b.param_groups[1]["lr"] == 3e-2
    for opt, params in ((opt_a, a), (opt_b, b)):
        g = torch.Generator().manual_seed(9)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
        opt.step()
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert opt_b.state[b[0]]["step"].item() == 4


def test_state_dict_interchangeable_with_torch():
    ours = _params(4)
    opt = _run(lambda g: AdamW(g, lr=1e-2), ours, 2, seed=5)
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    ref = torch.optim.AdamW(_groups(ref_params), lr=1e-2, foreach=False)
    state = copy.deepcopy(opt.state_dict())
    for group in state["param_groups"]:
        group.pop("fused")
    ref.load_state_dict(state)
    for opt_, params in ((opt, ours), (ref, ref_params)):
        g = torch.Generator().manual_seed(6)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
        opt_.step()
    for x, y in zip(ours, ref_params):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": -1.0}, "lr"),
        ({"betas": (0.9, 1.0)}, "betas"),
        ({"eps": -1e-8}, "eps"),
        ({"weight_decay": -0.1}, "weight_decay"),
    ],
)
def test_adamw_rejects_bad_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AdamW([torch.nn.Parameter(torch.zeros(2))], **kwargs)
    opt = AdamW([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(ValueError, match=match):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], **kwargs})


def test_cosine_lr_key_points():
    kw = {"max_lr": 1.0, "min_lr": 0.1, "warmup_steps": 10, "cosine_steps": 30}
    assert cosine_lr(0, **kw) == 0.0
    assert cosine_lr(5, **kw) == pytest.approx(0.5)
    assert cosine_lr(10, **kw) == pytest.approx(1.0)
    assert cosine_lr(20, **kw) == pytest.approx(0.55)  # halfway: (max + min) / 2
    assert cosine_lr(15, **kw) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 4)))
    assert cosine_lr(30, **kw) == pytest.approx(0.1)
    assert cosine_lr(1000, **kw) == 0.1
    # the course's reference values (max 1, min 0.1, warmup 7, cosine 21)
    course = [cosine_lr(t, 1.0, 0.1, 7, 21) for t in range(25)]
    assert course[:8] == pytest.approx([i / 7 for i in range(8)])
    assert course[14] == pytest.approx(0.55)
    assert course[21:] == pytest.approx([0.1] * 4)
    after_warmup = course[7:]
    assert after_warmup == sorted(after_warmup, reverse=True)  # monotone decay
    with pytest.raises(ValueError, match="warmup_steps"):
        cosine_lr(0, 1.0, 0.1, 10, 5)


@pytest.mark.parametrize("max_norm", [0.5, 1e3])
def test_clip_grad_norm_matches_torch(max_norm):
    ours, ref = _params(7, torch.float32), _params(7, torch.float32)
    g = torch.Generator().manual_seed(8)
    for a, b in zip(ours, ref):
        a.grad = torch.randn(a.shape, generator=g) * 3
        b.grad = a.grad.clone()
    ours.append(torch.nn.Parameter(torch.zeros(3)))  # no grad: ignored
    total = clip_grad_norm(ours, max_norm)
    ref_total = torch.nn.utils.clip_grad_norm_(ref, max_norm)
    torch.testing.assert_close(total, ref_total)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.grad, b.grad)
    new_norm = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in ours[:-1]]))
    assert new_norm <= max_norm * (1 + 1e-5)


def test_clip_grad_norm_edge_cases():
    assert clip_grad_norm([torch.nn.Parameter(torch.zeros(2))], 1.0).item() == 0.0
    with pytest.raises(ValueError, match="max_norm"):
        clip_grad_norm([], 0.0)


@pytest.fixture
def torch_without(monkeypatch):
    """Remove private torch ops for one test (the availability checks are cached)."""
    from lm_core import optim

    def remove(*names):
        for name in names:
            monkeypatch.delattr(torch, name)
        optim._fused_available.cache_clear()
        optim._foreach_available.cache_clear()

    yield remove
    optim._fused_available.cache_clear()
    optim._foreach_available.cache_clear()


def test_implementation_choice_falls_back_without_private_ops(torch_without):
    from lm_core.optim import implementation

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert implementation(None, cuda) == "fused"  # a feature check, no GPU needed
    assert implementation(None, cpu) == "foreach"
    torch_without("_fused_adamw_")
    assert implementation(None, cuda) == "foreach"
    with pytest.raises(RuntimeError, match="fused=True"):
        implementation(True, cpu)
    with pytest.raises(RuntimeError, match="fused=True"):
        AdamW(_params(0), fused=True)
    torch_without("_foreach_lerp_")
    assert implementation(None, cuda) == implementation(False, cpu) == "plain"


def test_fused_op_with_another_signature_is_not_used(monkeypatch):
    from lm_core import optim

    monkeypatch.setattr(optim, "_FUSED_KWARGS", optim._FUSED_KWARGS | {"renamed_beta"})
    optim._fused_available.cache_clear()
    try:
        assert optim.implementation(None, torch.device("cuda")) == "foreach"
    finally:
        optim._fused_available.cache_clear()


def test_plain_fallback_is_the_foreach_math(torch_without):
    """Without torch._foreach_* the per-tensor update runs: bitwise the foreach result on CPU,
    and torch.optim.AdamW's update."""
    kw = {"lr": 1e-2, "weight_decay": 0.1, "betas": (0.9, 0.95), "eps": 1e-8}
    foreach, plain, ref = _params(0), _params(0), _params(0)
    _run(lambda g: AdamW(g, **kw), foreach, 5, seed=3, skip_grad_for=2)
    _run(lambda g: torch.optim.AdamW(g, foreach=False, **kw), ref, 5, seed=3, skip_grad_for=2)
    torch_without("_foreach_addcdiv_")
    opt = _run(lambda g: AdamW(g, **kw), plain, 5, seed=3, skip_grad_for=2)
    assert all(s["step"].device.type == "cpu" for s in opt.state.values())
    for a, b, r in zip(plain, foreach, ref):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-12)


def test_fused_update_without_foreach_ops(torch_without):
    """The fused kernel alone (no torch._foreach_*): its step counts still advance."""
    kw = {"lr": 1e-2, "weight_decay": 0.1, "betas": (0.9, 0.95), "eps": 1e-8}
    fused, ref = _params(0, torch.float32), _params(0, torch.float32)
    torch_without("_foreach_add_")
    _run(lambda g: AdamW(g, fused=True, **kw), fused, 3, seed=5)
    _run(lambda g: torch.optim.AdamW(g, foreach=False, **kw), ref, 3, seed=5)
    for a, b in zip(fused, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
