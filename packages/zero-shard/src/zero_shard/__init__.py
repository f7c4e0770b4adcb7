"""Optimizer-state sharding (ZeRO stage 1) for any torch.optim.Optimizer.

`ShardedOptimizer(params, optimizer_cls, process_group=None, **kwargs)` keeps the state of
`optimizer_cls` only for this rank's shard of the parameters and broadcasts updated
parameters from their owners after each step. Depends on torch only.
"""

from zero_shard.optimizer import ShardedOptimizer
from zero_shard.partition import greedy_partition

__all__ = ["ShardedOptimizer", "greedy_partition"]
__version__ = "0.1.0"
