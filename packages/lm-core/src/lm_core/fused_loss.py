"""Fused LM head + cross-entropy: the mean loss of `h @ weight.T` and its gradients without
ever materializing the full (N, V) logits.

Shapes: N rows (tokens), D hidden size, V vocabulary, C rows per chunk.

Algorithm (chunked fusion, as Liger-Kernel's FusedLinearCrossEntropy): for each chunk of C
rows of h,
  1. logits = h_c @ W^T                       (C, V) in the compute dtype, one cuBLAS matmul;
  2. the chunk step, in place on that buffer: per-row online log-sum-exp in fp32 -> loss rows,
     then (when gradients are needed) dlogits = (softmax - onehot(target)) / n_valid
     (`ce_chunk_torch` below, or the Triton kernel `lm_core.fused_loss_triton.ce_chunk`);
  3. dh_c = dlogits @ W                        (C, D), written to its rows of dh;
     dW  += dlogits^T @ h_c                    (V, D), accumulated in fp32 (or fp64).
The gradients are computed during the forward (the loss is a scalar: its backward only scales
them by the incoming gradient, in place), which saves recomputing the logits matmul. With no
gradient needed (eval, `torch.no_grad()`) only the loss is computed.

Memory beyond the inputs and outputs, e = bytes per element of the compute dtype:
  C*V*e (the logits chunk) + C*D*e (h chunk, when h's dtype differs from the compute dtype)
  + V*D*e (cast of W, when its dtype differs) + V*D*4 (fp32 dW accumulator, when W is not
  fp32; for an fp32 W it is the output itself) + N*D (dh, the output)
  [+ V*D*e for the partial product of a chunk where torch has no fp32-output GEMM for the
  compute dtype (before torch 2.8 and off CUDA)] [+ about 2*C*V*4 for the torch chunk step's
  fp32 temporaries].
The full logits would take N*V*e, and an unfused loss another N*V*4 (fp32 copy) and more for
their gradients. The default C makes the chunk about as large as h: C ~ N*D/V (at least 256
rows, rounded up to a multiple of 256), i.e. ceil(V/D) chunks.

Numerics: logits are rounded to the compute dtype (as autocast's F.linear does), the loss and
softmax are computed in fp32 from them, dlogits are rounded to the compute dtype before the two
gradient matmuls (as an unfused autocast backward does), dW is accumulated across chunks in fp32.

Backends: "triton" (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1; fp16/bf16/fp32),
"torch" (any device and floating dtype), "auto" (triton where it can run and is installed,
else torch). The choice is made when the op runs, so it never reaches a compiled graph.

`torch.compile`: the work runs in one custom op, `lm_core::fused_linear_cross_entropy`, with a
fake implementation and an autograd formula, so dynamo traces through without a graph break.
"""

from __future__ import annotations

import math
import os

import torch

__all__ = ["ce_chunk_torch", "default_chunk_size", "fused_linear_cross_entropy"]

BACKENDS = ("auto", "triton", "torch")
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
CHUNK_MULTIPLE = 256


# --- the chunk step in plain PyTorch (reference; used where the Triton kernel cannot run) ---


