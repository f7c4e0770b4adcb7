"""Recorded launches (``fastlaunch.Replay``) as launch descriptions for the C++ replay node.

``cpp_launch`` hands these to ``csrc/launch_replay.cpp``. A description holds one compiled
kernel's function handle, grid and launch attributes, and its parameters packed into one byte
string the way Triton 3.6's generated launcher packs them (one slot per non-constexpr
argument, each 8-byte aligned, a TMA descriptor as its filled 128-byte ``CUtensorMap``
128-byte aligned, then the global and profile scratch pointers). Slots that hold a call's
buffer addresses are listed so that C++ writes each call's addresses in; TMA descriptors come
with a function that fills one for another base address (C++ caches the result per address).

Everything here depends on that launcher's layout, so ``supported`` admits Triton 3.6 only;
on other releases the Python launchers stay in charge.
"""

from __future__ import annotations

import ctypes
import re
import struct
from collections.abc import Callable
from typing import Any

from .fastlaunch import Replay, _Step, _with_base

# The Triton release whose launcher layout this module repeats.
TRITON_SERIES = "3.6."

_INT_FORMATS = {
    "i1": "<b", "i8": "<b", "u1": "<B", "u8": "<B", "i16": "<h", "u16": "<H",
    "i32": "<i", "u32": "<I", "i64": "<q", "u64": "<Q",
}  # fmt: skip
_TENSORDESC = re.compile(r"tensordesc<([^[>]*)\[([^]]*)\]")


def supported(triton_version: str) -> bool:
    """Whether this Triton's launcher lays out parameters as ``launch_description`` does."""
    return triton_version.startswith(TRITON_SERIES)


def flat_types(signature: dict, tensordesc_meta: list | None) -> list[str]:
    """The launcher's flat parameter types for a kernel ``signature`` (argument name -> type
    string): a TMA descriptor becomes ``nvTmaDesc`` (or, without TMA metadata, a pointer, its
    shape and strides and a padding flag) followed by its shape (i32) and strides (i64)."""
    metas = iter(tensordesc_meta or [])
    out: list[str] = []
    for ty in signature.values():
        if isinstance(ty, tuple):
            raise TypeError("tuple kernel arguments are not supported")
        if isinstance(ty, str) and ty.startswith("tensordesc"):
            meta = next(metas) if tensordesc_meta else None
            match = _TENSORDESC.match(ty)
            if match is None:
                raise TypeError(f"unfamiliar tensor descriptor type {ty!r}")
            ndim = match.group(2).count(",") + 1
            if meta is None:
                out += ["*" + match.group(1)] + ["i64"] * (2 * ndim) + ["i1"]
            else:
                out.append("nvTmaDesc")
            out += ["i32"] * ndim + ["i64"] * ndim
        else:
            out.append(ty)
    return out


def pack(ty: str, value: Any) -> bytes:
    """One scalar or pointer parameter's bytes (little endian, as the launcher stores it)."""
    if ty.startswith("*"):
        return struct.pack("<Q", int(value or 0))
    if ty in _INT_FORMATS:
        return struct.pack(_INT_FORMATS[ty], int(value))
    if ty in ("fp32", "f32"):
        return struct.pack("<f", float(value))
    if ty in ("fp64", "f64"):
        return struct.pack("<d", float(value))
    if ty in ("fp16", "f16"):
        return struct.pack("<e", float(value))
    if ty == "bf16":  # the upper half of the float32 bits (truncation, as the launcher does)
        return struct.pack("<f", float(value))[2:]
    raise TypeError(f"unsupported parameter type {ty!r}")


def tensormap_bytes(obj: Any) -> bytes:
    """The 128-byte ``CUtensorMap`` inside Triton 3.6's ``PyCUtensorMap`` object (declared
    ``PyObject_HEAD; _Alignas(128) CUtensorMap tensorMap``: it starts 128 bytes in)."""
    if type(obj).__name__ != "PyCUtensorMap":
        raise TypeError(f"expected a PyCUtensorMap, got {type(obj).__name__}")
    return ctypes.string_at(id(obj) + 128, 128)


def _align(blob: bytearray, to: int) -> int:
    while len(blob) % to:
        blob.append(0)
    return len(blob)


def launch_description(step: _Step) -> dict:
    """The launch of one recorded step as ``launch_replay.cpp`` reads it; raises TypeError or
    ValueError where the step is not one this module can describe."""
    direct = step.direct
    if direct is None:
        raise ValueError("the step has no direct launch (Triton's dispatch launches it)")
    compiled = step.compiled
    types = flat_types(compiled.src.signature, getattr(compiled.metadata, "tensordesc_meta", None))
    if len(types) != len(direct.args):
        raise ValueError(f"{len(types)} parameter types for {len(direct.args)} arguments")
    coop, pdl, _, _, packed, _, _, _ = direct.head
    num_warps, num_ctas, shared = packed
    descriptors = {
        start: (index, template, meta) for start, _, index, template, meta, _ in direct.descriptors
    }
    pointer_slots = dict(direct.pointers)
    blob = bytearray()
    offsets: list[int] = []
    pointers: list[tuple[int, int]] = []
    fills: list[tuple[int, int, Callable[[int], bytes]]] = []
    for pos, (ty, value) in enumerate(zip(types, direct.args)):
        if ty == "constexpr":
            continue
        offset = _align(blob, 128 if ty == "nvTmaDesc" else 8)
        offsets.append(offset)
        if ty == "nvTmaDesc":
            index, template, meta = descriptors[pos]
            blob += tensormap_bytes(value)
            fills.append((offset, index, _descriptor_fill(direct.expand, template, meta)))
        else:
            if pos in descriptors:  # a descriptor passed as a pointer (no TMA metadata)
                pointers.append((offset, descriptors[pos][0]))
            elif pos in pointer_slots:
                pointers.append((offset, pointer_slots[pos]))
            blob += pack(ty, value)
    for _ in range(2):  # the global and profile scratch pointers (none: ``fastlaunch``)
        offsets.append(_align(blob, 8))
        blob += bytes(8)
    return {
        "function": int(compiled.function), "grid": list(step.grid), "num_warps": num_warps,
        "num_ctas": num_ctas, "shared": shared, "coop": bool(coop), "pdl": bool(pdl),
        "blob": bytes(blob), "offsets": offsets, "pointers": pointers, "descs": fills,
    }  # fmt: skip


def _descriptor_fill(expand: Callable, template: Any, meta: Any) -> Callable[[int], bytes]:
    """base address -> the 128 bytes of ``template``'s descriptor moved to that address."""

    def fill(base: int) -> bytes:
        return tensormap_bytes(expand(_with_base(template, base), meta)[0])

    return fill


def describe(replay: Replay) -> list[dict] | None:
    """Every step of ``replay`` described, or None where one cannot be."""
    try:
        return [launch_description(step) for step in replay.steps]
    except (TypeError, ValueError, KeyError, AttributeError):
        return None
