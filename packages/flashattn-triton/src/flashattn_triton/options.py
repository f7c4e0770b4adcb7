"""Kernel options: the switches a user may need, as one typed, validated object.

``Options`` holds the backward scheme, tile overrides, float32 matrix precision and the
other launch choices. The active options are read once from ``FLASHATTN_TRITON_*``
environment variables at import (handy for experiments in a fresh process), and changed
in code with :func:`set_options` or, for a block, the :func:`use_options` context manager::

    import flashattn_triton as fa

    fa.set_options(backward="split")          # from now on
    with fa.use_options(tile_configs="fwd=128,64,4,3"):
        o = fa.flash_attention(q, k, v, causal=True)

Nothing is read from the environment per call: the launchers cache a launch plan per input
layout and options, and every change here invalidates those plans.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, fields, replace

BWD_SCHEMES = ("auto", "split", "fused", "atomic", "onepass")
FP32_PRECISIONS = ("tf32x3", "tf32", "ieee")

# option name -> environment variable read at import
ENV_VARS = {
    "backward": "FLASHATTN_TRITON_BWD",
    "fp32_precision": "FLASHATTN_TRITON_FP32_PRECISION",
    "gluon": "FLASHATTN_TRITON_GLUON",
    "head_group": "FLASHATTN_TRITON_HEAD_GROUP",
    "tile_configs": "FLASHATTN_TRITON_CONFIGS",
    "autotune": "FLASHATTN_TRITON_AUTOTUNE",
    "fast_launch": "FLASHATTN_TRITON_FAST_LAUNCH",
    "traced_compile": "FLASHATTN_TRITON_TRACED_COMPILE",
    "cpp_launch": "FLASHATTN_TRITON_CPP_LAUNCH",
    "cpp_launch_compiled": "FLASHATTN_TRITON_CPP_LAUNCH_COMPILED",
}
_BOOLS = ("gluon", "autotune", "fast_launch", "cpp_launch_compiled")  # the on/off options
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Options:
    """Launch choices of the Triton backend (all have measured defaults).

    backward: ``auto`` (fused on small causal 16-bit grids; else on Hopper at head dims 64
        and 128 from 2048 keys (d = 64: more, ``gluon_bwd.enough_keys``) the one-pass Gluon
        backward, ``onepass``; else split), ``split``,
        ``fused``, ``atomic`` or ``onepass`` (see ``launch``). ``onepass`` sums dQ by
        atomics, so its last bits may vary between runs; ``split`` is deterministic, and
        torch's deterministic mode runs it instead of ``onepass``.
    fp32_precision: matrix-unit precision for float32 inputs, ``tf32x3`` (near-fp32),
        ``tf32`` or ``ieee``; None follows ``torch.get_float32_matmul_precision()``
        ('highest' -> tf32x3, else tf32).
    gluon: allow the Hopper Gluon kernels (d = 128: the forward from 2048 keys, non-causal
        from 512 on a persistent grid, the split backward; d = 64: the forward on large
        grids; d = 64 and 128: the one-pass backward) where they apply.
    head_group: launch order by head groups, ``auto``, ``off`` or a number of heads (not
        the persistent forward's, which runs heads in order).
    tile_configs: tile overrides, ``"fwd=128,64,4,3;dq=128,64,8,3,tma"`` (see
        ``configs.TileConfig.parse``; ``kind.fp32=...`` for float32 inputs).
    autotune: ``triton.autotune`` per (sequence bucket, head dim, dtype, causal) instead of
        the default tables (the first call per key takes a while).
    fast_launch: after the first call per input layout, launch the compiled kernels directly
        from a cached plan (skips Triton's per-call argument binding); False always goes
        through Triton's JIT dispatch.
    traced_compile: under torch.compile, let the compiler trace the launchers and launch the
        Triton kernels itself (``traced_ops``: no Python of ours per compiled call, but
        pointer loads and no Gluon kernels) where sizes and the scale are concrete; False
        calls one opaque op per forward and backward instead; ``auto`` traces the calls of
        at most ``configs.TRACED_MAX_WORK`` (where host time counts more than the kernels')
        outside graphs compiled for CUDA graphs, on GPUs like the ones its tiles were
        measured on (``_device.tables_fit``), which makes host-bound compiled models faster
        (the default).
    cpp_launch: repeated eager calls (4-D, 3-D) through a C++ autograd node that replays the
        recorded launches, forward and backward (``cpp_launch``; calls autograd does not
        record replay the forward alone); ``auto`` compiles it in the background at the
        first such call and uses it once ready (the default; without a C++ compiler the
        Python path stays), True compiles it in the first call and raises if that fails,
        False keeps the Python launchers.
    cpp_launch_compiled: compiled graphs' opaque ops replay through the same C++ entries
        instead of the Python launchers (``cpp_launch.op_forward``); with it
        ``traced_compile="auto"`` traces no call while the C++ path can serve them
        (``cpp_launch.serves_compiled``), so compiled calls keep the Gluon kernels and TMA.
        On by default: on an H100 it puts more compiled sweep rows at or under SDPA than
        traced calls do and ties or beats them in the compiled small and xl models
        (BENCHMARKS 3.1, 3.3); False traces small calls again.
    """

    backward: str = "auto"
    fp32_precision: str | None = None
    gluon: bool = True
    head_group: str | int = "auto"
    tile_configs: str = ""
    autotune: bool = False
    fast_launch: bool = True
    traced_compile: bool | str = "auto"
    cpp_launch: bool | str = "auto"
    cpp_launch_compiled: bool = True

    def __post_init__(self) -> None:
        if self.backward not in BWD_SCHEMES:
            raise ValueError(f"backward must be one of {BWD_SCHEMES}, got {self.backward!r}")
        if self.fp32_precision is not None and self.fp32_precision not in FP32_PRECISIONS:
            raise ValueError(
                f"fp32_precision must be None or one of {FP32_PRECISIONS}, "
                f"got {self.fp32_precision!r}"
            )
        for name in _BOOLS:
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("traced_compile", "cpp_launch"):
            value = getattr(self, name)
            if not (isinstance(value, bool) or value == "auto"):
                raise ValueError(f"{name} must be True, False or 'auto', got {value!r}")
        object.__setattr__(self, "head_group", _head_group(self.head_group))
        if not isinstance(self.tile_configs, str):
            raise TypeError(f"tile_configs must be a str, got {type(self.tile_configs).__name__}")
        from .configs import parse_overrides

        parse_overrides(self.tile_configs)  # raises ValueError naming the bad item

    def resolved_fp32_precision(self) -> str:
        """The float32 precision in effect (torch's setting where ``fp32_precision`` is None)."""
        if self.fp32_precision is not None:
            return self.fp32_precision
        import torch

        return "tf32x3" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def _head_group(value: str | int) -> str | int:
    if isinstance(value, bool):
        raise TypeError(f"head_group must be 'auto', 'off' or a positive int, got {value!r}")
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"head_group must be 'auto', 'off' or a positive int, got {value}")
        return value
    spec = str(value).strip().lower()
    if spec in ("auto", "off"):
        return spec
    if spec.isdigit() and int(spec) >= 1:
        return int(spec)
    raise ValueError(f"head_group must be 'auto', 'off' or a positive int, got {value!r}")


def from_env(environ: Mapping[str, str] | None = None) -> Options:
    """Options from ``FLASHATTN_TRITON_*`` variables (unset ones keep their defaults); an
    invalid value raises ValueError naming the variable."""
    environ = os.environ if environ is None else environ
    kwargs: dict[str, object] = {}
    for name, var in ENV_VARS.items():
        raw = environ.get(var)
        if raw is None:
            continue
        value: object = raw.strip()
        if name in _BOOLS:
            low = raw.strip().lower()
            if low not in _TRUE + _FALSE:
                raise ValueError(f"{var} must be 1 or 0, got {raw!r}")
            value = low in _TRUE
        elif name in ("traced_compile", "cpp_launch"):
            low = raw.strip().lower()
            if low not in _TRUE + _FALSE + ("auto",):
                raise ValueError(f"{var} must be 1, 0 or auto, got {raw!r}")
            value = "auto" if low == "auto" else low in _TRUE
        elif name in ("backward", "fp32_precision"):
            value = raw.strip().lower()
        kwargs[name] = value
    try:
        return Options(**kwargs)
    except (TypeError, ValueError) as e:
        bad = next((ENV_VARS[f.name] for f in fields(Options) if f.name in str(e)), "")
        raise ValueError(f"{bad}: {e}" if bad else str(e)) from None


_current: Options | None = None
# Read at import, so that a graph torch.compile traces never makes the first read; a bad
# variable is reported by the first call, not by the import.
with contextlib.suppress(ValueError):
    _current = from_env()
_listeners: list[Callable[[], None]] = []


def get_options() -> Options:
    """The active options (read from the environment at import, or on the first call if a
    variable was bad then)."""
    global _current
    if _current is None:
        _current = from_env()
    return _current


def set_options(new: Options | None = None, /, **changes: object) -> Options:
    """Replace the active options (``new``, or the current ones with ``changes``); returns
    the previous options. Cached launch plans are dropped."""
    global _current
    previous = get_options()
    base = previous if new is None else new
    if not isinstance(base, Options):
        raise TypeError(f"set_options takes an Options, got {type(base).__name__}")
    unknown = set(changes) - {f.name for f in fields(Options)}
    if unknown:
        raise TypeError(f"unknown option(s) {sorted(unknown)}; known: {sorted(asdict(base))}")
    _current = replace(base, **changes) if changes else base
    for listener in _listeners:
        listener()
    return previous


@contextlib.contextmanager
def use_options(**changes: object) -> Iterator[Options]:
    """``with use_options(backward="split"): ...``: the changes apply inside the block only."""
    previous = set_options(**changes)
    try:
        yield get_options()
    finally:
        set_options(previous)


def reload_from_env() -> Options:
    """Re-read the environment variables (for scripts that change them mid-process)."""
    set_options(from_env())
    return get_options()


def on_change(listener: Callable[[], None]) -> None:
    """Call ``listener`` whenever the options change (the launchers drop their plans)."""
    _listeners.append(listener)
