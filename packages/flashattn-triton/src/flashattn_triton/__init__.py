"""FlashAttention-2 forward and backward in plain PyTorch and in Triton, usable as a
torch.compile-friendly custom op.

Read top-down: ``reference`` (naive attention) -> ``torch_impl`` (FlashAttention2Torch) ->
``kernels`` (Triton) -> ``launch`` / ``launch_varlen`` / ``launch_kvcache`` / ``ops`` (custom
ops) -> ``autograd`` (FlashAttention2Triton) -> ``api`` (flash_attention,
flash_attention_varlen, flash_attention_kvcache, FlashAttention).
The launchers build on ``launch_common`` (one kernel's launch), ``launch_backward`` (the
backward schemes) and ``launch_plans`` (launch-plan keys). ``options`` holds the launch
switches (``set_options``, ``use_options``), ``fastlaunch`` the cached launch plans
(``cpp_launch`` / ``cpp_plans``: their replay from a C++ autograd node),
``traced_ops`` the launchers as ops torch.compile traces into (``for_cuda_graphs``),
``features`` what grouped-query heads, windows and packing ask of them, ``sdpa`` a drop-in
for ``torch.nn.functional.scaled_dot_product_attention`` (``hf_attention``: the same as a
Hugging Face attention implementation).
"""

from .api import (
    BACKENDS,
    FlashAttention,
    flash_attention,
    flash_attention_kvcache,
    flash_attention_varlen,
)
from .autograd import FlashAttention2Triton
from .cpp_launch import build as build_cpp_launch
from .cpp_launch import counters as cpp_launch_counters
from .cpp_launch import status as cpp_launch_status
from .flops import attention_bytes, attention_floor_ms, attention_flops, tflops_per_s
from .options import Options, get_options, set_options, use_options
from .reference import attention_reference, causal_mask
from .sdpa import DropinCalls, scaled_dot_product_attention, sdpa_replaced
from .torch_impl import FlashAttention2Torch
from .traced_ops import for_cuda_graphs

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "DropinCalls",
    "FlashAttention",
    "FlashAttention2Torch",
    "FlashAttention2Triton",
    "Options",
    "attention_bytes",
    "attention_floor_ms",
    "attention_flops",
    "attention_reference",
    "build_cpp_launch",
    "causal_mask",
    "cpp_launch_counters",
    "cpp_launch_status",
    "flash_attention",
    "flash_attention_kvcache",
    "flash_attention_varlen",
    "for_cuda_graphs",
    "get_options",
    "scaled_dot_product_attention",
    "sdpa_replaced",
    "set_options",
    "tflops_per_s",
    "use_options",
]
