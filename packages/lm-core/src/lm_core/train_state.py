"""The trainer's checkpoints: a run's whole state (model, optimizer, RNG, the data
generator's position and the run's options) saved at a step, and restored from a checkpoint
of any world size, wrapper and format (`lm_core.checkpoint`'s single file or
`lm_core.dcp_checkpoint`'s sharded directory)."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import torch

from lm_core import lowp_weights
from lm_core.checkpoint import (
    check_optimizer_state,
    checked_model_state,
    read_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from lm_core.dcp_checkpoint import (
    collectively,
    is_dcp_checkpoint,
    load_dcp_checkpoint,
    read_dcp_meta,
    save_dcp_checkpoint,
)
from lm_core.distributed import DistEnv, ParallelModel
from lm_core.train_config import RUN_RECORD, TrainConfig


def save_run(
    path: Path,
    pm: ParallelModel,
    optimizer: torch.optim.Optimizer,
    step: int,
    generator: torch.Generator,
    config: TrainConfig,
    env: DistEnv,
) -> None:
    """Checkpoint. checkpoint.format "full": from rank 0, the full model and optimizer
    states, as one process training alone would have them (sharded parameters gathered,
    sharded optimizer state consolidated on rank 0 first: every rank takes part); "dcp": a
    directory every rank writes its own shards to (`lm_core.dcp_checkpoint`)."""
    # the run's options, for lm_core.generate (its tokenizer, the data's end-of-text id)
    extra = {"data_generator": generator.get_state(), RUN_RECORD: config.to_dict()}
    if config.checkpoint.format == "dcp":
        save_dcp_checkpoint(path, pm, optimizer, step, config=config.model_config, extra=extra)
        return
    model_state = pm.full_state_dict()
    optimizer_state = pm.full_optimizer_state_dict(optimizer)
    if config.training.bf16_weights:  # the fp32 model; the masters are not saved twice
        model_state = lowp_weights.with_masters(model_state, pm.model, optimizer)
        optimizer_state = lowp_weights.without_masters(optimizer_state)

    def write() -> None:
        if env.is_main:
            save_checkpoint(
                path, model_state, optimizer_state, step, config=config.model_config, extra=extra
            )

    # a failed write (a full disk, no permission) raises on every rank: none waits for rank 0
    collectively(write, None)


def _group_shapes(
    optimizer: torch.optim.Optimizer, param_shapes: list[tuple[int, ...]]
) -> list[list[tuple[int, ...]]]:
    """The full shapes of `param_shapes` (the model's parameters, in order) split as the
    optimizer's groups are: the trainer builds every optimizer over the parameters in order."""
    groups = getattr(optimizer, "caller_param_groups", optimizer.param_groups)
    sizes = [len(g["params"]) for g in groups]
    if sum(sizes) != len(param_shapes):
        raise RuntimeError(
            f"the optimizer holds {sum(sizes)} parameters, the model {len(param_shapes)}"
        )
    bounds = itertools.accumulate(sizes, initial=0)
    return [param_shapes[a:b] for a, b in itertools.pairwise(bounds)]


def resume_run(
    path: Path,
    pm: ParallelModel,
    optimizer: torch.optim.Optimizer,
    generator: torch.Generator,
    config: TrainConfig,
    param_shapes: list[tuple[int, ...]],
) -> int:
    """Restore model, optimizer, RNG and data-generator state from a checkpoint of any world
    size and wrapper, of either format (a file: full states, see `save_run`; a directory: a
    sharded checkpoint, `lm_core.dcp_checkpoint`); returns its step. Every rank reads it.
    Model and optimizer state are checked against the model (full shapes `param_shapes`, in
    parameter order) before either is loaded."""
    sharded = is_dcp_checkpoint(path)

    def read() -> tuple[dict[str, Any], dict[str, torch.Tensor] | None]:
        payload = read_dcp_meta(path)[1] if sharded else read_checkpoint(path)
        start = payload["step"]
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ValueError(f"checkpoint {path}: step is {start!r}, expected a non-negative int")
        steps = config.training.steps
        if start > steps:
            raise ValueError(
                f"checkpoint.resume (--resume): checkpoint is at step {start}, beyond "
                f"training.steps (--steps) {steps}"
            )
        if sharded:
            return payload, None
        state = checked_model_state(payload, path, config.model_config, pm.full_shapes())
        if payload["optimizer"] is None:
            raise ValueError(f"checkpoint {path} holds no optimizer state")
        check_optimizer_state(payload["optimizer"], _group_shapes(optimizer, param_shapes), path)
        return payload, state

    # each rank reads its host's copy; one that fails (a damaged copy) fails every rank here,
    # before the load's collectives, where the others would wait for it
    payload, state = collectively(read, None)
    start = payload["step"]
    if sharded:
        load_dcp_checkpoint(path, pm, optimizer, config=config.model_config)
        return _restore_generator(generator, payload, start)
    pm.load_full_state_dict(state)
    try:
        pm.load_full_optimizer_state_dict(optimizer, payload["optimizer"])
    except (ValueError, KeyError, RuntimeError) as exc:
        raise ValueError(
            f"checkpoint {path}: optimizer state does not match this optimizer: {exc}"
        ) from exc
    restore_rng_state(payload["rng"])
    return _restore_generator(generator, payload, start)


def _restore_generator(generator: torch.Generator, payload: dict[str, Any], start: int) -> int:
    generator_state = payload["extra"].get("data_generator")
    if generator_state is not None:  # the batches a resumed run draws: the same as unresumed
        generator.set_state(generator_state)
    return start
