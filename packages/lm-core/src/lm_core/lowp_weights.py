"""Linear-layer weights held in bf16 for the forward and backward, their fp32 masters kept by
`lm_core.AdamW`: `hold_in_bf16(matmul_weights(model))` before the first step.

Why: under bf16 autocast every step casts each fp32 weight to bf16 for the forward, casts it
again for the backward (the compiler recomputes cheap casts rather than keep them), and casts
each bf16 weight gradient up to fp32 for the optimizer: 6 + 6 + 6 bytes per parameter of
element-wise traffic, ~9.5 ms of the xl step on an H100. Held in bf16, the weights feed the
matmuls as they are, their gradients arrive in bf16, and one optimizer kernel reads the bf16
gradient with the fp32 master and moments and writes the master, the moments and the bf16
weight (`lm_core.adamw_triton.adamw_master_step`): 28 bytes per parameter, what the fp32
AdamW update alone moves.

The step computes what the fp32 weights under autocast compute: autocast multiplies
`bf16(W)`, the held weight is `bf16(master)` rounded the same way, the weight gradient is
the same bf16 product either way (autocast then casts it up exactly), and the update is
AdamW's on the fp32 master. Gradients summed over several backwards (accumulation) are
summed in bf16, though, where fp32 weights sum them in fp32: hold weights only when every
optimizer step follows one backward. Clipping (`lm_core.optim.clip_grad_norm`) takes the
norm in fp32 and leaves a held gradient's scale to the optimizer kernel, which applies it in
fp32: the same as scaling an fp32 gradient. The weights must be used under bf16 autocast (an fp32
input meets a bf16 weight otherwise), and only lm_core's AdamW (plain, or per block through
`OverlappedOptimizer`) knows the masters.

The master lives on the parameter until the optimizer's first step with it takes it into its
state ("master", fp32), so it starts as the exact fp32 weight: hold after loading weights
(a held weight that changed since is refused there, not trained from a stale master). State
dicts carry it; `AdamW.load_state_dict` keeps it fp32. Checkpoints of the model alone hold
the bf16 weights: save `master_state_dict(model, optimizer)` for the fp32 weights.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

HELD = "_lm_core_bf16_held"  # attribute set on a held parameter
PENDING = "_lm_core_fp32_master"  # the master until the optimizer's first step takes it
GRAD_SCALE = "_lm_core_grad_scale"  # a clip scale left for the optimizer to apply


def matmul_weights(model: nn.Module) -> list[nn.Parameter]:
    """The weights that bf16 autocast multiplies in bf16: every `nn.Linear` weight of
    `model`'s Transformer blocks (`model.layers`; the whole model where it has none). The
    LM head is left as it is (xl: 16 M of 2 B parameters)."""
    root = getattr(model, "layers", model)
    return [m.weight for m in root.modules() if isinstance(m, nn.Linear)]


def hold_in_bf16(params: Iterable[torch.Tensor]) -> None:
    """Convert each fp32 parameter to bf16 in place (same Parameter object) and keep its
    exact fp32 value as the master that `lm_core.AdamW` updates. Call before the optimizer's
    first step (and before compiling or capturing the step)."""
    params = list(params)
    for p in params:
        if not isinstance(p, nn.Parameter):
            raise TypeError(f"hold_in_bf16: expected parameters, got {type(p).__name__}")
        if is_held(p):
            raise ValueError(f"hold_in_bf16: a parameter of shape {tuple(p.shape)} is held already")
        if p.dtype != torch.float32:
            raise ValueError(
                f"hold_in_bf16: parameters must be float32, got {p.dtype} for a parameter of "
                f"shape {tuple(p.shape)}"
            )
        if hasattr(p, "device_mesh"):
            raise ValueError("hold_in_bf16: sharded (DTensor) parameters are not supported")
    for p in params:
        master = p.detach().clone()
        p.data = p.data.to(torch.bfloat16)
        p.grad = None
        setattr(p, PENDING, master)
        setattr(p, HELD, True)


def is_held(p: torch.Tensor) -> bool:
    """Whether `p` is a bf16 weight whose fp32 master the optimizer keeps."""
    return getattr(p, HELD, False)


def defer_grad_scale(p: torch.Tensor, scale: torch.Tensor) -> None:
    """Leave the clip scale of held `p`'s gradient for the optimizer, which multiplies the
    gradient by it in fp32 (as an fp32 gradient is scaled) instead of it being scaled, and
    rounded again, in bf16 (`lm_core.optim.clip_grad_norm`)."""
    setattr(p, GRAD_SCALE, scale)


def take_grad_scale(p: torch.Tensor) -> torch.Tensor | None:
    """The scale `defer_grad_scale` left on `p` (once), else None."""
    scale = getattr(p, GRAD_SCALE, None)
    if scale is not None:
        delattr(p, GRAD_SCALE)
    return scale


def take_master(p: torch.Tensor, check: bool = True) -> torch.Tensor | None:
    """The master `hold_in_bf16` left on `p` (once; None after, or if none). With `check`,
    RuntimeError if `p` no longer is that master rounded (weights loaded or changed after
    the hold would otherwise train from the stale master)."""
    master = getattr(p, PENDING, None)
    if master is None:
        return None
    delattr(p, PENDING)
    if check and not torch.equal(master.to(device=p.device, dtype=p.dtype), p.detach()):
        raise RuntimeError(
            f"a held bf16 weight of shape {tuple(p.shape)} changed after hold_in_bf16 (its "
            "weights were loaded or set since?): call lm_core.lowp_weights.hold_in_bf16 after "
            "loading weights, so the fp32 master is the loaded value"
        )
    return master


def new_master(p: torch.Tensor) -> torch.Tensor:
    """The fp32 master for held `p` at the optimizer's first step: the one `hold_in_bf16`
    left (exact), or, where another optimizer took it (a second optimizer over the same
    model), `p`'s bf16 value in fp32."""
    master = take_master(p)
    return p.detach().float() if master is None else master.to(p.device)


def _masters(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Parameter name -> fp32 master of each held weight of `model` (from the optimizer's
    state, also `OverlappedOptimizer`'s units, or the one still waiting on the parameter)."""
    found: dict[int, torch.Tensor] = {}
    states = [optimizer.state]
    states += [u.optimizer.state for u in getattr(optimizer, "_units", [])]
    for state in states:
        for p, entry in state.items():
            if isinstance(entry, dict) and "master" in entry:
                found[id(p)] = entry["master"]
    out = {}
    for name, p in model.named_parameters():
        if is_held(p):
            master = found.get(id(p), getattr(p, PENDING, None))
            if master is None:
                raise RuntimeError(f"no fp32 master for the held weight {name}")
            out[name] = master
    return out


def with_masters(
    state: dict[str, torch.Tensor], model: nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, torch.Tensor]:
    """A copy of `state` (a state dict of `model`) with each held weight replaced by a copy
    of its fp32 master: the fp32 model, as a checkpoint should hold it."""
    out = dict(state)
    for name, master in _masters(model, optimizer).items():
        out[name] = master.detach().clone()
    return out


def master_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """`model.state_dict()` with each held weight replaced by its fp32 master."""
    return with_masters(model.state_dict(), model, optimizer)


def without_masters(optimizer_state: dict) -> dict:
    """A copy of an optimizer state dict without the masters (the model state carries them;
    the held weights are held again after loading it: `hold_in_bf16`)."""
    state = {
        k: ({n: v for n, v in e.items() if n != "master"} if isinstance(e, dict) else e)
        for k, e in optimizer_state["state"].items()
    }
    return {**optimizer_state, "state": state}
