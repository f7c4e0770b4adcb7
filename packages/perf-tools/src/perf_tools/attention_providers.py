"""The attention implementations the attention benchmarks compare, behind one signature.

Every provider is `fn(q, k, v) -> o` on (B, N, d) tensors with causal masking as configured;
building one may fail with `UnsupportedError` (wrong device, dtype or missing package), which the
benchmark records as a cell instead of crashing.

| name           | what                                                                 |
|----------------|----------------------------------------------------------------------|
| naive          | lm_core's naive attention (scores, softmax, weighted sum), eager     |
| naive-compiled | the same under torch.compile (dynamic=False)                         |
| flash-triton   | ours: flashattn_triton.FlashAttention2Triton.apply                   |
| flash-torch    | flashattn_triton.FlashAttention2Torch (tiled PyTorch reference)      |
| sdpa-flash     | F.scaled_dot_product_attention, FLASH_ATTENTION backend only         |
| sdpa-cudnn     | the same, CUDNN_ATTENTION backend only                               |
| sdpa-efficient | the same, EFFICIENT_ATTENTION (memory-efficient) backend only        |
| sdpa-math      | the same, MATH backend (PyTorch ops)                                 |
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from perf_tools._compile import compile_for_bench

AttnFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
PROVIDERS = (
    "naive",
    "naive-compiled",
    "flash-triton",
    "flash-torch",
    "sdpa-flash",
    "sdpa-cudnn",
    "sdpa-efficient",
    "sdpa-math",
)
_SDPA_BACKENDS = {
    "sdpa-flash": "FLASH_ATTENTION",
    "sdpa-cudnn": "CUDNN_ATTENTION",
    "sdpa-efficient": "EFFICIENT_ATTENTION",
    "sdpa-math": "MATH",
}


class UnsupportedError(RuntimeError):
    """This provider cannot run this configuration here (recorded, not raised to the user)."""


def naive_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
) -> torch.Tensor:
    """Attention written out on (B, N, d): lm_core's naive backend when causal, else plain.

    The causal path runs lm_core's implementation on a head axis of 1 ((B, 1, N, d)), so the
    numbers are those of the model's own naive attention.
    """
    if causal:
        from lm_core.attention import naive_attention as lm_naive

        return lm_naive(q[:, None], k[:, None], v[:, None])[:, 0]  # (B, 1, N, d) -> (B, N, d)
    scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))  # (B, N, N)
    probs = torch.softmax(scores, dim=-1)  # (B, N, N)
    return torch.matmul(probs, v)  # (B, N, d)


def triton_runs_here(device: torch.device) -> bool:
    """Triton kernels run on CUDA, or on CPU tensors through TRITON_INTERPRET=1."""
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def make_provider(name: str, device: torch.device, dtype: torch.dtype, causal: bool) -> AttnFn:
    """The callable for `name` (module table); raises UnsupportedError where it cannot run."""
    if name == "naive":
        return lambda q, k, v: naive_attention(q, k, v, causal)
    if name == "naive-compiled":
        inner = compile_for_bench(naive_attention)
        return lambda q, k, v: inner(q, k, v, causal)
    if name in ("flash-triton", "flash-torch"):
        try:
            import flashattn_triton
        except ImportError as exc:
            raise UnsupportedError(f"flashattn_triton is not importable: {exc}") from exc
        if name == "flash-triton":
            if not triton_runs_here(device):
                raise UnsupportedError("needs a CUDA device (or TRITON_INTERPRET=1 on CPU)")
            fn = flashattn_triton.FlashAttention2Triton.apply
        else:
            fn = flashattn_triton.FlashAttention2Torch.apply
        return lambda q, k, v: fn(q, k, v, causal)
    if name in _SDPA_BACKENDS:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, _SDPA_BACKENDS[name], None)
        if backend is None:
            raise UnsupportedError(f"this torch has no SDPBackend.{_SDPA_BACKENDS[name]}")

        def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # (B, N, d) -> (1, B, N, d): the batch acts as heads, as the leaderboard does
            with sdpa_kernel(backend):
                o = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=causal)
            return o[0]  # (B, N, d)

        return sdpa
    raise ValueError(f"provider: expected one of {', '.join(PROVIDERS)}, got {name!r}")


def is_unsupported_error(name: str, exc: BaseException) -> bool:
    """Whether `exc` (not an OOM: callers check that first) means 'cannot run this config'.

    An SDPA call pinned to one backend raises RuntimeError ("No available kernel") when that
    backend does not support the dtype / head dim / device; our kernels raise ValueError or
    TypeError from their argument checks.
    """
    if isinstance(exc, UnsupportedError):
        return True
    if name.startswith("sdpa-") and isinstance(exc, RuntimeError):
        return True
    return isinstance(exc, ValueError | TypeError | NotImplementedError)