def ce_chunk_torch(
    logits: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
    scale: torch.Tensor,
    compute_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss and log-sum-exp of a logits chunk; with `compute_grad` the chunk is
    overwritten with dloss/dlogits = (softmax - onehot(target)) * scale (0 for ignored rows).

    logits (C, V) floating; targets (C,) integer; scale () float on logits' device (1 / the
    number of non-ignored rows). Returns loss (C,) and lse (C,) in fp32 (fp64 for fp64 logits):
    0 loss for rows whose target is `ignore_index`, NaN (loss and gradient) for a target outside
    [0, V). The same contract as the Triton kernel `fused_loss_triton.ce_chunk`.
    """
    acc = torch.promote_types(logits.dtype, torch.float32)
    v = logits.shape[1]
    x = logits.to(acc)  # (C, V); a copy unless logits are already fp32/fp64
    lse = torch.logsumexp(x, dim=-1)  # (C,)
    ignored = targets == ignore_index
    in_range = (targets >= 0) & (targets < v)
    safe = torch.where(in_range, targets, 0).long()  # (C,) gather index, always valid
    loss = lse - x.gather(1, safe[:, None])[:, 0]  # (C,)
    nan = torch.full_like(loss, math.nan)
    loss = torch.where(ignored, torch.zeros_like(loss), torch.where(in_range, loss, nan))
    if compute_grad:
        row_scale = torch.where(in_range, scale.to(acc), math.nan)
        row_scale = torch.where(ignored, 0.0, row_scale)  # (C,)
        probs = x.sub_(lse[:, None]).exp_() if x is not logits else torch.exp(x - lse[:, None])
        probs.scatter_add_(1, safe[:, None], -in_range.to(acc)[:, None])  # softmax - onehot
        logits.copy_(probs.mul_(row_scale[:, None]))
    return loss, lse


def _ce_chunk_triton(logits, targets, ignore_index, scale, compute_grad):
    from lm_core import fused_loss_triton

    return fused_loss_triton.ce_chunk(logits, targets, ignore_index, scale, compute_grad)


# --- backend choice (at run time, inside the op) ---


def _triton_runnable(device: torch.device) -> tuple[bool, str]:
    """(can the Triton kernel run on this device here, why not)."""
    if device.type not in ("cuda", "cpu"):
        return False, f"the Triton kernel runs on CUDA (or CPU in the interpreter), not {device}"
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return False, (
            "the Triton kernel needs CUDA tensors, got CPU tensors; set TRITON_INTERPRET=1 "
            "before the first call to run it in Triton's (slow) CPU interpreter, or use "
            "backend='torch' (or 'auto')"
        )
    try:
        from lm_core import fused_loss_triton
    except ImportError as exc:
        return False, f"triton is not importable ({exc}); pip install 'lm-core[triton]'"
    if device.type == "cpu" and not fused_loss_triton.interpreting():
        return False, (
            "TRITON_INTERPRET=1 was set after lm_core.fused_loss_triton was imported; set it "
            "before the first call"
        )
    return True, ""


def _chunk_step(backend: str, device: torch.device, compute_dtype: torch.dtype):
    if backend == "torch":
        return ce_chunk_torch
    if compute_dtype not in TRITON_DTYPES:
        if backend == "triton":
            raise TypeError(
                f"backend='triton' computes in float16, bfloat16 or float32, got {compute_dtype}"
                "; use backend='torch'"
            )
        return ce_chunk_torch
    ok, why = _triton_runnable(device)
    if ok:
        return _ce_chunk_triton
    if backend == "triton":
        raise RuntimeError(f"backend='triton': {why}")
    return ce_chunk_torch


# --- the chunk loop ---

_FP32_OUT_GEMM: dict[tuple[str, torch.dtype], bool] = {}


def _accumulate_dw(acc: torch.Tensor, grad: torch.Tensor, h_chunk: torch.Tensor) -> None:
    """acc (V, D) += grad^T (V, C) @ h_chunk (C, D), summing in acc's dtype (fp32 / fp64).

    Low-precision operands use torch's fp32-output GEMM (`out_dtype`, CUDA, torch >= 2.8)
    where available, else one rounded partial product per chunk added to acc."""
    if grad.dtype == acc.dtype:
        acc.addmm_(grad.t(), h_chunk)
        return
    key = (acc.device.type, grad.dtype)
    if key not in _FP32_OUT_GEMM:  # probe once per device type and dtype
        try:
            torch.addmm(acc, grad.t(), h_chunk, out_dtype=acc.dtype, out=acc)
            _FP32_OUT_GEMM[key] = True
            return
        except (TypeError, RuntimeError, NotImplementedError):  # old torch, or not here
            _FP32_OUT_GEMM[key] = False
    if _FP32_OUT_GEMM[key]:
        torch.addmm(acc, grad.t(), h_chunk, out_dtype=acc.dtype, out=acc)
    else:
        acc.add_(grad.t() @ h_chunk)


def default_chunk_size(n: int, d: int, v: int) -> int:
    """Rows per chunk: about N*D/V (the logits chunk about as large as h), at least 256,
    rounded up to a multiple of 256, at most N (and at least 1)."""
    rows = -(-n * d // max(v, 1))
    rows = -(-max(rows, 1) // CHUNK_MULTIPLE) * CHUNK_MULTIPLE
    return max(1, min(n, rows))


def _fused_forward(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
    chunk_size: int,
    compute_dtype: torch.dtype,
    need_dh: bool,
    need_dw: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h (N, D), weight (V, D), targets (N,) -> mean loss () fp32, dh (N, D) in h's dtype or
    (0,), dW (V, D) in weight's dtype or (0,): gradients of the mean loss (not yet scaled by an
    incoming gradient)."""
    n, d = h.shape
    v = weight.shape[0]
    step = _chunk_step(backend, h.device, compute_dtype)
    acc_dtype = torch.promote_types(compute_dtype, torch.float32)
    compute_grad = need_dh or need_dw
    w = weight.to(compute_dtype)  # (V, D); no copy when the dtypes match
    n_valid = (targets != ignore_index).sum()
    scale = 1.0 / n_valid.clamp(min=1).to(acc_dtype)  # () on the device: no host sync
    loss_sum = torch.zeros((), dtype=acc_dtype, device=h.device)
    dh = torch.empty((n, d), dtype=h.dtype, device=h.device) if need_dh else h.new_empty(0)
    dw = weight.new_empty(0)
    dw_acc = None
    if need_dw:
        dw_acc = torch.zeros((v, d), dtype=acc_dtype, device=weight.device)
    for start in range(0, n, chunk_size):
        end = min(start + chunk_size, n)
        h_c = h[start:end].to(compute_dtype)  # (C, D)
        logits = h_c @ w.t()  # (C, V), becomes dlogits in place
        loss_rows, _ = step(logits, targets[start:end], ignore_index, scale, compute_grad)
        loss_sum += loss_rows.sum()
        if need_dh:
            dh[start:end] = logits @ w  # (C, D)
        if need_dw:
            _accumulate_dw(dw_acc, logits, h_c)
    if need_dw:
        dw = dw_acc if dw_acc.dtype == weight.dtype else dw_acc.to(weight.dtype)
    loss = (loss_sum * scale).to(torch.float32)
    return loss, dh, dw


