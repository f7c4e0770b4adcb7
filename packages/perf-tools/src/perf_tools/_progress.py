"""The one progress bar of perf_tools (tqdm; a disabled bar when quiet)."""

from __future__ import annotations

from typing import Any


def progress(total: int, label: str, quiet: bool = False, *, leave: bool = True) -> Any:
    """A tqdm bar of `total` steps labelled `label`; with `quiet` a bar that prints nothing.

    Either way it has `update(n)` and `close()` and is a context manager.
    """
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=label, dynamic_ncols=True, leave=leave, disable=quiet)
