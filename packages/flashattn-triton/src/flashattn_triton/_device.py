"""Facts about the device a launch runs on, cached: the interpreter switch, SM count,
compute capability, L2 size, and what a tensor allows (TMA, the kernels at all).

Shared by ``launch`` and the Gluon launchers (which therefore do not import each other).
"""

from __future__ import annotations

import functools
import threading

import torch

from . import configs as C
from . import fastlaunch
from .options import get_options


def kernels():
    """The Triton kernels module (imported on first use, so that importing the package costs
    nothing and ``TRITON_INTERPRET=1`` may be set any time before the first call)."""
    from . import kernels as k

    return k


@functools.cache
def interpreting() -> bool:
    """True when the kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1).
    Cached: the answer is fixed once ``kernels`` is imported (by the first call)."""
    try:
        import triton.runtime.interpreter as interp

        return isinstance(kernels().attn_fwd_kernel, interp.InterpretedFunction)
    except ImportError:  # no triton, or the interpreter's numpy missing
        return False


def require_runnable(t: torch.Tensor) -> None:
    """Fail clearly, before any launch, where the Triton kernels cannot run."""
    if t.device.type == "cuda":
        return
    if t.device.type == "cpu" and interpreting():
        return
    raise RuntimeError(
        f"the Triton kernels need CUDA tensors, got tensors on {t.device}. Move q, k, v to a "
        "GPU, or set TRITON_INTERPRET=1 before the first call to run the kernels in Triton's "
        "(slow) CPU interpreter, or call flash_attention(..., backend='torch') (or 'auto', "
        "which picks the PyTorch implementation off-GPU)."
    )


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def _cuda_smem_per_sm(index: int) -> int:
    props = torch.cuda.get_device_properties(index)
    return int(getattr(props, "shared_memory_per_multiprocessor", 0)) or 228 * 1024


@functools.cache
def _cuda_smem_per_block(index: int) -> int:
    props = torch.cuda.get_device_properties(index)
    return int(getattr(props, "shared_memory_per_block_optin", 0)) or 227 * 1024


def smem_limit(t: torch.Tensor) -> int:
    """Shared memory the tile estimates (``configs.fits``) may plan for on t's GPU: the
    tables' Hopper limit, or less where one block may opt in to less; the limit off-GPU."""
    index = t.get_device()
    if index < 0:
        return C.SMEM_LIMIT_BYTES
    return min(C.SMEM_LIMIT_BYTES, _cuda_smem_per_block(index) - C.SMEM_RESERVE_BYTES)


def tables_fit(t: torch.Tensor) -> bool:
    """Whether t's GPU is of the kind the tile tables were measured on and fit: compute
    capability 9 or newer with Hopper's shared memory per block (not an A100 or a desktop
    GPU of ~100 KB, where the eager launchers shrink tiles after Triton refuses them)."""
    index = t.get_device()
    return index >= 0 and cuda_major(index) >= 9 and smem_limit(t) >= C.SMEM_LIMIT_BYTES


def smem_per_sm(t: torch.Tensor) -> int:
    """Shared memory of one SM of t's GPU in bytes (Hopper's 228 KB where torch does not
    report it); 0 off-GPU."""
    index = t.get_device()
    return _cuda_smem_per_sm(index) if index >= 0 else 0


def sm_count(t: torch.Tensor) -> int:
    """Streaming multiprocessors of t's GPU; 0 off-GPU (the interpreter: no small grids)."""
    index = t.get_device()
    return _cuda_sm_count(index) if index >= 0 else 0


@functools.cache
def cuda_major(index: int) -> int:
    """Compute-capability major version of GPU ``index`` (cached: asked on every launch)."""
    return torch.cuda.get_device_capability(index)[0]


@functools.cache
def _cuda_l2_bytes(index: int) -> int:
    return getattr(torch.cuda.get_device_properties(index), "L2_cache_size", 0)


def head_group_args(t: torch.Tensor, bh: int, n_rows: int, block_d: int) -> dict:
    """head_group / GROUPED kernel arguments (configs.head_group with ``Options.head_group``)
    for kernels streaming two (n_rows, block_d) tiles per head of t's dtype; the plain order
    off-GPU."""
    index = t.get_device()
    l2 = _cuda_l2_bytes(index) if index >= 0 else 0
    setting = get_options().head_group
    group = C.head_group(bh, 2 * n_rows * block_d * t.element_size(), l2, setting)
    return {"head_group": group, "GROUPED": group < bh}


def tma_usable(t: torch.Tensor) -> bool:
    """Whether a (B, H, N, d) tensor can be read through a TMA descriptor: a Hopper or newer
    GPU (or Triton's interpreter), a 16-byte aligned base and 16-byte multiple strides."""
    if fastlaunch.tracing():  # a traced graph's wrap_triton nodes carry no host descriptors
        return False
    index = t.get_device()
    if index >= 0:
        if cuda_major(index) < 9:
            return False
    elif not interpreting():
        return False
    elem = t.element_size()
    return (
        t.stride(-1) == 1
        and t.data_ptr() % 16 == 0
        and all(s * elem % 16 == 0 for s in t.stride()[:-1])
    )


_thread = threading.local()


def ensure_context() -> None:
    """Make the current GPU's context current on this thread, once per thread. Triton's TMA
    descriptors are filled through the driver API, which (unlike the runtime API torch uses)
    does not bind a context by itself: on a fresh thread that never made a CUDA runtime call
    their launch failed with "invalid device context". Any runtime call binds it; a stream
    query is one that neither blocks nor allocates."""
    if not getattr(_thread, "context", False):
        torch.cuda.current_stream().query()
        _thread.context = True
