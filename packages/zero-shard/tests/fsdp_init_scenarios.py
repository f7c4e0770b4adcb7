"""FSDP over a module built on the meta device, run inside each rank (see zs_harness): the
shards are materialized unit by unit and equal the full build bitwise for the same seed."""

from __future__ import annotations

import re

import pytest
import torch
from fsdp_scenarios import VOCAB, Block, ToyLM, fsdp_step, make_opt, reference_step
from torch import nn

from zero_shard import FSDP


class StackLM(nn.Module):
    """Torch layers registered in the order they are built (each constructor draws its own
    init, as its reset_parameters does): embedding, blocks, final norm, untied head.
    tokens (B, T) -> logits (B, T, VOCAB)."""

    def __init__(self, d: int = 16, hidden: int = 23, layers: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.layers = nn.ModuleList(Block(d, hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)  # (B, T, d)
        for block in self.layers:
            x = block(x)
        return self.head(self.norm(x))  # (B, T, VOCAB)


def _meta(cls: type[nn.Module], **kwargs) -> nn.Module:
    with torch.device("meta"):
        return cls(**kwargs)


def _built(cls, device: torch.device, *args) -> nn.Module:
    """The full build on `device` (its generator draws the init, as FSDP's materialization
    on that device does)."""
    with torch.device(device):
        return cls(*args)


def _seed_rank0(rank: int, seed: int) -> None:
    """Rank 0 gets `seed`, the others another one: FSDP must use rank 0's generator."""
    torch.manual_seed(seed if rank == 0 else seed + 1000 + rank)


def _assert_bitwise(got: dict, want: dict) -> None:
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        assert torch.equal(got[k], want[k]), k


def _lm_config():
    lm_core = pytest.importorskip("lm_core")
    return lm_core, lm_core.ModelConfig(
        vocab_size=VOCAB, context_length=16, d_model=16, num_layers=2, num_heads=2, d_ff=24,
        num_kv_heads=1,
    )  # fmt: skip


def scenario_meta_equals_full_build(rank: int, world: int, device: torch.device) -> None:
    """Torch layers built on meta: FSDP's shards gathered are bitwise the full build for rank
    0's seed (rank 1 seeded differently), every rank's generator continues as rank 0's did
    after the full build, replicated parameters keep their identity, only the current unit is
    ever held at full size, and the wrapper trains like a built module."""
    torch.manual_seed(11)
    full = _built(StackLM, device)
    after_full = torch.rand(4, device=device)
    model = _meta(StackLM)
    norm_weight = model.norm.weight
    held: list[int] = []  # parameter elements materialized when each Linear is initialized
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.reset_parameters = _counting(m.reset_parameters, model, held)
    _seed_rank0(rank, 11)
    fsdp = FSDP(model, device=device)
    assert fsdp.module.norm.weight is norm_weight
    assert not norm_weight.is_meta
    _assert_bitwise(fsdp.gather_full_params(), full.state_dict())
    assert torch.equal(torch.rand(4, device=device), after_full), "generator as rank 0's"
    block = sum(p.numel() for p in full.layers[0].parameters())  # the largest unit
    norms = [m for m in full.modules() if isinstance(m, nn.LayerNorm)]
    replicated = sum(p.numel() for m in norms for p in m.parameters())  # stay whole
    total = sum(p.numel() for p in full.parameters())
    assert len(held) == 7, held
    assert block <= max(held) <= block + replicated < total / 2, held
    opt, ref_opt = make_opt("sgd", fsdp.parameters()), make_opt("sgd", full.parameters())
    for step in range(2):
        fsdp_step(fsdp, opt, step, rank, device)
        reference_step(full, ref_opt, step, world, device)
    for k, v in fsdp.gather_full_params().items():
        torch.testing.assert_close(v, full.state_dict()[k], rtol=1e-5, atol=1e-6, msg=k)


def _counting(reset, model: nn.Module, held: list[int]):
    """`reset`, first appending to `held` how many elements of `model`'s parameters are
    materialized (not on the meta device) at that moment."""

    def wrapped() -> None:
        held.append(sum(p.numel() for p in model.parameters() if not p.is_meta))
        reset()

    return wrapped


def scenario_meta_tied_and_roots(rank: int, world: int, device: torch.device) -> None:
    """ToyLM (embedding tied to the head, blocks without reset_parameters): the roots are
    the topmost modules with reset_parameters inside one unit or outside every unit, called
    in registration order; the tied weight is initialized by each root holding it, the last
    (the head's) wins: bitwise the same calls on a full model."""
    torch.manual_seed(5)
    ref = _built(ToyLM, device)
    torch.manual_seed(5)
    roots = [ref.emb]
    for block in ref.layers:
        roots += [block.norm, block.up, block.down]
    roots += [ref.norm, ref.head]
    with torch.no_grad():
        for m in roots:
            m.reset_parameters()
    _seed_rank0(rank, 5)
    fsdp = FSDP(_meta(ToyLM), device=device)
    full = fsdp.gather_full_params()
    _assert_bitwise(full, ref.state_dict())
    assert full["emb.weight"] is full["head.weight"]


def scenario_meta_lm_core(rank: int, world: int, device: torch.device) -> None:
    """lm_core's TransformerLM (grouped-query attention, odd sizes) built on meta: weights
    bitwise the full build's, RoPE tables (non-persistent buffers) recomputed on the device,
    and three AdamW steps equal single-process training from the full build."""
    lm_core, config = _lm_config()
    torch.manual_seed(3)
    full = _built(lm_core.TransformerLM, device, config)
    _seed_rank0(rank, 3)
    with torch.device("meta"):
        model = lm_core.TransformerLM(config)
    fsdp = FSDP(model, device=device)
    _assert_bitwise(fsdp.gather_full_params(), full.state_dict())
    for name, buf in full.named_buffers():
        assert torch.equal(dict(fsdp.module.named_buffers())[name], buf), name
    opt = lm_core.AdamW(fsdp.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = lm_core.AdamW(full.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(3):
        fsdp_step(fsdp, opt, step, rank, device)
        reference_step(full, ref_opt, step, world, device)
    for k, v in fsdp.gather_full_params().items():
        torch.testing.assert_close(v, full.state_dict()[k], rtol=1e-5, atol=1e-6, msg=k)


class _Scaled(nn.Module):
    """A Linear and a non-persistent buffer, with no reset_parameters of its own."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)
        self.register_buffer("scale", torch.full((d_out,), 3.0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def scenario_meta_init_fn_and_errors(rank: int, world: int, device: torch.device) -> None:
    """init_fn(root) is called on each topmost module inside one unit (or outside every
    unit) and initializes its subtree; without it a module holding tensors that no
    reset_parameters covers, an init that replaces a parameter, and bad `device` values are
    refused on every rank, naming the problem."""
    calls: list[str] = []

    def init_fn(m: nn.Module) -> None:
        calls.append(type(m).__name__)
        for p in m.parameters():
            p.fill_(0.5)
        for b in m.buffers():
            b.fill_(2.0)

    with torch.device("meta"):
        model = nn.Sequential(_Scaled(6, 7), nn.LayerNorm(7), _Scaled(7, 5))
    fsdp = FSDP(model, device=device, init_fn=init_fn)
    # the Sequential's children holding a Linear are units; the LayerNorm lies outside
    assert calls == ["_Scaled", "LayerNorm", "_Scaled"], calls
    for key, value in fsdp.gather_full_params().items():
        assert torch.equal(value, torch.full_like(value, 0.5)), key
    for b in fsdp.module.buffers():
        assert b.device == device
        assert torch.equal(b, torch.full_like(b, 2.0))
    assert fsdp(torch.ones(2, 6, device=device)).shape == (2, 5)

    def expect(exc: type, text: str, build) -> None:
        with torch.device("meta"):
            model = build()
        with pytest.raises(exc, match=re.escape(text)):
            FSDP(model, device=device)

    uncovered = "'0' (_Scaled) holds tensors on the meta device but neither it nor"
    expect(ValueError, uncovered, lambda: nn.Sequential(_Scaled(6, 7), nn.Linear(7, 3)))

    class Replacing(nn.Linear):
        def reset_parameters(self) -> None:
            if not self.weight.is_meta:  # at materialization, not in the constructor
                self.weight = nn.Parameter(torch.zeros(self.weight.shape, device=device))

    expect(ValueError, "replaced parameter 'weight' of a Replacing", lambda: Replacing(3, 4))
    with pytest.raises(ValueError, match=re.escape("device: 'meta' holds no values")):
        FSDP(_meta(StackLM), device="meta")
    with pytest.raises(TypeError, match=re.escape("device: expected a torch.device")):
        FSDP(_meta(StackLM), device=3.5)
    other = "cuda:7" if device.type == "cpu" else "cpu"
    with pytest.raises(ValueError, match=re.escape("`device` places a module built on")):
        FSDP(StackLM().to(device), device=other)
    # the refusals left nothing half-done: a fresh meta build still materializes exactly
    torch.manual_seed(2)
    full = _built(StackLM, device)
    torch.manual_seed(2)
    _assert_bitwise(FSDP(_meta(StackLM), device=device).gather_full_params(), full.state_dict())
