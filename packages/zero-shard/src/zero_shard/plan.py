"""How `FSDP` plans its sharding: argument checks, which parameters are sharded, the gathering
units, and the construction-time collectives (same model on every rank, rank 0's weights).

Everything here runs once, in the constructor; the runtime lives in `fsdp.py`.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from zero_shard._comm import Comm
from zero_shard.shard import Collectives, ShardedParam
from zero_shard.units import Slot, Unit, default_unit_roots

DEFAULT_SHARD_TYPES: tuple[type[nn.Module], ...] = (nn.Linear, nn.Embedding)
SlotRef = tuple[nn.Module, str, nn.Parameter]  # module._parameters[attr] holds the parameter


def check_dtype(dtype: object, arg: str) -> torch.dtype | None:
    if dtype is None:
        return None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(
            f"FSDP: {arg}: expected a floating torch.dtype (torch.bfloat16, torch.float16, "
            f"torch.float32) or None, got {dtype!r}"
        )
    return dtype


def check_types(types: object) -> tuple[type[nn.Module], ...]:
    if types is None:
        return DEFAULT_SHARD_TYPES
    found = (types,) if isinstance(types, type) else tuple(types)  # type: ignore[arg-type]
    bad = [t for t in found if not (isinstance(t, type) and issubclass(t, nn.Module))]
    if bad or not found:
        raise TypeError(
            "FSDP: shard_module_types: expected nn.Module subclasses (the classes themselves, "
            f"e.g. (torch.nn.Linear, torch.nn.Embedding)), got {bad[0] if bad else types!r}"
        )
    return found


def check_units(units: Iterable[nn.Module], module: nn.Module) -> list[tuple[str, nn.Module]]:
    names = {id(m): n for n, m in module.named_modules()}
    roots = list(units)
    for r in roots:
        if not isinstance(r, nn.Module) or id(r) not in names:
            raise ValueError(f"FSDP: units: every entry must be a submodule of module, got {r!r}")
    for a in roots:
        for b in roots:
            if a is not b and any(m is b for m in a.modules()):
                raise ValueError(
                    f"FSDP: units: {names[id(a)] or '<root>'!r} contains {names[id(b)]!r}; "
                    "units must not nest"
                )
    return [(names[id(r)], r) for r in roots]


def param_slots(module: nn.Module) -> list[tuple[str, nn.Module, str, nn.Parameter]]:
    """(state-dict key, module, attribute, parameter) for every parameter slot."""
    out = []
    for name, m in module.named_modules(remove_duplicate=False):
        for attr, p in m._parameters.items():
            if p is not None:
                out.append((f"{name}.{attr}" if name else attr, m, attr, p))
    return out


def sharded_params(
    module: nn.Module,
    slots: list[tuple[str, nn.Module, str, nn.Parameter]],
    types: tuple[type[nn.Module], ...],
    compute_dtype: torch.dtype | None,
) -> set[int]:
    """Ids of the parameters held directly by a module of `types`; checks what FSDP needs."""
    sharded = {id(p) for _, m, _, p in slots if isinstance(m, types)}
    names = ", ".join(t.__name__ for t in types)
    if not sharded:
        raise ValueError(
            f"FSDP: module: no parameter to shard: no module of shard_module_types ({names}) "
            "holds a parameter. Name the classes that hold the big weights in "
            "shard_module_types, or use plain data parallelism for this model"
        )
    params = [(k, p) for k, _, _, p in slots if id(p) in sharded]
    for key, p in params:
        if not p.is_floating_point():
            raise ValueError(f"FSDP: module: parameter {key!r} is {p.dtype}, not floating")
    devices = {p.device for _, m, _, p in slots} | {b.device for b in module.buffers()}
    if len(devices) > 1:
        raise ValueError(f"FSDP: module: tensors on several devices {sorted(map(str, devices))}")
    dtypes = {p.dtype for _, p in params}
    if compute_dtype is None and len(dtypes) > 1:
        raise ValueError(
            f"FSDP: compute_dtype: the sharded parameters have several dtypes "
            f"({sorted(map(str, dtypes))}); pass compute_dtype or convert the module to one"
        )
    return sharded


def plan_units(
    module: nn.Module,
    slots: list[tuple[str, nn.Module, str, nn.Parameter]],
    sharded: set[int],
    roots: list[tuple[str, nn.Module]] | None,
) -> tuple[list[tuple[str, nn.Module, list[SlotRef]]], list[SlotRef]]:
    """(name, root module, the slots of its subtree) per unit, in registration order, and
    the replicated slots outside every unit."""
    holders = {id(m) for _, m, _, p in slots if id(p) in sharded}
    if roots is None:
        has = {id(m) for m in module.modules() if any(id(c) in holders for c in m.modules())}
        roots = default_unit_roots(module, has)
    owner: dict[int, int] = {}
    for i, (_, root) in enumerate(roots):
        for m in root.modules():
            owner.setdefault(id(m), i)
    plan: list[tuple[str, nn.Module, list[SlotRef]]] = [(n, root, []) for n, root in roots]
    names = {id(m): n for n, m in module.named_modules()}
    for _, m, _, p in slots:
        if id(p) in sharded and id(m) not in owner:  # outside every unit: a unit of its own
            owner[id(m)] = len(plan)
            plan.append((names[id(m)], m, []))
    for _, m, attr, p in slots:
        if id(m) in owner:
            plan[owner[id(m)]][2].append((m, attr, p))
    units = [u for u in plan if any(id(p) in sharded for _, _, p in u[2])]
    inside = {id(m) for _, _, members in units for m, _, _ in members}
    outside = [(m, attr, p) for _, m, attr, p in slots if id(m) not in inside]
    position = {id(m): i for i, (_, m) in enumerate(module.named_modules())}
    return sorted(units, key=lambda u: position[id(u[1])]), dedup(outside)


def make_unit(
    name: str,
    root: nn.Module,
    members: list[SlotRef],
    made: dict[int, ShardedParam],
    comm: Collectives,
    dtype: torch.dtype,
    device: torch.device,
    cast: torch.dtype | None,
) -> Unit:
    params: list[ShardedParam] = []
    index: dict[int, int] = {}
    slots = []
    replicated = []
    for m, attr, p in dedup(members):
        if id(p) not in made:
            replicated.append((m, attr, p))
            continue
        if id(p) not in index:
            index[id(p)] = len(params)
            params.append(made[id(p)])
        slots.append(Slot(m, attr, index[id(p)]))
    unit = Unit(name or "<root>", root, params, slots, comm, dtype, device)
    unit.replicated, unit.cast = replicated, cast
    return unit


def dedup(slots: list[SlotRef]) -> list[SlotRef]:
    """Slots without repeats (a module registered under two names appears once)."""
    seen: set[tuple[int, str]] = set()
    out = []
    for m, attr, p in slots:
        if (id(m), attr) not in seen:
            seen.add((id(m), attr))
            out.append((m, attr, p))
    return out


def resolve_group(process_group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "FSDP: process_group: the default process group is not initialized. Call "
            "torch.distributed.init_process_group(backend='nccl' on GPUs or 'gloo' on CPU) in "
            "every process before wrapping the model (torchrun sets rank and world size)"
        )
    group = process_group if process_group is not None else dist.group.WORLD
    if dist.get_rank(group) < 0:
        raise ValueError(
            f"FSDP: process_group: this process (global rank {dist.get_rank()}) is not a "
            "member of the given group"
        )
    return group


def comm_device(module: nn.Module, group: dist.ProcessGroup) -> torch.device:
    """Where the (built) module's tensors are: the device of every collective."""
    device = next(module.parameters()).device
    if "nccl" in str(dist.get_backend(group)).lower() and device.type != "cuda":
        raise ValueError(
            f"FSDP: module: its parameters are on {device} but the process group backend is "
            "NCCL, which only moves CUDA tensors; move the module to this rank's GPU first "
            "or use the gloo backend"
        )
    return device


