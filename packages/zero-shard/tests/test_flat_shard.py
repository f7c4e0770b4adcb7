"""FlatShard and flat_boxes without a process group: the boxes tile exactly a flat range, and
DCP (no-dist mode) reads any rank's flat shard of any world size out of a checkpoint of the
whole tensor."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from zero_shard import FlatShard
from zero_shard.flat_shard import flat_boxes

SHAPES = [(), (1,), (7,), (5, 7), (3, 1), (2, 3, 4), (4, 1, 3, 2)]


@pytest.mark.parametrize("shape", SHAPES)
def test_boxes_tile_every_flat_range(shape) -> None:
    numel = math.prod(shape)
    index = torch.arange(numel).view(shape)
    for start in range(numel + 1):
        for stop in range(start, numel + 1):
            covered = []
            for offsets, sizes in flat_boxes(shape, start, stop):
                box = index[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
                flat = box.reshape(-1)
                # each box is contiguous in flat order and follows the previous one
                assert torch.equal(flat, torch.arange(flat[0], flat[0] + flat.numel()))
                covered += flat.tolist()
            assert covered == list(range(start, stop)), (shape, start, stop)
            if len(shape) == 2:
                assert len(flat_boxes(shape, start, stop)) <= 3


def test_boxes_reject_a_range_outside_the_tensor() -> None:
    with pytest.raises(ValueError, match=r"flat range \[3, 36\) is outside"):
        flat_boxes((5, 7), 3, 36)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_any_rank_loads_its_shard_from_a_whole_tensor(tmp_path, world) -> None:
    torch.manual_seed(world)
    full = {"w": torch.randn(5, 7), "b": torch.randn(3), "c": torch.randn(2, 3, 4)}
    with warnings.catch_warnings():  # DCP warns that it runs in one process, as told
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(full, checkpoint_id=tmp_path, no_dist=True)
        for rank in range(world):
            state, expected = {}, {}
            for key, value in full.items():
                chunk = math.ceil(value.numel() / world)
                start = min(rank * chunk, value.numel())
                stop = min(start + chunk, value.numel())
                state[key] = FlatShard(torch.zeros(stop - start), value.shape, start)
                expected[key] = value.reshape(-1)[start:stop]
            dcp.load(state, checkpoint_id=tmp_path, no_dist=True)
            for key in full:
                assert torch.equal(state[key].local, expected[key]), (world, rank, key)


def test_a_flat_shard_refuses_tensor_ops() -> None:
    shard = FlatShard(torch.arange(4.0), (3, 3), 2)
    assert shard.shape == (3, 3)
    assert shard.dtype == torch.float32
    assert "elements [2, 6)" in repr(shard)
    with pytest.raises(NotImplementedError, match="checkpoint view"):
        shard + 1
    with pytest.raises(ValueError, match="local: expected a 1-D tensor"):
        FlatShard(torch.zeros(2, 2), (4,), 0)
