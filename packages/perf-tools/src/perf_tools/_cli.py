"""Argument types and option groups shared by the perf_tools commands.

Every type raises `argparse.ArgumentTypeError`, so a bad value ends with argparse's usual
"argument --steps: ..." message that names the flag and the expected value. The ``config_*``
checks at the end are the configs' (`__post_init__`): each returns the value normalized or
raises ValueError("<field>: expected ..., got ...").
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
from collections.abc import Callable, Iterable, Sequence
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
    """A finite float > 0 (inf and nan are refused here, not later in a traceback)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not 0 < value < math.inf:
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


def exit_now(code: int) -> None:
    """Flush stdout and stderr, then end the process through `os._exit`: no destructors, no
    at-exit teardown (which has aborted processes holding gloo's threads, or stopped mid-step
    by a signal, after their results were written)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken stream: nothing to flush
            stream.flush()
    os._exit(code)


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


def model_dim_fields(a: argparse.Namespace) -> dict[str, Any]:
    """The model-dimension flags accounting and plan share (--size, --d-model, --d-ff,
    --num-layers, --vocab-size, --num-heads, --ffn-only) as their configs' fields."""
    return {
        "size": a.size,
        "d_model": a.d_model,
        "d_ff": a.d_ff,
        "num_layers": a.num_layers,
        "vocab_size": a.vocab_size,
        "num_heads": a.num_heads,
        "ffn_only": a.ffn_only,
    }


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


def config_int(field: str, value: object, low: int | None = None) -> int:
    """An int >= ``low``; a bool is refused (True is 1 to Python, never a count here)."""
    if isinstance(value, bool) or not isinstance(value, int) or (low is not None and value < low):
        words = "an integer" if low is None else f"an integer >= {low}"
        words = "a positive integer" if low == 1 else words
        raise ValueError(f"{field}: expected {words}, got {value!r}")
    return value


def config_number(
    field: str,
    value: object,
    low: float | None = None,
    *,
    closed: bool = False,
    high: float | None = None,
    expected: str | None = None,
    finite: bool = True,
) -> float:
    """An int or float (not a bool, not NaN; not infinite unless ``finite`` is False) above
    ``low`` (at least it when ``closed``) and at most ``high``; ``expected`` words the message
    (default: from the bounds)."""
    ok = not isinstance(value, bool) and isinstance(value, int | float) and value == value
    if ok and finite:
        ok = math.isfinite(value)  # type: ignore[arg-type]
    if ok and low is not None:
        ok = value >= low if closed else value > low  # type: ignore[operator]
    if ok and high is not None:
        ok = value <= high  # type: ignore[operator]
    if not ok:
        if expected is None:
            expected = "a finite number"
            if low == 0 and not closed and high is None:
                expected = "a positive number"
            elif low is not None and high is not None:
                expected = f"a number in {'[' if closed else '('}{low:g}, {high:g}]"
            elif low is not None:
                expected = f"a number {'>=' if closed else '>'} {low:g}"
            elif high is not None:
                expected = f"a number <= {high:g}"
        raise ValueError(f"{field}: expected {expected}, got {value!r}")
    return value  # type: ignore[return-value]


def config_tuple(
    field: str,
    values: object,
    allowed: Sequence[Any] | None = None,
    *,
    empty: bool = False,
    unique: bool = False,
) -> tuple[Any, ...]:
    """A sequence field as a tuple (a list is welcome; a bare str is refused, not split into
    letters), each value one of ``allowed`` (type too: True is not 1) when given, at least one
    value unless ``empty``, repeats dropped (order kept) with ``unique``."""
    if isinstance(values, str | bytes) or not isinstance(values, Iterable):
        raise ValueError(f"{field}: expected a list or tuple of values, got {values!r}")
    out = tuple(dict.fromkeys(values)) if unique else tuple(values)
    if not out and not empty:
        raise ValueError(f"{field}: expected at least one value, got {out}")
    if allowed is not None:
        bad = [v for v in out if not any(v == a and type(v) is type(a) for a in allowed)]
        if bad:
            options = ", ".join(map(str, allowed))
            raise ValueError(f"{field}: expected some of {options}, got {bad}")
    return out