def check_same_on_all_ranks(
    module: nn.Module,
    slots: list[tuple[str, nn.Module, str, nn.Parameter]],
    sharded: set[int],
    plan: list[tuple[str, nn.Module, list]],
    comm: Comm,
    device: torch.device,
) -> None:
    """Collective: raise on every rank (instead of hanging later) when the ranks' models or
    sharding plans differ."""
    tensors = [*module.named_parameters(), *module.named_buffers()]
    sig = [(n, tuple(t.shape), str(t.dtype)) for n, t in tensors]
    layout = [[k for k, _, _, p in slots if id(p) in sharded], [u[0] for u in plan]]
    mine = [len(sig), zlib.crc32(repr(sig).encode()), zlib.crc32(repr(layout).encode())]
    everyone = [torch.empty(3, dtype=torch.int64, device=device) for _ in range(comm.world_size)]
    digest = torch.tensor(mine, dtype=torch.int64, device=device)  # (3,)
    comm.all_gather(everyone, digest, ("all_gather of the model's structure digest", ())).wait()
    rows = [t.tolist() for t in everyone]
    if any(r[:2] != rows[0][:2] for r in rows):
        counts = ", ".join(f"rank {i}: {r[0]} tensors" for i, r in enumerate(rows))
        raise ValueError(
            f"FSDP: module: parameters/buffers (names, shapes, dtypes) differ across ranks "
            f"({counts}); build the same model on every rank before wrapping it"
        )
    if any(r[2] != rows[0][2] for r in rows):
        raise ValueError(
            "FSDP: shard_module_types / units: the sharding plan differs across ranks; pass "
            "the same arguments on every rank"
        )


@torch.no_grad()
def broadcast_from_rank0(tensors: list[torch.Tensor], comm: Comm) -> None:
    """Collective: every rank gets group rank 0's values of `tensors` (parameters and
    buffers; one asynchronous broadcast per tensor, waited for at the end)."""
    if comm.world_size == 1:
        return
    pending = []
    for i, t in enumerate(tensors):
        buf = t.data if t.data.is_contiguous() else t.data.contiguous()
        what = ("broadcast of parameter or buffer %d from rank 0", (i,))
        pending.append((t, buf, comm.broadcast(buf, 0, what)))
    for t, buf, work in pending:
        work.wait()
        if buf is not t.data:
            t.data.copy_(buf)
