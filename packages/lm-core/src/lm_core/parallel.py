"""Tensor parallelism for a built `TransformerLM`, on torch's DTensor engine, beside the model.

`apply_tensor_parallel(model, tp_mesh)` shards every block over a 1-D `DeviceMesh` of N ranks
with `torch.distributed.tensor.parallel.parallelize_module` (Megatron-LM's layout):

- attention by heads: the q/k/v projection `qkv_proj` column-parallel (`ColwiseParallel`:
  weight rows sharded, output features sharded), so a rank computes q, k and v of H / N heads
  and attends over them alone; the output projection row-parallel (`RowwiseParallel`: weight
  columns sharded, partial outputs summed by one all-reduce);
- the SwiGLU as the handout's FFN: w1 and w3 (`w13`) column-parallel, w2 row-parallel, one
  all-reduce of the block's output;
- `sequence_parallel=True`: between the sharded matmuls the residual stream is split along the
  sequence (Korthikanti et al. 2022): the norms run on T / N tokens (`SequenceParallel`), each
  all-reduce becomes a reduce-scatter, and an all-gather brings the full sequence back before
  each sharded matmul. Same communication volume, 1/N of the norms' work and activations.
  The sequence length must divide by N.

Per block and step that is 2 all-reduces of (B, T, D) activations in the forward (one after
attention, one after the FFN) and 2 in the backward (the inputs' gradients of the two
column-parallel layers).

The token embedding, the final norm and the LM head stay plain replicated tensors: every rank
computes them in full on the same inputs (the fused LM head + cross-entropy,
`model(x, targets)`, needs the whole head weight), and their gradients come out equal on every
rank without communication.

Fused weights. `qkv_proj.weight` stacks q, k, v (3 D, D) and `w13.weight` stacks w1, w3
(2 F, D); a contiguous 1/N of those rows would give a rank all of q and none of v. So before
sharding, the rows are reordered rank-major (`to_tp_layout`): rank r's contiguous block holds
its heads' q, k, v rows (its columns of w1, then of w3), and the model's forward (`view` with
-1 heads) sees its local heads. The DTensors of those two weights therefore hold the rows in
that order; `from_tp_layout` converts a gathered state dict back to the layout of
single-process training (lm_core's trainer does it for every checkpoint).

Composition (torchtitan's `parallelize` order): tensor parallelism first, then activation
checkpointing, then `torch.compile`, then `fully_shard(..., mesh=mesh["dp"])` on the other axis
of a 2-D ("dp", "tp") mesh (`make_mesh`). `lm_core.tp_engine` does all four for the trainer.
Needs torch >= 2.5 (public `torch.distributed.tensor`).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from lm_core.config import ModelConfig

__all__ = [
    "apply_tensor_parallel",
    "check_tensor_parallel",
    "from_tp_layout",
    "make_mesh",
    "tensor_parallel_degree",
    "to_tp_layout",
]

# state-dict key -> number of stacked row blocks in the fused weight
_FUSED = (
    (re.compile(r"(^|\.)attn\.qkv_proj\.weight$"), 3),  # q, k, v
    (re.compile(r"(^|\.)ffn\.w13\.weight$"), 2),  # w1, w3
)
_TP_ATTR = "_lm_core_tensor_parallel"  # (degree, sequence_parallel) on a parallelized model


def _tp_api() -> Any:
    """torch.distributed.tensor (DTensor) and its parallel styles, or an ImportError saying why."""
    try:
        import torch.distributed.tensor as dt
        import torch.distributed.tensor.parallel as tp
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    except ImportError as exc:
        raise ImportError(
            f"tensor parallelism needs torch.distributed.tensor (torch >= 2.5); this is torch "
            f"{torch.__version__}"
        ) from exc
    return dt, tp, DeviceMesh, init_device_mesh


def check_tensor_parallel(
    config: ModelConfig, tp: int, *, sequence_parallel: bool = False, seq_len: int | None = None
) -> None:
    """Raise ValueError naming the value when `config` cannot be split `tp` ways."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp: expected a positive int, got {tp!r}")
    if config.num_heads % tp:
        raise ValueError(
            f"tp={tp}: attention is split by heads, and num_heads={config.num_heads} is not "
            f"divisible by {tp}"
        )
    if config.kv_heads != config.num_heads:
        raise ValueError(
            f"tp={tp}: grouped-query attention (num_kv_heads={config.kv_heads} < num_heads="
            f"{config.num_heads}) is not split by tensor parallelism yet (the fused qkv "
            "projection is reordered as three equal parts); use num_kv_heads=None"
        )
    if config.d_ff % tp:
        raise ValueError(f"tp={tp}: d_ff={config.d_ff} is not divisible by {tp}")
    if config.matmul != "default":
        raise ValueError(
            f"tp={tp}: matmul={config.matmul!r} multiplies plain tensors, not the DTensors of "
            "tensor parallelism; use matmul='default'"
        )
    if sequence_parallel and seq_len is not None and seq_len % tp:
        raise ValueError(
            f"sequence_parallel: the sequence length {seq_len} must be divisible by tp={tp} "
            "(each rank keeps T / tp tokens between the sharded matmuls)"
        )


