"""Benchmarks and profiles for lm-core, flashattn-triton, ddp-kit and zero-shard: one command per
experiment, tables, CSV/JSON and plots.

Read top-down:

commands (`python -m perf_tools.<name>`, see COMMANDS; each a console script `perf-<name>`)
    bench, profile           model steps: `cells` (the sweep's cells, shared by both),
                             `model_args` (their flags), `bench_args` (bench's flags and
                             cells), `bench_dist` (bench on N ranks)
    train_loop               a real training run beside the bench step
    attention                attention calls (`attention_providers`); the naive sweep
                             (`attention_naive`)
    allreduce, ddp, zero     collectives and data parallelism on N ranks
    mixed_precision, accounting   calculations, no timing loop
the harness every timing command runs its cells through
    harness                  spec -> step -> time -> row, release between cells, failure
                             rows (OOM / unsupported / error), one progress bar
    _dist                    the same on N ranks: spawn or torchrun, collective timing
below it
    timing                   clocks, statistics, memory probes, OOM detection
    report                   tables, CSV/JSON with run metadata, plots
    steps, models            one training step of an lm_core model; building it
    flops, hardware          FLOP formulas (lm_core's, flashattn_triton's) and peak FLOP/s
    _cli, _progress, _compile   argument types, the progress bar, torch.compile settings
Nothing is imported eagerly: `import perf_tools` stays cheap.
"""

__version__ = "0.1.0"

# name -> what `python -m perf_tools.<name>` measures
COMMANDS: dict[str, str] = {
    "bench": "end-to-end model step timing: sizes x contexts x modes x precisions, MFU, memory",
    "profile": "kernel-level profile of a model step: top kernels, matmul split, named ranges",
    "attention": "attention benchmarks: naive eager vs compiled, flash vs PyTorch vs SDPA",
    "attention_sweep": "flash_attention vs SDPA flash / cuDNN over shapes, eager and compiled",
    "attention_features": "GQA, varlen, sliding-window and decode attention: ours vs SDPA",
    "mixed_precision": "accumulation precision and the dtypes inside autocast",
    "allreduce": "all-reduce latency and bandwidth over sizes and world sizes",
    "ddp": "data-parallel wrappers: step time and communication overhead",
    "zero": "optimizer-state sharding: memory and step time",
    "accounting": "memory and FLOP accounting of the models",
    "generate_bench": "decode tokens/s: KV-cache generation eager / compiled / CUDA graph vs HF",
    "plan": "predicted step time, communication and memory of DP, FSDP, TP and FSDP x TP",
    "train_loop": "a real lm_core.train run's tokens/s (data, logging, checkpoints) vs the bench",
}

__all__ = ["COMMANDS", "__version__"]
