"""ShardedOptimizer on 2 ranks matches the unsharded optimizer (gloo here, NCCL on 2 GPUs).

The ranks are spawned once per module (zs_harness.Pools) and each test runs a scenario from
zs_scenarios on them; the scenario asserts inside every rank and the harness fails the test
with the rank's traceback.
"""

from __future__ import annotations

import importlib.util

import pytest
import zs_scenarios as sc
from zs_harness import BACKENDS, Pools

OPTIMIZERS = ["sgd", "adamw", "lm_adamw"]


@pytest.fixture(scope="module")
def ranks():
    pools = Pools()
    yield pools
    pools.close()


def _need(opt_name: str) -> None:
    # lm_core is another package of this repo, not a dependency of zero-shard: its AdamW is
    # tested where it is installed (the nccl session puts every package on the path).
    if opt_name == "lm_adamw":
        lm_core = pytest.importorskip("lm_core")
        if not hasattr(lm_core, "AdamW"):
            pytest.skip("lm_core has no AdamW yet")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("opt_name", OPTIMIZERS)
def test_matches_unsharded_optimizer(backend: str, opt_name: str, ranks) -> None:
    _need(opt_name)
    ranks.run(sc.scenario_matches_reference, opt_name, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rank_with_empty_shard(backend: str, ranks) -> None:
    ranks.run(sc.scenario_one_tensor, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_param_group_added_mid_run(backend: str, opt_name: str, ranks) -> None:
    ranks.run(sc.scenario_add_group_midrun, opt_name, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_params_broadcast_from_rank0_without_wrapper(backend: str, ranks) -> None:
    ranks.run(sc.scenario_broadcast_at_construction, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_lr_changes_reach_the_shards(backend: str, ranks) -> None:
    ranks.run(sc.scenario_lr_changes, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_save_resume_equals_uninterrupted(backend: str, opt_name: str, tmp_path, ranks) -> None:
    ranks.run(sc.scenario_save_resume, opt_name, str(tmp_path), backend=backend)
    # The same checkpoint resumes under another world size (1 rank) exactly as a plain
    # optimizer loaded from it does.
    ranks.run(sc.scenario_other_world_size, opt_name, str(tmp_path), world_size=1, backend=backend)


WRAPPERS = ["torch-ddp", "NaiveDDP", "FlatDDP", "DDPIndividualParameters", "DDPBucketed"]


def _ddp_kit_has(name: str) -> bool:
    if name == "torch-ddp":
        return True
    if importlib.util.find_spec("ddp_kit") is None:
        return False
    return hasattr(importlib.import_module("ddp_kit"), name)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_under_data_parallel_wrappers(backend: str, wrapper: str, ranks) -> None:
    if not _ddp_kit_has(wrapper):
        pytest.skip(f"ddp_kit.{wrapper} is not available yet")
    ranks.run(sc.scenario_under_wrapper, wrapper, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_errors_with_a_process_group(backend: str, ranks) -> None:
    ranks.run(sc.scenario_errors, backend=backend)
