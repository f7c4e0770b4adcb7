"""Host (Python) time of one forward + backward through flash_attention, kernels not launched.

Every Triton launch is replaced by a no-op, so what is timed is our own wrapper: argument
checks, the autograd.Function, the launchers' allocations, strides and tile choice, and the
autograd engine around them (.grad is reset each call, so no accumulation). Triton's own
launch cost is not included. Runs on CPU (no GPU or interpreter needed) or CUDA.

    PYTHONPATH=packages/flashattn-triton/src python3 \
        packages/flashattn-triton/benchmarks/host_overhead.py [--device cuda] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def stub_launches() -> None:
    from flashattn_triton import launch, launch_backward

    for module in (launch, launch_backward):  # each binds the helpers it calls
        module._run = lambda *args, **kwargs: None
        module.require_runnable = lambda t: None
    launch._kernels().attn_bwd_preprocess_kernel = _NoLaunch()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", default="1,12,512,64", help="B,H,N,d")
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="print the top cProfile entries")
    a = ap.parse_args(argv)
    stub_launches()
    from flashattn_triton import flash_attention

    shape = tuple(int(x) for x in a.shape.split(","))
    q, k, v = (torch.randn(shape, device=a.device, requires_grad=True) for _ in range(3))
    do = torch.randn(shape, device=a.device)

    def fwd_bwd():
        flash_attention(q, k, v, causal=True, backend="triton").backward(do)
        q.grad = k.grad = v.grad = None  # no accumulation work (the stubbed grads are garbage)

    def fwd():
        with torch.no_grad():
            flash_attention(q, k, v, causal=True, backend="triton")

    for name, fn in (("fwd+bwd", fwd_bwd), ("fwd, no grad", fwd)):
        for _ in range(50):
            fn()
        runs = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            for _ in range(a.calls):
                fn()
            runs.append((time.perf_counter() - t0) / a.calls * 1e6)
        print(f"{name}: median {statistics.median(runs):.0f} us per call "
              f"(runs: {', '.join(f'{r:.0f}' for r in runs)})")  # fmt: skip
    if a.profile:
        prof = cProfile.Profile()
        prof.runcall(lambda: [fwd_bwd() for _ in range(200)])
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
