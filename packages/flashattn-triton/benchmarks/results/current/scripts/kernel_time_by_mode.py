"""Per-kernel GPU time of forward + backward, ours against SDPA cuDNN, eager and compiled,
in one process (the torch profiler's device times, mean of five calls, two rounds).

Produced ``h100_kernel_time_by_mode_long.json`` (default: both modes, d = 128, non-causal)
and, with ``MODES=eager``, ``h100_kernel_time_short_noncausal_d128.json``:

    python kernel_time_by_mode.py OUT.json 16x16384 32x32768
    MODES=eager python kernel_time_by_mode.py OUT.json 128x512 64x1024 32x2048

Shapes are HEADSxN at batch 1; ``D`` sets the head dim (128). The question it answers: do
the sweep's eager and compiled rows differ in the kernels' own time, or around them?
"""

from __future__ import annotations

import collections
import functools
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from flashattn_triton import flash_attention


def attention(provider: str, compiled: bool):
    """Non-causal attention (q, k, v) -> o: ours, or SDPA pinned to cuDNN inside the
    function (so a compiled graph keeps the pin); compiled with static shapes."""
    if provider == "ours":

        def fn(q, k, v):
            return flash_attention(q, k, v, causal=False)
    else:

        def fn(q, k, v):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v)

    return torch.compile(fn, dynamic=False) if compiled else fn


def fwd_bwd(attn, q, k, v, do) -> None:
    torch.autograd.grad(attn(q, k, v), (q, k, v), do)


def kernel_times(fn, calls: int = 5, warmup: int = 3, width: int = 60) -> dict[str, float]:
    """ms per call of each CUDA kernel name (its first ``width`` characters) over ``calls``
    calls, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    per: dict[str, float] = collections.defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name[:width]] += e.device_time_total / 1000 / calls
    return {name: round(ms, 4) for name, ms in per.items()}


def main(argv: list[str]) -> None:
    d = int(os.environ.get("D", "128"))
    modes = [m == "compiled" for m in os.environ.get("MODES", "eager,compiled").split(",")]
    shapes = [tuple(int(x) for x in s.split("x")) for s in (argv[1:] or ["16x16384"])]
    rows = []
    for heads, n in shapes:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (
            torch.randn(
                1, heads, n, d, device="cuda", generator=g, dtype=torch.bfloat16
            ).requires_grad_()
            for _ in range(3)
        )
        do = torch.randn(1, heads, n, d, device="cuda", generator=g, dtype=torch.bfloat16)
        for rnd in range(2):
            for provider in ("ours", "sdpa-cudnn"):
                for compiled in modes:
                    call = functools.partial(fwd_bwd, attention(provider, compiled), q, k, v, do)
                    kernels = kernel_times(call)
                    row = {
                        "shape": f"{heads}x{n}", "provider": provider, "compiled": compiled,
                        "round": rnd, "kernels_ms": kernels,
                        "total_ms": round(sum(kernels.values()), 4),
                    }  # fmt: skip
                    print(row, flush=True)
                    rows.append(row)
        del q, k, v, do
    with open(argv[0], "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
