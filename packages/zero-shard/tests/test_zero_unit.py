"""Single-process checks: the partition rule and the errors raised before any communication."""

from __future__ import annotations

import datetime
import math
import random

import pytest
import torch
import torch.distributed as dist

from zero_shard import ShardedOptimizer, greedy_partition


def _brute_force_best(numels: list[int], world: int) -> int:
    """The smallest possible largest load, by trying every assignment (small inputs only)."""
    best = sum(numels)
    for code in range(world ** len(numels)):
        loads = [0] * world
        for n in numels:
            loads[code % world] += n
            code //= world
        best = min(best, max(loads))
    return best


def test_greedy_partition_is_balanced_and_deterministic() -> None:
    rng = random.Random(0)
    for _ in range(200):
        world = rng.randint(1, 3)
        numels = [rng.choice([0, 1, 7, 64, 1000, 4096]) for _ in range(rng.randint(0, 7))]
        loads = [0] * world
        owners = greedy_partition(numels, loads)
        assert owners == greedy_partition(numels, [0] * world)  # same answer every time
        assert all(0 <= o < world for o in owners)
        assert loads == [sum(n for n, o in zip(numels, owners) if o == r) for r in range(world)]
        # LPT guarantee: within 4/3 of the optimum.
        assert 3 * max(loads) <= 4 * _brute_force_best(numels, world)


def test_greedy_partition_largest_first_with_carried_loads() -> None:
    loads = [0, 0]
    assert greedy_partition([10, 30, 20], loads) == [1, 0, 1]  # 30 -> r0, 20 -> r1, 10 -> r1
    assert loads == [30, 30]
    # A later group goes to the lighter rank first; earlier ones never move.
    assert greedy_partition([5], loads) == [0]
    assert loads == [35, 30]
    # More ranks than tensors: the extra ranks own nothing.
    loads = [0, 0, 0]
    assert greedy_partition([4], loads) == [0]
    assert loads == [4, 0, 0]


def test_greedy_partition_needs_a_rank() -> None:
    with pytest.raises(ValueError, match="loads"):
        greedy_partition([1], [])


class NotAnOptimizer:
    pass


@pytest.mark.parametrize(
    "cls", [NotAnOptimizer, torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1), "SGD"]
)
def test_optimizer_cls_must_be_an_optimizer_subclass(cls) -> None:
    with pytest.raises(TypeError, match="optimizer_cls: expected a subclass"):
        ShardedOptimizer([torch.nn.Parameter(torch.ones(2))], cls, lr=0.1)


def test_empty_params() -> None:
    with pytest.raises(ValueError, match="params: got an empty parameter list"):
        ShardedOptimizer([], torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="empty parameter list"):
        ShardedOptimizer(iter(()), torch.optim.SGD, lr=0.1)


def test_bucket_cap_must_be_positive() -> None:
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        ShardedOptimizer([torch.nn.Parameter(torch.ones(2))], torch.optim.SGD, bucket_cap_mb=0)


def test_needs_an_initialized_process_group() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        ShardedOptimizer([torch.nn.Parameter(torch.ones(2))], torch.optim.SGD, lr=0.1)


def test_param_sync_must_be_known() -> None:
    with pytest.raises(ValueError, match="param_sync: expected 'broadcast' or 'allgather'"):
        ShardedOptimizer([torch.nn.Parameter(torch.ones(2))], torch.optim.SGD, param_sync="ring")


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
    with pytest.raises(exc, match="ShardedOptimizer: timeout: expected"):
        ShardedOptimizer([torch.nn.Parameter(torch.ones(2))], torch.optim.SGD, timeout=bad)
