"""A captured CUDA graph replayed with per-kernel priorities: `PriorityGraph`.

torch instantiates a captured graph without flags, so all its kernels run at the priority of
the stream it is launched into, and two streams captured side by side (the backward's, and
the side stream `OverlappedOptimizer` steps units on) compete as equals: the memory-bound
AdamW kernels take the SMs that the next backward matmul waits for. The CUDA driver keeps
each kernel node's priority, copied from its stream at capture, and honours it when the
graph is instantiated with CU_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY. Captured on a stream
of the highest priority beside a side stream of the default (lowest) one, the backward's
kernels are then scheduled first and the optimizer's fill the SMs they leave (lm-core DESIGN.md,
"Node priorities in the graph").

torch has no argument for the flag, so the graph is taken as torch captured it
(`CUDAGraph(keep_graph=True)`, `raw_cuda_graph()`), instantiated and launched through the
driver API (`libcuda` through ctypes), while torch's graph object keeps owning the memory.

torch's own replay also advances the CUDA random generator by what the captured kernels
drew; this launch does not, so a step that draws random numbers on the GPU (dropout) would
draw the same ones at every replay: capture such a step with torch's replay.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import weakref

import torch

_USE_NODE_PRIORITY = 8  # CU_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY (CUDA 11.7+)
_HIGHEST = -(2**10)  # torch maps a priority beyond the device's range to its highest


def high_priority_stream(device: torch.device) -> torch.cuda.Stream:
    """A stream of the device's highest priority, to capture the critical path on."""
    return torch.cuda.Stream(device, priority=_HIGHEST)


def _driver() -> ctypes.CDLL:
    # the name the driver installs first: find_library may name a toolkit's link stub
    name = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"
    try:
        lib = ctypes.CDLL(name)
    except OSError:
        found = ctypes.util.find_library("cuda")
        if found is None:
            raise
        lib = ctypes.CDLL(found)
    lib.cuGraphInstantiateWithFlags.argtypes = [
        ctypes.POINTER(ctypes.c_void_p),
        ctypes.c_void_p,
        ctypes.c_ulonglong,
    ]
    lib.cuGraphLaunch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.cuGraphExecDestroy.argtypes = [ctypes.c_void_p]
    return lib


class PriorityGraph:
    """The replay of a torch CUDA graph (captured with `keep_graph=True`) instantiated with
    per-node priorities; call it to launch on the device's current stream. Raises
    RuntimeError where that cannot be done (no `raw_cuda_graph` in this torch, no driver
    library, a driver error), so that callers can replay through torch instead."""

    def __init__(self, graph: torch.cuda.CUDAGraph, device: torch.device) -> None:
        if not hasattr(graph, "raw_cuda_graph"):
            raise RuntimeError("this torch has no CUDAGraph.raw_cuda_graph (torch 2.8+)")
        try:
            lib = _driver()
        except (OSError, AttributeError) as exc:
            raise RuntimeError(f"the CUDA driver library could not be loaded: {exc}") from exc
        handle = ctypes.c_void_p()
        rc = lib.cuGraphInstantiateWithFlags(
            ctypes.byref(handle), ctypes.c_void_p(graph.raw_cuda_graph()), _USE_NODE_PRIORITY
        )
        if rc != 0:
            raise RuntimeError(f"cuGraphInstantiateWithFlags failed: CUDA driver error {rc}")
        self.device = device
        self._lib = lib
        self._graph = graph  # owns the captured memory: alive as long as the launches
        self._handle = handle
        self._finalizer = weakref.finalize(self, lib.cuGraphExecDestroy, handle)

    def __call__(self) -> None:
        # the driver launches in the calling thread's current context: the device's own
        with torch.cuda.device(self.device):
            stream = torch.cuda.current_stream(self.device).cuda_stream
            rc = self._lib.cuGraphLaunch(self._handle, ctypes.c_void_p(stream))
        if rc != 0:
            raise RuntimeError(f"cuGraphLaunch failed: CUDA driver error {rc}")
