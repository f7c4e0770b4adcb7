"""Sharded checkpoints (torch.distributed.checkpoint) of FSDP and ShardedOptimizer: saved at
one world size, loaded at another (2 -> 4; 2 -> 1 and 1 -> 2 with the single process a plain
model and torch AdamW without any process group, through torch's get/set_state_dict), the full
states equal what was saved, bitwise; a resume at the same world size continues bitwise as the
uninterrupted run. gloo ranks (zs_harness.Pools), at most one 2-rank and one 4-rank pool."""

from __future__ import annotations

import dcp_scenarios as sc
import pytest
import torch
from zs_harness import Pools

TIMEOUT = 60.0  # seconds per task: a hung collective fails the test instead of blocking CI


@pytest.fixture(scope="module")
def ranks():
    pools = Pools()
    yield pools
    pools.close()


def _no_dist_load_equals_saved(path: str) -> None:
    """A plain ToyLM + torch AdamW in this process (no process group) loads the checkpoint
    through torch's get_state_dict/set_state_dict; everything equals the saved full state."""
    torch.set_num_threads(1)
    model, opt = sc.plain_load(path)
    ref = torch.load(f"{path}.ref.pt", weights_only=True)
    sc.assert_states_equal(model.state_dict(), ref["model"], "plain model")
    names = sc.names_of(model)
    state = {names[i]: e for i, e in opt.state_dict()["state"].items()}
    sc.assert_states_equal(state, ref["optim"], "plain optimizer")


@pytest.fixture(scope="module")
def single_process_checkpoint(tmp_path_factory) -> str:
    """Saved by one process without a process group (a plain model, torch AdamW)."""
    path = str(tmp_path_factory.mktemp("plain") / "one")
    torch.set_num_threads(1)
    sc.plain_save(path)
    return path


def test_fsdp_checkpoint_loads_at_other_world_sizes(
    ranks, tmp_path, single_process_checkpoint
) -> None:
    two = str(tmp_path / "two")
    ranks.run(sc.scenario_fsdp_save, two, world_size=2, timeout=TIMEOUT)
    ranks.run(sc.scenario_fsdp_load, two, world_size=4, timeout=TIMEOUT)
    _no_dist_load_equals_saved(two)
    ranks.run(sc.scenario_fsdp_load, single_process_checkpoint, world_size=2, timeout=TIMEOUT)


def test_sharded_optimizer_checkpoint_loads_at_other_world_sizes(
    ranks, tmp_path, single_process_checkpoint
) -> None:
    two = str(tmp_path / "two")
    ranks.run(sc.scenario_zero_save, two, world_size=2, timeout=TIMEOUT)
    ranks.run(sc.scenario_zero_load, two, world_size=4, timeout=TIMEOUT)
    _no_dist_load_equals_saved(two)
    ranks.run(sc.scenario_zero_load, single_process_checkpoint, world_size=2, timeout=TIMEOUT)
    # the layouts agree: FSDP's flat shards load into a replicated model + ShardedOptimizer
    fsdp = str(tmp_path / "fsdp")
    ranks.run(sc.scenario_fsdp_save, fsdp, world_size=2, timeout=TIMEOUT)
    ranks.run(sc.scenario_fsdp_into_zero, fsdp, world_size=4, timeout=TIMEOUT)


def test_resume_at_the_same_world_size_is_bitwise(ranks, tmp_path) -> None:
    ranks.run(sc.scenario_fsdp_resume, str(tmp_path / "fsdp"), world_size=2, timeout=TIMEOUT)
    ranks.run(sc.scenario_zero_resume, str(tmp_path / "zero"), world_size=2, timeout=TIMEOUT)
