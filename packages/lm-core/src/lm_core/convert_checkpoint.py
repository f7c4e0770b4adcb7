"""`python -m lm_core.convert_checkpoint SRC OUT`: convert a checkpoint between the sharded
directory format (`--checkpoint-format dcp`, `lm_core.dcp_checkpoint`) and the single file
`lm_core.load_checkpoint` reads (`--checkpoint-format full`).

    python -m lm_core.convert_checkpoint runs/a/checkpoint.dcp model.pt       # dcp -> file
    python -m lm_core.convert_checkpoint model.pt runs/b/checkpoint.dcp --to dcp

`--to` defaults to the other format than SRC's (a directory converts to a file and back).
Everything a checkpoint holds carries over unchanged: model and optimizer state (the file
keys the optimizer's parameters by position, the directory by name), step, model config, the
RNG state of the run that saved it and `extra`. Runs in one process, without a process group:
the whole state passes through this process's memory (CPU). OUT is written atomically (a
file: renamed over; a directory: swapped in whole) and an existing OUT is replaced only with
`--overwrite`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lm_core.checkpoint import read_checkpoint, save_checkpoint
from lm_core.config import ModelConfig
from lm_core.dcp_checkpoint import (
    FORMAT,
    MODEL_PREFIX,
    OPTIM_PREFIX,
    is_dcp_checkpoint,
    one_process_ok,
    read_dcp_meta,
    split_optim_key,
    storage_metadata,
    verify_dcp_files,
    write_dcp_dir,
)


def dcp_to_full(src: str | Path, out: str | Path) -> None:
    """Read the sharded checkpoint `src` whole (checksums verified) and write it as one file."""
    import torch.distributed.checkpoint as dcp

    src, out = Path(src), Path(out)
    directory, meta = read_dcp_meta(src)
    verify_dcp_files(src, directory, meta)
    storage = storage_metadata(src, directory)
    state: dict[str, Any] = {
        key: torch.empty(md.size, dtype=md.properties.dtype) if hasattr(md, "size") else None
        for key, md in storage.items()
    }
    with one_process_ok():
        dcp.load(state, checkpoint_id=directory, no_dist=True)
    model = {k[len(MODEL_PREFIX) :]: v for k, v in state.items() if k.startswith(MODEL_PREFIX)}
    optimizer = None
    if meta["param_groups"] is not None:
        names = list(meta["param_names"])
        index = {name: i for i, name in enumerate(names)}
        by_index: dict[int, dict[str, Any]] = {}
        for key, value in state.items():
            if key.startswith(OPTIM_PREFIX):
                split = split_optim_key(key, set(names))
                if split is None:
                    raise RuntimeError(f"checkpoint {src}: {key} names no parameter")
                by_index.setdefault(index[split[0]], {})[split[1]] = value
        groups = [{**g, "params": [index[n] for n in g["params"]]} for g in meta["param_groups"]]
        optimizer = {"state": dict(sorted(by_index.items())), "param_groups": groups}
    save_checkpoint(
        out,
        model,
        optimizer,
        meta["step"],
        config=meta["config"],
        extra=meta["extra"],
        rng=meta["rng"],
    )


def parameter_names(config: dict[str, Any] | None, path: Path) -> list[str]:
    """`TransformerLM.named_parameters()` names of the model `config` describes (built on the
    meta device: no memory), in order: the file keys optimizer state by these positions."""
    from lm_core.model import TransformerLM

    if config is None:
        raise ValueError(
            f"checkpoint {path} records no model config, which names the optimizer's "
            "parameters; it cannot be converted"
        )
    with torch.device("meta"):
        model = TransformerLM(ModelConfig.from_dict(config))
    return [name for name, _ in model.named_parameters()]


def full_to_dcp(src: str | Path, out: str | Path) -> None:
    """Read the checkpoint file `src` (checksum verified) and write it as a sharded directory
    (one process's shards: whole tensors, loadable at any world size)."""
    src, out = Path(src), Path(out)
    payload = read_checkpoint(src)
    state = {MODEL_PREFIX + k: v for k, v in payload["model"].items()}
    groups = None
    names = parameter_names(payload["config"], src)
    optimizer = payload["optimizer"]
    if optimizer is not None:
        listed = sum(len(g["params"]) for g in optimizer["param_groups"])
        if listed != len(names):
            raise ValueError(
                f"checkpoint {src}: its optimizer holds {listed} parameters, the model {len(names)}"
            )
        for i, entry in optimizer["state"].items():
            for key, value in entry.items():
                state[f"{OPTIM_PREFIX}{names[int(i)]}.{key}"] = value
        groups = [
            {**g, "params": [names[int(i)] for i in g["params"]]} for g in optimizer["param_groups"]
        ]
    meta = {
        "format": FORMAT,
        "step": payload["step"],
        "config": payload["config"],
        "param_names": names,
        "param_groups": groups,
        "rng": payload["rng"],
        "extra": payload["extra"],
        "world_size": 1,
    }
    write_dcp_dir(out, state, meta)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m lm_core.convert_checkpoint",
        description="Convert a checkpoint between the sharded directory format (dcp) and the "
        "single file lm_core.load_checkpoint reads (full).",
    )
    p.add_argument("src", type=Path, help="a sharded checkpoint directory or a checkpoint file")
    p.add_argument("out", type=Path, help="where to write the converted checkpoint")
    p.add_argument(
        "--to",
        choices=["full", "dcp"],
        help="the format to write [full for a directory SRC, dcp for a file]",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    """Parse `argv` and convert; bad arguments exit 2 naming them, a checkpoint that cannot be
    read raises (FileNotFoundError, RuntimeError, ValueError naming the path)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    sharded = is_dcp_checkpoint(args.src)
    if not sharded and not args.src.is_file():
        parser.error(f"src: not found (neither a checkpoint file nor a directory): {args.src}")
    to = args.to or ("full" if sharded else "dcp")
    if to == ("dcp" if sharded else "full"):
        kind = "sharded directory" if sharded else "file"
        parser.error(f"--to {to}: src {args.src} is already a {kind} checkpoint")
    if args.out.exists() and not args.overwrite:
        parser.error(f"out: {args.out} exists; pass --overwrite to replace it")
    if args.out.resolve() == args.src.resolve():
        parser.error("out: must differ from src")
    (dcp_to_full if to == "full" else full_to_dcp)(args.src, args.out)


def cli() -> None:
    """The `lm-convert-checkpoint` console script: errors as one line, exit status 1."""
    try:
        main()
    except (FileNotFoundError, RuntimeError, ValueError) as exc:
        sys.exit(f"lm-convert-checkpoint: error: {exc}")


if __name__ == "__main__":
    cli()
