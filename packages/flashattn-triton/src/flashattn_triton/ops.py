"""The Triton launchers as ``torch.library`` custom ops, so torch.compile has no graph break.

- ``flashattn_triton::fwd(q, k, v, causal, softmax_scale, window_left=-1, window_right=-1)
  -> (o, lse)``
- ``flashattn_triton::bwd(do, q, k, v, o, lse, causal, softmax_scale, window_left=-1,
  window_right=-1) -> (dq, dk, dv)``
- ``flashattn_triton::varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
  max_seqlen_k, causal, softmax_scale, window_left, window_right) -> (o, lse)`` and
  ``varlen_bwd(do, q, k, v, o, lse, <the same>) -> (dq, dk, dv)``
- ``flashattn_triton::kvcache_fwd(q, k_cache, v_cache, cache_seqlens, causal, softmax_scale,
  window_left, window_right) -> (o, lse)``: forward only; ``kvcache_append_fwd(q, k_cache,
  v_cache, cache_seqlens, k, v, <the same>)`` first stores k, v into the caches (it mutates
  them, declared so that compile orders it and keeps the caches in place)

Compiled graphs call ``fwd_launch``, ``bwd_launch``, ``varlen_fwd_launch``,
``varlen_bwd_launch``, ``kvcache_fwd_launch`` and ``kvcache_append_fwd_launch`` instead
(``_launch_op``): the same schemas,
launchers and fake implementations, registered without an autograd formula (the
autograd.Functions of ``autograd``, which dynamo traces, own the backward) and without
custom_op's Python wrappers, so that a compiled call goes from the dispatcher straight to
the launcher. With ``Options.traced_compile`` the dense forward and backward are traced
instead (``traced_ops``: ``fwd_traced`` / ``bwd_traced``).

All tensors are (B, H, N, d) (lse: (B, H, Nq) float32); k and v may have fewer heads than q
(grouped-query attention), and dk, dv come back shaped like them. The varlen ops take
packed tensors seen as (1, H, total, d) and int32 offsets (batch + 1,). The fake
implementations give compile the output shapes and strides without running anything;
``fwd`` and ``varlen_fwd`` are differentiable through ``bwd`` / ``varlen_bwd``
(``register_autograd``), and the log-sum-exp output is non-differentiable.
"""

from __future__ import annotations

import torch

from . import cpp_launch, launch, launch_kvcache, launch_varlen
from ._ops_namespace import NAMESPACE


@torch.library.custom_op(f"{NAMESPACE}::fwd", mutates_args=())
def attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    window_left: int = -1,
    window_right: int = -1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, H, Nq, d), k, v (B, Hkv, Nk, d) -> o (B, H, Nq, d), lse (B, H, Nq) float32."""
    return launch.forward(q, k, v, causal, softmax_scale, window_left, window_right)


@attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, causal, softmax_scale, window_left=-1, window_right=-1):
    lse = q.new_empty(q.shape[:-1], dtype=torch.float32)  # (B, H, Nq)
    return launch.out_like(q), lse


@torch.library.custom_op(f"{NAMESPACE}::bwd", mutates_args=())
def attention_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    window_left: int = -1,
    window_right: int = -1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dO (B, H, Nq, d) and the forward's q, k, v, o, lse -> dq, dk, dv (shaped like q, k, v)."""
    return launch.backward(do, q, k, v, o, lse, causal, softmax_scale, window_left, window_right)


@attention_bwd.register_fake
def _attention_bwd_fake(
    do, q, k, v, o, lse, causal, softmax_scale, window_left=-1, window_right=-1
):
    return launch.out_like(q), launch.out_like(k), launch.out_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, causal, softmax_scale, *window = inputs
    o, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.causal = causal
    ctx.softmax_scale = softmax_scale
    ctx.window = window


def _backward(ctx, do, _dlse):
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = attention_bwd(do, q, k, v, o, lse, ctx.causal, ctx.softmax_scale, *ctx.window)
    return dq, dk, dv, None, None, None, None


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op(f"{NAMESPACE}::varlen_fwd", mutates_args=())
def varlen_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    softmax_scale: float,
    window_left: int,
    window_right: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (1, H, total_q, d), k, v (1, Hkv, total_k, d) packed, int32 offsets (batch + 1,)
    -> o (1, H, total_q, d), lse (1, H, total_q) float32."""
    return launch_varlen.forward_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
        softmax_scale, window_left, window_right,
    )  # fmt: skip


@varlen_fwd.register_fake
def _varlen_fwd_fake(q, k, v, *args):
    return launch.out_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op(f"{NAMESPACE}::varlen_bwd", mutates_args=())
def varlen_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    softmax_scale: float,
    window_left: int,
    window_right: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The varlen forward's gradients: dq, dk, dv shaped like q, k, v."""
    return launch_varlen.backward_varlen(
        do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
        softmax_scale, window_left, window_right,
    )  # fmt: skip


