"""Optimizer, learning-rate schedule and gradient clipping.

`AdamW` performs exactly torch.optim.AdamW's update (decoupled weight decay, bias correction):

    p <- p * (1 - lr * wd)
    m <- beta1 * m + (1 - beta1) * g
    v <- beta2 * v + (1 - beta2) * g^2
    p <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

with three implementations of the same math, chosen per (device, dtype) group:
- fused: torch's fused AdamW kernel (`torch._fused_adamw_`, one launch per group), the default
  for CUDA parameters;
- foreach: multi-tensor `torch._foreach_*` ops, the default elsewhere;
- plain: one public in-place op per tensor, the same ops in the same order as foreach.
Fused and foreach are private torch APIs: each is used only after a feature check (the op
exists, and for the fused kernel its schema takes the keywords we pass), else the next one
serves, so a torch that renames or drops them still trains, only slower. The class stays
ours (it is lm_core's public optimizer, the course's exercise); torch.optim.AdamW gives the
same update and loads the same state dicts. State keys and layout ("step",
"exp_avg", "exp_avg_sq") match torch's, so state dicts load into either optimizer.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch

ParamsT = Iterable[torch.Tensor] | Iterable[dict[str, Any]]


# The keywords `_fused_update` passes to torch._fused_adamw_ (its schema since torch 2.0).
_FUSED_KWARGS = frozenset({"lr", "beta1", "beta2", "weight_decay", "eps", "amsgrad", "maximize"})
# The torch._foreach_* ops `_foreach_update` calls.
_FOREACH_OPS = (
    "_foreach_add_",
    "_foreach_mul_",
    "_foreach_lerp_",
    "_foreach_addcmul_",
    "_foreach_sqrt",
    "_foreach_div_",
    "_foreach_addcdiv_",
)


@functools.cache  # the torch build does not change while a process runs
def _fused_available() -> bool:
    """Whether torch has the private fused AdamW op with the signature we call."""
    fn = getattr(torch, "_fused_adamw_", None)
    if fn is None:
        return False
    try:
        names = {a.name for a in torch.ops.aten._fused_adamw_.default._schema.arguments}
    except (AttributeError, RuntimeError):
        return False
    return names >= _FUSED_KWARGS


@functools.cache
def _foreach_available() -> bool:
    """Whether torch has every private multi-tensor op the foreach update uses."""
    return all(hasattr(torch, name) for name in _FOREACH_OPS)


def implementation(fused: bool | None, device: torch.device) -> str:
    """'fused', 'foreach' or 'plain': how a group with this `fused` setting steps on `device`.

    fused=True needs the fused op (RuntimeError without it); fused=None takes it on CUDA when
    available; otherwise foreach when available, else plain.
    """
    if fused or (fused is None and device.type == "cuda"):
        if _fused_available():
            return "fused"
        if fused:
            raise RuntimeError(
                "AdamW(fused=True): this torch has no usable torch._fused_adamw_; "
                "pass fused=None or False"
            )
    return "foreach" if _foreach_available() else "plain"


class AdamW(torch.optim.Optimizer):
    """AdamW with torch.optim.AdamW's semantics, fast on many tensors.

    Args:
        params: tensors or param-group dicts (per-group lr, betas, eps, weight_decay).
        lr: learning rate (>= 0).
        betas: (beta1, beta2), each in [0, 1).
        eps: added to the denominator (>= 0).
        weight_decay: decoupled weight decay coefficient (>= 0).
        fused: True -> torch's fused kernel (CPU or CUDA; RuntimeError if this torch lacks
            it); False -> foreach ops; None (default) -> fused for CUDA parameters, else
            foreach. Where this torch lacks the private op chosen, the next one serves
            (fused -> foreach -> plain; see the module docstring).
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        fused: bool | None = None,
    ) -> None:
        _check_hparams(lr, betas, eps, weight_decay)
        if fused:
            implementation(True, torch.device("cpu"))  # raises if the fused op is unusable
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "fused": fused,
        }
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (validating its hyperparameters), as torch.optim.Optimizer does."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _check_hparams(group["lr"], group["betas"], group["eps"], group["weight_decay"])

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of every parameter that has a gradient; returns closure() if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_group(group)
        return loss

    def _step_group(self, group: dict[str, Any]) -> None:
        # (device, dtype, DTensor mesh or None) -> lists of params, grads, exp_avgs,
        # exp_avg_sqs, steps: a foreach op takes no mix of tensors and DTensors (tensor
        # parallelism leaves the replicated parameters plain) nor DTensors of two meshes.
        buckets: dict[tuple[Any, ...], list[list[torch.Tensor]]] = defaultdict(
            lambda: [[], [], [], [], []]
        )
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("AdamW does not support sparse gradients")
            state = self.state[p]
            if len(state) == 0:
                # fused: the step count lives on the parameter's device (the kernel reads it);
                # foreach: on the CPU (bias corrections are host math). Created in place, so
                # the first step does not copy host -> device either.
                fused = implementation(group.get("fused"), p.device) == "fused"
                step_device = p.device if fused else "cpu"
                state["step"] = torch.zeros((), dtype=torch.float32, device=step_device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            lists = buckets[(p.device, p.dtype, getattr(p, "device_mesh", None))]
            for i, t in enumerate((p, p.grad, state["exp_avg"], state["exp_avg_sq"])):
                lists[i].append(t)
            lists[4].append(state["step"])
        for (device, _, _), (params, grads, exp_avgs, exp_avg_sqs, steps) in buckets.items():
            update = {
                "fused": self._fused_update,
                "foreach": self._foreach_update,
                "plain": self._plain_update,
            }[implementation(group.get("fused"), device)]
            update(group, params, grads, exp_avgs, exp_avg_sqs, steps)

    def _fused_update(
        self,
        group: dict[str, Any],
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        exp_avgs: list[torch.Tensor],
        exp_avg_sqs: list[torch.Tensor],
        steps: list[torch.Tensor],
    ) -> None:
        # The fused kernel reads the step count from device tensors; move them once.
        device = params[0].device
        if steps[0].device != device:
            for p, s in zip(params, steps):
                self.state[p]["step"] = s.to(device)
            steps = [self.state[p]["step"] for p in params]
        if _foreach_available():
            torch._foreach_add_(steps, 1.0)
        else:
            for s in steps:
                s.add_(1.0)
        beta1, beta2 = group["betas"]
        torch._fused_adamw_(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            amsgrad=False,
            maximize=False,
        )

    def _foreach_update(
        self,
        group: dict[str, Any],
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        exp_avgs: list[torch.Tensor],
        exp_avg_sqs: list[torch.Tensor],
        steps: list[torch.Tensor],
    ) -> None:
        # Step counts stay on the CPU here so bias corrections are host math, not device syncs.
        steps = self._host_steps(params, steps)
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        beta1, beta2 = group["betas"]
        torch._foreach_add_(steps, 1.0)
        if wd != 0:
            torch._foreach_mul_(params, 1.0 - lr * wd)
        torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1.0 - beta2)
        step_values = [s.item() for s in steps]  # CPU tensors: no device sync
        step_sizes = [-lr / (1.0 - beta1**t) for t in step_values]
        bias2_sqrt = [math.sqrt(1.0 - beta2**t) for t in step_values]
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, bias2_sqrt)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(params, exp_avgs, denom, step_sizes)

    def _plain_update(
        self,
        group: dict[str, Any],
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        exp_avgs: list[torch.Tensor],
        exp_avg_sqs: list[torch.Tensor],
        steps: list[torch.Tensor],
    ) -> None:
        # The foreach update's ops, one tensor at a time, with public torch ops only.
        steps = self._host_steps(params, steps)
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        beta1, beta2 = group["betas"]
        for p, g, m, v, s in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
            s.add_(1.0)
            if wd != 0:
                p.mul_(1.0 - lr * wd)
            m.lerp_(g, 1.0 - beta1)
            v.mul_(beta2)
            v.addcmul_(g, g, value=1.0 - beta2)
            t = s.item()  # a CPU tensor: no device sync
            denom = v.sqrt()
            denom.div_(math.sqrt(1.0 - beta2**t))
            denom.add_(eps)
            p.addcdiv_(m, denom, value=-lr / (1.0 - beta1**t))

    def _host_steps(self, params: list[torch.Tensor], steps: list[torch.Tensor]) -> list:
        """The step counts as CPU tensors (moved once if they were on a device)."""
        if steps[0].device.type != "cpu":
            for p, s in zip(params, steps):
                self.state[p]["step"] = s.cpu()
            steps = [self.state[p]["step"] for p in params]
        return steps


