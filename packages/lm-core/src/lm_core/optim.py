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

Opt-in, numerics-changing: `state_dtype=torch.bfloat16` keeps the moments of fp32 parameters
in bf16 (the parameters stay fp32 master weights): half the state memory and 20 instead of 28
bytes of traffic per parameter on CUDA, where a Triton kernel does the update
(`lm_core.optim_lowp` says how, and how the moments are rounded).
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch

from lm_core import lowp_weights, optim_lowp

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
            (fused -> foreach -> plain; see the module docstring). With bf16 states: True ->
            the Triton kernel (RuntimeError where it cannot run), None -> that kernel for
            CUDA parameters, False -> PyTorch ops (`optim_lowp.backend`).
        state_dtype: dtype of exp_avg and exp_avg_sq of fp32 parameters: torch.float32 (the
            default: torch's AdamW exactly) or torch.bfloat16 (opt-in; changes numerics:
            see `lm_core.optim_lowp`). Other parameters' moments keep their own dtype.
            State dicts hold the moments in their dtype; loading converts them to this one
            (fp32 -> bf16 rounds to nearest, bf16 -> fp32 is exact).
        state_rounding: how bf16 moments are rounded after each update: "stochastic"
            (default: unbiased, keeps updates below half a bf16 ulp on average) or "nearest"
            (half to even). Ignored for fp32 states.
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
        state_dtype: torch.dtype = torch.float32,
        state_rounding: str = "stochastic",
    ) -> None:
        _check_hparams(lr, betas, eps, weight_decay)
        # optimizer-wide, not per group: they say what this optimizer stores, whatever dtype
        # a loaded state dict had (`load_state_dict` converts)
        self.state_dtype = optim_lowp.check_state_dtype(state_dtype)
        self.state_rounding = optim_lowp.check_rounding(state_rounding)
        if fused and state_dtype == torch.float32:
            implementation(True, torch.device("cpu"))  # raises if the fused op is unusable
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "fused": fused,
        }
        super().__init__(params, defaults)

    def __getstate__(self) -> dict[str, Any]:
        # torch's keeps defaults, state and param_groups only (copy.deepcopy, pickle)
        extra = {"state_dtype": self.state_dtype, "state_rounding": self.state_rounding}
        return {**super().__getstate__(), **extra}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        # kept when torch's load_state_dict passes state and groups only; an older pickle
        # had fp32 states
        self.__dict__.setdefault("state_dtype", torch.float32)
        self.__dict__.setdefault("state_rounding", "stochastic")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (validating its hyperparameters), as torch.optim.Optimizer does."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _check_hparams(group["lr"], group["betas"], group["eps"], group["weight_decay"])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch.optim.Optimizer.load_state_dict, with the moments converted to this
        optimizer's `state_dtype` (torch's casts them to the parameter's dtype) and fp32
        masters of held bf16 weights kept fp32 (`lm_core.lowp_weights`). A master saved for
        a parameter that is fp32 here becomes its value; a held parameter loaded without one
        keeps the master `hold_in_bf16` gave it."""
        params = [p for g in self.param_groups for p in g["params"]]
        entries = [e for e in state_dict["state"].values() if isinstance(e, dict)]
        if (
            self.state_dtype == torch.float32
            and not any("master" in e for e in entries)
            and not any(lowp_weights.is_held(p) for p in params)
        ):
            super().load_state_dict(state_dict)  # torch's behaviour exactly
            return
        # Take the moments and masters out so torch does not cast them to the parameter's
        # dtype (or make fp32 copies of bf16 moments) first.
        kept = (*optim_lowp.MOMENTS, "master")
        moved: dict[Any, dict[str, Any]] = {}
        stripped: dict[Any, Any] = {}
        for key, entry in state_dict["state"].items():
            if isinstance(entry, dict):
                moved[key] = {n: v for n, v in entry.items() if n in kept}
                entry = {n: v for n, v in entry.items() if n not in kept}
            stripped[key] = entry
        super().load_state_dict({**state_dict, "state": stripped})
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        param_of = dict(zip(saved_ids, params))
        for key, entry in moved.items():
            p = param_of.get(key)
            if p is None:  # torch keeps state it cannot place under its key, as it came
                self.state[key].update(entry)
                continue
            master = entry.pop("master", None)
            if master is not None and not lowp_weights.is_held(p):
                with torch.no_grad():
                    p.copy_(master)
                master = None
            if master is None and lowp_weights.is_held(p):
                master = lowp_weights.take_master(p)
                if master is None:
                    raise ValueError(
                        "load_state_dict: a held bf16 weight has no fp32 master in the state "
                        "dict nor a pending one (lm_core.lowp_weights.hold_in_bf16)"
                    )
            if master is not None:
                lowp_weights.take_master(p, check=False)  # the loaded one replaces it
                self.state[p]["master"] = master.to(device=p.device, dtype=torch.float32)
            dtype = optim_lowp.moment_dtype(p, self.state_dtype)
            for name, value in entry.items():
                if isinstance(value, torch.Tensor):
                    value = value.to(device=p.device, dtype=dtype)
                self.state[p][name] = value

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
        # (device, dtype, moments' dtype, DTensor mesh or None) -> lists of params, grads,
        # exp_avgs, exp_avg_sqs, steps: a foreach op takes no mix of tensors and DTensors
        # (tensor parallelism leaves the replicated parameters plain) nor DTensors of two
        # meshes; moments of another dtype than the parameter's take the bf16-state update.
        buckets: dict[tuple[Any, ...], list[list[torch.Tensor]]] = defaultdict(
            lambda: [[], [], [], [], [], []]
        )
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("AdamW does not support sparse gradients")
            state = self.state[p]
            if len(state) == 0:
                # fused (and the Triton kernels): the step count lives on the parameter's
                # device (the kernel reads it); foreach: on the CPU (bias corrections are host
                # math). Created in place, so the first step does not copy host -> device.
                dtype = optim_lowp.moment_dtype(p, self.state_dtype)
                if dtype != p.dtype:
                    on_device = optim_lowp.backend(group.get("fused"), p.device) == "triton"
                else:
                    on_device = implementation(group.get("fused"), p.device) == "fused"
                step_device = p.device if on_device else "cpu"
                state["step"] = torch.zeros((), dtype=torch.float32, device=step_device)
                for name in optim_lowp.MOMENTS:
                    state[name] = torch.zeros_like(
                        p, dtype=dtype, memory_format=torch.preserve_format
                    )
            master = state.get("master")
            if master is None and lowp_weights.is_held(p):  # also held after a resume
                master = state["master"] = lowp_weights.new_master(p)
            mesh = getattr(p, "device_mesh", None)
            key = (p.device, p.dtype, state["exp_avg"].dtype, mesh, master is not None)
            lists = buckets[key]
            for i, t in enumerate((p, p.grad, state["exp_avg"], state["exp_avg_sq"])):
                lists[i].append(t)
            lists[4].append(state["step"])
            if master is not None:
                lists[5].append(master)
        for (device, dtype, moments, _, held), lists in buckets.items():
            if held:
                self._master_update(group, *lists)
                continue
            if moments != dtype:
                self._lowp_update(group, *lists[:5])
                continue
            update = {
                "fused": self._fused_update,
                "foreach": self._foreach_update,
                "plain": self._plain_update,
            }[implementation(group.get("fused"), device)]
            update(group, *lists[:5])

    def _master_update(
        self,
        group: dict[str, Any],
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        exp_avgs: list[torch.Tensor],
        exp_avg_sqs: list[torch.Tensor],
        steps: list[torch.Tensor],
        masters: list[torch.Tensor],
    ) -> None:
        """bf16 parameters with fp32 masters (`lm_core.lowp_weights`): the Triton kernel, or
        the fp32 (or bf16-moment) update of the masters by PyTorch ops, each parameter then
        set to its master rounded to nearest."""
        device = params[0].device
        what = "AdamW(fused=True): the update of bf16 weights with fp32 masters"
        if optim_lowp.backend(group.get("fused"), device, what) == "triton":
            steps = self._device_steps(params, steps)
            self._advance(steps)
            for p, g, m, v, s, w in zip(params, grads, exp_avgs, exp_avg_sqs, steps, masters):
                work = [t.contiguous() for t in (p, w, g, m, v)]
                scale = lowp_weights.take_grad_scale(p)
                optim_lowp.master_kernel_step(*work, s, group, self.state_rounding, scale)
                for t, c in zip((p, w, g, m, v), work):
                    if c is not t and t is not g:
                        t.copy_(c)
            return
        steps = self._host_steps(params, steps)  # resolved here: the updates see masters
        grads32 = [g.float() for g in grads]
        for p, g in zip(params, grads32):
            scale = lowp_weights.take_grad_scale(p)  # clipping, in fp32 (clip_grad_norm)
            if scale is not None:
                g.mul_(scale)
        if exp_avgs[0].dtype != torch.float32:
            self._lowp_torch(group, masters, grads32, exp_avgs, exp_avg_sqs, steps)
        elif _foreach_available():
            self._foreach_update(group, masters, grads32, exp_avgs, exp_avg_sqs, steps)
        else:
            self._plain_update(group, masters, grads32, exp_avgs, exp_avg_sqs, steps)
        for p, w in zip(params, masters):
            p.copy_(w)

    def _lowp_update(
        self,
        group: dict[str, Any],
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        exp_avgs: list[torch.Tensor],
        exp_avg_sqs: list[torch.Tensor],
        steps: list[torch.Tensor],
    ) -> None:
        """fp32 parameters with bf16 moments (`lm_core.optim_lowp`): the Triton kernel, or
        the foreach / plain update on fp32 copies of the moments, rounded back."""
        device = params[0].device
        if optim_lowp.backend(group.get("fused"), device) == "triton":
            steps = self._device_steps(params, steps)
            self._advance(steps)
            for p, g, m, v, s in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
                ts = [optim_lowp.local(t) for t in (p, g, m, v)]
                work = [t.contiguous() for t in ts]  # the kernel's flat indexing (rarely a copy)
                optim_lowp.kernel_step(*work, s, group, self.state_rounding)
                for t, w in zip(ts, work):
                    if w is not t and t is not ts[1]:
                        t.copy_(w)
            return
        self._lowp_torch(group, params, grads, exp_avgs, exp_avg_sqs, steps)

    def _lowp_torch(
        self,
        group: dict[str, Any],
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        exp_avgs: list[torch.Tensor],
        exp_avg_sqs: list[torch.Tensor],
        steps: list[torch.Tensor],
    ) -> None:
        # The fp32 update on fp32 copies (scratch), then the moments rounded back into bf16.
        # `params` may be masters, which are no keys of self.state: the counts are resolved
        # to CPU tensors of the state first, then read from the list.
        steps = self._host_steps(params, steps) if params[0] in self.state else steps
        m32 = [m.float() for m in exp_avgs]
        v32 = [v.float() for v in exp_avg_sqs]
        update = self._foreach_update if _foreach_available() else self._plain_update
        update(group, params, grads, m32, v32, steps)
        counts = [int(s.item()) for s in steps]  # CPU tensors, advanced in place
        rounding = self.state_rounding
        moments = [[optim_lowp.local(t) for t in ts] for ts in (exp_avgs, exp_avg_sqs)]
        optim_lowp.round_into(moments[0], [optim_lowp.local(t) for t in m32], counts, 0, rounding)
        optim_lowp.round_into(moments[1], [optim_lowp.local(t) for t in v32], counts, 1, rounding)

    def _fused_update(
        self,
        group: dict[str, Any],
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        exp_avgs: list[torch.Tensor],
        exp_avg_sqs: list[torch.Tensor],
        steps: list[torch.Tensor],
    ) -> None:
        steps = self._device_steps(params, steps)
        self._advance(steps)
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

    def _device_steps(self, params: list[torch.Tensor], steps: list[torch.Tensor]) -> list:
        """The step counts on the parameters' device (moved once): fused kernels read them
        there."""
        device = params[0].device
        if steps[0].device != device:
            for p, s in zip(params, steps):
                self.state[p]["step"] = s.to(device)
            steps = [self.state[p]["step"] for p in params]
        return steps

    @staticmethod
    def _advance(steps: list[torch.Tensor]) -> None:
        if _foreach_available():
            torch._foreach_add_(steps, 1.0)
        else:
            for s in steps:
                s.add_(1.0)

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
    (norms by `torch._foreach_norm` per (device, dtype) group, of bf16 / fp16 gradients in
    fp32). Gradients of held bf16 weights (`lm_core.lowp_weights`) are not scaled here: AdamW
    multiplies them by the scale in fp32 at its next step, as fp32 gradients are scaled.
    Returns the total norm before clipping as a 0-dim fp32 tensor on the first gradient's
    device (0 if no gradients).
    """
    if not max_norm > 0:
        raise ValueError(f"clip_grad_norm: max_norm must be > 0, got {max_norm}")
    if isinstance(params, torch.Tensor):
        params = [params]
    with_grads = [p for p in params if p.grad is not None]
    grads = [p.grad for p in with_grads]
    if not grads:
        return torch.tensor(0.0)
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    positions: dict[tuple[torch.device, torch.dtype], list[int]] = defaultdict(list)
    for i, g in enumerate(grads):
        groups[(g.device, g.dtype)].append(g)
        positions[(g.device, g.dtype)].append(i)
    first = grads[0].device
    norms: list[torch.Tensor] = [torch.empty(0)] * len(grads)
    for (device, dtype), group in groups.items():
        # low-precision gradients (held bf16 weights, lm_core.lowp_weights): norms in fp32,
        # as of their values in fp32; stacked in parameter order, so the sum is the one an
        # all-fp32 model takes
        kw = {} if dtype in (torch.float32, torch.float64) else {"dtype": torch.float32}
        for i, n in zip(positions[(device, dtype)], torch._foreach_norm(group, 2, **kw)):
            norms[i] = n.to(device=first, dtype=torch.float32)
    total = torch.linalg.vector_norm(torch.stack(norms))
    scale = torch.clamp(max_norm / (total + eps), max=1.0)
    held = {id(p.grad) for p in with_grads if lowp_weights.is_held(p)}
    for p in with_grads:
        if id(p.grad) in held:
            lowp_weights.defer_grad_scale(p, scale.to(p.device))
    for (device, _), group in groups.items():
        group = [g for g in group if id(g) not in held]
        if group:
            torch._foreach_mul_(group, scale.to(device))
    return total
