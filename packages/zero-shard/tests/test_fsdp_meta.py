"""FSDP over a module built on the meta device (2 gloo ranks; NCCL on 2 GPUs): sharded
initialization bitwise equal to the full build for a seed; the argument checks that need no
process group."""

from __future__ import annotations

import importlib.util
import re

import fsdp_init_scenarios as sc
import pytest
import torch
from fsdp_scenarios import ToyLM
from torch import nn
from zs_harness import BACKENDS, Pools

from zero_shard import FSDP


@pytest.fixture(scope="module")
def ranks():
    pools = Pools()
    yield pools
    pools.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_meta_build_equals_full_build(backend: str, ranks) -> None:
    ranks.run(sc.scenario_meta_equals_full_build, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_meta_tied_weight_and_init_roots(backend: str, ranks) -> None:
    ranks.run(sc.scenario_meta_tied_and_roots, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_meta_lm_core_transformer(backend: str, ranks) -> None:
    if importlib.util.find_spec("lm_core") is None:
        pytest.skip("lm_core is not installed")
    ranks.run(sc.scenario_meta_lm_core, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_meta_init_fn_and_errors(backend: str, ranks) -> None:
    ranks.run(sc.scenario_meta_init_fn_and_errors, backend=backend)


def test_partly_meta_module_is_refused() -> None:
    model = ToyLM()
    with torch.device("meta"):
        model.head = nn.Linear(16, 29)
    with pytest.raises(ValueError, match=re.escape("'head.weight' is on the meta device but")):
        FSDP(model)


def test_init_fn_checks() -> None:
    with torch.device("meta"):
        model = ToyLM()
    with pytest.raises(TypeError, match="init_fn: expected a callable"):
        FSDP(model, init_fn="normal")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="init_fn: only initializes a module built on the meta"):
        FSDP(ToyLM(), init_fn=lambda m: None)
