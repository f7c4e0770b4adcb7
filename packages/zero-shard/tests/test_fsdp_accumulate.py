"""FSDP without a reduce-scatter per micro-batch (`no_sync()`, `set_requires_gradient_sync`)
and without a re-gather per backward (`reshard_after_forward=False`), on 2 gloo ranks
(NCCL on 2 GPUs)."""

from __future__ import annotations

import fsdp_sync_scenarios as sc
import pytest
from zs_harness import BACKENDS, Pools


@pytest.fixture(scope="module")
def ranks():
    pools = Pools()
    yield pools
    pools.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_sync_equals_one_big_batch(backend: str, ranks) -> None:
    ranks.run(sc.scenario_no_sync_equals_big_batch, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_sync_rules(backend: str, ranks) -> None:
    ranks.run(sc.scenario_no_sync_rules, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("remat", [0, 2])
def test_reshard_after_forward_false(backend: str, remat: int, ranks) -> None:
    ranks.run(sc.scenario_keep_gathered, remat, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_keep_gathered_with_no_sync(backend: str, ranks) -> None:
    ranks.run(sc.scenario_keep_gathered_no_sync, backend=backend)
