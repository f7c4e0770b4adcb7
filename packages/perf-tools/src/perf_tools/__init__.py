"""Benchmarks and profiles for lm-core, flashattn-triton, ddp-kit and zero-shard: one command per
experiment, tables, CSV/JSON and plots.

Each command is a module run with `python -m perf_tools.<name>` (see COMMANDS); the shared
pieces are `timing` (timers, memory probes, OOM detection), `report` (tables, CSV/JSON, plots),
`hardware` (peak FLOP/s, MFU) and `flops` (the FLOP formulas). Nothing is imported eagerly:
`import perf_tools` stays cheap.
"""

__version__ = "0.1.0"

# name -> what `python -m perf_tools.<name>` measures
COMMANDS: dict[str, str] = {
    "bench": "end-to-end model step timing: sizes x contexts x modes x precisions, MFU, memory",
    "profile": "kernel-level profile of a model step: top kernels, matmul split, named ranges",
    "attention": "attention benchmarks: naive eager vs compiled, flash vs PyTorch vs SDPA",
    "attention_features": "GQA, varlen, sliding-window and decode attention: ours vs SDPA",
    "mixed_precision": "accumulation precision and the dtypes inside autocast",
    "allreduce": "all-reduce latency and bandwidth over sizes and world sizes",
    "ddp": "data-parallel wrappers: step time and communication overhead",
    "zero": "optimizer-state sharding: memory and step time",
    "accounting": "memory and FLOP accounting of the models",
    "generate_bench": "decode tokens/s: KV-cache generation eager / compiled / CUDA graph vs HF",
    "plan": "predicted step time, communication and memory of DP, FSDP, TP and FSDP x TP",
}

__all__ = ["COMMANDS", "__version__"]