def _check_hparams(lr: Any, betas: Any, eps: Any, weight_decay: Any) -> None:
    if isinstance(lr, torch.Tensor):
        raise TypeError("AdamW: lr must be a float (tensor learning rates are not supported)")
    if not lr >= 0:
        raise ValueError(f"AdamW: lr must be >= 0, got {lr}")
    if len(tuple(betas)) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"AdamW: betas must be two numbers in [0, 1), got {betas}")
    if not eps >= 0:
        raise ValueError(f"AdamW: eps must be >= 0, got {eps}")
    if not weight_decay >= 0:
        raise ValueError(f"AdamW: weight_decay must be >= 0, got {weight_decay}")


def cosine_lr(
    step: int, max_lr: float, min_lr: float, warmup_steps: int, cosine_steps: int
) -> float:
    """Learning rate at `step`: linear warmup, cosine decay, then constant (course schedule).

    step < warmup_steps:             max_lr * step / warmup_steps
    warmup_steps <= step <= cosine_steps:
        min_lr + (1 + cos(pi * (step - warmup_steps) / (cosine_steps - warmup_steps))) / 2
                 * (max_lr - min_lr)
    step > cosine_steps:             min_lr
    `cosine_steps` is the step at which the decay ends (the course's T_c), counted from 0,
    so warmup_steps <= cosine_steps is required.
    """
    if step < 0:
        raise ValueError(f"cosine_lr: step must be >= 0, got {step}")
    if warmup_steps < 0 or cosine_steps < warmup_steps:
        raise ValueError(
            "cosine_lr: need 0 <= warmup_steps <= cosine_steps, "
            f"got warmup_steps={warmup_steps}, cosine_steps={cosine_steps}"
        )
    if step < warmup_steps:
        return max_lr * step / warmup_steps
    if step >= cosine_steps:
        # At step == cosine_steps the cosine reaches min_lr; this also covers warmup == cosine.
        return min_lr
    progress = (step - warmup_steps) / (cosine_steps - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (max_lr - min_lr)


@torch.no_grad()
def clip_grad_norm(
    params: Iterable[torch.Tensor] | torch.Tensor, max_norm: float, eps: float = 1e-6
) -> torch.Tensor:
    """Scale gradients in place so their global L2 norm is at most `max_norm`.

    The scale is min(1, max_norm / (norm + eps)), applied on the device with no host sync
    (norms by `torch._foreach_norm` per (device, dtype) group). Returns the total norm before
    clipping as a 0-dim fp32 tensor on the first gradient's device (0 if no gradients).
    """
    if not max_norm > 0:
        raise ValueError(f"clip_grad_norm: max_norm must be > 0, got {max_norm}")
    if isinstance(params, torch.Tensor):
        params = [params]
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        groups[(g.device, g.dtype)].append(g)
    first = grads[0].device
    norms = []
    for group in groups.values():
        norms.extend(n.to(device=first, dtype=torch.float32) for n in torch._foreach_norm(group))
    total = torch.linalg.vector_norm(torch.stack(norms))
    scale = torch.clamp(max_norm / (total + eps), max=1.0)
    for (device, _), group in groups.items():
        torch._foreach_mul_(group, scale.to(device))
    return total
