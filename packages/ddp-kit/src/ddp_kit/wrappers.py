"""The four data-parallel wrappers: one engine (`DataParallelBase`), four bucket strategies.

| wrapper                   | collectives per step        | sent                         |
|---------------------------|-----------------------------|------------------------------|
| NaiveDDP                  | one per parameter           | after backward               |
| FlatDDP                   | one per (device, dtype)     | after backward               |
| DDPIndividualParameters   | one per parameter           | during backward, when ready  |
| DDPBucketed               | one per <= bucket_size_mb   | during backward, when full   |

All are used the same way (every rank runs this loop; see the package README):

    model = DDPBucketed(model, bucket_size_mb=25)
    loss_fn(model(x), y).backward()
    model.finish_gradient_synchronization()
    optimizer.step()
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import torch
from torch import nn

from ddp_kit._checks import ProcessGroup, validate_bucket_size
from ddp_kit.base import DataParallelBase
from ddp_kit.buckets import MIB, ParamInfo, per_parameter_plan, plan_buckets

__all__ = ["DDPBucketed", "DDPIndividualParameters", "FlatDDP", "NaiveDDP"]


class NaiveDDP(DataParallelBase):
    """All-reduce every parameter's gradient, one call each, after backward.

    The simplest scheme and the slowest: nothing overlaps the backward pass and every
    parameter pays the per-call latency. Collective: see `DataParallelBase`.
    """

    _overlap = False

    def _plan(self, infos: Sequence[ParamInfo]) -> list[list[int]]:
        return per_parameter_plan(len(infos))


class FlatDDP(DataParallelBase):
    """One all-reduce of all gradients flattened together (one per device/dtype), after backward.

    Pays the per-call latency once, but still waits for the whole backward before sending.
    Gradients live as views of the flat buffer, so there is no flatten/unflatten copy per step.
    """

    _overlap = False

    def _plan(self, infos: Sequence[ParamInfo]) -> list[list[int]]:
        return plan_buckets(infos, cap_bytes=None)


class DDPIndividualParameters(DataParallelBase):
    """Asynchronous all-reduce of each parameter's gradient as soon as backward produces it.

    Overlaps communication with the rest of backward; pays the per-call latency per
    parameter. Only the last parameters' reductions remain after backward ends.
    """

    _overlap = True

    def _plan(self, infos: Sequence[ParamInfo]) -> list[list[int]]:
        return per_parameter_plan(len(infos))


class DDPBucketed(DataParallelBase):
    """Gradients grouped into buckets of at most `bucket_size_mb` MiB, each all-reduced
    asynchronously as soon as its last gradient arrives.

    Buckets are filled in reverse parameter order (the order backward produces gradients),
    one dtype per bucket; a parameter larger than the cap travels alone. Each bucket's buffer
    is allocated once, and gradients are views into it (no copy back after the reduction).

    Args:
        module, process_group, find_unused_parameters, timeout, reduce_dtype: see
            `DataParallelBase`.
        bucket_size_mb: cap per bucket in MiB (2**20 bytes), a positive finite number.
    """

    _overlap = True

    def __init__(
        self,
        module: nn.Module,
        bucket_size_mb: float = 25.0,
        *,
        process_group: ProcessGroup | None = None,
        find_unused_parameters: bool = False,
        timeout: float | datetime.timedelta | None = None,
        reduce_dtype: torch.dtype | None = None,
    ) -> None:
        self.bucket_size_mb = validate_bucket_size(bucket_size_mb)
        super().__init__(
            module,
            process_group=process_group,
            find_unused_parameters=find_unused_parameters,
            timeout=timeout,
            reduce_dtype=reduce_dtype,
        )

    def _plan(self, infos: Sequence[ParamInfo]) -> list[list[int]]:
        return plan_buckets(infos, cap_bytes=self.bucket_size_mb * MIB)
