"""Sharded data parallelism for any torch.optim.Optimizer. Depends on torch only.

`ShardedOptimizer(params, optimizer_cls, process_group=None, **kwargs)` (ZeRO stage 1) keeps
the state of `optimizer_cls` only for this rank's shard of the parameters and broadcasts
updated parameters from their owners after each step.

`FSDP(module, compute_dtype=None, shard_module_types=None, process_group=None)` (ZeRO
stage 3) keeps only this rank's fp32 shard of every Linear/Embedding weight, gathers weights
just in time for forward and backward and reduce-scatters their gradients; it materializes a
module built on the meta device shard by shard, and accumulates without communication under
`no_sync()`.

Sharded checkpoints through torch.distributed.checkpoint: `FSDP.sharded_state_dict()`,
`FSDP.sharded_optimizer_state_dict(opt)` and `ShardedOptimizer.sharded_state_dict(names)` give
each rank's own part (`FlatShard`s of the shards in the parameters' full shapes), so every
rank writes in parallel and a checkpoint loads at any world size; `load_*` take them back.
"""

from zero_shard._comm import CollectiveError
from zero_shard.flat_shard import FlatShard
from zero_shard.fsdp import FSDP
from zero_shard.optimizer import ShardedOptimizer
from zero_shard.partition import greedy_partition

__all__ = ["FSDP", "CollectiveError", "FlatShard", "ShardedOptimizer", "greedy_partition"]
__version__ = "0.1.0"