def make_mesh(tp: int, device_type: str = "cuda") -> Any:
    """A 2-D DeviceMesh ("dp", "tp") over the default process group: world / tp data-parallel
    groups of `tp` consecutive ranks (a TP group within a node). `mesh["tp"]` is the axis for
    `apply_tensor_parallel`, `mesh["dp"]` the one for `fully_shard`. Collective: every rank."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("make_mesh: the default process group is not initialized")
    world = dist.get_world_size()
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1 or world % tp:
        raise ValueError(f"tp: expected a positive divisor of the world size {world}, got {tp!r}")
    _, _, _, init_device_mesh = _tp_api()
    return init_device_mesh(device_type, (world // tp, tp), mesh_dim_names=("dp", "tp"))


def _row_blocks(key: str) -> int | None:
    for pattern, parts in _FUSED:
        if pattern.search(key):
            return parts
    return None


def _reorder(t: torch.Tensor, parts: int, tp: int, to_tp: bool, key: str) -> torch.Tensor:
    rows = t.shape[0]
    if rows % (parts * tp):
        raise ValueError(f"{key}: {rows} rows do not split into {parts} blocks x tp={tp}")
    rest = t.shape[1:]
    if to_tp:  # (parts, tp, rows_per_rank, ...) -> (tp, parts, rows_per_rank, ...)
        view = t.reshape(parts, tp, -1, *rest)
    else:  # (tp, parts, ...) -> (parts, tp, ...)
        view = t.reshape(tp, parts, -1, *rest)
    return view.transpose(0, 1).reshape(t.shape).contiguous()


def _convert(state: dict[str, Any], tp: int, to_tp: bool) -> dict[str, Any]:
    if tp == 1:
        return dict(state)
    out = {}
    for key, value in state.items():
        parts = _row_blocks(key)
        if parts is not None and isinstance(value, torch.Tensor) and value.dim() >= 1:
            value = _reorder(value, parts, tp, to_tp, key)
        out[key] = value
    return out


def to_tp_layout(state: dict[str, Any], tp: int) -> dict[str, Any]:
    """A full state dict (single-process layout) with the fused weights' rows reordered for
    `tp`-way tensor parallelism (module docstring); other entries as they are. Also applies to
    any per-parameter tensor of a fused weight's shape (AdamW's moments) keyed by its name."""
    return _convert(state, tp, to_tp=True)


def from_tp_layout(state: dict[str, Any], tp: int) -> dict[str, Any]:
    """The inverse of `to_tp_layout`: a gathered state dict of a `tp`-way model back to the
    layout of single-process training."""
    return _convert(state, tp, to_tp=False)


def tensor_parallel_degree(model: nn.Module) -> int:
    """N of the `apply_tensor_parallel` applied to `model`, 1 if none."""
    return getattr(model, _TP_ATTR, (1, False))[0]


def apply_tensor_parallel(
    model: nn.Module, tp_mesh: Any, sequence_parallel: bool = False
) -> nn.Module:
    """Shard `model` (a `TransformerLM`) over the 1-D DeviceMesh `tp_mesh`, in place; returns it.

    Call it on every rank of the mesh, on identical weights (same seed, or after a broadcast),
    before activation checkpointing, `torch.compile` and `fully_shard`. The model then takes
    the same token ids (B, T) on every rank of the mesh and returns the same logits (B, T, V)
    or loss; with `sequence_parallel` T must divide by the mesh size. See the module docstring
    for the layout; state dicts gathered from the model hold the fused weights in TP row
    order (`from_tp_layout`).
    """
    from lm_core.model import TransformerLM

    dt, tpar, device_mesh_cls, _ = _tp_api()
    if not isinstance(model, TransformerLM):
        raise TypeError(f"model: expected a TransformerLM, got {type(model).__name__}")
    if not isinstance(tp_mesh, device_mesh_cls) or tp_mesh.ndim != 1:
        raise ValueError(
            f"tp_mesh: expected a 1-D DeviceMesh (e.g. make_mesh(tp)['tp']), got {tp_mesh!r}"
        )
    if hasattr(model, _TP_ATTR):
        raise ValueError("model: tensor parallelism is already applied to this model")
    if any(isinstance(p, dt.DTensor) for p in model.parameters()):
        raise ValueError(
            "model: its parameters are already DTensors (fully_shard?); apply tensor "
            "parallelism first, then fully_shard"
        )
    tp = tp_mesh.size()
    check_tensor_parallel(model.config, tp, sequence_parallel=sequence_parallel)
    shard, replicate = dt.Shard, dt.Replicate
    with torch.no_grad():
        for name, p in model.named_parameters():
            parts = _row_blocks(name)
            if parts is not None:
                p.copy_(_reorder(p, parts, tp, True, name))
    if sequence_parallel:
        seq_sharded = {"input_layouts": (shard(1),), "desired_input_layouts": (replicate(),)}
        block_plan = {
            "ln1": tpar.SequenceParallel(),
            "attn": tpar.PrepareModuleInput(**seq_sharded),
            "attn.qkv_proj": tpar.ColwiseParallel(),
            "attn.output_proj": tpar.RowwiseParallel(output_layouts=shard(1)),
            "ln2": tpar.SequenceParallel(),
            "ffn": tpar.PrepareModuleInput(**seq_sharded),
            "ffn.w13": tpar.ColwiseParallel(),
            "ffn.w2": tpar.RowwiseParallel(output_layouts=shard(1)),
        }
    else:
        block_plan = {
            "attn.qkv_proj": tpar.ColwiseParallel(),
            "attn.output_proj": tpar.RowwiseParallel(),
            "ffn.w13": tpar.ColwiseParallel(),
            "ffn.w2": tpar.RowwiseParallel(),
        }
    for block in model.layers:
        tpar.parallelize_module(block, tp_mesh, block_plan)
    if sequence_parallel:
        # embedding output: keep this rank's T / N tokens (a slice; all-gather in backward);
        # the last block's output: all-gather the sequence for the replicated norm and head
        tpar.parallelize_module(
            model,
            tp_mesh,
            {
                "token_embeddings": tpar.PrepareModuleOutput(
                    output_layouts=replicate(), desired_output_layouts=shard(1)
                ),
                "ln_final": tpar.PrepareModuleInput(
                    input_layouts=(shard(1),),
                    desired_input_layouts=(replicate(),),
                    use_local_output=True,
                ),
            },
        )

        def check_seq(module: nn.Module, args: tuple) -> None:
            if args and isinstance(args[0], torch.Tensor) and args[0].dim() == 2:
                seq = args[0].shape[1]
                if seq % tp:
                    raise ValueError(
                        f"token_ids: sequence length {seq} is not divisible by the tensor "
                        f"parallel degree {tp} (sequence_parallel=True splits the sequence)"
                    )

        model.register_forward_pre_hook(check_seq)
    setattr(model, _TP_ATTR, (tp, sequence_parallel))
    return model
