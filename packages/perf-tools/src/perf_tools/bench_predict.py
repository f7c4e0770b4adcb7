"""Predictions beside the measured rows of the multi-GPU bench: memory and step time.

`fsdp_memory_estimate`: bytes per GPU of a `--fsdp ours --fused-loss` training step (the
`est_peak_mem_gib` column; its docstring writes out the terms).

`planner_columns` (the `pred_*` columns of every train row) asks `perf_tools.plan_model.predict`
(the closed forms of `python -m perf_tools.plan`) for the configuration a row ran: DP over N
ranks (`--ddp`, the planner's "dp"), FSDP over N (`--fsdp`), TP over N (`--tp N`) or FSDP x TP
on the (N/K, K) mesh; the row's global batch in one micro-step, checkpointing of every block
when `--activation-checkpointing` is on, bf16 activations and communication (fp32 for
`--precision fp32`, and for DDP, whose buckets hold the fp32 gradients of the fp32 weights:
bf16 runs under autocast there). Hardware: the planner's preset of the GPU the ranks ran on
(memory, NVLink bandwidth), with the row's peak FLOP/s (the precision's, or `--peak-tflops`).
On a CPU or a GPU the planner has no preset for: none.

The planner computes at the peak (100% MFU) and counts no transient buffers, so the measured
step is slower and the measured memory higher by those; and it counts the embedding and LM
head as sharded under TP, where lm_core keeps them replicated (perf-tools
docs/distributed.md, plan).
"""

from __future__ import annotations

from typing import Any

GIB = 2**30


def planner_columns(
    config: Any,
    *,
    nprocs: int,
    tp: int,
    batch: int,
    context: int,
    precision: str,
    act_ckpt: str | int,
    gpu: str | None,
    peak_tflops: float | None,
    ddp: bool = False,
) -> dict[str, Any]:
    """`pred_step_ms` (communication overlapped), `pred_serial_ms` (not), `pred_compute_ms`,
    `pred_comm_ms`, `pred_mem_gib` (per GPU) for the row's configuration; {} when the GPU
    (`hardware.device_key` name, e.g. 'H100 SXM') is not one of the planner's presets.
    `batch` is per data-parallel group (N / tp of them); `ddp`: replicated data parallelism
    (tp 1)."""
    from dataclasses import replace

    from perf_tools.accounting import Dtypes, ModelDims
    from perf_tools.plan_model import HARDWARE, Layout, Workload, predict

    hw = next((h for h in HARDWARE.values() if h.name == gpu), None)
    if hw is None:
        return {}
    if peak_tflops is not None:
        hw = replace(hw, flops=peak_tflops * 1e12)
    dp = nprocs // tp
    if ddp:
        if tp != 1:
            raise ValueError(f"ddp: data parallelism over replicas has tp 1, got tp {tp}")
        layout = Layout("dp", nprocs, 1)
    elif tp == 1:
        layout = Layout("fsdp", nprocs, 1)
    elif dp == 1:
        layout = Layout("tp", 1, tp)
    else:
        layout = Layout("fsdp x tp", dp, tp)
    dims = ModelDims(
        "bench",
        config.d_model,
        config.d_ff,
        config.num_layers,
        config.vocab_size,
        config.num_heads,
    )
    dtypes = Dtypes() if precision == "bf16" else Dtypes(activation=4, comm=4)
    if ddp:
        dtypes = replace(dtypes, comm=4)
    work = Workload(dims, batch * dp * context, context, dtypes)
    row = predict(layout, work, hw, micro_batch=batch, ckpt=act_ckpt != "none")
    return {
        "pred_step_ms": row["step_overlap_ms"],
        "pred_serial_ms": row["step_serial_ms"],
        "pred_compute_ms": row["compute_ms"],
        "pred_comm_ms": row["comm_ms"],
        "pred_mem_gib": row["total_GB"] * 1e9 / GIB,
    }


def fsdp_memory_estimate(
    config: Any,
    *,
    world: int,
    batch: int,
    context: int,
    group_size: int,
    compute_bytes: int = 2,
) -> dict[str, float]:
    """Bytes per GPU of a training step of lm_core's model under zero_shard.FSDP, lm_core
    AdamW and the fused loss (`--fsdp ours --fused-loss --mode train`), batch per rank.

    P_s sharded parameters (every Linear / Embedding weight), P_r replicated (the norms),
    N ranks, b = `compute_bytes` (2 for bf16), a = batch * context * d_model * b (one block
    input), k = `group_size` blocks per checkpointed group (0: none):
      params  4 P_s / N + 4 P_r      fp32 shards and norms
      grads   4 P_s / N + 4 P_r      created during backward (None during forward)
      optim   8 P_s / N + 8 P_r      AdamW's two fp32 moments
      activations  (activation_memory(L, k, r) + 2) * a   stored block inputs and the last
                   group's activations (r = lm_core's single-dtype block ratio: no autocast
                   under FSDP), plus the final norm's input and output
      head    V D (b + 4 + b) + C V b + a   at the LM head, end of forward: the gathered
              weight, the fused loss's fp32 dW accumulator (b < 4) and its result in b bytes,
              one logits chunk of C = default_chunk_size rows, dh
    end_of_forward = params + optim + activations + head; end_of_backward = params + grads +
    optim + 3 V D b (the embedding gathered, its gradient, the reduce-scatter input); peak =
    their maximum, `upper_bound` = everything at once. Not counted: the CUDA context, NCCL
    buffers and allocator fragmentation (`peak_reserved_gib` shows the latter).
    """
    from lm_core.activation_ckpt import activation_memory, block_activation_ratio
    from lm_core.fused_loss import default_chunk_size

    d, f, n_layers, vocab = config.d_model, config.d_ff, config.num_layers, config.vocab_size
    replicated = 2 * d * n_layers + d
    sharded = 2 * vocab * d + n_layers * (4 * d * d + 3 * d * f)
    b = compute_bytes
    params = 4 * sharded / world + 4 * replicated
    grads = params
    optim = 2 * params
    a = batch * context * d * b
    stored = activation_memory(n_layers, group_size, block_activation_ratio(config))
    activations = (stored + 2) * a
    tokens = batch * context
    head = vocab * d * (b + (4 if b < 4 else 0) + b)
    head += default_chunk_size(tokens, d, vocab) * vocab * b + a
    end_fwd = params + optim + activations + head
    end_bwd = params + grads + optim + 3 * vocab * d * b
    return {
        "params": params,
        "grads": grads,
        "optim": optim,
        "activations": activations,
        "head": head,
        "end_of_forward": end_fwd,
        "end_of_backward": end_bwd,
        "peak": max(end_fwd, end_bwd),
        "upper_bound": params + grads + optim + activations + head,
    }
