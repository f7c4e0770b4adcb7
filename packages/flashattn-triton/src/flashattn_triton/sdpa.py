"""A drop-in for ``torch.nn.functional.scaled_dot_product_attention``.

Code written against SDPA (Hugging Face models' ``sdpa`` attention, ports of nanoGPT) can
take our kernels without edits: ``scaled_dot_product_attention`` has SDPA's signature and
runs ``flash_attention`` on the calls whose meaning the two share, and torch's own SDPA on
every other call, so results never change meaning. ``sdpa_replaced()`` puts it in place of
``torch.nn.functional.scaled_dot_product_attention`` for the code inside it, which finds the
function on the module at call time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from ._checks import MAX_HEAD_DIM
from .api import flash_attention, in_autocast_dtype

# torch's function, kept before anything replaces it (the fallback, and what
# ``sdpa_replaced`` restores)
TORCH_SDPA = F.scaled_dot_product_attention
# Inputs ours takes: 16-bit on CUDA (float32 calls stay with torch, whose kernels for them
# were not measured against ours)
DTYPES = (torch.float16, torch.bfloat16)


def _positive_number(x: object) -> bool:
    return not isinstance(x, bool) and isinstance(x, int | float) and math.isfinite(x) and x > 0


def _kernels_run_on(t: torch.Tensor) -> bool:
    """Whether t's device is one the drop-in gives our kernels (CUDA; tests widen it)."""
    return t.is_cuda


def runs_ours(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> bool:
    """Whether ``scaled_dot_product_attention`` runs ``flash_attention`` for these arguments:
    plain CUDA float16/bfloat16 tensors of rank 3 or 4 with one head dim d <= 128 for q, k
    and v, no mask, no dropout, a finite positive scale (or none), the same leading dims (no
    broadcasting), k / v heads equal to q's or, with ``enable_gqa``, dividing them, and,
    when causal, as many queries as keys
    (SDPA aligns a causal mask to the top left, ``flash_attention`` to the bottom right: the
    same mask only for a square one)."""
    # (ordered and written for host time: an eager model pays this per call)
    if (
        attn_mask is not None
        or dropout_p != 0.0
        or (is_causal is not True and is_causal is not False)
    ):
        return False
    if type(query) is not torch.Tensor or type(key) is not torch.Tensor:
        return False
    if type(value) is not torch.Tensor:
        return False
    if scale is not None and not _positive_number(scale):
        return False  # (SDPA takes any scale; ours a finite positive one)
    dtype, q_shape, k_shape = query.dtype, query.shape, key.shape
    rank = len(q_shape)
    if dtype not in DTYPES or (rank != 3 and rank != 4) or len(k_shape) != rank:
        return False
    if key.dtype is not dtype or value.dtype is not dtype or value.shape != k_shape:
        return False
    d, h, h_kv = q_shape[-1], q_shape[-3], k_shape[-3]
    if d > MAX_HEAD_DIM or k_shape[-1] != d or (rank == 4 and q_shape[0] != k_shape[0]):
        return False
    if h != h_kv and not (enable_gqa and h % h_kv == 0):
        return False
    if is_causal and q_shape[-2] != k_shape[-2]:
        return False
    if query.numel() == 0 or key.numel() == 0 or not _kernels_run_on(query):
        return False
    return key.device == query.device and value.device == query.device


def _as_autocast(query, key, value) -> tuple:
    """q, k, v as SDPA sees them on the kernels' device: under autocast SDPA runs in the
    autocast dtype (a Hugging Face model kept in float32 under bf16 autocast passes float32
    q and k, from RoPE's float32 tables, with a bf16 v). Elsewhere torch's SDPA gets the
    inputs as they are."""
    if type(query) is not torch.Tensor or not _kernels_run_on(query):
        return query, key, value
    return in_autocast_dtype(query, key, value, query.device.type)


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` with our kernels where
    ``runs_ours`` says the call means the same to both; torch's SDPA (with every argument as
    given) otherwise. query (..., H, L, E), key / value (..., Hkv, S, E) -> (..., H, L, E).
    Under autocast, as SDPA does, q, k and v are taken in the autocast dtype."""
    q, k, v = _as_autocast(query, key, value)
    ours = runs_ours(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if not torch.compiler.is_compiling() and _OPEN:  # (a traced graph counts nothing)
        _count(ours)
    if ours:
        softmax_scale = None if scale is None else float(scale)
        return flash_attention(q, k, v, is_causal, softmax_scale)
    return TORCH_SDPA(
        query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
        scale=scale, enable_gqa=enable_gqa,
    )  # fmt: skip


@dataclasses.dataclass(eq=False)  # (blocks are told apart by identity)
class DropinCalls:
    """The drop-in's eager calls inside an ``sdpa_replaced()`` block: ``ours`` ran our
    kernels, ``torch`` went to torch's SDPA. Compiled graphs decide once, when traced, and
    their calls are not counted."""

    ours: int = 0
    torch: int = 0


_OPEN: list[DropinCalls] = []  # the counts of the open ``sdpa_replaced`` blocks


def _count(ours: bool) -> None:
    for calls in _OPEN:
        if ours:
            calls.ours += 1
        else:
            calls.torch += 1


@contextlib.contextmanager
def sdpa_replaced() -> Iterator[DropinCalls]:
    """Within: ``torch.nn.functional.scaled_dot_product_attention`` is
    ``scaled_dot_product_attention`` (for code that looks it up at call time, e.g. Hugging
    Face's ``sdpa`` attention); restored on exit, also on an exception. Yields the block's
    ``DropinCalls``, to check that a model's calls take our kernels. The replacement is
    process-wide: threads entering and leaving it out of order can leave the drop-in in
    place, which changes no result (it means what SDPA means for every call)."""
    before = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = scaled_dot_product_attention
    calls = DropinCalls()
    _OPEN.append(calls)
    try:
        yield calls
    finally:
        _OPEN.remove(calls)
        F.scaled_dot_product_attention = before
