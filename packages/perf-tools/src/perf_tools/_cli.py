"""Argument types and option groups shared by the perf_tools commands.

Every type raises `argparse.ArgumentTypeError`, so a bad value ends with argparse's usual
"argument --steps: ..." message that names the flag and the expected value.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def positive_int(text: str) -> int:
    """An int >= 1."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def nonneg_int(text: str) -> int:
    """An int >= 0."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A float > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def choice(options: Sequence[str], aliases: dict[str, str] | None = None) -> Callable[[str], str]:
    """A case-insensitive choice with aliases; the error lists the accepted values."""
    canon = {o.lower(): o for o in options}
    for alias, target in (aliases or {}).items():
        canon[alias.lower()] = target

    def parse(text: str) -> str:
        try:
            return canon[text.lower()]
        except KeyError:
            raise argparse.ArgumentTypeError(
                f"expected one of {', '.join(options)}; got {text!r}"
            ) from None

    return parse


def flatten(values: Sequence[Any] | None) -> list[Any] | None:
    """Flatten `nargs='+'` values that may also be comma-separated ('128,256 512')."""
    if values is None:
        return None
    out: list[Any] = []
    for v in values:
        out.extend(v if isinstance(v, list) else [v])
    # keep order, drop repeats: a sweep never measures the same cell twice
    return list(dict.fromkeys(out))


def listed(item_type: Callable[[str], T]) -> Callable[[str], list[T]]:
    """An argparse type for 'a,b,c' (combine with nargs='+' and `flatten`)."""

    def parse(text: str) -> list[T]:
        parts = [p for p in text.split(",") if p.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(f"expected a value, got {text!r}")
        return [item_type(p.strip()) for p in parts]

    return parse


def add_output_args(
    parser: argparse.ArgumentParser, plot: bool = True, inherit: bool = False
) -> None:
    """--csv, --json (and --plot) options every tool has. ``inherit``: for a subcommand whose
    parent parser has the same options; leaving one out keeps the parent's value."""
    d = {"default": argparse.SUPPRESS} if inherit else {}
    group = parser.add_argument_group("output")
    group.add_argument("--csv", type=Path, metavar="FILE", help="write the table as CSV", **d)
    group.add_argument(
        "--json", type=Path, metavar="FILE", help="write the table and run metadata as JSON", **d
    )
    if plot:
        group.add_argument(
            "--plot", type=Path, metavar="PNG", help="save a plot of the results", **d
        )
    group.add_argument("--quiet", action="store_true", help="no progress bars", **d)


def default_device() -> str:
    """'cuda' when a GPU is visible, else 'cpu'."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def device_arg(text: str) -> torch.device:
    """A torch device string that exists on this machine."""
    try:
        dev = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(
            f"expected a device like cpu or cuda, got {text!r}"
        ) from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError("cuda: no CUDA device is visible on this machine")
    if dev.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu or cuda, got {text!r}")
    return dev


def config_device(value: object, field: str = "device") -> torch.device:
    """A config's device (a torch.device or its name) as a torch.device; ValueError naming
    ``field`` unless it is cpu or cuda (configs check values, not this machine's GPUs)."""
    try:
        dev = torch.device(value)
    except (RuntimeError, TypeError):
        raise ValueError(f"{field}: expected cpu or cuda, got {value!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"{field}: expected cpu or cuda, got {dev}")
    return dev
