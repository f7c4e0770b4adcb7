"""Tensors inside nested Python containers (a module's inputs and outputs), for FSDP's casts
and backward hooks."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch


def cast_float(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` in `dtype` if it is floating, else `t` (token ids stay integers)."""
    return t.to(dtype) if t.is_floating_point() else t


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """`obj` with `fn` applied to every tensor in nested tuples, lists and dicts."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(map_tensors(o, fn) for o in obj))
    if isinstance(obj, list | tuple):
        return type(obj)(map_tensors(o, fn) for o in obj)
    if isinstance(obj, dict):
        return type(obj)((k, map_tensors(v, fn)) for k, v in obj.items())
    return obj


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in nested tuples, lists and dicts."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, list | tuple):
        for o in obj:
            yield from tensors_in(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from tensors_in(o)
