"""Benchmarks and profiles for lm-core, flashattn-triton, ddp-kit and zero-shard: one command per
experiment, tables, CSV/JSON and plots.
"""

__version__ = "0.1.0"
