"""The optimizer step overlapped with the backward pass: `OverlappedOptimizer`.

The parameters are split into units (for a `TransformerLM`: the token embedding, each block,
the final norm, the LM head), each with its own optimizer (lm_core's `AdamW` by default: the
fused kernel on CUDA). A post-accumulate-grad hook on every parameter counts its unit's final
gradients; when the unit's last one lands, the unit steps at once, while the backward goes on
through the blocks below it, and its gradients are released. On CUDA the step runs on a side
stream that first waits (an event) for the work that produced the gradients, so the
memory-bound update runs beside the backward's compute-bound kernels; `step()` ends the step:
the current stream waits for the side stream. Fork and join are stream events, so a whole
train step can be captured in one CUDA graph. On a CPU each unit steps inline.

Same math as one optimizer over all the parameters: AdamW updates every element from that
element's own parameter, gradient and state only, so splitting the parameters into groups
changes no value (bitwise equal with the same implementation; the tests check it), and each
unit's param groups keep the caller's hyperparameters (weight decay or not, lr, ...).

A unit steps only when all its gradients are final, so the overlap needs a backward made of
several autograd nodes: eager, or the blocks compiled one by one (`lm_core.compiling.
compile_blocks`). `torch.compile(model)` makes the whole backward one node, whose gradients
all land at its end: the results are the same, but nothing overlaps.

What it cannot do (each needs every gradient before any update):
- clip gradients by their global norm (`clip_grad_norm` after the backward sees none: they
  were released by then);
- data-parallel or sharded training: DDP / FSDP reduce gradients after these hooks fire;
- change the learning rate between backward and `step()`: set it before the backward
  (`set_lr`); `step()` raises if a unit's hyperparameters changed after it stepped.
Gradient accumulation: run the backward of every micro-batch but the last inside `no_step()`.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lm_core.checkpoint import unwrap_model
from lm_core.optim import AdamW, ParamsT

__all__ = ["OverlappedOptimizer", "default_units"]


def default_units(model: nn.Module) -> list[nn.Module]:
    """The model's children in order, a ModuleList (a TransformerLM's `layers`) as one unit
    per item: token_embeddings, every block, ln_final, lm_head for a TransformerLM."""
    units: list[nn.Module] = []
    for child in unwrap_model(model).children():
        units.extend(child if isinstance(child, nn.ModuleList) else [child])
    return units


@dataclass(eq=False)
class _Unit:
    """One unit: its optimizer, its parameters, and this step's progress."""

    optimizer: torch.optim.Optimizer
    params: list[torch.Tensor]  # every parameter it steps, in the optimizer's order
    needed: int  # how many of them require a gradient (hooks to wait for)
    event: Any = None  # CUDA: marks the gradients' producer on the current stream
    seen: set[int] = field(default_factory=set)  # ids of parameters whose gradient landed
    stepped: Any = None  # the hyperparameters it stepped with this step, None: not yet


