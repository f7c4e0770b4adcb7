"""Activation checkpointing: the same loss and gradients as the plain model, blocks recomputed
as planned, state-dict keys unchanged, the group-size policies and their memory model."""

from __future__ import annotations

import copy

import pytest
import torch

from lm_core import (
    TransformerLM,
    apply_activation_checkpointing,
    cross_entropy,
    get_config,
    save_checkpoint,
)
from lm_core.activation_ckpt import (
    activation_memory,
    block_activation_ratio,
    checkpoint_group_size,
    parse_every,
    resolve_group_size,
)
from lm_core.checkpoint import load_checkpoint

LAYERS = 5


def _model(**overrides) -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(get_config("tiny", **{"num_layers": LAYERS, **overrides}))


def _batch():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (2, 17), generator=gen)
    return ids[:, :-1], ids[:, 1:]


def _loss_and_grads(model, fused=False):
    x, y = _batch()
    model.zero_grad(set_to_none=True)
    loss = model(x, y) if fused else cross_entropy(model(x), y)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("every", [1, 2, 3, LAYERS, 99, "sqrt", "optimal"])
def test_same_loss_and_gradients_as_plain(every):
    plain = _model()
    ref_loss, ref_grads = _loss_and_grads(plain)
    model = apply_activation_checkpointing(copy.deepcopy(plain), every)
    loss, grads = _loss_and_grads(model)
    # the recomputation repeats the same CPU kernels on the same inputs: equal to the bit;
    # the tolerance only allows for a different summation order elsewhere
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-6, atol=1e-8, msg=name)


def _forward_counts(model, every) -> list[int]:
    counts = [0] * len(model.layers)
    for i, block in enumerate(model.layers):
        block.register_forward_pre_hook(lambda *_, i=i: counts.__setitem__(i, counts[i] + 1))
    apply_activation_checkpointing(model, every)
    _loss_and_grads(model)
    return counts


@pytest.mark.parametrize(
    ("every", "expected"),
    [
        ("none", [1, 1, 1, 1, 1]),
        (1, [2, 2, 2, 2, 1]),  # every block but the last recomputed
        (2, [2, 2, 2, 2, 1]),  # groups (0 1) (2 3) checkpointed, (4) kept
        (3, [2, 2, 2, 1, 1]),  # (0 1 2) checkpointed, (3 4) kept
        (LAYERS, [1, 1, 1, 1, 1]),  # one group: nothing to gain from checkpointing it
    ],
)
def test_blocks_are_recomputed_as_planned(every, expected):
    """Module hooks fire in the forward and again in the recomputation (blocks are called as
    modules inside the checkpoint), once per block per pass."""
    assert _forward_counts(_model(), every) == expected


def test_reapply_replaces_and_none_removes():
    model = _model()
    apply_activation_checkpointing(model, 2)
    assert checkpoint_group_size(model) == 2
    apply_activation_checkpointing(model, 1)
    assert checkpoint_group_size(model) == 1
    apply_activation_checkpointing(model, "none")
    assert checkpoint_group_size(model) == 0
    assert "run_blocks" not in model.__dict__


