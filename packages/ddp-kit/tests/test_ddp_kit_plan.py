"""Bucket planning (pure: no process group) and the package's public surface."""

from __future__ import annotations

import math

import pytest
import torch

import ddp_kit
from ddp_kit.buckets import ParamInfo, per_parameter_plan, plan_buckets

CPU = torch.device("cpu")


def infos(*sizes: int, dtype: torch.dtype = torch.float32) -> list[ParamInfo]:
    return [
        ParamInfo(f"p{i}", n, torch.empty((), dtype=dtype).element_size(), dtype, CPU)
        for i, n in enumerate(sizes)
    ]


def test_reverse_order_and_cap() -> None:
    # 4-byte elements: sizes in bytes 40, 40, 40, 80; cap 100 bytes.
    plan = plan_buckets(infos(10, 10, 10, 20), cap_bytes=100)
    assert plan == [[3], [2, 1], [0]]  # p3 (80) alone: p2 would make 120 > 100


def test_param_larger_than_cap_travels_alone() -> None:
    plan = plan_buckets(infos(5, 1000, 5), cap_bytes=64)
    assert plan == [[2], [1], [0]]


def test_no_cap_is_one_bucket_and_zero_cap_one_per_parameter() -> None:
    assert plan_buckets(infos(3, 4, 5), cap_bytes=None) == [[2, 1, 0]]
    assert plan_buckets(infos(3, 4, 5), cap_bytes=0) == per_parameter_plan(3) == [[2], [1], [0]]


def test_dtypes_never_share_a_bucket() -> None:
    mixed = infos(4, 4) + infos(4, dtype=torch.float64) + infos(4)
    plan = plan_buckets(mixed, cap_bytes=None)
    assert sorted(map(sorted, plan)) == [[0, 1, 3], [2]]
    for bucket in plan:
        assert len({mixed[i].dtype for i in bucket}) == 1


def test_every_parameter_planned_once_and_caps_respected() -> None:
    gen = torch.Generator().manual_seed(0)
    sizes = torch.randint(1, 300, (57,), generator=gen).tolist()
    cap = 1000
    plan = plan_buckets(infos(*sizes), cap_bytes=cap)
    flat = [i for b in plan for i in b]
    assert sorted(flat) == list(range(len(sizes)))
    for b in plan:
        assert len(b) == 1 or sum(4 * sizes[i] for i in b) <= cap
        assert b == sorted(b, reverse=True)  # reverse registration order inside a bucket


@pytest.mark.parametrize("bad", [-1.0, math.nan])
def test_plan_rejects_bad_cap(bad: float) -> None:
    with pytest.raises(ValueError, match="cap_bytes"):
        plan_buckets(infos(1), cap_bytes=bad)


def test_public_exports() -> None:
    expected = {
        "NaiveDDP",
        "FlatDDP",
        "DDPIndividualParameters",
        "DDPBucketed",
        "DataParallelBase",
        "plan_buckets",
    }
    assert expected <= set(ddp_kit.__all__)
    for name in ddp_kit.__all__:
        assert getattr(ddp_kit, name) is not None
    assert isinstance(ddp_kit.__version__, str)
