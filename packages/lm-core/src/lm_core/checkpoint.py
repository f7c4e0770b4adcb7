"""Checkpoints: model + optimizer + step + config + RNG state in one file, written atomically.

`save_checkpoint` writes to a temporary file in the target directory, fsyncs it and renames it
over the target (`os.replace`), so a crash never leaves a half-written checkpoint and an older
checkpoint at the same path survives a failed save; temporary files left by a killed save are
removed by the next save to that path (`lm_core.ckpt_io`). The file is one `torch.save` dict;
its `checksum` entry holds a SHA-256 of every other entry, verified on read, so a damaged file
is refused instead of loaded (files without the entry, from before it existed, load
unverified). Loads check everything (config, keys, shapes, dtypes, the optimizer's group
layout and per-parameter state shapes) before they change the model or optimizer.

Models wrapped by `torch.compile` (`_orig_mod`) or by a data-parallel wrapper (`.module`) are
unwrapped, so keys never carry their prefixes; prefixed keys written by other code are
stripped on load. Files are read with `torch.load(weights_only=True)`: loading a checkpoint
runs no pickled code.
"""

from __future__ import annotations

import os
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from lm_core.ckpt_io import atomic_write, payload_digest
from lm_core.config import ModelConfig

FORMAT = "lm_core.checkpoint/1"
CHECKSUM_KEY = "checksum"  # {"sha256": hex digest of every other entry}
_WRAPPER_PREFIXES = ("_orig_mod.", "module.")
# Config fields that may differ between a checkpoint and the model loading it: they change
# neither parameter shapes nor the function computed (RoPE tables are rebuilt from the config).
_FREE_FIELDS = frozenset({"attention", "context_length", "matmul"})


def unwrap_model(model: nn.Module) -> nn.Module:
    """The innermost module under torch.compile (`_orig_mod`) and DDP-style (`module`) wrappers."""
    while True:
        inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            inner = getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def strip_wrapper_prefixes(state: dict[str, Any]) -> dict[str, Any]:
    """Drop `_orig_mod.` / `module.` prefixes shared by every key of a state dict."""
    changed = True
    while changed and state:
        changed = False
        for prefix in _WRAPPER_PREFIXES:
            if all(k.startswith(prefix) for k in state):
                state = {k[len(prefix) :]: v for k, v in state.items()}
                changed = True
    return state


def _config_dict(config: Any, model: nn.Module | None) -> dict[str, Any] | None:
    if config is None and model is not None:
        config = getattr(model, "config", None)
    if config is None:
        return None
    if isinstance(config, ModelConfig):
        return config.to_dict()
    if isinstance(config, dict):
        return dict(config)
    raise TypeError(f"config: expected a ModelConfig, a dict or None, got {type(config).__name__}")