class OverlappedOptimizer:
    """An optimizer that steps each unit of a model during the backward (module docstring).

    Args:
        model: the module whose backward produces the gradients (a TransformerLM, possibly
            under `torch.compile`; no data-parallel or sharding wrapper).
        params: what to optimize, as for any torch optimizer: tensors or param-group dicts
            (e.g. no weight decay for norms); default `model.parameters()`. Every tensor
            must be a parameter of `model`, all on one device.
        optimizer_cls: the optimizer each unit gets, built as
            `optimizer_cls(unit_groups, **kwargs)` (default lm_core's AdamW; on CUDA it
            must keep its step counters on the device to be captured in a CUDA graph, as
            lm_core's fused AdamW and torch's fused or capturable AdamW do).
        units: modules whose parameters step together; default `default_units(model)`.
            Parameters in none of them form one more unit.
        side_stream: CUDA: step the units on a side stream (the overlap); False steps them
            in order on the backward's own stream (to measure what the overlap hides).
        stream_priority: the side stream's priority (`torch.cuda.Stream`'s: lower runs
            first; 0 is the default streams'). -1 made no measurable difference on xl (DESIGN.md).
        **kwargs: hyperparameters for `optimizer_cls` (lr, betas, eps, weight_decay, ...).

    Use: set the learning rate (`set_lr`) before the forward, then `loss.backward()`, then
    `step()`; gradients are None after it. Accumulating micro-batches: every backward but
    the last inside `with opt.no_step():`. `state_dict()` has the layout of
    `optimizer_cls(params, **kwargs)`'s, so checkpoints load into either.
    """

    def __init__(
        self,
        model: nn.Module,
        params: ParamsT | None = None,
        optimizer_cls: type[torch.optim.Optimizer] = AdamW,
        *,
        units: Sequence[nn.Module] | None = None,
        side_stream: bool = True,
        stream_priority: int = 0,
        **kwargs: Any,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
        if not (
            isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)
        ):
            raise TypeError(
                f"optimizer_cls: expected a torch.optim.Optimizer subclass, got {optimizer_cls!r}"
            )
        if _data_parallel(model):
            raise ValueError(
                f"model: a {type(model).__name__} (data-parallel wrapper) reduces gradients after "
                "the hooks that would step them; OverlappedOptimizer trains one process only"
            )
        self._groups = _param_groups(model.parameters() if params is None else params)
        self.device = _check_params(model, [p for g in self._groups for p in g["params"]])
        unit_of = _unit_index(model, default_units(model) if units is None else units)
        self._units = self._build_units(optimizer_cls, kwargs, unit_of)
        self._step_enabled = True
        self._side: torch.cuda.Stream | None = None
        self._forked = False  # the side stream got work since the last step()
        if self.device.type == "cuda" and side_stream:
            # made here, not in a hook: nothing to create while a CUDA graph is captured
            self._side = torch.cuda.Stream(self.device, priority=stream_priority)
            for unit in self._units:
                unit.event = torch.cuda.Event()
        self._handles = self._register_hooks()
        # hooks hold only a weak reference: a dropped optimizer leaves no live hook behind
        self._finalizer = weakref.finalize(self, _remove_handles, self._handles)

    # -------------------------------------------------------------- building

    def _build_units(
        self, optimizer_cls: type[torch.optim.Optimizer], kwargs: dict, unit_of: dict[int, int]
    ) -> list[_Unit]:
        rest = max(unit_of.values(), default=-1) + 1  # parameters in no unit
        # unit index -> outer group index -> that group's parameters in the unit
        split: dict[int, dict[int, list[torch.Tensor]]] = {}
        for gi, group in enumerate(self._groups):
            for p in group["params"]:
                split.setdefault(unit_of.get(id(p), rest), {}).setdefault(gi, []).append(p)
        units = []
        for _, by_group in sorted(split.items()):
            inner = [{**self._groups[gi], "params": ps} for gi, ps in by_group.items()]
            opt = optimizer_cls(inner, **kwargs)
            params = [p for g in opt.param_groups for p in g["params"]]
            units.append(_Unit(opt, params, sum(p.requires_grad for p in params)))
        return units

    def _register_hooks(self) -> list[Any]:
        ref = weakref.ref(self)
        handles = []
        for unit in self._units:
            for p in unit.params:
                if p.requires_grad:
                    handles.append(p.register_post_accumulate_grad_hook(_hook(ref, unit)))
        return handles

    # -------------------------------------------------------------- the step

    def _on_grad(self, unit: _Unit, param: torch.Tensor) -> None:
        """A gradient is final (a post-accumulate-grad hook, inside the backward)."""
        if not self._step_enabled:
            return
        if id(param) in unit.seen:
            raise RuntimeError(
                "OverlappedOptimizer: a parameter got a second gradient before step(): call "
                "step() after every backward, and run the backward of all but the last "
                "micro-batch inside no_step()"
            )
        unit.seen.add(id(param))
        if len(unit.seen) == unit.needed:
            self._step_unit(unit, in_backward=True)

    def _step_unit(self, unit: _Unit, *, in_backward: bool) -> None:
        if in_backward and self._side is not None:
            # the side stream waits for everything issued so far on the stream that
            # produced the gradients (it also read the old parameters)
            unit.event.record(torch.cuda.current_stream(self.device))
            self._side.wait_event(unit.event)
            with torch.cuda.stream(self._side):
                unit.optimizer.step()
                for p in unit.params:
                    if p.grad is not None:
                        # the allocator must not hand this memory to the backward's stream
                        # before the side stream is done reading it
                        p.grad.record_stream(self._side)
                        p.grad = None
            self._forked = True
        else:
            unit.optimizer.step()
            for p in unit.params:
                p.grad = None
        unit.stepped = _hparams(unit.optimizer)

    def step(self, closure: Any = None) -> Any:
        """End the step: wait for the units stepped during the backward (the current stream
        waits for the side stream), step the others (parameters whose gradients did not all
        arrive: unused ones, or a backward run inside `no_step()`), release every gradient.
        Returns closure() if given (it runs first, with gradients enabled)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._forked:
            assert self._side is not None
            torch.cuda.current_stream(self.device).wait_stream(self._side)
            self._forked = False
        changed = []
        for i, unit in enumerate(self._units):
            if unit.stepped is None:
                if any(p.grad is not None for p in unit.params):
                    self._step_unit(unit, in_backward=False)
            elif unit.stepped != _hparams(unit.optimizer):
                changed.append(i)
            unit.seen.clear()
            unit.stepped = None
        if changed:
            raise RuntimeError(
                f"OverlappedOptimizer: hyperparameters (lr, ...) of units {changed} changed "
                "after they stepped in the backward; set them before the backward (set_lr)"
            )
        return loss

    @contextlib.contextmanager
    def no_step(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients and step nothing (all but the last
        micro-batch of an accumulated step)."""
        before = self._step_enabled
        self._step_enabled = False
        try:
            yield
        finally:
            self._step_enabled = before

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every gradient (set_to_none=False: fill them with zeros)."""
        for unit in self._units:
            unit.optimizer.zero_grad(set_to_none=set_to_none)

    def set_lr(self, lr: float) -> None:
        """Set the learning rate of every param group (before the backward)."""
        for group in self.param_groups:
            group["lr"] = lr

    def remove(self) -> None:
        """Remove the hooks: backward passes no longer step (this optimizer's `step()` then
        steps everything, as a plain optimizer would)."""
        self._finalizer()

    # -------------------------------------------------------------- optimizer interface

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Every unit's param groups (the dicts themselves: setting "lr" on them works)."""
        return [g for unit in self._units for g in unit.optimizer.param_groups]

    @property
    def caller_param_groups(self) -> list[dict[str, Any]]:
        """The param groups as given (`params`, or the model's parameters as one group): the
        layout of `state_dict()`, which the units' groups split."""
        return self._groups

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The units' optimizers, in unit order."""
        return [unit.optimizer for unit in self._units]

    @property
    def state(self) -> dict[torch.Tensor, Any]:
        """Parameter -> its optimizer state (a new dict over the units' states)."""
        return {p: s for unit in self._units for p, s in unit.optimizer.state.items()}

    def state_dict(self) -> dict[str, Any]:
        """The state dict `optimizer_cls(params, **kwargs)` would have: parameters numbered
        in `params` order, one param group per group of `params`."""
        index = {id(p): i for i, p in enumerate(p for g in self._groups for p in g["params"])}
        group_of = {id(p): gi for gi, g in enumerate(self._groups) for p in g["params"]}
        state: dict[int, Any] = {}
        hparams: dict[int, dict[str, Any]] = {}
        for unit in self._units:
            inner = unit.optimizer.state_dict()
            for g, ig in zip(unit.optimizer.param_groups, inner["param_groups"]):
                for p, local in zip(g["params"], ig["params"]):
                    hparams.setdefault(
                        group_of[id(p)], {k: v for k, v in ig.items() if k != "params"}
                    )
                    if local in inner["state"]:
                        state[index[id(p)]] = inner["state"][local]
        groups = [
            {**hparams[gi], "params": [index[id(p)] for p in g["params"]]}
            for gi, g in enumerate(self._groups)
        ]
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of `state_dict()`'s layout (or of a plain optimizer over the
        same params and groups)."""
        groups = state_dict["param_groups"]
        sizes = [len(g["params"]) for g in self._groups]
        if [len(g["params"]) for g in groups] != sizes:
            raise ValueError(
                f"state_dict: param groups of {[len(g['params']) for g in groups]} parameters "
                f"do not match this optimizer's {sizes}"
            )
        saved_index = {}  # id(param) -> its index in the saved dict
        group_of = {}
        for gi, (mine, saved) in enumerate(zip(self._groups, groups)):
            for p, i in zip(mine["params"], saved["params"]):
                saved_index[id(p)] = i
                group_of[id(p)] = gi
        for unit in self._units:
            inner_groups, inner_state = [], {}
            local = 0
            for g in unit.optimizer.param_groups:
                saved = groups[group_of[id(g["params"][0])]]
                ids = list(range(local, local + len(g["params"])))
                inner_groups.append(
                    {**{k: v for k, v in saved.items() if k != "params"}, "params": ids}
                )
                for p, j in zip(g["params"], ids):
                    if saved_index[id(p)] in state_dict["state"]:
                        inner_state[j] = state_dict["state"][saved_index[id(p)]]
                local += len(g["params"])
            unit.optimizer.load_state_dict({"state": inner_state, "param_groups": inner_groups})


def _data_parallel(model: nn.Module) -> bool:
    """Whether a wrapper with a `module` (DDP, ddp_kit, zero_shard.FSDP) sits around the
    model, under torch.compile's `_orig_mod` or not."""
    while True:
        inner = getattr(model, "_orig_mod", None)
        if isinstance(inner, nn.Module):
            model = inner
            continue
        return isinstance(getattr(model, "module", None), nn.Module)