@varlen_bwd.register_fake
def _varlen_bwd_fake(do, q, k, v, *args):
    return launch.out_like(q), launch.out_like(k), launch.out_like(v)


def _varlen_setup_context(ctx, inputs, output) -> None:
    q, k, v, cu_q, cu_k, *args = inputs
    o, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, o, lse, cu_q, cu_k)
    ctx.args = args


def _varlen_backward(ctx, do, _dlse):
    q, k, v, o, lse, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = varlen_bwd(do, q, k, v, o, lse, cu_q, cu_k, *ctx.args)
    return dq, dk, dv, *(None,) * 8


varlen_fwd.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)


@torch.library.custom_op(f"{NAMESPACE}::kvcache_fwd", mutates_args=())
def kvcache_fwd(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    window_left: int,
    window_right: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, H, Nq, d), caches (B, Hkv, S, d), int32 key counts (B,) -> o (B, H, Nq, d),
    lse (B, H, Nq) float32. Forward only (no autograd formula: a KV cache serves inference)."""
    return launch_kvcache.forward_kvcache(
        q, k_cache, v_cache, cache_seqlens, causal, softmax_scale, window_left, window_right
    )


@kvcache_fwd.register_fake
def _kvcache_fwd_fake(q, k_cache, v_cache, *args):
    return launch.out_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)


def _kvcache_append_launcher(
    q, k_cache, v_cache, cache_seqlens, k, v, causal, softmax_scale, window_left, window_right
):  # fmt: skip
    """``forward_kvcache`` in the op's argument order (the new rows after the lengths)."""
    return launch_kvcache.forward_kvcache(
        q, k_cache, v_cache, cache_seqlens, causal, softmax_scale, window_left, window_right,
        k, v,
    )  # fmt: skip


@torch.library.custom_op(f"{NAMESPACE}::kvcache_append_fwd", mutates_args=("k_cache", "v_cache"))
def kvcache_append_fwd(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    window_left: int,
    window_right: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``kvcache_fwd`` after storing k, v (B, Hkv, n_new, d) into the caches from row
    cache_seqlens[b] on; element b then sees cache_seqlens[b] + n_new keys."""
    return _kvcache_append_launcher(
        q, k_cache, v_cache, cache_seqlens, k, v, causal, softmax_scale, window_left, window_right
    )  # fmt: skip


kvcache_append_fwd.register_fake(_kvcache_fwd_fake)  # the same outputs as kvcache_fwd's


# custom_op wraps each kernel in Python layers (an autograd kernel that redispatches, an
# output aliasing check, a dynamo guard); a compiled graph pays them on every call
# (benchmarks/host_cost.py --compiled). The graphs of our autograd.Functions need none of
# them, so they call these plain registrations of the same launchers.
_LAUNCH_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")


def _launch_op(public: str, launcher, fake) -> torch._ops.OpOverload:
    """The public op ``public``'s schema as ``<public>_launch``, implemented by ``launcher``
    on every device."""
    schema = getattr(getattr(torch.ops, NAMESPACE), public).default._schema
    name = f"{public}_launch"
    _LAUNCH_LIB.define(name + str(schema).partition(schema.name)[2])  # "(args) -> outs"
    _LAUNCH_LIB.impl(name, launcher, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_LAUNCH_LIB)
    return getattr(getattr(torch.ops, NAMESPACE), name).default


def _late(module, name: str):
    """``module.<name>`` looked up on each call, as the eager path does: a wrapper set on
    the launcher later (benchmarks/step_breakdown.py times ``launch.forward``) then runs in
    compiled graphs too, for the cost of one attribute read."""

    def launcher(*args, **kwargs):
        return getattr(module, name)(*args, **kwargs)

    return launcher


# (the C++ replay where ``Options.cpp_launch_compiled`` allows it, else ``launch.forward`` /
# ``launch.backward``, still looked up per call)
fwd_launch = _launch_op("fwd", _late(cpp_launch, "op_forward"), _attention_fwd_fake)
bwd_launch = _launch_op("bwd", _late(cpp_launch, "op_backward"), _attention_bwd_fake)
varlen_fwd_launch = _launch_op(
    "varlen_fwd", _late(launch_varlen, "forward_varlen"), _varlen_fwd_fake
)
varlen_bwd_launch = _launch_op(
    "varlen_bwd", _late(launch_varlen, "backward_varlen"), _varlen_bwd_fake
)
kvcache_fwd_launch = _launch_op(
    "kvcache_fwd", _late(launch_kvcache, "forward_kvcache"), _kvcache_fwd_fake
)
kvcache_append_fwd_launch = _launch_op(
    "kvcache_append_fwd", _kvcache_append_launcher, _kvcache_fwd_fake
)
