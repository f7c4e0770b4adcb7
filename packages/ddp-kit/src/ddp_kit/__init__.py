"""Data-parallel wrappers (naive, flat, per-parameter overlap, bucketed overlap) on
torch.distributed.
"""

__version__ = "0.1.0"