def _hook(ref: weakref.ref, unit: _Unit) -> Any:
    def hook(param: torch.Tensor) -> None:
        owner = ref()
        if owner is not None:
            owner._on_grad(unit, param)

    return hook


def _remove_handles(handles: list[Any]) -> None:
    for h in handles:
        h.remove()
    handles.clear()


def _hparams(optimizer: torch.optim.Optimizer) -> list[tuple]:
    """What a unit stepped with: every group's hyperparameters (tensors by identity)."""
    return [
        tuple(
            (k, id(v) if isinstance(v, torch.Tensor) else v)
            for k, v in sorted(g.items())
            if k != "params"
        )
        for g in optimizer.param_groups
    ]


def _param_groups(params: ParamsT) -> list[dict[str, Any]]:
    """`params` as a list of group dicts (copies), as torch.optim.Optimizer reads them."""
    if isinstance(params, torch.Tensor):
        raise TypeError("params: expected an iterable of tensors or dicts, got a tensor")
    items = list(params)
    if not items:
        raise ValueError("params: got an empty parameter list")
    if all(isinstance(x, dict) for x in items):
        groups = [dict(g) for g in items]
        for g in groups:
            g["params"] = (
                [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
            )
    elif any(isinstance(x, dict) for x in items):
        raise TypeError("params: expected tensors or param-group dicts, not a mix")
    else:
        groups = [{"params": items}]
    return groups


def _check_params(model: nn.Module, params: list[torch.Tensor]) -> torch.device:
    """Every tensor a distinct parameter of `model`, on one device, not sharded; the device."""
    owned = {id(p) for p in model.parameters()}
    seen: set[int] = set()
    devices = set()
    for p in params:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"params: expected tensors, got {type(p).__name__}")
        if id(p) in seen:
            raise ValueError("params: a parameter appears twice")
        seen.add(id(p))
        if id(p) not in owned:
            raise ValueError(
                f"params: a tensor of shape {tuple(p.shape)} is not a parameter of model "
                "(the hooks that step it would never fire)"
            )
        if hasattr(p, "device_mesh"):
            raise ValueError(
                "params: sharded (DTensor) parameters are not supported: FSDP and tensor "
                "parallelism reduce gradients after the hooks that would step them"
            )
        devices.add(p.device)
    if len(devices) != 1:
        raise ValueError(
            f"params: expected parameters on one device, got {sorted(map(str, devices))}"
        )
    (device,) = devices
    if device.type == "meta":
        raise ValueError("params: parameters on the meta device; materialize the model first")
    return device


def _unit_index(model: nn.Module, units: Iterable[nn.Module]) -> dict[int, int]:
    """id(parameter) -> the index of the unit that holds it."""
    index: dict[int, int] = {}
    for i, unit in enumerate(units):
        if not isinstance(unit, nn.Module):
            raise TypeError(f"units: expected nn.Modules, got {type(unit).__name__}")
        for p in unit.parameters():
            if index.get(id(p), i) != i:
                raise ValueError(f"units: a parameter belongs to units {index[id(p)]} and {i}")
            index[id(p)] = i
    return index
