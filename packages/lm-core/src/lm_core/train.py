"""`python -m lm_core.train`: train a TransformerLM on one device or under torchrun.

Examples:
    python -m lm_core.train --size tiny --steps 200                       # CPU, synthetic data
    python -m lm_core.train --config run.toml --max-lr 3e-3    # a TOML file; flags override it
    python -m lm_core.train --config run.toml --dump-config -  # print the merged config, exit
    python -m lm_core.train --size small --data train.bin --pack-documents --eot-id 0 \
        --num-kv-heads 4 --sliding-window 256 --attention flash-triton --bf16
    python -m lm_core.train --size small --data train.bin --val-data val.bin --bf16 --compile \
        --batch-size 32 --context-length 512 --steps 5000 --out-dir runs/small
    torchrun --nproc_per_node 2 -m lm_core.train --size xl --bf16 --ddp bucketed \
        --bucket-size-mb 100 --zero --batch-size 8 --context-length 512
    torchrun --nproc_per_node 2 -m lm_core.train --size 2.7B --bf16 --fsdp ours \
        --activation-checkpointing optimal --fused-loss --batch-size 8 --context-length 2048
    torchrun --nproc_per_node 4 -m lm_core.train --size 2.7B --bf16 --tp 2 --fsdp torch \
        --sequence-parallel --fused-loss --batch-size 8 --context-length 1024
    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \
        -m lm_core.train --size xl --bf16 --ddp bucketed --zero --batch-size 16  # each host

Every option is a field of `lm_core.train_config.TrainConfig` (`--max-lr` is `optim.max_lr`);
the flags are built from its fields, so `--help`, TOML files and Python name the same options.
`--batch-size` is the global number of sequences per micro-step, split evenly over ranks;
each optimizer step sees batch-size x grad-accum-steps sequences.

In Python: `run(TrainConfig(...))` validates and trains, returning the `TrainResult`;
`main(argv)` does what the command does (tests call it in-process).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lm_core.train_checks import resolve_config
from lm_core.train_config import (
    SECTIONS,
    ConfigError,
    KeyNames,
    TrainConfig,
    flag_of,
    read_toml,
)

if TYPE_CHECKING:
    from lm_core.trainer import TrainResult

_CONFIG_DEST = "config"
_DUMP_DEST = "dump_config"


def build_parser() -> argparse.ArgumentParser:
    """The trainer's argument parser: one flag per `TrainConfig` field, grouped by section.

    Flags that are not given are absent from the parsed namespace (`argparse.SUPPRESS`), so
    only those given override the `--config` file."""
    p = argparse.ArgumentParser(
        prog="python -m lm_core.train",
        description="Train a TransformerLM (single device or torchrun). Options come from "
        "their defaults, then a --config TOML file, then the flags given.",
        argument_default=argparse.SUPPRESS,
    )
    p.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        dest=_CONFIG_DEST,
        help="TOML file of options by section ([optim] max_lr = 3e-3); flags override it",
    )
    p.add_argument(
        "--dump-config",
        metavar="FILE",
        dest=_DUMP_DEST,
        help="write the options of this command (file and flags merged, checked) as TOML to "
        "FILE ('-': stdout) and exit without training",
    )
    for section, cls in SECTIONS.items():
        group = p.add_argument_group(section, (cls.__doc__ or "").partition(": ")[2])
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            _add_option(group, f"{section}.{f.name}", hints[f.name], f)
    return p


def _add_option(group: Any, key: str, hint: Any, f: Any) -> None:
    """The flag of one field: its type converts the string, Literal types and `choices`
    restrict it, bools get `--x` / `--no-x`."""
    members = [hint]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        members = [h for h in typing.get_args(hint) if h is not type(None)]
    base = members[0] if len(members) == 1 else str  # str | int: parsed later (parse_every)
    doc = f.metadata["doc"].replace("%", "%%")
    if isinstance(f.default, bool):
        doc += " [default: on]" if f.default else ""
    elif f.default is not None:
        doc += f" [default: {f.default}]"
    kwargs: dict[str, Any] = {"dest": key, "help": doc}
    if base is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif typing.get_origin(base) is typing.Literal:
        kwargs["choices"] = list(typing.get_args(base))
    else:
        kwargs["type"] = base
        if "choices" in f.metadata:
            kwargs["choices"] = list(f.metadata["choices"])
        if "metavar" in f.metadata:
            kwargs["metavar"] = f.metadata["metavar"]
    group.add_argument(flag_of(key), **kwargs)


def _merged(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None
) -> tuple[TrainConfig, KeyNames, argparse.Namespace]:
    """The options of `argv`: defaults, then the --config file, then the flags given; type
    errors exit through `parser.error`. Also returns how errors should name each option."""
    ns = parser.parse_args(argv)
    given = {k: v for k, v in vars(ns).items() if k not in (_CONFIG_DEST, _DUMP_DEST)}
    config, from_file = TrainConfig(), frozenset()
    path = getattr(ns, _CONFIG_DEST, None)
    try:
        if path is not None:
            raw = read_toml(path)
            config = TrainConfig.from_dict(raw, source=path)
            keys = {f"{s}.{k}" for s, table in raw.items() for k in table}
            from_file = frozenset(keys - set(given))
        config = config.with_overrides(given)
    except ConfigError as exc:  # the message names the file and the key
        parser.error(str(exc))
    return config, KeyNames(flags=True, from_file=from_file), ns


def _checked(
    parser: argparse.ArgumentParser,
    config: TrainConfig,
    names: KeyNames,
    ns: argparse.Namespace,
    check_run_dir: bool = True,
    tell_peers: bool = False,
) -> TrainConfig:
    """`resolve_config`, its ConfigError as a parser error (exit 2) naming the option; the
    message starts with the --config file when the option came from there. With
    `tell_peers`, under torchrun the other ranks learn of the error first (a file missing on
    one host only would leave them waiting: `lm_core.distributed.refuse_together`)."""
    try:
        return resolve_config(config, names, check_run_dir=check_run_dir)
    except ConfigError as exc:
        source = getattr(ns, _CONFIG_DEST, None)
        prefix = f"{source}: " if exc.key in names.from_file else ""
        if tell_peers:
            _refuse_together(f"{prefix}{exc}", config)
        parser.error(f"{prefix}{exc}")


def _refuse_together(message: str, config: TrainConfig) -> None:
    from lm_core.distributed import refuse_together

    p = config.parallel
    refuse_together(message, p.ddp, config.training.device, p.backend, fsdp=p.fsdp, tp=p.tp)


def parse_args(argv: Sequence[str] | None = None) -> TrainConfig:
    """The resolved `TrainConfig` of a command line (`lm_core.train_checks.resolve_config`);
    an invalid option exits with status 2 and a message naming the flag (or, for a value from
    the --config file, the file and the key)."""
    parser = build_parser()
    config, names, ns = _merged(parser, argv)
    return _checked(parser, config, names, ns)


def run(config: TrainConfig) -> TrainResult:
    """Train as `config` says: what `python -m lm_core.train` does, from Python.

    The config is checked first as the command line's is (`resolve_config`: a ConfigError,
    a ValueError, names the option by its key, e.g. `optim.max_lr`); `config` itself is not
    modified. Under torchrun call it on every rank. Returns the `lm_core.trainer.TrainResult`:
    `step` (steps completed), `final_loss`, `history` (the logged records), `evals`, the
    trained `model` and `optimizer`. A wrapped model holds its gloo process group, whose
    destructor can hang when the result is freed (`cli()` explains why): in a torchrun
    worker that is done, flush what you write and leave through `os._exit`, as `cli()` does.

    Example:
        from lm_core.train import run
        from lm_core.train_config import TrainConfig
        config = TrainConfig.from_toml("run.toml")
        config.training.steps = 50
        result = run(config)
        print(result.step, result.final_loss)
    """
    from lm_core.trainer import train

    return train(config)


def main(argv: Sequence[str] | None = None) -> TrainResult | None:
    """Parse `argv` (default: sys.argv[1:]) and train; returns the `TrainResult` (None after
    --dump-config, which writes the merged options and trains nothing)."""
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    config, names, ns = _merged(parser, argv)
    dump = getattr(ns, _DUMP_DEST, None)
    if dump is not None:  # an existing run in --out-dir is no reason to refuse a dump
        _checked(parser, config, names, ns, check_run_dir=False)
        _write_text(dump, config.to_toml())
        return None
    return run(_checked(parser, config, names, ns, tell_peers=True))


def _write_text(target: str, text: str) -> None:
    if target == "-":
        sys.stdout.write(text)
        return
    from lm_core.ckpt_io import atomic_write

    atomic_write(Path(target), lambda f: f.write(text.encode()))


def cli() -> None:
    """The `lm-train` console script: `main()`, then exit status 0 (its TrainResult is not a
    code) without freeing the run's objects (`_exit_now`)."""
    result = main()
    # The run's files are written and closed by now. What is left would only free objects,
    # and freeing them can hang or abort a finished job: a wrapped model keeps its gloo
    # process group alive after `destroy_process_group` (which does not stop gloo's worker
    # threads), so the group's destructor runs when the TrainResult is dropped, on this
    # thread, holding the interpreter lock while it joins those workers; a worker that needs
    # the lock (to drop a tensor's Python object, or its own thread state) never finishes.
    # Dropped here, that hung a two-node CI job after its last step (the worker's stack ended
    # at this call); dropped during interpreter exit, it aborts the process ("terminate
    # called without an active exception").
    _exit_now(0, keep=result)


def _exit_now(code: int, keep: object = None) -> None:
    """Flush stdout, stderr and logging, then end the process with `code` through `os._exit`:
    no destructors, no at-exit teardown. `keep` stays referenced until then."""
    import logging
    import os

    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken stream: nothing to flush
            stream.flush()
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    cli()
