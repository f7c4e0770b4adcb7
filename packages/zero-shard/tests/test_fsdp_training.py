"""FSDP on 2 ranks matches single-process training (gloo here, NCCL on 2 GPUs).

The ranks are spawned once per module (zs_harness.Pools); each test runs a scenario from
fsdp_scenarios on them, which asserts inside every rank.
"""

from __future__ import annotations

import importlib.util

import fsdp_scenarios as sc
import pytest
from zs_harness import BACKENDS, Pools


@pytest.fixture(scope="module")
def ranks():
    pools = Pools()
    yield pools
    pools.close()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_fp32_matches_single_process(backend: str, opt_name: str, ranks) -> None:
    ranks.run(sc.scenario_matches_fp32, opt_name, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_bf16_within_twice_a_bf16_baseline(backend: str, opt_name: str, ranks) -> None:
    ranks.run(sc.scenario_matches_bf16, opt_name, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_compute_fp32_reduce(backend: str, ranks) -> None:
    ranks.run(sc.scenario_reduce_dtype_fp32, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fallback_collectives(backend: str, ranks) -> None:
    ranks.run(sc.scenario_fallback_collectives, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gathered_just_in_time_and_freed(backend: str, ranks) -> None:
    ranks.run(sc.scenario_gather_schedule, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gather_wait_timing(backend: str, ranks) -> None:
    ranks.run(sc.scenario_gather_waits, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_order_other_than_registration(backend: str, ranks) -> None:
    ranks.run(sc.scenario_order_changes, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["none", "bfloat16"])
def test_activation_checkpointing(backend: str, dtype: str, ranks) -> None:
    ranks.run(sc.scenario_checkpointed_blocks, dtype, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_load_full_params_and_accumulation(backend: str, ranks) -> None:
    ranks.run(sc.scenario_load_and_accumulate, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_lm_core_transformer(backend: str, ranks) -> None:
    # lm_core is another package of this repo, not a dependency of zero-shard: tested where
    # it is installed (the nccl session puts every package on the path).
    if importlib.util.find_spec("lm_core") is None:
        pytest.skip("lm_core is not installed")
    ranks.run(sc.scenario_lm_core, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_errors_with_a_process_group(backend: str, ranks) -> None:
    ranks.run(sc.scenario_errors, backend=backend)
