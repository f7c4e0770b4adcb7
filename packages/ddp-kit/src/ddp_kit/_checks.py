"""Argument checks and the construction-time collectives every wrapper shares.

`resolve_group` and `validate_bucket_size` are local (no communication). `check_same_structure`
and the broadcasts are collectives (through the owner's `Comm`, so bounded by its
timeout): every rank of the group must call them in the same order, which the wrappers'
constructors do.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from ddp_kit._comm import Comm

ProcessGroup = dist.ProcessGroup if dist.is_available() else object


def resolve_group(process_group: ProcessGroup | None, owner: str) -> ProcessGroup:
    """The group to communicate over: `process_group`, or WORLD when None.

    Raises RuntimeError saying how to initialize torch.distributed when it is not, and
    ValueError when this process is not a member of `process_group`.
    """
    if not dist.is_available():
        raise RuntimeError(f"{owner}: this torch build has no torch.distributed support")
    if not dist.is_initialized():
        raise RuntimeError(
            f"{owner}: the default process group is not initialized. Call "
            "torch.distributed.init_process_group(backend='nccl' on GPUs or 'gloo' on CPU) "
            "in every process before wrapping the model; under torchrun the rank, world size "
            "and rendezvous address come from the environment it sets."
        )
    group = process_group if process_group is not None else dist.group.WORLD
    if dist.get_rank(group) < 0:
        raise ValueError(
            f"{owner}: process_group: this process (global rank "
            f"{dist.get_rank()}) is not a member of the given group"
        )
    return group


def validate_bucket_size(bucket_size_mb: object) -> float:
    """`bucket_size_mb` as a float, or a TypeError / ValueError naming the expected value."""
    if isinstance(bucket_size_mb, bool) or not isinstance(bucket_size_mb, int | float):
        raise TypeError(
            f"bucket_size_mb: expected a positive number of MiB, got {bucket_size_mb!r}"
        )
    value = float(bucket_size_mb)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"bucket_size_mb: expected a positive, finite number of MiB, got {bucket_size_mb!r}"
        )
    return value


def validate_reduce_dtype(reduce_dtype: object, owner: str) -> torch.dtype | None:
    """`reduce_dtype` (None or a floating-point torch.dtype), or a TypeError naming it."""
    if reduce_dtype is None:
        return None
    if not isinstance(reduce_dtype, torch.dtype) or not reduce_dtype.is_floating_point:
        raise TypeError(
            f"{owner}: reduce_dtype: expected None (each gradient's own dtype) or a "
            f"floating-point torch.dtype such as torch.bfloat16, got {reduce_dtype!r}"
        )
    return reduce_dtype


def is_nccl(group: ProcessGroup) -> bool:
    """True when the group's backend (or its CUDA half, for 'cpu:gloo,cuda:nccl') is NCCL."""
    return "nccl" in str(dist.get_backend(group)).lower()


def comm_device(module: nn.Module, group: ProcessGroup) -> torch.device:
    """Device for small control tensors: the module's first tensor's, or the backend's default.

    Raises ValueError when the module lives on the CPU but the group only speaks NCCL.
    """
    first = next(module_tensors(module), None)
    backend = str(dist.get_backend(group)).lower()
    if first is None:
        if backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    if backend == "nccl" and first.device.type != "cuda":
        raise ValueError(
            f"module: its tensors are on {first.device} but the process group backend is "
            "NCCL, which only moves CUDA tensors; move the module to this rank's GPU "
            "(module.to(f'cuda:{local_rank}')) or use the gloo backend"
        )
    return first.device


def module_tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    """The module's parameters, then its buffers, in registration order."""
    yield from module.parameters()
    yield from module.buffers()


def structure_signature(module: nn.Module) -> list[tuple[str, str, tuple[int, ...], str]]:
    """(kind, name, shape, dtype) of every parameter and buffer, in registration order."""
    sig = [("param", n, tuple(p.shape), str(p.dtype)) for n, p in module.named_parameters()]
    sig += [("buffer", n, tuple(b.shape), str(b.dtype)) for n, b in module.named_buffers()]
    return sig


