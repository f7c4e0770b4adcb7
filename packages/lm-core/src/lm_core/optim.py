"""Optimizer, learning-rate schedule and gradient clipping.

`AdamW` performs exactly torch.optim.AdamW's update (decoupled weight decay, bias correction):

    p <- p * (1 - lr * wd)
    m <- beta1 * m + (1 - beta1) * g
    v <- beta2 * v + (1 - beta2) * g^2
    p <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

with two implementations: multi-tensor `torch._foreach_*` ops over parameters grouped by
(device, dtype), and torch's fused AdamW kernel (`torch._fused_adamw_`, one launch per group),
used by default for CUDA parameters when this torch has it. State keys and layout ("step",
"exp_avg", "exp_avg_sq") match torch's, so state dicts load into either optimizer.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch

ParamsT = Iterable[torch.Tensor] | Iterable[dict[str, Any]]


def _fused_available() -> bool:
    return hasattr(torch, "_fused_adamw_")


class AdamW(torch.optim.Optimizer):
    """AdamW with torch.optim.AdamW's semantics, fast on many tensors.

    Args:
        params: tensors or param-group dicts (per-group lr, betas, eps, weight_decay).
        lr: learning rate (>= 0).
        betas: (beta1, beta2), each in [0, 1).
        eps: added to the denominator (>= 0).
        weight_decay: decoupled weight decay coefficient (>= 0).
        fused: True -> torch's fused kernel (CPU or CUDA); False -> foreach ops;
            None (default) -> fused for groups whose parameters are all on CUDA, else foreach.
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
        if fused and not _fused_available():
            raise RuntimeError("AdamW(fused=True): this torch has no torch._fused_adamw_")
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
                step_device = p.device if self._use_fused(group, p.device) else "cpu"
                state["step"] = torch.zeros((), dtype=torch.float32, device=step_device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            lists = buckets[(p.device, p.dtype, getattr(p, "device_mesh", None))]
            for i, t in enumerate((p, p.grad, state["exp_avg"], state["exp_avg_sq"])):
                lists[i].append(t)
            lists[4].append(state["step"])
        for (device, _, _), (params, grads, exp_avgs, exp_avg_sqs, steps) in buckets.items():
            if self._use_fused(group, device):
                self._fused_update(group, params, grads, exp_avgs, exp_avg_sqs, steps)
            else:
                self._foreach_update(group, params, grads, exp_avgs, exp_avg_sqs, steps)

    @staticmethod
    def _use_fused(group: dict[str, Any], device: torch.device) -> bool:
        fused = group.get("fused")
        if fused is None:
            return device.type == "cuda" and _fused_available()
        return bool(fused)

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
        torch._foreach_add_(steps, 1.0)
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
        if steps[0].device.type != "cpu":
            for p, s in zip(params, steps):
                self.state[p]["step"] = s.cpu()
            steps = [self.state[p]["step"] for p in params]
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
