"""Sharded checkpoints: a directory written by every rank in parallel through
torch.distributed.checkpoint (DCP), loadable at any world size and by any engine.

`save_dcp_checkpoint(path, model, optimizer, step, ...)` (collective: every rank calls it)
hands DCP each rank's own part of the state: `ParallelModel.sharded_state_dict()` and
`sharded_optimizer_state_dict()` (zero_shard's `FlatShard`s under --fsdp ours, DTensors under
--fsdp torch, whole tensors otherwise; a ZeRO optimizer lists its own parameters' state).
Nothing is gathered to one rank. The tensors are stored under flat keys

    model.<state-dict key>                       the model, in its full shapes
    optim.state.<parameter name>.<state name>    exp_avg, exp_avg_sq, step, ... (full shapes)

and rank 0 writes a manifest, `lm_core_meta.pt`, last: format, step, model config, parameter
names, the optimizer's param_groups (by name), its RNG state, `extra` and the SHA-256 of
every file of the directory (hashed by all ranks, each a share). The directory is written
beside the target and swapped in whole (`lm_core.dcp_io`): a killed save never costs the
previous checkpoint.

`load_dcp_checkpoint(path, model, optimizer)` (collective) verifies the files' checksums
(each rank a share), checks the config, keys and shapes against the model and optimizer
before changing anything (ValueError naming the path and what differs), then lets DCP read
into this rank's own shards, wherever they lie in the saved ones. Without a process group it
runs in one process (DCP's no-dist mode), e.g. to resume a sharded run on one device.

DCP reads its `.metadata` file with pickle (and its non-tensor entries with torch.load):
load only checkpoints you trust, as with any pickle.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lm_core.checkpoint import (
    _PARAM_SHAPED_STATE,
    _check_config,
    _check_state,
    _config_dict,
    _rng_state,
    restore_rng_state,
)
from lm_core.ckpt_io import atomic_write, payload_digest
from lm_core.config import ModelConfig
from lm_core.dcp_io import (
    META_NAME,
    commit,
    io_threads,
    is_checkpoint_dir,
    new_temp_dir,
    recover,
    remove_quietly,
    resolve_dir,
    sha256_files,
)
from lm_core.engine import ParallelModel

FORMAT = "lm_core.dcp/1"
is_dcp_checkpoint = is_checkpoint_dir  # a directory to load with load_dcp_checkpoint
MODEL_PREFIX = "model."
OPTIM_PREFIX = "optim.state."
_CHECKSUM = "checksum"


def _engine(model: ParallelModel | nn.Module) -> ParallelModel:
    if isinstance(model, ParallelModel):
        return model
    if isinstance(model, nn.Module):  # an unsharded model in one process (or replicated)
        return ParallelModel(model, lambda: None, contextlib.nullcontext)
    raise TypeError(f"model: expected a ParallelModel or an nn.Module, got {type(model)}")


def _dist(group: Any) -> tuple[bool, int, int]:
    """(use a process group, rank, world size)."""
    if dist.is_available() and dist.is_initialized():
        return True, dist.get_rank(group), dist.get_world_size(group)
    return False, 0, 1


@contextlib.contextmanager
def one_process_ok() -> Iterator[None]:
    """DCP warns that it runs in one process even when that is what we asked for."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is (disabled|unavail)")
        yield


def _broadcast(value: Any, group: Any, use_dist: bool) -> Any:
    if not use_dist:
        return value
    box = [value]
    src = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def _share(names: list[str], rank: int, world: int) -> list[str]:
    return names[rank::world]


def _all_gather(value: Any, group: Any, use_dist: bool, world: int) -> list[Any]:
    if not use_dist:
        return [value]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, value, group=group)
    return out


_ERRORS = {"FileNotFoundError": FileNotFoundError, "ValueError": ValueError}


def collectively(fn: Callable[[], Any], group: Any) -> Any:
    """Collective: `fn()` on every rank; if it raised on any rank, raise the first rank's
    error on every rank (its own exception there, the same type and message elsewhere), so no
    rank goes on into a collective that a failed rank never joins."""
    use_dist, rank, world = _dist(group)
    error: BaseException | None = None
    result = None
    try:
        result = fn()
    except Exception as exc:
        error = exc
    if not use_dist:
        if error is not None:
            raise error
        return result
    mine = None if error is None else (type(error).__name__, str(error))
    for r, found in enumerate(_all_gather(mine, group, use_dist, world)):
        if found is not None:
            if r == rank and error is not None:
                raise error
            raise _ERRORS.get(found[0], RuntimeError)(f"{found[1]} (raised on rank {r})")
    return result