def check_same_structure(module: nn.Module, comm: Comm, device: torch.device) -> None:
    """Collective: raise ValueError on every rank if parameter/buffer names, shapes or dtypes
    differ between ranks. Never hangs on a mismatch: it exchanges a fixed-size digest first.
    """
    sig = structure_signature(module)
    numel = sum(math.prod(s[2]) for s in sig)
    digest = zlib.crc32(repr(sig).encode())
    mine = torch.tensor([len(sig), numel, digest], dtype=torch.int64, device=device)  # (3,)
    gathered = [torch.empty_like(mine) for _ in range(comm.world_size)]
    comm.all_gather(gathered, mine, ("all_gather of the model's structure digest", ())).wait()
    rows = [tuple(t.tolist()) for t in gathered]
    if all(r == rows[0] for r in rows):
        return
    # Every rank saw the same mismatch, so every rank takes this branch: the object gather
    # below is matched on all of them.
    texts = _all_gather_bytes(json.dumps(sig).encode(), comm, device)
    sigs = [[(k, n, tuple(shape), dt) for k, n, shape, dt in json.loads(t)] for t in texts]
    raise ValueError(f"{comm.owner}: module: " + _describe_mismatch(sigs))


def _all_gather_bytes(data: bytes, comm: Comm, device: torch.device) -> list[bytes]:
    """Collective: every rank's `data`, by group rank (tensor collectives only: unlike
    all_gather_object this needs neither numpy nor a current CUDA device)."""
    world = comm.world_size
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)  # (1,)
    sizes = [torch.empty_like(size) for _ in range(world)]
    comm.all_gather(sizes, size, ("all_gather of the structure's length", ())).wait()
    lengths = [int(t.item()) for t in sizes]
    payload = torch.zeros(max(lengths), dtype=torch.uint8)  # (max_len,) padded
    if data:
        payload[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    payload = payload.to(device)
    gathered = [torch.empty_like(payload) for _ in range(world)]
    comm.all_gather(gathered, payload, ("all_gather of the model's structure", ())).wait()
    return [bytes(t[:n].tolist()) for t, n in zip(gathered, lengths)]


def _describe_mismatch(sigs: list[object]) -> str:
    ref = sigs[0]
    assert isinstance(ref, list)
    for rank, sig in enumerate(sigs[1:], start=1):
        assert isinstance(sig, list)
        if sig == ref:
            continue
        for a, b in zip(ref, sig):
            if a != b:
                return (
                    f"parameters/buffers differ across ranks: rank 0 has {a[0]} {a[1]!r} "
                    f"shape {a[2]} {a[3]}, rank {rank} has {b[0]} {b[1]!r} shape {b[2]} {b[3]}. "
                    "Build the same model (same config) on every rank before wrapping it."
                )
        return (
            f"parameters/buffers differ across ranks: rank 0 has {len(ref)} tensors, rank "
            f"{rank} has {len(sig)}. Build the same model on every rank before wrapping it."
        )
    return "parameters/buffers differ across ranks"


def broadcast_from_rank0(tensors: Iterable[torch.Tensor], comm: Comm, what: str) -> None:
    """Collective: copy group rank 0's `tensors` into every rank's (see `broadcast_from`)."""
    broadcast_from(tensors, comm, what, src=0)


@torch.no_grad()
def broadcast_from(tensors: Iterable[torch.Tensor], comm: Comm, what: str, src: int) -> None:
    """Collective: copy group rank `src`'s `tensors` into every rank's (`what` names them in
    errors, e.g. "buffer").

    One asynchronous broadcast per tensor (in the given order, the same on every rank once
    `check_same_structure` passed), waited for at the end; a non-contiguous tensor goes
    through a contiguous copy.
    """
    pending = []
    for i, t in enumerate(tensors):
        data = t.data
        buf = data if data.is_contiguous() else data.contiguous()
        pending.append((data, buf, comm.broadcast(buf, src, ("broadcast of %s %d", (what, i)))))
    for data, buf, work in pending:
        work.wait()
        if buf is not data:
            data.copy_(buf)
