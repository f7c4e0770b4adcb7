"""Launch plans: repeat a call's kernel launches with the compiled kernels themselves.

Triton's ``kernel[grid](**kwargs)`` binds, specializes and hashes every argument on every
call; for our 36-60 argument kernels that is most of a launch's host time (on an H100 host,
76-98 us per launch through the JIT against 25-31 us for the same compiled kernel called
directly). So the launchers run the first call for a given input layout the ordinary way
while a ``Recorder`` notes each launch, then build a ``Replay`` that, for later calls with
the same layout, fills the new data pointers into the recorded argument lists and calls each
compiled kernel directly, the way Triton's own dispatcher finally does.

A replay is only valid where the recorded launches depend on nothing but the cache key:
shapes, strides, dtypes, flags, options and the 16-byte alignment of every pointer (all part
of the key; Triton specializes on them). Every tensor argument must be one of the call's
buffers, matched by data pointer; a launch that cannot be expressed so (an unknown tensor,
a callable grid, an unfamiliar compiled-kernel object) makes the key fall back to the JIT
path for good. A replay that raises is dropped the same way, with one warning.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

_local = threading.local()
# Launch through the compiled kernel's C launcher where possible (``_Direct``); False keeps
# each replayed launch on ``compiled.run`` (for A/B measurements).
DIRECT = True


def launch(kernel: Any, grid: tuple, *args: Any, **kwargs: Any) -> Any:
    """``kernel[grid](*args, **kwargs)``, noted by the active ``Recorder`` of this thread;
    inside ``traced()``, through ``torch.library.wrap_triton`` (nothing returned)."""
    if getattr(_local, "tracing", False):
        _launch_traced(kernel, grid, args, kwargs)
        return None
    compiled = kernel[grid](*args, **kwargs)
    recorder = getattr(_local, "recorder", None)
    if recorder is not None:
        recorder.note(kernel, grid, args, kwargs, compiled)
    return compiled


def _launch_traced(kernel: Any, grid: tuple, args: tuple, kwargs: dict) -> None:
    """``wrap_triton(kernel)[grid]`` with every kernel parameter passed, defaults included
    (torch.compile's analysis of which tensors a kernel writes counts the arguments given),
    and without a register cap (torch.compile would pass it on as a kernel argument)."""
    signature = getattr(kernel, "signature", None)
    if not isinstance(signature, inspect.Signature):  # the interpreter's: launched as given
        kwargs = {k: v for k, v in kwargs.items() if k != "maxnreg"}
        torch.library.wrap_triton(kernel)[grid](*args, **kwargs)
        return
    params = {k: v for k, v in kwargs.items() if k in signature.parameters}
    options = {k: v for k, v in kwargs.items() if k not in params and k != "maxnreg"}
    bound = signature.bind(*args, **params)
    bound.apply_defaults()
    torch.library.wrap_triton(kernel)[grid](**bound.arguments, **options)


def tracing() -> bool:
    """Whether this thread runs inside ``traced()`` (a ``traced_ops`` body: tensors may be
    fake, with no address; launches become graph nodes under torch.compile)."""
    return getattr(_local, "tracing", False)


@contextlib.contextmanager
def traced() -> Iterator[None]:
    """Launch through ``torch.library.wrap_triton`` inside the block (a ``triton_op`` body),
    so that torch.compile records each Triton kernel instead of running it; the launchers
    then skip everything that needs addresses (launch plans, TMA descriptors, Gluon)."""
    outer = tracing()
    _local.tracing = True
    try:
        yield
    finally:
        _local.tracing = outer


class Recorder:
    """Notes the launches made through ``launch`` inside its ``with`` block (this thread)."""

    def __init__(self) -> None:
        self.records: list[tuple] = []

    def note(self, kernel, grid, args, kwargs, compiled) -> None:
        self.records.append((kernel, grid, args, kwargs, compiled))

    def __enter__(self) -> Recorder:
        self._outer = getattr(_local, "recorder", None)
        _local.recorder = self
        return self

    def __exit__(self, *exc) -> None:
        _local.recorder = self._outer


class _Address(int):
    """A device address standing in for a tensor where a launcher asks for ``data_ptr()``."""

    def data_ptr(self) -> int:
        return int(self)


def _with_base(template: Any, base: int) -> Any:
    """A copy of a tensor descriptor with another base address (no re-validation: shape,
    strides and block are the recorded ones, the address has the recorded alignment)."""
    desc = object.__new__(type(template))
    desc.__dict__.update(template.__dict__)
    desc.base = _Address(base)
    return desc


@dataclass
class _Step:
    compiled: Any
    grid: tuple[int, int, int]
    args: list
    pointers: list[tuple[int, int]]  # (argument position, buffer index)
    descriptors: list[tuple[int, int, Any]]  # (argument position, buffer index, template)
    direct: _Direct | None = None  # the compiled kernel's C launcher, called as Triton does


# The C launcher's leading arguments in the Triton release whose launch path ``_Direct``
# repeats (3.6): grid, stream, function, cooperative, PDL, two scratch buffers, metadata,
# launch metadata and the two hooks; the kernel's arguments follow, TMA descriptors expanded.
_BASE_ARGS_FORMAT = "iiiKKppOOOOOO"


@dataclass
class _Direct:
    """A step launched through its compiled kernel's C launcher with pre-expanded arguments:
    what Triton's ``CudaLauncher`` does per call (scratch buffers, expanding each TMA
    descriptor into a filled ``CUtensorMap`` and its shape and strides) done once per layout,
    and per descriptor once per base address (a training loop reuses a few)."""

    launch: Callable[..., Any]
    head: tuple  # cooperative, PDL, scratch, scratch, metadata, launch metadata, hooks
    args: list  # the kernel's arguments, expanded
    pointers: list[tuple[int, int]]  # (position in args, buffer index)
    descriptors: list[tuple[int, int, int, Any, Any, dict]]  # start, end, buffer, template,
    # the launcher's metadata for it, and expansions by base address
    expand: Callable[[Any, Any], list]

    def run(self, function: Any, grid: tuple[int, int, int], stream: int, addresses) -> None:
        args = self.args.copy()
        for pos, index in self.pointers:
            args[pos] = addresses[index]
        for start, end, index, template, meta, cache in self.descriptors:
            base = addresses[index]
            expanded = cache.get(base)
            if expanded is None:
                if len(cache) >= 64:
                    cache.clear()
                expanded = cache[base] = self.expand(_with_base(template, base), meta)
            args[start:end] = expanded
        g0, g1, g2 = grid
        self.launch(g0, g1, g2, stream, function, *self.head, *args)


def _direct(compiled: Any, values: list, pointers, descriptors) -> _Direct | None:
    """The direct launch of ``compiled`` with these arguments, where this Triton's launcher
    is the one ``_Direct`` knows (else None: the step goes through ``compiled.run``)."""
    import sys

    driver = sys.modules.get("triton.backends.nvidia.driver")
    launcher = compiled.run
    if (
        driver is None
        or getattr(driver, "_BASE_ARGS_FORMAT", None) != _BASE_ARGS_FORMAT
        or type(launcher).__name__ != "CudaLauncher"
        or getattr(launcher, "global_scratch_size", 1) != 0
        or getattr(launcher, "profile_scratch_size", 1) != 0
    ):
        return None
    raw, metas, positions = launcher.launch, [], set()
    if descriptors:
        closure = inspect.getclosurevars(launcher.launch).nonlocals
        if not {"launcher", "tensordesc_meta", "tensordesc_indices"} <= set(closure):
            return None
        raw, metas, positions = (
            closure["launcher"], list(closure["tensordesc_meta"]), closure["tensordesc_indices"]
        )  # fmt: skip
    if positions != {pos for pos, _, _ in descriptors} or len(metas) != len(descriptors):
        return None
    if any(m is not None and m.get("fp4_padded") for m in metas):
        return None
    expand = driver.make_tensordesc_arg
    slots = dict(pointers)
    by_pos = {pos: (index, template) for pos, index, template in descriptors}
    flat, flat_pointers, flat_descs, meta_iter = [], [], [], iter(metas)
    for pos, value in enumerate(values):
        if pos in by_pos:
            index, template = by_pos[pos]
            meta = next(meta_iter)
            start = len(flat)
            flat.extend(expand(_with_base(template, template.base.data_ptr()), meta))
            flat_descs.append((start, len(flat), index, template, meta, {}))
        else:
            if pos in slots:
                flat_pointers.append((len(flat), slots[pos]))
            flat.append(value)
    head = (
        launcher.launch_cooperative_grid, launcher.launch_pdl, None, None,
        compiled.packed_metadata, None, None, None,
    )  # fmt: skip
    return _Direct(raw, head, flat, flat_pointers, flat_descs, expand)


def _hooks_active(runtime: Any) -> bool:
    """Whether a launch hook (e.g. a profiler's) is set: then launches keep Triton's path."""
    for name in ("launch_enter_hook", "launch_exit_hook"):
        hook = getattr(runtime, name, None)
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


def _is_descriptor(value: Any) -> bool:
    return type(value).__name__ == "TensorDescriptor" and hasattr(value, "base")


def _step(record: tuple, addresses: Sequence[int]) -> _Step | None:
    kernel, grid, args, kwargs, compiled = record
    if callable(grid) or compiled is None:
        return None
    if not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
        return None
    signature = getattr(kernel, "signature", None)
    if not isinstance(signature, inspect.Signature):
        return None
    params = signature.parameters
    bound = signature.bind(*args, **{k: v for k, v in kwargs.items() if k in params})
    bound.apply_defaults()
    values = list(bound.arguments.values())
    pointers, descriptors = [], []
    for pos, value in enumerate(values):
        if isinstance(value, torch.Tensor):
            ptr = value.data_ptr()
            if ptr not in addresses:
                return None
            pointers.append((pos, addresses.index(ptr)))
            values[pos] = ptr
        elif _is_descriptor(value):
            if not hasattr(value, "__dict__") or not isinstance(value.base, torch.Tensor):
                return None
            ptr = value.base.data_ptr()
            if ptr not in addresses:
                return None
            descriptors.append((pos, addresses.index(ptr), value))
    g = (*tuple(grid), 1, 1)
    step = _Step(compiled, (int(g[0]), int(g[1]), int(g[2])), values, pointers, descriptors)
    try:
        step.direct = _direct(compiled, values, pointers, descriptors)
    except Exception:  # an unfamiliar launcher: compiled.run it is
        step.direct = None
    return step


class Replay:
    """The recorded launches of one call, replayed with new buffer addresses."""

    def __init__(self, steps: list[_Step]) -> None:
        self.steps = steps
        from triton import knobs

        self._runtime = knobs.runtime

    @classmethod
    def build(cls, records: list[tuple], addresses: Sequence[int]) -> Replay | None:
        """A replay of ``records`` whose tensor arguments are all among ``addresses`` (the
        call's buffers, in a fixed order), or None where that does not hold."""
        if not records:
            return None
        try:
            steps = [_step(r, list(addresses)) for r in records]
            if any(s is None for s in steps):
                return None
            return cls(steps)  # type: ignore[arg-type]
        except Exception:  # an unfamiliar Triton: the JIT path stays
            return None

    def run(self, addresses: Sequence[int], stream: int) -> None:
        """Launch every recorded kernel with the buffers at ``addresses`` on ``stream``."""
        runtime = self._runtime
        direct = DIRECT and not _hooks_active(runtime)
        enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
        for step in self.steps:
            if direct and step.direct is not None:
                step.direct.run(step.compiled.function, step.grid, stream, addresses)
                continue
            args = step.args.copy()
            for pos, index in step.pointers:
                args[pos] = addresses[index]
            for pos, index, template in step.descriptors:
                args[pos] = _with_base(template, addresses[index])
            ck, (g0, g1, g2) = step.compiled, step.grid
            meta = ck.launch_metadata(step.grid, stream, *args)
            ck.run(g0, g1, g2, stream, ck.function, ck.packed_metadata, meta, enter, leave, *args)


_NO_REPLAY = object()  # a key whose launches cannot be replayed: always the JIT path


class PlanCache:
    """Replays by cache key; ``run`` falls back to ``slow`` (the JIT path) and records it."""

    def __init__(self, max_entries: int = 4096) -> None:
        self._plans: dict[tuple, Any] = {}
        self.max_entries = max_entries

    def clear(self) -> None:
        self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)

    def forget(self, key: tuple) -> None:
        """Drop the plan of ``key``, if any."""
        self._plans.pop(key, None)

    def replay(self, key: tuple) -> Replay | None:
        """The replay recorded for ``key``, if it has one."""
        plan = self._plans.get(key)
        return plan if isinstance(plan, Replay) else None

    def replays(self) -> int:
        """How many keys have a replay (benchmarks and tests)."""
        return sum(isinstance(p, Replay) for p in self._plans.values())

    def run(
        self, key: tuple, addresses: Sequence[int], stream: int, slow: Callable[[], None]
    ) -> None:
        """Launch the call of ``key`` whose buffers sit at ``addresses``: replay it if it has
        a replay, else run ``slow`` (recording it the first time)."""
        plan = self._plans.get(key)
        if isinstance(plan, Replay):
            try:
                plan.run(addresses, stream)
                return
            except Exception as e:  # e.g. a launcher that does not take our arguments
                error = e
            slow()  # if the dispatch path fails too, the fault is not the replay's: raise
            self._plans[key] = _NO_REPLAY
            warnings.warn(
                f"flashattn_triton: launching the compiled kernels directly failed "
                f"({type(error).__name__}: {error}); using Triton's dispatch for this layout",
                RuntimeWarning,
                stacklevel=3,
            )
            return
        if plan is _NO_REPLAY:
            slow()
            return
        with Recorder() as recorder:
            slow()
        if len(self._plans) >= self.max_entries:
            self._plans.clear()
        self._plans[key] = Replay.build(recorder.records, addresses) or _NO_REPLAY