# ----- save ---------------------------------------------------------------------------------
def sharded_state(
    model: ParallelModel | nn.Module, optimizer: torch.optim.Optimizer | None
) -> tuple[dict[str, Any], list[dict[str, Any]] | None]:
    """This rank's flat DCP state (`model.*`, `optim.state.*` keys) and the optimizer's
    param_groups by name (None without an optimizer)."""
    engine = _engine(model)
    state = {MODEL_PREFIX + k: v for k, v in engine.sharded_state_dict().items()}
    if optimizer is None:
        return state, None
    optim = engine.sharded_optimizer_state_dict(optimizer)
    for name, entry in optim["state"].items():
        for key, value in entry.items():
            state[f"{OPTIM_PREFIX}{name}.{key}"] = value
    return state, list(optim["param_groups"])


def save_dcp_checkpoint(
    path: str | os.PathLike[str],
    model: ParallelModel | nn.Module,
    optimizer: torch.optim.Optimizer | None,
    step: int,
    config: ModelConfig | dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    *,
    process_group: Any = None,
) -> None:
    """Write a sharded checkpoint directory at `path` (module docstring). Collective.

    model: the trainer's `ParallelModel` (any engine), or an unsharded `nn.Module`.
    config: defaults to the model's `config`. extra: small tensors / plain values (rank 0's
    are kept). The previous checkpoint at `path` is replaced only once this one is complete.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step: expected a non-negative int, got {step!r}")
    engine = _engine(model)
    state, groups = sharded_state(engine, optimizer)
    world = _dist(process_group)[2]
    meta = {
        "format": FORMAT,
        "step": step,
        "config": _config_dict(config, engine.model),
        "param_names": engine.param_names(),
        "param_groups": groups,
        "rng": _rng_state(),
        "extra": dict(extra) if extra else {},
        "world_size": world,
    }
    write_dcp_dir(Path(path), state, meta, process_group)


def write_dcp_dir(
    target: Path, state: dict[str, Any], meta: dict[str, Any], process_group: Any = None
) -> None:
    """Collective: `dcp.save(state)` into a temporary directory beside `target`, checksums
    (each rank hashes a share of the files), the manifest `meta` (rank 0's), then the swap.
    A step failing on any rank raises on every rank (nothing waits for a rank that failed)."""
    import torch.distributed.checkpoint as dcp

    group = process_group
    use_dist, rank, world = _dist(group)

    def prepare() -> str | None:
        if rank != 0:
            return None
        recover(target, META_NAME)
        return str(new_temp_dir(target))

    tmp = Path(_broadcast(collectively(prepare, group), group, use_dist))
    try:
        threads = io_threads()
        writer = dcp.FileSystemWriter(tmp, thread_count=threads)  # a file per thread
        with one_process_ok():  # DCP raises on every rank when one fails
            dcp.save(state, storage_writer=writer, process_group=group, no_dist=not use_dist)
        listed = sorted(p.name for p in tmp.iterdir()) if rank == 0 else None
        names = _broadcast(listed, group, use_dist)  # rank 0's view of the directory

        def hash_share() -> dict[str, str]:
            share = _share(names, rank, world)
            return dict(zip(share, sha256_files([tmp / n for n in share], threads)))

        mine = collectively(hash_share, group)
        digests: dict[str, str] = {}
        for part in _all_gather(mine, group, use_dist, world):
            digests.update(part)

        def finish() -> None:
            if rank == 0:
                full = {**meta, "files": dict(sorted(digests.items()))}
                full[_CHECKSUM] = {"sha256": payload_digest(full, skip=_CHECKSUM)}
                atomic_write(tmp / META_NAME, lambda f: torch.save(full, f))
                commit(tmp, target)

        collectively(finish, group)
    except BaseException:
        if rank == 0:
            remove_quietly(tmp)
        raise


# ----- load ---------------------------------------------------------------------------------
def read_dcp_meta(path: str | os.PathLike[str]) -> tuple[Path, dict[str, Any]]:
    """(the directory to read, its manifest), the manifest's own checksum verified.

    FileNotFoundError for a missing checkpoint, RuntimeError naming the path for a directory
    that is not one of ours, incomplete or damaged.
    """
    path = Path(path)
    directory = resolve_dir(path, META_NAME)
    if directory is None:
        if path.is_file():
            raise RuntimeError(
                f"checkpoint {path} is a file, not a sharded (DCP) checkpoint directory; "
                "load it with lm_core.load_checkpoint"
            )
        raise FileNotFoundError(f"checkpoint not found: {path}")
    meta_path = directory / META_NAME
    if not meta_path.is_file():
        raise RuntimeError(
            f"checkpoint {path} is not a complete lm_core sharded checkpoint: it has no "
            f"{META_NAME} (an interrupted save, or a directory written by other code)"
        )
    try:
        meta = torch.load(meta_path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise RuntimeError(
            f"checkpoint {path} is corrupt: {META_NAME} could not be read: "
            f"{type(exc).__name__}: {str(exc)[:300]}"
        ) from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise RuntimeError(f"checkpoint {path}: {META_NAME} is not of format {FORMAT!r}")
    stored = meta.get(_CHECKSUM)
    if not isinstance(stored, dict) or stored.get("sha256") != payload_digest(meta, skip=_CHECKSUM):
        raise RuntimeError(
            f"checkpoint {path} is corrupt: {META_NAME} does not match its SHA-256 checksum"
        )
    return directory, meta


def verify_dcp_files(
    path: Path, directory: Path, meta: dict[str, Any], process_group: Any = None
) -> None:
    """Collective: every file of the manifest is there and matches its SHA-256 (each rank
    hashes a share); RuntimeError naming the checkpoint and the file on every rank."""
    use_dist, rank, world = _dist(process_group)
    share = _share(sorted(meta["files"]), rank, world)
    problem = next(
        (
            f"checkpoint {path} is incomplete: its file {name} is missing"
            for name in share
            if not (directory / name).is_file()
        ),
        None,
    )
    if problem is None:
        digests = sha256_files([directory / name for name in share], io_threads())
        for name, digest in zip(share, digests):
            if digest != meta["files"][name]:
                problem = (
                    f"checkpoint {path} is corrupt: its file {name} does not match the SHA-256 "
                    "checksum stored when it was saved; use a copy or an older checkpoint"
                )
                break
    problems = [p for p in _all_gather(problem, process_group, use_dist, world) if p]
    if problems:
        raise RuntimeError(problems[0])


def storage_metadata(path: Path, directory: Path) -> dict[str, Any]:
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return FileSystemReader(directory).read_metadata().state_dict_metadata
    except Exception as exc:
        raise RuntimeError(
            f"checkpoint {path}: its DCP metadata could not be read: {type(exc).__name__}: "
            f"{str(exc)[:300]}"
        ) from exc


def _stand_in(md: Any) -> Any:
    """A meta-device tensor of a saved tensor's shape and dtype (non-tensors: None)."""
    size = getattr(md, "size", None)
    if size is None:
        return None
    return torch.empty(size, dtype=md.properties.dtype, device="meta")


def split_optim_key(key: str, names: set[str]) -> tuple[str, str] | None:
    """`optim.state.<name>.<state>` -> (name, state) for a parameter name in `names`."""
    name, _, entry = key[len(OPTIM_PREFIX) :].rpartition(".")
    return (name, entry) if name in names else None


def _check_optimizer(
    path: Path,
    meta: dict[str, Any],
    storage: dict[str, Any],
    optimizer: torch.optim.Optimizer,
    names: list[str],
    shapes: dict[str, tuple[int, ...]],
) -> dict[str, set[str]]:
    """The saved param_groups name our parameters group by group, and param-shaped state has
    the parameter's shape. Returns the saved state names by parameter."""
    where = f"checkpoint {path}: optimizer state"
    saved = meta.get("param_groups")
    if saved is None:
        raise ValueError(f"checkpoint {path} holds no optimizer state")
    sizes = [len(g["params"]) for g in optimizer.param_groups]
    if len(saved) != len(sizes):
        raise ValueError(
            f"{where} does not match this optimizer: {len(saved)} parameter groups in the "
            f"checkpoint vs {len(sizes)} in the optimizer"
        )
    start = 0
    for g, (group, n) in enumerate(zip(saved, sizes)):
        ours = names[start : start + n]
        start += n
        if list(group.get("params", [])) != ours:
            diff = sorted(set(group.get("params", [])) ^ set(ours))[:3]
            raise ValueError(
                f"{where} does not match this optimizer: group {g} holds other parameters "
                f"({len(group.get('params', []))} in the checkpoint vs {n}; differing: {diff})"
            )
    by_param: dict[str, set[str]] = {}
    for key, md in storage.items():
        if not key.startswith(OPTIM_PREFIX):
            continue
        split = split_optim_key(key, set(names))
        if split is None:
            raise ValueError(f"{where}: {key} belongs to no parameter of this model")
        name, entry = split
        by_param.setdefault(name, set()).add(entry)
        size = getattr(md, "size", None)
        if entry in _PARAM_SHAPED_STATE and size is not None and tuple(size) != shapes[name]:
            raise ValueError(
                f"{where} does not match this optimizer: {entry!r} of {name} has shape "
                f"{tuple(size)} in the checkpoint, the parameter {shapes[name]}"
            )
    return by_param


def load_dcp_checkpoint(
    path: str | os.PathLike[str],
    model: ParallelModel | nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    restore_rng: bool = True,
    config: ModelConfig | None = None,
    process_group: Any = None,
) -> dict[str, Any]:
    """Load a sharded checkpoint into `model` (and `optimizer`, RNG state); returns its
    manifest (`step`, `extra`, `config`, ...). Collective (module docstring).

    config: checked against the saved one (default: the model's `config`). Raises
    FileNotFoundError, RuntimeError (corrupt or incomplete: naming the path and the file) or
    ValueError (another model or optimizer: naming the field, key or shape) before anything
    is changed.
    """
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    group = process_group
    engine = _engine(model)
    directory, meta = collectively(lambda: read_dcp_meta(path), group)
    verify_dcp_files(path, directory, meta, group)

    def check() -> dict[str, set[str]]:
        """Config, model keys and shapes, the optimizer's layout (the same on every rank);
        the saved optimizer state's names by parameter."""
        storage = storage_metadata(path, directory)
        _check_config(meta.get("config"), config or getattr(engine.model, "config", None), path)
        saved_model = {
            k[len(MODEL_PREFIX) :]: _stand_in(md)
            for k, md in storage.items()
            if k.startswith(MODEL_PREFIX)
        }
        _check_state(saved_model, shapes, path)
        if optimizer is None:
            return {}
        names = engine.param_names()
        full = {n: tuple(shapes[n]) for n in names}
        return _check_optimizer(path, meta, storage, optimizer, names, full)

    shapes = engine.full_shapes()
    saved_by_param = collectively(check, group)
    template = {MODEL_PREFIX + k: v for k, v in engine.sharded_state_dict().items()}
    optim = None
    if optimizer is not None:
        fresh = not optimizer.state
        optim = engine.sharded_optimizer_state_dict(optimizer)  # creates a fresh one's state

        def check_entries() -> None:  # this rank's parameters (a ZeRO rank lists its own)
            for name, entry in optim["state"].items():
                if saved_by_param.get(name, set()) != set(entry):
                    raise ValueError(
                        f"checkpoint {path}: optimizer state of {name} holds "
                        f"{sorted(saved_by_param.get(name, set()))}, this optimizer's "
                        f"{sorted(entry)}: another optimizer class or settings"
                    )

        try:
            collectively(check_entries, group)
        except ValueError:
            if fresh:  # as it was: no state
                optimizer.state.clear()
            raise
        for name, entry in optim["state"].items():
            for key, value in entry.items():
                template[f"{OPTIM_PREFIX}{name}.{key}"] = value
    use_dist = _dist(group)[0]
    try:
        with one_process_ok():  # DCP raises on every rank when one fails
            dcp.load(template, checkpoint_id=directory, process_group=group, no_dist=not use_dist)
    except Exception as exc:
        raise RuntimeError(
            f"checkpoint {path} could not be loaded: {type(exc).__name__}: {str(exc)[:500]}"
        ) from exc
    engine.load_sharded_state_dict(
        {k[len(MODEL_PREFIX) :]: v for k, v in template.items() if k.startswith(MODEL_PREFIX)}
    )
    if optim is not None:
        loaded = {
            name: {key: template[f"{OPTIM_PREFIX}{name}.{key}"] for key in entry}
            for name, entry in optim["state"].items()
        }
        state = {"state": loaded, "param_groups": meta["param_groups"]}
        engine.load_sharded_optimizer_state_dict(optimizer, state)
    if restore_rng:
        restore_rng_state(meta["rng"])
    return meta
