"""Point-to-point transfer of nested Python objects that hold tensors (optimizer state).

The structure travels pickled as bytes with every tensor replaced by a slot (shape, dtype);
the tensors then travel one by one with `send`/`recv`, on `device` (the process group's
communication device: the rank's GPU for NCCL, the CPU for gloo). The receiver moves each
tensor to the CPU as it arrives, so gathering a large state on one rank needs only one
tensor's worth of extra device memory.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

import torch

from zero_shard._comm import Comm


@dataclass(frozen=True)
class _Slot:
    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def _strip(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """`obj` with each tensor replaced by a `_Slot`; the tensors are appended to `tensors`."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return _Slot(len(tensors) - 1, tuple(obj.shape), obj.dtype)
    if isinstance(obj, dict):
        return {k: _strip(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_strip(v, tensors) for v in obj)
    return obj


def _fill(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, _Slot):
        return tensors[obj.index]
    if isinstance(obj, dict):
        return {k: _fill(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_fill(v, tensors) for v in obj)
    return obj


def to_cpu(obj: Any) -> Any:
    """A copy of `obj` whose tensors are detached CPU copies."""
    tensors: list[torch.Tensor] = []
    skeleton = _strip(obj, tensors)
    return _fill(skeleton, [t.detach().to("cpu", copy=True) for t in tensors])


def send_object(obj: Any, dst: int, comm: Comm, device: torch.device) -> None:
    """Send `obj` to group rank `dst`, which must call `recv_object` with this rank."""
    tensors: list[torch.Tensor] = []
    payload = pickle.dumps(_strip(obj, tensors))
    header = torch.tensor([len(payload), len(tensors)], dtype=torch.int64, device=device)
    what = ("send of the optimizer state to rank %d (%s)", (dst, "header"))
    comm.send(header, dst, what).wait()
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)  # (n_bytes,)
    comm.send(data, dst, (what[0], (dst, "structure"))).wait()
    for i, t in enumerate(tensors):
        comm.send(t.detach().to(device).contiguous(), dst, (what[0], (dst, f"tensor {i}"))).wait()


def recv_object(src: int, comm: Comm, device: torch.device) -> Any:
    """Receive an object sent by group rank `src` with `send_object`; tensors land on CPU."""
    what = "receive of the optimizer state from rank %d (%s)"
    header = torch.empty(2, dtype=torch.int64, device=device)
    comm.recv(header, src, (what, (src, "header"))).wait()
    n_bytes, n_tensors = (int(v) for v in header.tolist())
    data = torch.empty(n_bytes, dtype=torch.uint8, device=device)
    comm.recv(data, src, (what, (src, "structure"))).wait()
    skeleton = pickle.loads(bytes(data.cpu().tolist()))
    slots = _slots(skeleton)
    if len(slots) != n_tensors:
        raise RuntimeError(f"corrupt transfer: {n_tensors} tensors announced, {len(slots)} slots")
    tensors = []
    for slot in slots:
        buf = torch.empty(slot.shape, dtype=slot.dtype, device=device)
        comm.recv(buf, src, (what, (src, f"tensor {slot.index}"))).wait()
        tensors.append(buf.cpu())
    return _fill(skeleton, tensors)


def _slots(skeleton: Any) -> list[_Slot]:
    """Every slot in `skeleton`, in index (= send) order."""
    found: list[_Slot] = []
    stack = [skeleton]
    while stack:
        obj = stack.pop()
        if isinstance(obj, _Slot):
            found.append(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, list | tuple):
            stack.extend(obj)
    return sorted(found, key=lambda s: s.index)
