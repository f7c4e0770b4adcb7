"""Building on the meta device: no memory at any size, and the full build is exactly a meta
build given memory and initialized by `reset_parameters()` (what sharded wrappers rely on to
materialize shards bitwise as the full build; `lm_core.fsdp`, zero_shard.FSDP)."""

from __future__ import annotations

import os

import torch

from lm_core import TransformerLM, get_config
from lm_core.distributed import DistEnv, model_init_device
from lm_core.fsdp import init_roots


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_8b_meta_build_allocates_no_parameter_memory():
    config = get_config("8B")
    before = _rss_bytes()
    with torch.device("meta"):
        model = TransformerLM(config)
    grown = _rss_bytes() - before
    tensors = [*model.parameters(), *model.buffers()]
    assert all(t.is_meta for t in tensors)
    assert model.num_params() == 8_125_698_048  # 32.5 GB in fp32 if it were real
    assert grown < 64 * 2**20, f"RSS grew by {grown / 2**20:.0f} MiB"


def test_full_build_is_meta_build_then_reset_parameters():
    config = get_config("tiny", num_kv_heads=2, context_length=32)
    torch.manual_seed(4)
    full = TransformerLM(config)
    after_full = torch.rand(3)
    torch.manual_seed(4)
    with torch.device("meta"):
        model = TransformerLM(config)
    model.to_empty(device="cpu")
    for root in init_roots(model):  # one child at a time, as the sharded wrappers do
        root.reset_parameters()
    assert torch.equal(torch.rand(3), after_full)  # the same random numbers, no more
    for key, value in full.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    for (name, buf), other in zip(full.named_buffers(), model.buffers()):  # RoPE tables
        assert torch.equal(other, buf), name
    names = [type(m).__name__ for m in init_roots(model)]
    assert names == ["TokenEmbedding", "TransformerBlock", "TransformerBlock", "RMSNorm", "LMHead"]


def test_trainer_builds_on_meta_under_fsdp_only():
    env = DistEnv(device=torch.device("cpu"))
    assert model_init_device(env, "ours").type == "meta"
    assert model_init_device(env, "torch").type == "meta"
    assert model_init_device(env, "torch", tp=2) == env.device  # TP shards a built model
    assert model_init_device(env, "none") == env.device
