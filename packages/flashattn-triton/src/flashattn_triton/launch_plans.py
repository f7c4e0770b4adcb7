"""Launch plans of the launchers: the plan key of a call and its launch by replay or by JIT.

Host cost: the first call for a given input layout (shapes, strides, dtype, flags, options,
pointer alignment) picks tiles and launches through Triton's JIT; later calls with that
layout replay the recorded launches with the compiled kernels (``fastlaunch``), so per call
only the outputs are allocated and the new addresses filled in. ``_layout_key`` and
``_launch_planned`` run on every call of every launcher (``launch``, ``launch_backward``,
``launch_varlen``), so they are kept to a few lookups each.

The launchers also keep choices of their own by plan key (the backward scheme, the decode
split); ``keyed_cache`` gives them dicts that ``clear_plans`` empties with the plans.

Repeated calls: ``launch.forward`` and ``launch_backward.backward`` first look their call up
by ``call_key`` (the caller's own tensors' shapes, strides, dtypes and alignment, the current
device, the tile overrides and the flags) in a cache that ``remember_call`` fills after a
call whose launches were replayable; a hit allocates the outputs as that call did and
replays (``replay_call``), skipping the checks, the feature and scheme choices and the plan
key that the first call derived from the same layout. Compiled models call the launchers
once per layer from host-bound graphs, where these microseconds are step time
(benchmarks/launch_cost.py times each piece).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from . import _device as _D
from . import configs as C
from . import fastlaunch
from .options import get_options, on_change

# Launch plans by input layout (see ``fastlaunch``), dropped whenever the options change.
_PLANS = fastlaunch.PlanCache()
_GENERATION = [0]
# The launchers' per-key choices (``keyed_cache``), dropped with the plans.
_KEYED: list[dict] = []
# Called by ``clear_plans`` (the C++ launch path drops its entries).
_ON_CLEAR: list[Callable[[], None]] = []


def keyed_cache() -> dict:
    """A new dict for choices by launch-plan key, emptied by ``clear_plans``."""
    cache: dict = {}
    _KEYED.append(cache)
    return cache


def clear_plans() -> None:
    """Forget every launch plan (after changing ``configs`` tables in place; option changes
    through ``set_options`` and ``configs.OVERRIDES`` are noticed without it)."""
    _GENERATION[0] += 1
    _PLANS.clear()
    for cache in _KEYED:
        cache.clear()
    for listener in _ON_CLEAR:
        listener()


def on_clear(listener: Callable[[], None]) -> None:
    """Call ``listener`` after every ``clear_plans`` (option changes included)."""
    _ON_CLEAR.append(listener)


on_change(clear_plans)


def forget_plan(key: tuple | None) -> None:
    """Forget the launch plan of one key (its next call launches through the JIT again)."""
    if key is not None:
        _PLANS.forget(key)


def _device_guard(t: torch.Tensor):
    """Make t's GPU current for the launch (a no-op where it already is, or off-GPU)."""
    index = t.get_device()
    if index < 0 or index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(index)


def _layout_key(inputs: tuple[torch.Tensor, ...], *flags) -> tuple | None:
    """The launch-plan key of a call on CUDA ``inputs``: their shapes, strides and 16-byte
    alignment (Triton specializes on it), dtype, device, the options and ``flags``; None
    where launches must go through Triton's dispatch (``Options.fast_launch`` off,
    autotuning, a device other than the current one)."""
    opts = get_options()
    if not opts.fast_launch or opts.autotune or fastlaunch.tracing():
        return None
    q = inputs[0]
    index = q.get_device()
    if index < 0 or index != torch._C._cuda_getDevice():
        return None
    align = 0
    for i, t in enumerate(inputs):
        if t.data_ptr() & 15:
            align |= 1 << i
    prec = opts.resolved_fp32_precision() if q.dtype == torch.float32 else None
    layout = tuple((t.shape, t.stride()) for t in inputs)
    return (layout, q.dtype, index, align, prec, _GENERATION[0], C.overrides_key(), *flags)


def call_key(tensors: tuple[torch.Tensor, ...], *flags) -> tuple | None:
    """The key of a repeated call on 16-bit CUDA ``tensors`` (None for others: float32
    launches also depend on torch's matmul precision setting, read per call by
    ``_layout_key``)."""
    q = tensors[0]
    if q.dtype == torch.float32 or not q.is_cuda or fastlaunch.tracing():
        return None
    align = 0
    for i, t in enumerate(tensors):
        if t.data_ptr() & 15:
            align |= 1 << i
    layout = tuple((t.shape, t.stride(), t.dtype) for t in tensors)
    return (layout, torch._C._cuda_getDevice(), q.get_device(), align, C.overrides_key(), *flags)


def remember_call(cache: dict, call: tuple | None, key: tuple | None, recipe: tuple) -> None:
    """After a call that launched under plan ``key``: keep its replay and the ``recipe`` of
    its outputs for later calls with call key ``call``, if the plan has a replay."""
    if call is None or key is None:
        return
    replay = _PLANS.replay(key)
    if replay is None:
        return
    if len(cache) >= 4096:
        cache.clear()
    cache[call] = (replay, recipe)


def replay_call(
    cache: dict, call: tuple, replay: fastlaunch.Replay, addresses: list[int], n_inputs: int
) -> bool:
    """Replay a remembered call on buffers at ``addresses`` (inputs first); False where it
    cannot (outputs off 16-byte alignment, aliased buffers, a failing launcher: then the
    entry is dropped and the caller takes the full path)."""
    if any(a & 15 for a in addresses[n_inputs:]) or len(set(addresses)) != len(addresses):
        return False
    _D.ensure_context()
    try:
        replay.run(addresses, torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice()))
    except Exception:  # the full path replays again and reports a failure that persists
        cache.pop(call, None)
        return False
    return True


def _launch_planned(
    key: tuple | None,
    inputs: tuple[torch.Tensor, ...],
    outputs: tuple[torch.Tensor, ...],
    launch_jit,
) -> None:
    """Run ``launch_jit`` (this call's launches through Triton's dispatch), or replay the
    launches recorded for ``key`` with these buffers (``fastlaunch.PlanCache``). Buffers
    that alias each other or outputs off 16-byte alignment take the dispatch path (a
    replay maps arguments to buffers by address)."""
    if inputs[0].is_cuda and not fastlaunch.tracing():
        _D.ensure_context()
    if key is not None:
        addresses = [t.data_ptr() for t in inputs + outputs]
        aligned = not any(a & 15 for a in addresses[len(inputs) :])
        if aligned and len(set(addresses)) == len(addresses):
            stream = torch._C._cuda_getCurrentRawStream(inputs[0].get_device())
            _PLANS.run(key, addresses, stream, launch_jit)
            return
    with _device_guard(inputs[0]):
        launch_jit()
