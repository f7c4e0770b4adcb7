"""Repeated eager ``flash_attention`` calls through a C++ autograd node (``Options.cpp_launch``).

Inside an eager model, our Python launchers cost 2.5-3.1x what they cost back to back (lm-
core's small model, flashattn-triton DESIGN), and the backward's Python runs on autograd's
device thread between C++ nodes. The C++ node (``csrc/launch_replay.cpp``) replays the
kernel launches that the Python launchers recorded for an input layout: a repeated call is
found in C++ by its layouts, allocates its outputs and launches the compiled kernels with
``cuLaunchKernelEx``; its backward runs in C++ as well once a dO layout has been seen (the
first backward of a dO layout takes the Python path, which then registers it).

The extension is compiled on first use with ``torch.utils.cpp_extension`` (a C++ compiler and
ninja; no CUDA toolkit) and cached per user, named by a hash of the source, the torch and
Triton versions and Triton's header path (environments that differ there get builds of their
own rather than rebuilding one another's). ``cpp_launch="auto"`` (the default) compiles it
on a background thread at the first eligible call and keeps the Python path until it is
ready, or for good if it cannot be built (``status()`` says why); ``True`` compiles it in
the first call and raises if that fails; ``False`` never uses it.

Eligible calls: 4-D or 3-D CUDA float16/bfloat16 inputs (3-D ones keyed and launched as the
Python path's 4-D views of them) outside torch.compile and functorch transforms, with or
without the lse (``return_lse``: the node's second output, not differentiable; the same
entry as calls without it), a window and a scale given as a float other than the default
being part of the layout's key, ``causal`` a bool, plain ``torch.Tensor``s, no
``configs.OVERRIDES``, on Triton 3.6 (``cpp_plans``). Calls that autograd does not record
(evaluation under ``torch.no_grad``, inference) replay the forward without the node; their
layouts get an entry at their second Python call, so that a loop over ever new shapes (a
growing cache) fills no entries. Everything else, and every layout whose launches cannot be
described, takes the Python path unchanged. Triton launch hooks (e.g. proton's) do not see
these launches; set ``cpp_launch=False`` while using them.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import threading
from importlib import resources
from typing import Any

import torch

from . import configs as C
from . import cpp_plans, launch, launch_backward
from ._ops_namespace import NAMESPACE
from .launch_plans import call_key, on_clear
from .options import get_options

_log = logging.getLogger(__name__)

# Entries registered at most (each holds its launches and up to 64 filled TMA descriptors per
# descriptor argument, never freed): workloads with ever new shapes keep the Python path for
# layouts past this many rather than growing host memory without bound.
MAX_ENTRIES = 1024
# Seconds a ``cpp_launch=True`` call waits for the build (a stale lock left by a killed build
# makes torch's builder wait forever).
BUILD_TIMEOUT_S = 900.0

_lock = threading.Lock()
_state: dict[str, Any] = {"module": None, "status": "not built", "thread": None, "error": None}
# Layouts marked refused in the extension's index (their calls cannot be described; the
# lookup answers False for them, and they are not offered to ``learn`` again).
_n_refused = [0]
_registered: set[tuple] = set()  # call keys with an entry
_seen_once: set[tuple] = set()  # call keys of calls without autograd seen once
_bwd_refused: set[tuple] = set()  # (entry, dO layout) whose backward was tried
_ops_served: set[tuple[str, str]] = set()  # (namespace, dispatch key) with C++ kernels
# True while calls may take the C++ path (the extension is loaded and the options allow it).
ACTIVE = [False]
# True while compiled graphs' opaque ops may too (``Options.cpp_launch_compiled``).
OPS_ACTIVE = [False]


COUNTERS = ("forward", "backward", "backward_fallback")


def counters() -> dict[str, int]:
    """Calls the C++ path served since the extension was loaded: ``forward`` (forwards
    replayed, eager or in compiled graphs), ``backward`` (backwards replayed) and
    ``backward_fallback`` (backwards of a replayed forward that ran the Python launchers:
    a dO layout without a plan yet); zeros before the extension is loaded. The difference
    of two readings says how many calls in between took the C++ path."""
    module = _state["module"]
    got = module.counters() if module is not None else {}
    return {name: int(got.get(name, 0)) for name in COUNTERS}


def status() -> str:
    """'ready', 'building', 'off' (``cpp_launch=False``), 'not built', or 'failed: <why>'."""
    if not get_options().cpp_launch:
        return "off"
    return _state["status"]


def _source() -> str:
    return resources.files(__package__).joinpath("csrc", "launch_replay.cpp").read_text()


def compile_extension() -> Any:
    """Compile (or load the cached build of) ``csrc/launch_replay.cpp``; the module."""
    import triton
    from torch.utils.cpp_extension import load

    include = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "include")
    digest = hashlib.sha256(
        "\0".join((_source(), torch.__version__, triton.__version__, include)).encode()
    ).hexdigest()[:16]
    path = resources.files(__package__).joinpath("csrc", "launch_replay.cpp")
    with resources.as_file(path) as source:
        return load(
            name=f"flashattn_triton_launch_{digest}", sources=[str(source)],
            extra_include_paths=[include], extra_cflags=["-O2"], with_cuda=False,
            verbose=False,
        )  # fmt: skip


def _compile_supported() -> Any:
    import triton

    if not cpp_plans.supported(triton.__version__):
        raise RuntimeError(
            f"triton {triton.__version__} is not supported (the parameter layout is "
            f"triton {cpp_plans.TRITON_SERIES}x's)"
        )
    return compile_extension()


def _build_into_state() -> None:
    try:
        module = _compile_supported()
    except Exception as e:  # no compiler, no ninja, an unsupported Triton: the Python path
        with _lock:
            _state["status"] = f"failed: {type(e).__name__}: {str(e).strip()[:400]}"
            _state["error"] = e
        _log.info("flashattn_triton: C++ launch path unavailable (%s)", _state["status"])
        return
    with _lock:
        _state["module"] = module
        _state["status"] = "ready"
    _refresh()


def _start_build() -> threading.Thread:
    with _lock:
        thread = _state["thread"]
        if thread is None:
            _state["status"] = "building"
            thread = threading.Thread(
                target=_build_into_state, name="flashattn-triton-cpp-build", daemon=True
            )
            _state["thread"] = thread
            thread.start()
        return thread


def build(timeout: float = BUILD_TIMEOUT_S) -> None:
    """Compile (or load the cached) extension now and wait for it; raises RuntimeError if it
    cannot be built. Training scripts may call it before the first step, so that every step
    from the first takes the C++ path (``cpp_launch="auto"`` builds in the background).
    ``timeout``: seconds to wait, a positive number."""
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    thread = _start_build()
    thread.join(timeout)
    if thread.is_alive():
        raise RuntimeError(
            f"flashattn_triton: building the C++ launch path took over {timeout:.0f} s "
            "(a stale 'lock' file in the torch extensions directory, left by a killed build?)"
        )
    if _state["module"] is None:
        raise RuntimeError(
            f"flashattn_triton: the C++ launch path could not be built ({_state['status']})"
        ) from _state["error"]


def _refresh() -> None:
    """Recompute ``ACTIVE`` and drop every registered layout (the options or the tile tables
    changed, and the Python launchers dropped their plans)."""
    opts = get_options()
    module = _state["module"]
    _n_refused[0] = 0
    _registered.clear()
    _seen_once.clear()
    _bwd_refused.clear()
    if module is not None:
        module.reset()
    ACTIVE[0] = (
        module is not None and opts.cpp_launch is not False and opts.fast_launch
        and not opts.autotune
    )  # fmt: skip
    OPS_ACTIVE[0] = ACTIVE[0] and opts.cpp_launch_compiled
    if OPS_ACTIVE[0] and not _ops_served:
        serve_ops(module, NAMESPACE, "CUDA")
    if module is not None:
        module.set_ops_serving(OPS_ACTIVE[0])


on_clear(_refresh)


def serve_ops(module, namespace: str, dispatch_key: str) -> None:
    """Make the extension's functions the ``dispatch_key`` kernels of ``<namespace>::
    fwd_launch`` / ``bwd_launch`` (once): compiled graphs then reach the C++ replay from the
    dispatcher, without the Python kernel of the ops, ``op_forward`` and the lookup's
    argument parsing per call. What they do not replay goes to ``op_forward`` /
    ``op_backward`` (looked up per call), the same as before. Registered when
    ``cpp_launch_compiled`` first takes effect, and kept: with the option off again the
    kernels hand every call to Python. Unlike ``op_forward`` they do not read
    ``configs.OVERRIDES`` per call (a benchmark's tile table): layouts registered before it
    changed keep their tiles until the next options change or ``launch_plans.clear_plans()``;
    after that, calls with overrides set are not registered."""
    if (namespace, dispatch_key) in _ops_served:
        return
    _ops_served.add((namespace, dispatch_key))  # (tried once: a failure is not retried)
    try:
        module.serve_ops(namespace, dispatch_key, _op_forward_fallback, _op_backward_fallback)
    except RuntimeError as e:  # the ops keep their Python kernel, which replays too
        _log.warning("flashattn_triton: the opaque ops' C++ kernels were not registered (%s)", e)


def _op_forward_fallback(*args):
    return op_forward(*args)


def _op_backward_fallback(*args):
    return op_backward(*args)


def _eligible(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Plain tensors first: anything else (None, a subclass) goes on to the Python path,
    whose checks name the bad argument."""
    return (
        type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor
        and not C.OVERRIDES and not torch._C._are_functorch_transforms_active()
    )  # fmt: skip


def _records_graph(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether autograd records the call (then the C++ node; else the forward alone)."""
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


def _window(window_size: object) -> tuple[int, int] | None:
    """``window_size`` if it is a tuple of two valid plain ints, else None (the Python path,
    whose checks name anything wrong with it)."""
    if type(window_size) is not tuple or len(window_size) != 2:
        return None
    left, right = window_size
    if type(left) is not int or type(right) is not int or left < -1 or right < -1:
        return None
    return left, right


def known_call(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, window_size=(-1, -1),
    softmax_scale: float | None = None, return_lse: bool = False,
):  # fmt: skip
    """The output of a call whose layouts (window and scale) have a C++ entry (launched
    there: through the C++ autograd node where autograd records the call, else without
    one), (o, lse) with ``return_lse``; False for layouts the path refused (the Python path,
    without ``learn``); else None. ``softmax_scale``: None or a float (an invalid one has no
    entry: the Python path's checks name it)."""
    if not _eligible(q, k, v):
        return None
    scale = 0.0 if softmax_scale is None else softmax_scale  # 0: the default, in C++
    window = (-1, -1) if window_size == (-1, -1) else _window(window_size)
    if window is None:
        return None
    module = _state["module"]
    if _records_graph(q, k, v):
        return module.attention_if_known(q, k, v, causal, *window, scale, return_lse)
    out = module.forward_if_known(q, k, v, causal, *window, scale)  # inference, evaluation
    return out if out is None or out is False or return_lse else out[0]


def after_python_call(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
    window_left: int = -1, window_right: int = -1,
) -> None:  # fmt: skip
    """After an eager call took the Python path (recording autograd or not):
    register its layouts if the extension is loaded; else, on CUDA, start building it
    (``auto``: in the background; ``True``: now)."""
    if ACTIVE[0]:
        learn(q, k, v, causal, scale, window_left, window_right)
    elif _state["thread"] is None and q.is_cuda:
        mode = get_options().cpp_launch
        if mode is True:
            build()
            # (the next call with these layouts replays)
            learn(q, k, v, causal, scale, window_left, window_right)
        elif mode == "auto":
            _start_build()


def learn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
    window_left: int = -1, window_right: int = -1,
) -> None:  # fmt: skip
    """After the Python path ran a call: give its layouts (and window: (-1, -1) for none) a
    C++ entry, if it can have one."""
    module = _state["module"]
    if module is None or not _eligible(q, k, v):
        return
    records = _records_graph(q, k, v)
    views = _as_launched(q, k, v)
    if views is None:
        return
    q, k, v = views
    window = (window_left, window_right)
    call = call_key((q, k, v), causal, scale, *window)
    if not records and _first_sighting(call):
        return
    _register(module, call, q, k, v, causal, scale, window)


def _as_launched(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple | None:
    """q, k, v as the launchers saw them: 4-D as given, 3-D as the 4-D views of
    ``autograd.as_bhnd`` ((H, N, d) with grouped k/v heads as (1, H, N, d), else (B, N, d)
    as (B, 1, N, d); the C++ lookup keys 3-D calls by the same views); None for other ranks
    (the Python path only)."""
    if q.dim() == k.dim() == v.dim() == 4:
        return q, k, v
    if q.dim() == k.dim() == v.dim() == 3:
        dim = 0 if q.shape[0] != k.shape[0] else 1
        return q.unsqueeze(dim), k.unsqueeze(dim), v.unsqueeze(dim)
    return None


def _first_sighting(call: tuple | None) -> bool:
    """Whether a call without autograd is the first of its call key (then it is only noted;
    None keys go on to ``_register``, which refuses them)."""
    if call is None or call in _seen_once:
        return False
    if len(_seen_once) >= 4 * MAX_ENTRIES:
        _seen_once.clear()
    _seen_once.add(call)
    return True


def _register(
    module, call: tuple | None, q, k, v, causal: bool, scale: float, window: tuple[int, int]
) -> None:  # fmt: skip
    """Give the layouts of a call the Python launchers just ran a C++ entry (or mark them
    refused). ``call``: its ``call_key``, computed once by the caller."""
    if len(_registered) >= MAX_ENTRIES:
        return
    if call in _registered:  # (a call the C++ lookup declined: aliased inputs, another device)
        return
    key = module.fwd_key(q, k, v, causal, *window, scale)
    remembered = launch._CALLS.get(call) if call is not None else None
    launches = None
    if remembered is not None and remembered[1] == ():
        launches = cpp_plans.describe(remembered[0])
    if launches is None:
        _refuse(module, key)
        return

    def backward_fallback(entry, do, q, k, v, o, lse):
        grads = launch_backward.backward(do, q, k, v, o, lse, causal, scale, *window)
        _learn_backward(module, entry, do, q, k, v, o, lse, causal, scale, window)
        return grads

    entry = module.add_entry(launches, backward_fallback)
    _registered.add(call)
    module.index_entry(key, entry)


def _refuse(module, key: str) -> None:
    """Mark a layout refused in the index (refused marks are dropped every ``16 *
    MAX_ENTRIES``, so ever new refused shapes do not grow it without bound)."""
    _n_refused[0] += 1
    if _n_refused[0] > 16 * MAX_ENTRIES:
        module.forget_refused()
        _n_refused[0] = 1
    module.refuse(key)


def _learn_backward(
    module, entry: int, do, q, k, v, o, lse, causal: bool, scale: float, window: tuple
) -> None:
    """After a Python backward of a C++ entry: register its launches for this dO layout
    (layouts that cannot be registered are not tried again)."""
    if do.stride(-1) != 1:
        return
    tried = (entry, module.layout_key(do))
    if tried in _bwd_refused:
        return
    _bwd_refused.add(tried)  # a registered layout does not come back here
    call = call_key((q, k, v, do, o, lse), causal, scale, *window)
    remembered = launch_backward._CALLS.get(call) if call is not None else None
    if remembered is None:
        return
    replay, (_packed, stats_shape, delta_offset, onepass) = remembered
    if stats_shape is None:  # padded statistics rows: buffers of the first call, not described
        return
    launches = cpp_plans.describe(replay)
    if launches is not None:
        module.add_backward(
            entry, module.layout_key(do), launches, list(stats_shape), int(delta_offset),
            bool(onepass),
        )  # fmt: skip


# ---------------------------------------------------------------- compiled graphs' opaque ops


def serves_compiled() -> bool:
    """Whether compiled graphs' opaque ops replay through the C++ entries, or will once the
    build finishes: ``Options.cpp_launch_compiled`` on, the path allowed by the options
    (not off, ``fast_launch``, no autotuning) and buildable (``_buildable``). Then
    ``traced_compile="auto"`` keeps calls on the opaque ops (``autograd._use_traced_ops``).
    Read while torch.compile traces: the options are guarded like every read of them."""
    opts = get_options()
    return (
        opts.cpp_launch_compiled and opts.cpp_launch is not False and opts.fast_launch
        and not opts.autotune and _buildable()
    )  # fmt: skip


@torch.compiler.assume_constant_result
def _buildable() -> bool:
    """A supported Triton, no failed build, and, before any build, a C++ compiler and ninja
    on this machine (``_toolchain_present``). A constant to torch.compile: the build's
    status is no reason to recompile a graph (one traced before a build fails keeps the
    opaque ops, which then run the Python launchers; the toolchain check makes that rare)."""
    import triton

    status = _state["status"]
    if status.startswith("failed") or not cpp_plans.supported(triton.__version__):
        return False
    return status != "not built" or _toolchain_present()


@functools.cache
def _toolchain_present() -> bool:
    """What ``compile_extension`` needs most often and a machine most often lacks: ninja
    and the C++ compiler torch's extension builder calls (``$CXX``, else ``c++``). Looked
    up once per process (ninja's check starts a subprocess; a model's trace asks per call)."""
    from torch.utils.cpp_extension import is_ninja_available

    return is_ninja_available() and shutil.which(os.environ.get("CXX", "c++")) is not None


def _replayable_op_call(q: torch.Tensor) -> bool:
    """An opaque-op call the C++ entries may serve: a plain 4-D tensor, no tile overrides
    (the scale is part of the entries' key)."""
    return OPS_ACTIVE[0] and type(q) is torch.Tensor and q.dim() == 4 and not C.OVERRIDES


def op_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float,
    window_left: int = -1, window_right: int = -1,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The launcher of the compiled graphs' opaque forward op (``ops.fwd_launch``): the C++
    replay where the layouts have an entry, else ``launch.forward``, whose launches then get
    one. The same (o, lse) as ``launch.forward``."""
    window = (window_left, window_right)
    replayable = _replayable_op_call(q)
    if replayable:
        out = _state["module"].forward_if_known(q, k, v, causal, *window, softmax_scale)
        if out is False:  # refused layouts: the Python launchers, not registered again
            return launch.forward(q, k, v, causal, softmax_scale, *window)
        if out is not None:
            return out
    out = launch.forward(q, k, v, causal, softmax_scale, *window)
    if replayable:
        call = call_key((q, k, v), causal, softmax_scale, *window)
        _register(_state["module"], call, q, k, v, causal, softmax_scale, window)
    elif _state["thread"] is None and q.is_cuda:
        opts = get_options()
        if opts.cpp_launch_compiled and opts.cpp_launch is not False:
            _start_build()  # (a compiled-only program makes no eager call that would)
    return out


def op_backward(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
    lse: torch.Tensor, causal: bool, softmax_scale: float, window_left: int = -1,
    window_right: int = -1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The launcher of the opaque backward op (``ops.bwd_launch``): the C++ replay where the
    forward's entry has a plan for dO's layout, else ``launch.backward``, whose launches the
    entry then gets (once per dO layout)."""
    window = (window_left, window_right)
    if not _replayable_op_call(q):
        return launch.backward(do, q, k, v, o, lse, causal, softmax_scale, *window)
    module = _state["module"]
    replayed = module.backward_if_known(do, q, k, v, o, lse, causal, *window, softmax_scale)
    if type(replayed) is tuple:
        return replayed
    grads = launch.backward(do, q, k, v, o, lse, causal, softmax_scale, *window)
    if replayed >= 0:  # the forward's entry: register this dO layout's launches
        _learn_backward(module, replayed, do, q, k, v, o, lse, causal, softmax_scale, window)
    return grads
