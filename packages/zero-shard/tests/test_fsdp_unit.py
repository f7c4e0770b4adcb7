"""FSDP argument checks that fail before any communication (no process group needed), and
the package's public exports."""

from __future__ import annotations

import datetime
import math
import re

import pytest
import torch
import torch.distributed as dist
from fsdp_scenarios import ToyLM
from torch import nn

import zero_shard
from zero_shard import FSDP


def test_public_exports() -> None:
    assert set(zero_shard.__all__) == {
        "CollectiveError",
        "FSDP",
        "FlatShard",
        "ShardedOptimizer",
        "greedy_partition",
    }
    for name in zero_shard.__all__:
        assert getattr(zero_shard, name) is not None


def test_needs_an_initialized_process_group() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"process_group: .*init_process_group"):
        FSDP(ToyLM())


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, "bfloat16", torch.bfloat16.itemsize])
def test_compute_dtype_must_be_floating(dtype) -> None:
    with pytest.raises(
        TypeError, match=re.escape("compute_dtype: expected a floating torch.dtype")
    ):
        FSDP(ToyLM(), compute_dtype=dtype)


def test_reduce_dtype_must_be_floating() -> None:
    with pytest.raises(TypeError, match=re.escape("reduce_dtype: expected a floating torch.dtype")):
        FSDP(ToyLM(), reduce_dtype=torch.int64)


@pytest.mark.parametrize("types", [["Linear"], [int], [nn.Linear, nn.Linear(2, 2)], []])
def test_shard_module_types_must_be_module_classes(types) -> None:
    with pytest.raises(
        TypeError, match=re.escape("shard_module_types: expected nn.Module subclasses")
    ):
        FSDP(ToyLM(), shard_module_types=types)


def test_module_without_shardable_parameters() -> None:
    with pytest.raises(ValueError, match=r"module: no parameter to shard.*shard_module_types"):
        FSDP(nn.Sequential(nn.LayerNorm(4), nn.ReLU()))
    with pytest.raises(ValueError, match=r"no module of shard_module_types \(Conv1d\)"):
        FSDP(ToyLM(), shard_module_types=nn.Conv1d)


def test_module_must_be_a_module() -> None:
    with pytest.raises(TypeError, match=re.escape("module: expected a torch.nn.Module")):
        FSDP(lambda x: x)  # type: ignore[arg-type]


def test_units_must_be_disjoint_submodules() -> None:
    model = ToyLM()
    with pytest.raises(ValueError, match="units: every entry must be a submodule"):
        FSDP(model, units=[nn.Linear(2, 2)])
    with pytest.raises(ValueError, match=re.escape("units: 'layers' contains 'layers.0'")):
        FSDP(model, units=[model.layers, model.layers[0]])


def test_mixed_dtypes_need_a_compute_dtype() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).double())
    with pytest.raises(ValueError, match="compute_dtype: the sharded parameters have several"):
        FSDP(model)


@pytest.mark.parametrize(
    ("bad", "exc"),
    [
        (0, ValueError),
        (-1.0, ValueError),
        (math.nan, ValueError),
        (math.inf, ValueError),
        (datetime.timedelta(0), ValueError),
        ("5", TypeError),
        (True, TypeError),
    ],
)
def test_timeout_must_be_a_positive_duration(bad: object, exc: type) -> None:
    with pytest.raises(exc, match="FSDP: timeout: expected"):
        FSDP(ToyLM(), timeout=bad)