def _rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {
            "bit_generator": np_state[0],
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Set the torch, Python, NumPy (and CUDA) generators to a checkpoint's `rng` entry."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np_state = state["numpy"]
    np.random.set_state(
        (
            np_state["bit_generator"],
            np_state["keys"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = state["cuda"][: torch.cuda.device_count()]
        torch.cuda.set_rng_state_all(cuda_states)


def save_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module | Mapping[str, Any],
    optimizer: torch.optim.Optimizer | Mapping[str, Any] | None,
    step: int,
    config: ModelConfig | dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    *,
    rng: dict[str, Any] | None = None,
) -> None:
    """Atomically write model/optimizer state, `step`, config and RNG state to `path`.

    model / optimizer: the objects (their `state_dict()` is saved) or state dicts already
    taken (e.g. full state dicts gathered from a sharded model: see `lm_core.distributed`).
    config: defaults to `model.config` (after unwrapping; give it with a state dict). extra:
    small tensors/plain values to keep (e.g. a data generator's state); read them back with
    `read_checkpoint(path)`. For a sharded optimizer, call
    `optimizer.consolidate_state_dict(to=0)` on every rank first and save from rank 0.
    rng: the RNG state to store (a checkpoint's `rng` entry); default: this process's.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step: expected a non-negative int, got {step!r}")
    if isinstance(model, nn.Module):
        target: nn.Module | None = unwrap_model(model)
        model_state = target.state_dict()
    elif isinstance(model, Mapping):
        target, model_state = None, dict(model)
    else:
        raise TypeError(f"model: expected an nn.Module or a state dict, got {type(model)}")
    if isinstance(optimizer, torch.optim.Optimizer):
        optimizer_state = optimizer.state_dict()
    elif optimizer is None or isinstance(optimizer, Mapping):
        optimizer_state = dict(optimizer) if optimizer is not None else None
    else:
        raise TypeError(
            f"optimizer: expected a torch Optimizer, a state dict or None, got {type(optimizer)}"
        )
    payload = {
        "format": FORMAT,
        "step": step,
        "model": strip_wrapper_prefixes(model_state),
        "optimizer": optimizer_state,
        "config": _config_dict(config, target),
        "rng": rng if rng is not None else _rng_state(),
        "extra": dict(extra) if extra else {},
    }
    payload[CHECKSUM_KEY] = {"sha256": payload_digest(payload, skip=CHECKSUM_KEY)}
    atomic_write(Path(path), lambda f: torch.save(payload, f))


def read_checkpoint(
    path: str | os.PathLike[str],
    map_location: str | torch.device = "cpu",
    *,
    verify: bool = True,
) -> dict[str, Any]:
    """The raw checkpoint dict (keys: format, step, model, optimizer, config, rng, extra,
    checksum).

    Raises FileNotFoundError for a missing file, RuntimeError naming the file for one that is
    unreadable, not ours, or (with `verify`) whose contents differ from its checksum. Files
    written before checkpoints carried a checksum load unverified.
    """
    path = Path(path)
    if path.is_dir():
        raise RuntimeError(
            f"checkpoint {path} is a directory (a sharded checkpoint?), not a checkpoint file: "
            f"load it with lm_core.dcp_checkpoint.load_dcp_checkpoint, or convert it with "
            f"python -m lm_core.convert_checkpoint {path} OUT.pt"
        )
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:
        raise RuntimeError(
            f"checkpoint {path} could not be read (corrupt, truncated, or not written by "
            f"lm_core.save_checkpoint): {type(exc).__name__}: {str(exc)[:300]}"
        ) from exc
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise RuntimeError(f"checkpoint {path} is not an lm_core checkpoint (format {FORMAT!r})")
    missing = sorted({"step", "model", "optimizer", "config", "rng", "extra"} - payload.keys())
    if missing:
        raise RuntimeError(f"checkpoint {path} is corrupt: entries {missing} are missing")
    if verify and CHECKSUM_KEY in payload:
        _verify_checksum(payload, path)
    return payload


def _verify_checksum(payload: dict[str, Any], path: Path) -> None:
    stored = payload[CHECKSUM_KEY]
    if not isinstance(stored, dict) or not isinstance(stored.get("sha256"), str):
        raise RuntimeError(f"checkpoint {path} is corrupt: its checksum entry is malformed")
    actual = payload_digest(payload, skip=CHECKSUM_KEY)
    if actual != stored["sha256"]:
        raise RuntimeError(
            f"checkpoint {path} is corrupt: its contents do not match the SHA-256 checksum "
            f"stored when it was saved ({stored['sha256'][:16]}... vs {actual[:16]}... now); "
            "the file was damaged after it was written: use a copy or an older checkpoint "
            "(read_checkpoint(path, verify=False) reads it anyway)"
        )


def _check_config(saved: dict[str, Any] | None, current: Any, path: Path) -> None:
    if saved is None or not isinstance(current, ModelConfig):
        return
    current_dict = current.to_dict()
    diffs = [
        f"{key}={saved.get(key)!r} in the checkpoint vs {current_dict.get(key)!r} in the model"
        for key in sorted(set(saved) | set(current_dict))
        if key not in _FREE_FIELDS and saved.get(key) != current_dict.get(key)
    ]
    if diffs:
        detail = "; ".join(diffs)
        raise ValueError(f"checkpoint {path} was saved for another model config: {detail}")


def _check_state(saved: Mapping[str, Any], expected: Mapping[str, Any], path: Path) -> None:
    """`expected`: key -> a tensor (shape and dtype are checked) or its shape (a torch.Size);
    other values (a module's `_extra_state`) are not checked."""
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {path} does not match the model: missing keys {missing[:8]}, "
            f"unexpected keys {unexpected[:8]}"
        )
    for key, value in expected.items():
        if not isinstance(value, torch.Tensor | tuple | list):
            continue
        got = saved[key]
        if not isinstance(got, torch.Tensor):
            raise ValueError(
                f"checkpoint {path}: parameter {key} is a {type(got).__name__}, expected a tensor"
            )
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else tuple(value)
        if tuple(got.shape) != shape:
            raise ValueError(
                f"checkpoint {path}: parameter {key} has shape {tuple(got.shape)} in the "
                f"checkpoint vs {shape} in the model"
            )
        if isinstance(value, torch.Tensor) and got.dtype != value.dtype:
            raise ValueError(
                f"checkpoint {path}: parameter {key} has dtype {got.dtype} in the checkpoint "
                f"vs {value.dtype} in the model; convert the model first (model.to({got.dtype}))"
            )


# Per-parameter optimizer state that has the parameter's shape (torch.optim's Adam, AdamW,
# Adamax, NAdam, RAdam, SGD, RMSprop, Adagrad, Adadelta, Rprop, ASGD; ours). Other entries
# (scalars such as `step`, factored state of other optimizers) are not shape-checked.
_PARAM_SHAPED_STATE = frozenset(
    {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "exp_inf", "momentum_buffer", "square_avg"}
    | {"grad_avg", "sum", "acc_delta", "prev", "step_size", "ax"}
)


def check_optimizer_state(
    state: Any, group_shapes: Sequence[Sequence[Sequence[int]]], path: str | os.PathLike[str]
) -> None:
    """Check an optimizer state dict against the optimizer that will load it, before loading.

    group_shapes: per parameter group of that optimizer, the (full) shape of each parameter.
    Checks the `state` / `param_groups` structure, the number of groups and of parameters per
    group (as `Optimizer.load_state_dict` pairs them by position), and that param-shaped
    state (`exp_avg`, `momentum_buffer`, ...) has its parameter's shape. ValueError naming
    the checkpoint and what differs.
    """
    where = f"checkpoint {path}: optimizer state"
    if not (
        isinstance(state, Mapping)
        and isinstance(state.get("state"), Mapping)
        and isinstance(state.get("param_groups"), list | tuple)
    ):
        raise ValueError(f"{where} is malformed: expected a dict with 'state' and 'param_groups'")
    saved_groups = state["param_groups"]
    if len(saved_groups) != len(group_shapes):
        raise ValueError(
            f"{where} does not match this optimizer: {len(saved_groups)} parameter groups in "
            f"the checkpoint vs {len(group_shapes)} in the optimizer"
        )
    shapes: dict[int, tuple[int, ...]] = {}
    for g, (saved, ours) in enumerate(zip(saved_groups, group_shapes)):
        params = saved.get("params") if isinstance(saved, Mapping) else None
        if not isinstance(params, list | tuple) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in params
        ):
            raise ValueError(f"{where} is malformed: group {g} has no list of parameter ids")
        if len(params) != len(ours):
            raise ValueError(
                f"{where} does not match this optimizer: group {g} has {len(params)} "
                f"parameters in the checkpoint vs {len(ours)} in the optimizer"
            )
        for i, shape in zip(params, ours):
            if i in shapes:
                raise ValueError(f"{where} is malformed: parameter id {i} is in two groups")
            shapes[i] = tuple(shape)
    for i, entry in state["state"].items():
        if i not in shapes or not isinstance(entry, Mapping):
            raise ValueError(f"{where} is malformed: state for parameter id {i!r}, in no group")
        for name, value in entry.items():
            shaped = name in _PARAM_SHAPED_STATE and isinstance(value, torch.Tensor)
            if shaped and tuple(value.shape) != shapes[i]:
                raise ValueError(
                    f"{where} does not match this optimizer: {name!r} of parameter {i} has "
                    f"shape {tuple(value.shape)}, the parameter {shapes[i]}"
                )


def _optimizer_group_shapes(optimizer: torch.optim.Optimizer) -> list[list[tuple[int, ...]]]:
    return [[tuple(p.shape) for p in group["params"]] for group in optimizer.param_groups]


def checked_model_state(
    payload: dict[str, Any],
    path: str | os.PathLike[str],
    config: ModelConfig | None,
    shapes: Mapping[str, Any],
) -> dict[str, Any]:
    """The model state dict of a checkpoint read by `read_checkpoint`, wrapper prefixes
    stripped, after checking it against `config` and `shapes` (state-dict key -> full shape,
    or a tensor: then its dtype too): ValueError naming the differing field, key, shape or
    dtype."""
    path = Path(path)
    _check_config(payload["config"], config, path)
    state = payload["model"]
    if not isinstance(state, Mapping) or not all(isinstance(k, str) for k in state):
        raise ValueError(f"checkpoint {path}: the model entry is not a state dict")
    state = strip_wrapper_prefixes(dict(state))
    _check_state(state, shapes, path)
    return state


def load_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    restore_rng: bool = True,
    map_location: str | torch.device = "cpu",
) -> int:
    """Restore model (and optimizer, RNG state) from `path`; returns the saved step.

    Raises FileNotFoundError for a missing file, RuntimeError for a corrupt one (unreadable,
    or contents that differ from the stored checksum), ValueError naming the field, parameter
    or optimizer group when the checkpoint belongs to another model or optimizer. Everything
    is checked before anything is changed: a failed load leaves model, optimizer and RNG as
    they were. Tensors are loaded to `map_location`, then copied onto the model's devices.
    """
    path = Path(path)
    payload = read_checkpoint(path, map_location)
    target = unwrap_model(model)
    state = checked_model_state(payload, path, getattr(target, "config", None), target.state_dict())
    step = payload["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"checkpoint {path}: step is {step!r}, expected a non-negative int")
    if optimizer is not None:
        if payload["optimizer"] is None:
            raise ValueError(f"checkpoint {path} holds no optimizer state")
        check_optimizer_state(payload["optimizer"], _optimizer_group_shapes(optimizer), path)
        before = optimizer.state_dict()
        try:  # torch checks the group layout before it replaces any state
            optimizer.load_state_dict(payload["optimizer"])
        except (ValueError, KeyError, RuntimeError, TypeError) as exc:
            raise ValueError(
                f"checkpoint {path}: optimizer state does not match this optimizer: {exc}"
            ) from exc
    try:
        target.load_state_dict(state)
    except BaseException:
        if optimizer is not None:
            optimizer.load_state_dict(before)
        raise
    if restore_rng:
        restore_rng_state(payload["rng"])
    return step
