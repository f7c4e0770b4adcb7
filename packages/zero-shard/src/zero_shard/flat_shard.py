"""`FlatShard`: a rank's flat shard of a tensor as torch.distributed.checkpoint (DCP) sees it.

zero_shard's FSDP keeps, of a parameter of `numel` elements, elements `[r * chunk, (r + 1) *
chunk)` of the flattened parameter on rank r (`shard.py`). That is `torch.chunk` of the
*flattened* parameter, so a DTensor could describe it only as a 1-D tensor of `numel`
elements, not in the parameter's shape: a checkpoint written that way would hold `(numel,)`
tensors that load neither into a plain model nor into torch's `fully_shard`. Instead a
`FlatShard` names the parameter's own shape as its global shape and lists the rectangular
boxes that tile its flat range: a range of a row-major `(R, C)` tensor is at most a partial
row, a block of whole rows and another partial row (`flat_boxes`; any rank similarly). Each
box is a view of the shard, so DCP writes this rank's boxes in parallel with the other ranks'
and loads into them in place, and its planner reads each box from whatever boxes (or whole
tensors, or DTensor shards) overlap it in a checkpoint of any layout and world size.

It plugs into DCP through the extension protocol DTensor itself implements
(`__create_write_items__`, `__create_chunk_list__`, `__get_tensor_shard__`; see torch's
`torch.distributed._checkpointable`). A `FlatShard` is a tensor subclass for DCP's benefit
only: it carries no operators (any torch op on it raises); read its data with `.local`.
Not for `dcp.async_save` (its staging copies tensors with torch ops).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) in the full tensor


def flat_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """Rectangular boxes, in flat order, that exactly cover elements `[start, stop)` of a
    row-major tensor of `shape` flattened. A 0-d tensor is one box `((), ())`."""
    shape = tuple(int(s) for s in shape)
    if not 0 <= start <= stop <= math.prod(shape):
        raise ValueError(f"flat range [{start}, {stop}) is outside a tensor of shape {shape}")
    if start == stop:
        return []
    if not shape:
        return [((), ())]
    if len(shape) == 1:
        return [((start,), (stop - start,))]
    inner = math.prod(shape[1:])  # elements per index of dim 0
    boxes: list[Box] = []
    row = start // inner
    if start % inner:  # a partial first row
        end = min(stop, (row + 1) * inner)
        boxes += _in_row(shape, row, start - row * inner, end - row * inner)
        start, row = end, row + 1
    whole = stop // inner - row  # whole rows next
    if whole > 0:
        boxes.append(((row, *[0] * (len(shape) - 1)), (whole, *shape[1:])))
        start, row = start + whole * inner, row + whole
    if start < stop:  # a partial last row
        boxes += _in_row(shape, row, 0, stop - row * inner)
    return boxes


def _in_row(shape: tuple[int, ...], row: int, start: int, stop: int) -> list[Box]:
    return [((row, *o), (1, *s)) for o, s in flat_boxes(shape[1:], start, stop)]


def _box_start(shape: Sequence[int], offsets: Sequence[int]) -> int:
    """Flat index of a box's first element."""
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    return sum(o * s for o, s in zip(offsets, strides))


class FlatShard(torch.Tensor):
    """Elements `[start, start + local.numel())` of a flattened tensor of `shape`, held by
    `local` (1-D), as DCP's view of a tensor of `shape` of which this rank has those boxes.

    Attributes: `local` (the data; writes to it are what DCP loads into), `start`.
    """

    local: torch.Tensor
    start: int

    @staticmethod
    def __new__(cls, local: torch.Tensor, shape: Sequence[int], start: int) -> FlatShard:
        if local.dim() != 1:
            raise ValueError(f"local: expected a 1-D tensor, got shape {tuple(local.shape)}")
        shape = torch.Size(shape)
        self = torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=local.dtype, device=local.device, requires_grad=False
        )
        self.local = local
        self.start = int(start)
        self._pieces = []  # (offsets, sizes, view of local)
        for offsets, sizes in flat_boxes(shape, self.start, self.start + local.numel()):
            a = _box_start(shape, offsets) - self.start
            view = local[a : a + math.prod(sizes)].view(sizes)
            self._pieces.append((torch.Size(offsets), torch.Size(sizes), view))
        return self

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        raise NotImplementedError(
            f"{func}: a FlatShard is a checkpoint view, not a tensor to compute with; "
            "use its .local data"
        )

    def __repr__(self) -> str:  # type: ignore[override]
        stop = self.start + self.local.numel()
        return (
            f"FlatShard(shape={tuple(self.shape)}, elements [{self.start}, {stop}) of the "
            f"flattened tensor, dtype={self.dtype}, device={self.device})"
        )

    # ----- torch.distributed.checkpoint's extension protocol (as DTensor's) -----------------
    def __create_write_items__(self, fqn: str, obj: object) -> list[Any]:
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata,
            MetadataIndex,
            TensorProperties,
        )
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                    properties=TensorProperties.create_from_tensor(view),
                    size=self.shape,
                ),
            )
            for offsets, sizes, view in self._pieces
        ]

    def __create_chunk_list__(self) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=o, sizes=s) for o, s, _ in self._pieces]

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        for offsets, _, view in self._pieces:
            if offsets == index.offset:
                return view
        raise ValueError(f"{index.fqn}: this rank holds no box at offsets {index.offset}")
