"""Data-parallel wrappers (naive, flat, per-parameter overlap, bucketed overlap) on
torch.distributed.

    from ddp_kit import DDPBucketed
    model = DDPBucketed(model, bucket_size_mb=25)   # collective: every rank
    loss.backward()
    model.finish_gradient_synchronization()         # collective: every rank
    optimizer.step()

Ranks with different numbers of batches: train inside
`torch.distributed.algorithms.Join([model])` (every wrapper is a torch `Joinable`).

See `ddp_kit.wrappers` for the four strategies, `ddp_kit.base` for the shared contract and
`ddp_kit.launch.spawn` to run a function in N local processes.
"""

from ddp_kit._comm import CollectiveError
from ddp_kit.base import DataParallelBase
from ddp_kit.buckets import plan_buckets
from ddp_kit.wrappers import DDPBucketed, DDPIndividualParameters, FlatDDP, NaiveDDP

__version__ = "0.1.0"

__all__ = [
    "CollectiveError",
    "DDPBucketed",
    "DDPIndividualParameters",
    "DataParallelBase",
    "FlatDDP",
    "NaiveDDP",
    "plan_buckets",
]