# --- custom op (torch.compile sees one opaque node) and its autograd formula ---


@torch.library.custom_op("lm_core::fused_linear_cross_entropy", mutates_args=())
def _fused_lce_op(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
    chunk_size: int,
    compute_dtype: torch.dtype,
    need_dh: bool,
    need_dw: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h (N, D), weight (V, D), targets (N,) -> loss () fp32, dh (N, D) | (0,), dW (V, D) | (0,)."""
    # autocast stays on inside a custom op; the dtypes here are chosen explicitly instead
    with torch.autocast(h.device.type, enabled=False):
        return _fused_forward(
            h, weight, targets, ignore_index, chunk_size, compute_dtype, need_dh, need_dw, backend
        )


@_fused_lce_op.register_fake
def _fused_lce_fake(
    h, weight, targets, ignore_index, chunk_size, compute_dtype, need_dh, need_dw, backend
):
    loss = h.new_empty((), dtype=torch.float32)
    dh = h.new_empty(h.shape) if need_dh else h.new_empty(0)
    dw = weight.new_empty(weight.shape) if need_dw else weight.new_empty(0)
    return loss, dh, dw


def _setup_context(ctx, inputs, output) -> None:
    _, _, _, _, _, _, need_dh, need_dw, _ = inputs
    _, dh, dw = output
    ctx.mark_non_differentiable(dh, dw)
    ctx.save_for_backward(dh, dw)
    ctx.need_dh, ctx.need_dw = need_dh, need_dw


def _backward(ctx, grad_loss, _grad_dh, _grad_dw):
    # The gradients were computed in the forward for an incoming gradient of 1. Eager: scale
    # them in place (no second (V, D) buffer); a second backward through the same graph
    # (retain_graph=True) is then refused by autograd's saved-tensor version check. Traced
    # (torch.compile: fake/functional tensor subclasses): out of place, as AOTAutograd's
    # partitioner requires; the compiler may reuse the saved buffer.
    try:
        dh, dw = ctx.saved_tensors
    except RuntimeError as exc:  # the version check: this backward already ran
        raise RuntimeError(
            "fused_linear_cross_entropy: backward ran twice through the same graph "
            "(retain_graph=True); its gradients are computed once, in the forward, and scaled "
            "in place. Call the loss again for a second backward."
        ) from exc
    eager = type(dw) is torch.Tensor and type(dh) is torch.Tensor
    dh_out = dw_out = None
    if ctx.need_dh:
        g = grad_loss.to(dh.dtype)
        dh_out = dh.mul_(g) if eager else dh * g
    if ctx.need_dw:
        g = grad_loss.to(dw.dtype)
        dw_out = dw.mul_(g) if eager else dw * g
    return dh_out, dw_out, None, None, None, None, None, None, None


_fused_lce_op.register_autograd(_backward, setup_context=_setup_context)


# --- functional API ---


def _is_compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and compiler.is_compiling())


def _check(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
    chunk_size: int | None,
    backend: str,
) -> None:
    for name, t in (("h", h), ("weight", weight), ("targets", targets)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if h.dim() < 1 or not h.is_floating_point():
        raise TypeError(
            f"h: expected a floating tensor of shape (..., D), got {h.dtype} {tuple(h.shape)}"
        )
    if weight.dim() != 2 or not weight.is_floating_point():
        raise TypeError(
            f"weight: expected a floating tensor of shape (V, D), got {weight.dtype} "
            f"{tuple(weight.shape)}"
        )
    if weight.shape[1] != h.shape[-1]:
        raise ValueError(
            f"weight: expected shape (V, {h.shape[-1]}) (D of h), got {tuple(weight.shape)}"
        )
    if weight.shape[0] == 0:
        raise ValueError("weight: the vocabulary is empty (V = 0)")
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise TypeError(f"targets: expected an integer dtype, got {targets.dtype}")
    if targets.shape != h.shape[:-1]:
        raise ValueError(
            f"targets: expected shape {tuple(h.shape[:-1])} (h without its last dim), "
            f"got {tuple(targets.shape)}"
        )
    if not h.device == weight.device == targets.device:
        raise ValueError(
            f"h, weight, targets must be on one device, got h {h.device}, weight "
            f"{weight.device}, targets {targets.device}"
        )
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index: expected an int, got {ignore_index!r}")
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0
    ):
        raise ValueError(f"chunk_size: expected a positive int or None, got {chunk_size!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")


def fused_linear_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Mean cross-entropy of `targets` under softmax(h @ weight.T), without the full logits.

    h: (..., D) hidden states (the LM head's input, after the final norm); weight: (V, D)
    (`lm_head.weight`); targets: (...) integer ids in [0, V), or `ignore_index` for positions
    that do not count (torch's default, -100). Returns a 0-dim fp32 tensor, the mean over the
    counted positions (0, with zero gradients, when none counts), differentiable w.r.t. h and
    weight. Equal to `cross_entropy(h @ weight.T, targets)` up to rounding.

    dtypes: h and weight must share one (fp16, bf16, fp32, fp64) unless torch.autocast is on
    for their device, in which case both are cast to the autocast dtype as F.linear would be.
    Logits are rounded to that compute dtype; softmax, loss and the dW accumulation are fp32.
    Gradients come back in h's and weight's own dtypes.

    chunk_size: rows per chunk (the (C, V) logits buffer); default `default_chunk_size`.
    backend: "auto" (Triton where it can run, else PyTorch), "triton" or "torch".
    A target outside [0, V) raises on CPU in eager mode; elsewhere (where checking values would
    make the host wait for the device) it yields a NaN loss instead of a wrong number.
    """
    _check(h, weight, targets, ignore_index, chunk_size, backend)
    device_type = h.device.type
    if torch.is_autocast_enabled(device_type) and device_type in ("cuda", "cpu"):
        compute_dtype = torch.get_autocast_dtype(device_type)
    else:
        if weight.dtype != h.dtype:
            raise TypeError(
                f"weight: expected dtype {h.dtype} (h's), got {weight.dtype}; cast one of them "
                "or run under torch.autocast"
            )
        compute_dtype = h.dtype
    d = h.shape[-1]
    h2 = h.reshape(-1, d)  # (N, D)
    t2 = targets.reshape(-1)  # (N,)
    n, v = h2.shape[0], weight.shape[0]
    if device_type == "cpu" and n > 0 and not _is_compiling():
        bad = (t2 != ignore_index) & ((t2 < 0) | (t2 >= v))
        if bool(bad.any()):
            raise ValueError(
                f"targets: values must lie in [0, V={v}) or equal ignore_index={ignore_index}, "
                f"got {int(t2[bad][0])}"
            )
    grad = torch.is_grad_enabled()
    need_dh = grad and h.requires_grad
    need_dw = grad and weight.requires_grad
    chunk = chunk_size if chunk_size is not None else default_chunk_size(n, d, v)
    loss, _, _ = _fused_lce_op(
        h2, weight, t2, ignore_index, chunk, compute_dtype, need_dh, need_dw, backend
    )
    return loss