def test_state_dict_and_checkpoints_unchanged(tmp_path):
    plain = _model()
    model = apply_activation_checkpointing(copy.deepcopy(plain), 2)
    assert list(model.state_dict()) == list(plain.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    save_checkpoint(tmp_path / "ckpt.pt", model, opt, step=3)
    fresh = _model()
    assert load_checkpoint(tmp_path / "ckpt.pt", fresh) == 3
    # a deep copy checkpoints its own blocks, not the original's
    clone = copy.deepcopy(model)
    assert checkpoint_group_size(clone) == 2
    assert clone.run_blocks.args[0] is clone.layers


def test_with_set_attention_and_fused_loss():
    plain = _model()
    plain.set_attention("naive")
    ref_loss, ref_grads = _loss_and_grads(plain)
    model = apply_activation_checkpointing(_model(), 2)
    model.set_attention("naive")  # after applying: the blocks are the same modules
    loss, grads = _loss_and_grads(model)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-6, atol=1e-8, msg=name)
    fused_loss, fused_grads = _loss_and_grads(model, fused=True)
    torch.testing.assert_close(fused_loss, ref_loss, rtol=1e-6, atol=1e-6)
    for name, g in ref_grads.items():
        torch.testing.assert_close(fused_grads[name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_compile_fullgraph_forward_backward():
    """dynamo traces the checkpointed groups (and the fused loss) without a graph break;
    aot_eager runs the traced forward and backward (about 10 s on 2 CPU cores)."""
    plain = _model(num_layers=3)
    ref_loss, ref_grads = _loss_and_grads(plain, fused=True)
    model = apply_activation_checkpointing(copy.deepcopy(plain), 1)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    loss, grads = _loss_and_grads(compiled, fused=True)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads["_orig_mod." + name], g, rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()


def test_group_size_policies():
    assert resolve_group_size(None, 12) == 0
    assert resolve_group_size("none", 12) == 0
    assert resolve_group_size(4, 12) == 4
    assert resolve_group_size("4", 12) == 4
    assert resolve_group_size(50, 12) == 12
    assert resolve_group_size("sqrt", 48) == 7
    assert resolve_group_size("sqrt", 16) == 4
    # r = 1 (Chen et al.): the optimum is ~sqrt(L), peak ~2 sqrt(L) (less one: the last group
    # is not checkpointed); k = 4, 5, 6 tie, the largest recomputes least
    assert resolve_group_size("optimal", 16, 1.0) == 6
    assert activation_memory(16, 4, 1.0) == 7  # 3 kept inputs + 4 blocks at a time
    assert activation_memory(16, 6, 1.0) == 7
    # a Transformer block stores ~20x its input: single blocks win
    assert resolve_group_size("optimal", 48, 25.0) == 1
    for layers in (1, 2, 7, 34, 48):
        for ratio in (1.0, 4.0, 14.5, 25.0):
            k = resolve_group_size("optimal", layers, ratio)
            best = min(activation_memory(layers, j, ratio) for j in range(1, layers + 1))
            assert activation_memory(layers, k, ratio) == best
            assert best <= activation_memory(layers, 0, ratio)


def test_memory_model():
    assert activation_memory(10, 0, 20.0) == 200  # no checkpointing: every block stored
    assert activation_memory(10, 1, 20.0) == 9 + 20  # 9 inputs kept + 1 block at a time
    assert activation_memory(10, 10, 20.0) == 200  # one group, not checkpointed
    assert activation_memory(10, 3, 20.0) == max(3 + 1 * 20, 2 + 3 * 20)


def test_activation_ratio_against_saved_tensors():
    """The shape formula for r against what autograd actually saves for one block (fp32)."""
    config = get_config("tiny", d_model=64, num_heads=4, d_ff=160)
    block = TransformerLM(config).layers[0]
    x = torch.randn(2, 32, 64, requires_grad=True)
    skip = {p.untyped_storage().data_ptr() for p in block.parameters()}
    skip |= {b.untyped_storage().data_ptr() for b in block.buffers()}
    storages: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    measured = sum(storages.values()) / (x.numel() * x.element_size())
    estimate = block_activation_ratio(config)
    assert estimate == pytest.approx(9 + 4 * 160 / 64)
    # CPU kernels save a few extra per-token tensors (e.g. the norm's rstd, sdpa's lse)
    assert estimate <= measured <= 1.25 * estimate, (measured, estimate)
    assert block_activation_ratio(config, autocast=True) == pytest.approx(4 + (5 + 10) / 2)


def test_validation():
    model = _model()
    with pytest.raises(ValueError, match="every"):
        apply_activation_checkpointing(model, 0)
    with pytest.raises(ValueError, match="every"):
        apply_activation_checkpointing(model, "often")
    with pytest.raises(TypeError, match="every"):
        apply_activation_checkpointing(model, True)
    with pytest.raises(TypeError, match=r"before torch\.compile"):
        apply_activation_checkpointing(torch.compile(model), 1)
    with pytest.raises(ValueError, match="activation_ratio"):
        apply_activation_checkpointing(model, "optimal", activation_ratio=0.0)
    assert parse_every(" SQRT ") == "sqrt"
    assert parse_every("3") == 3
