"""Sharded initialization of a module built on the meta device (`FSDP(meta_module)`).

Every parameter and buffer of the module on the meta device (built under
`with torch.device("meta"):`): FSDP gives each rank only its shards, initialized by the
module's own code, without any rank ever holding the whole model.

1. Init roots. Walking the modules in registration order (pre-order), the topmost modules
   that lie inside one gathering unit, or outside every unit, and define
   `reset_parameters()` are the init roots; with `init_fn`, the topmost modules inside one
   unit (or outside every unit) are, and `init_fn(root)` is called instead. A root must
   initialize every parameter and buffer of its subtree in place (it runs under no_grad).
   Every module that holds a tensor must lie under a root, else a ValueError names it. A
   `reset_parameters()` of a module spanning several units (the model's own, typically) is
   not called: it would need the whole model.
2. Random numbers. Rank 0's state of the default generator of the materialization device
   (the CPU's, or this rank's GPU's) is broadcast and set on every rank first, so all ranks
   draw the same numbers; afterwards every rank's generator is where rank 0's ended.
3. One unit at a time, in the order of the roots: the unit's parameters and buffers get
   uninitialized memory on the device at full size, its roots run, each rank keeps its rows
   of the sharded parameters and the full tensors go back to the meta device (freed). A
   parameter tied into a later unit stays until that unit's roots ran too (each root that
   holds it initializes it: the last one wins). Modules outside every unit are materialized
   in place: their tensors are replicated anyway.
4. Rank 0's replicated parameters and buffers are broadcast (`FSDP.__init__`), as for a
   module built whole.

The result is bitwise what one process gets from the same generator state by allocating the
whole module on the device without drawing random numbers and calling each root's init in
this order. For a module whose construction is exactly that, it is the full build for the
seed: lm_core's `TransformerLM` (built on meta, then `reset_parameters()` child by child), or
torch layers registered in the order they are constructed (their constructors call their
own `reset_parameters()`). Peak memory: the shards plus one unit at full size.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from zero_shard._comm import Comm
from zero_shard.shard import ShardedParam

InitFn = Callable[[nn.Module], None]
Plan = list[tuple[str, nn.Module, list[tuple[nn.Module, str, nn.Parameter]]]]


def on_meta(module: nn.Module) -> bool:
    """True when every parameter and buffer of `module` is on the meta device; a module
    with some on meta and some elsewhere is an error."""
    named = [*module.named_parameters(), *module.named_buffers()]
    meta = [n for n, t in named if t.is_meta]
    if meta and len(meta) < len(named):
        other = next(n for n, t in named if not t.is_meta)
        raise ValueError(
            f"FSDP: module: {meta[0]!r} is on the meta device but {other!r} is not; build "
            "the whole module under torch.device('meta') (FSDP materializes it) or none of it"
        )
    return bool(meta)


def check_init_args(init_fn: object, meta: bool) -> None:
    if init_fn is None:
        return
    if not callable(init_fn):
        raise TypeError(f"FSDP: init_fn: expected a callable init_fn(module), got {init_fn!r}")
    if not meta:
        raise ValueError(
            "FSDP: init_fn: only initializes a module built on the meta device; this module "
            "already has its values (leave init_fn out)"
        )


def target_device(
    device: object, group: dist.ProcessGroup, module_device: torch.device | None
) -> torch.device | None:
    """Where a meta-device module is materialized (`module_device` None), or the checked
    `device` argument for a built module (which must name where it already is)."""
    nccl = "nccl" in str(dist.get_backend(group)).lower()
    if device is None:
        if module_device is not None:
            return None
        return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    try:
        dev = torch.device(device)  # type: ignore[arg-type]
    except (TypeError, RuntimeError) as exc:
        raise TypeError(
            f"FSDP: device: expected a torch.device or a device string ('cpu', 'cuda:0'), got "
            f"{device!r}"
        ) from exc
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.type == "meta":
        raise ValueError("FSDP: device: 'meta' holds no values; name where to materialize")
    if module_device is not None and dev != module_device:
        raise ValueError(
            f"FSDP: device: {dev} given, but the module is already on {module_device}; "
            "`device` places a module built on the meta device: leave it out"
        )
    if nccl and dev.type != "cuda":
        raise ValueError(
            f"FSDP: device: {dev} with an NCCL process group, which only moves CUDA tensors; "
            "materialize on this rank's GPU (the default) or use the gloo backend"
        )
    return dev


def init_roots(
    module: nn.Module, units: list[nn.Module], init_fn: InitFn | None
) -> list[tuple[int, str, nn.Module]]:
    """(unit index or -1 outside every unit, name, module) of each init root, in pre-order."""
    group: dict[int, int] = {}
    for i, root in enumerate(units):
        for m in root.modules():
            group.setdefault(id(m), i)
    roots: list[tuple[int, str, nn.Module]] = []
    covered: set[int] = set()
    seen: set[int] = set()

    def visit(name: str, m: nn.Module) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        g = group.get(id(m), -1)
        whole = all(group.get(id(c), -1) == g for c in m.modules())
        if whole and (init_fn is not None or callable(getattr(m, "reset_parameters", None))):
            roots.append((g, name or "<root>", m))
            covered.update(id(c) for c in m.modules())
            return
        for child_name, child in m.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)

    visit("", module)
    for name, m in module.named_modules():
        holds = any(t is not None for t in [*m._parameters.values(), *m._buffers.values()])
        if holds and id(m) not in covered:
            raise ValueError(
                f"FSDP: module: {name or '<root>'!r} ({type(m).__name__}) holds tensors on the "
                "meta device but neither it nor an ancestor inside its unit defines "
                "reset_parameters(); define one that initializes them in place, or pass "
                "init_fn"
            )
    return roots


@torch.no_grad()
def sync_rng_from_rank0(device: torch.device, comm: Comm) -> None:
    """Collective: set rank 0's state of `device`'s default generator on every rank."""
    cuda = device.type == "cuda"
    state = torch.cuda.get_rng_state(device) if cuda else torch.get_rng_state()  # uint8
    if comm.world_size > 1:
        buf = state.to(device)
        comm.broadcast(buf, 0, ("broadcast of rank 0's random generator state", ())).wait()
        state = buf.cpu()
    if cuda:
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def _swap(t: torch.Tensor, device: torch.device | str) -> None:
    """Give `t` (a parameter or buffer) new uninitialized storage on `device` in place: the
    Python object stays, so every module slot and reference that holds it sees the change."""
    new = torch.empty_like(t, device=device)
    if isinstance(t, nn.Parameter):
        new = nn.Parameter(new, requires_grad=t.requires_grad)
    torch.utils.swap_tensors(t, new)


def _tensors(modules: list[nn.Module]) -> list[torch.Tensor]:
    out: dict[int, torch.Tensor] = {}
    for m in modules:
        for t in [*m._parameters.values(), *m._buffers.values()]:
            if t is not None:
                out.setdefault(id(t), t)
    return list(out.values())


def _run_roots(
    roots: list[tuple[str, nn.Module]],
    modules: list[nn.Module],
    init_fn: InitFn | None,
    device: torch.device,
) -> None:
    """Call the roots' init; check it filled `modules`' tensors in place, on `device`."""
    before = [(m, dict(m._parameters)) for m in modules]
    with torch.no_grad():
        for _, root in roots:
            if init_fn is not None:
                init_fn(root)
            else:
                root.reset_parameters()  # type: ignore[operator]
    names = ", ".join(repr(n) for n, _ in roots)
    for m, params in before:
        for attr, p in params.items():
            if m._parameters.get(attr) is not p:
                raise ValueError(
                    f"FSDP: the init of {names} replaced parameter {attr!r} of a "
                    f"{type(m).__name__} instead of filling it in place; initialize in place "
                    "(e.g. nn.init.*_ or .copy_() under torch.no_grad())"
                )
    for t in _tensors(modules):
        if t.device != device:
            raise ValueError(
                f"FSDP: the init of {names} left a tensor on {t.device}, not on {device}"
            )


def materialize(
    module: nn.Module,
    plan: Plan,
    keys: dict[int, str],
    sharded: set[int],
    device: torch.device,
    comm: Comm,
    init_fn: InitFn | None,
) -> dict[int, ShardedParam]:
    """Collective: initialize the meta-device `module` one unit at a time (module docstring).

    `plan`: the units (name, root, slots); `keys`: each parameter's first state-dict key by
    id; `sharded`: ids of the sharded parameters. Returns their shards (this rank's rows),
    by id, in the order of `keys`; replicated parameters and buffers end up whole on
    `device`, the sharded parameters' full tensors back on the meta device."""
    units = [root for _, root, _ in plan]
    roots = init_roots(module, units, init_fn)
    group: dict[int, int] = {}
    for i, root in enumerate(units):
        for m in root.modules():
            group.setdefault(id(m), i)
    in_unit: list[list[nn.Module]] = [[] for _ in units]
    for m in module.modules():
        if id(m) in group:
            in_unit[group[id(m)]].append(m)
    holders: dict[int, set[int]] = {}  # sharded parameter id -> the units that hold it
    for i, (_, _, members) in enumerate(plan):
        for _, _, p in members:
            if id(p) in sharded:
                holders.setdefault(id(p), set()).add(i)
    # steps: a unit's roots together (in pre-order), each root outside every unit alone
    steps: list[tuple[int, list[tuple[str, nn.Module]]]] = []
    step_of: dict[int, int] = {}
    for g, name, root in roots:
        if g >= 0 and g in step_of:
            steps[step_of[g]][1].append((name, root))
            continue
        if g >= 0:
            step_of[g] = len(steps)
        steps.append((g, [(name, root)]))

    sync_rng_from_rank0(device, comm)
    made: dict[int, ShardedParam] = {}
    done: set[int] = set()
    for g, step_roots in steps:
        if g >= 0:
            modules = in_unit[g]
        else:
            modules = [m for _, root in step_roots for m in root.modules()]
        for t in _tensors(modules):
            if t.is_meta:
                _swap(t, device)
        _run_roots(step_roots, modules, init_fn, device)
        if g < 0:
            continue
        done.add(g)
        for _, _, p in plan[g][2]:
            if id(p) in holders and id(p) not in made and holders[id(p)] <= done:
                made[id(p)] = ShardedParam(keys[id(p)], p, comm.rank, comm.world_size)
                _swap(p, "meta")  # the full tensor is freed; the shard is a copy
    return {pid: made[pid] for pid in keys if pid in made}
