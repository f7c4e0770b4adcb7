"""Host time per call of lm_core's 3xTF32 product, piece by piece, beside torch.mm.

On a tiny (64 x 64) product the GPU work is negligible, so calls back to back measure what
the host spends per call: the split (allocation + launch), the whole product, the public
function, the custom op torch.compile uses, and a Linear layer forward / forward+backward
with each matmul backend. Needs a CUDA GPU:

    PYTHONPATH=packages/lm-core/src python3 packages/perf-tools/scripts/tf32x3_host_cost.py
"""

from __future__ import annotations

import sys
import time

import torch


def per_call_us(fn, n: int = 2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e6


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from lm_core import tf32x3_triton
    from lm_core.matmul import Linear, tf32x3_mm

    a, b = torch.randn(64, 64, device="cuda"), torch.randn(64, 64, device="cuda")
    x = torch.randn(64, 64, device="cuda", requires_grad=True)
    default = Linear(64, 64, bias=False).cuda()
    ours = Linear(64, 64, bias=False, matmul="tf32x3").cuda()
    rows = [
        ("torch.mm", lambda: a @ b),
        ("torch.empty", lambda: torch.empty(2, 64, 64, device="cuda")),
        ("split_pair (one launch)", lambda: tf32x3_triton.split_pair(a, b)),
        ("tf32x3_triton.mm", lambda: tf32x3_triton.mm(a, b)),
        ("tf32x3_mm", lambda: tf32x3_mm(a, b)),
        ("custom op (torch.compile's path)", lambda: torch.ops.lm_core.tf32x3_mm(a, b)),
        ("Linear forward, default", lambda: default(x)),
        ("Linear forward, tf32x3", lambda: ours(x)),
        ("Linear fwd+bwd, default", lambda: default(x).sum().backward()),
        ("Linear fwd+bwd, tf32x3", lambda: ours(x).sum().backward()),
    ]
    print(torch.cuda.get_device_name())
    for name, fn in rows:
        print(f"{name:34s} {per_call_us(fn, 500 if 'bwd' in name else 2000):8.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
