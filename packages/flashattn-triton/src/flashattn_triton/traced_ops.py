"""The dense launchers as ``torch.library.triton_op``s, for compiled graphs.

With ``Options.traced_compile`` on, the autograd.Functions' compiled graphs call
``flashattn_triton::fwd_traced`` / ``bwd_traced`` instead of the opaque ``fwd_launch`` /
``bwd_launch`` (``ops``). torch.compile traces into these: the launcher runs once, at compile
time, with fake tensors (``fastlaunch.traced``), and each of its Triton kernel launches
becomes a node of the graph that inductor launches itself. A compiled call then runs none of
our Python: no checks, no plan lookup, no per-call launcher. Sizes and the scale must be
concrete (a symbolic size or float would reach the launchers' tile tables and caches, which
hash them): the ops' bodies hand symbolic ones to the opaque ops (``_concrete``), and the
Functions use the opaque ops for packed sequences and the KV-cache calls.

``auto`` traces only on GPUs like those the tile tables were measured on (compute
capability 9+ with Hopper's shared memory per block, ``_device.tables_fit``): inductor
compiles the traced kernels, where a tile that does not fit a smaller GPU cannot be shrunk
and retried as the eager launchers do. ``True`` traces on any GPU, its tiles fitted to the
GPU's shared memory by the estimate (``launch_common._run``).

Under CUDA graphs a step pays no host time per call and the traced kernels only lose GPU
time, so ``auto`` keeps the opaque ops in graphs that will be replayed from a CUDA graph:
inductor's own (``mode="reduce-overhead"``), and any compiled inside ``for_cuda_graphs()``
(what a step that captures compiled code itself wraps its warm-up and capture in).

Called eagerly (outside torch.compile) the ops run their launchers the same way, as traced:
no launch plans, pointer loads, no Gluon kernels, no register caps. That is slower than the
eager launchers; the ops are for compiled graphs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.library import triton_op

from . import _device, fastlaunch, launch, ops
from .ops import NAMESPACE
from .options import get_options

_graph_blocks = 0  # open ``for_cuda_graphs`` blocks


@contextlib.contextmanager
def for_cuda_graphs() -> Iterator[None]:
    """Graphs torch.compile traces in this block will be replayed from a CUDA graph: with
    ``traced_compile="auto"`` their calls keep the opaque ops (a replay pays no host time
    per call, and the traced kernels' pointer loads cost GPU time). Wrap the warm-up calls
    that compile a step you capture yourself with ``torch.cuda.graph``; inductor's own
    CUDA graphs (``mode="reduce-overhead"``) need nothing. Read when a graph is traced, so
    it makes no guard: graphs compiled before the block keep what they traced."""
    global _graph_blocks
    _graph_blocks += 1
    try:
        yield
    finally:
        _graph_blocks -= 1


def _for_cuda_graphs() -> bool:
    """Whether ``auto`` keeps this call on the opaque op because its graph will be replayed
    from a CUDA graph (see ``for_cuda_graphs``). Runs in the ops' bodies, which torch.compile
    runs only while it compiles, the last time inside inductor's config patch (where
    reduce-overhead sets ``cudagraphs``)."""
    if get_options().traced_compile != "auto":
        return False
    if _graph_blocks:
        return True
    from torch._inductor import config

    return bool(config.triton.cudagraphs)


@triton_op(f"{NAMESPACE}::fwd_traced", mutates_args=())
def fwd_traced(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    window_left: int = -1,
    window_right: int = -1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``launch.forward`` with its launches recorded for torch.compile (see the module)."""
    window = (window_left, window_right)
    if _for_cuda_graphs() or _auto_keeps_opaque(q) or not _concrete(softmax_scale, window, q, k, v):
        return ops.fwd_launch(q, k, v, causal, softmax_scale, window_left, window_right)
    with fastlaunch.traced():
        return launch.forward(q, k, v, causal, softmax_scale, window_left, window_right)


@triton_op(f"{NAMESPACE}::bwd_traced", mutates_args=())
def bwd_traced(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    window_left: int = -1,
    window_right: int = -1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``launch.backward`` with its launches recorded for torch.compile (see the module)."""
    window = (window_left, window_right)
    if (
        _for_cuda_graphs()
        or _auto_keeps_opaque(q)
        or not _concrete(softmax_scale, window, do, q, k, v, o, lse)
    ):
        return ops.bwd_launch(do, q, k, v, o, lse, causal, softmax_scale, window_left, window_right)
    with fastlaunch.traced():
        return launch.backward(
            do, q, k, v, o, lse, causal, softmax_scale, window_left, window_right
        )


def _auto_keeps_opaque(t: torch.Tensor) -> bool:
    """Whether ``auto`` keeps this call on the opaque op because t's GPU is not one the tile
    tables were measured on (``_device.tables_fit``): inductor compiles a traced kernel
    where a tile too large for the GPU's shared memory cannot be shrunk and retried, as the
    eager launchers do, and the traced tiles were checked on Hopper only. ``True`` traces on
    any GPU, with tiles fitted to its shared memory by the estimate."""
    return get_options().traced_compile == "auto" and not _device.tables_fit(t)


def static_sizes(*tensors: torch.Tensor) -> bool:
    """Whether every size and stride is a plain int (no symbolic size from dynamic shapes).
    Seen from dynamo a symbolic int's type is int, so under torch.compile this holds for
    any sizes; the ops' bodies, which run on the fake tensors themselves, check again."""
    return all(type(s) is int for t in tensors for s in (*t.shape, *t.stride()))


def _concrete(scale: float, window: tuple[int, int], *tensors: torch.Tensor) -> bool:
    """Whether the scale is a plain float and the window bounds, sizes and strides plain
    ints: dynamic shapes, or a graph torch.compile compiled again for another window, hand
    the ops symbolic ones, which the traced launchers' tables and caches cannot hash."""
    return type(scale) is float and all(type(w) is int for w in window) and static_sizes(*tensors)
