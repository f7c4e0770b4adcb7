"""Is the device thread's cost ours, or any Python backward's? Controls beside ours.

Host time per eager forward + backward (`torch.autograd.grad`, back-to-back calls, one
synchronize per batch), with the backward on autograd's device thread and on the calling
thread, interleaved rounds in one process, for:

- ``sdpa``: SDPA's flash backend, a C++ autograd node;
- ``sdpa in Python``: the same two aten kernels inside a Python ``autograd.Function``;
- ``sdpa in Python, 3 GIL releases``: that, whose backward also lets go of the interpreter
  three times (``time.sleep(0)``), as Triton's launcher does around each launch;
- ``ours``: ``flash_attention``;
- ``ours, empty backward``: our forward, and a Python backward that launches nothing.

    python python_node_probe.py OUT.json [--shape 128x512x64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

aten = torch.ops.aten


class SdpaInPython(torch.autograd.Function):
    releases = 0

    @staticmethod
    def forward(ctx, q, k, v, scale):
        out, lse, cq, ck, mq, mk, seed, offset, _ = aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, True, False, scale=scale
        )
        ctx.save_for_backward(q, k, v, out, lse, cq, ck, seed, offset)
        ctx.rest = (mq, mk, scale)
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse, cq, ck, seed, offset = ctx.saved_tensors
        mq, mk, scale = ctx.rest
        for _ in range(SdpaInPython.releases):
            time.sleep(0)
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            do, q, k, v, out, lse, cq, ck, mq, mk, 0.0, True, seed, offset, scale=scale
        )
        return dq, dk, dv, None


class OursEmptyBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale):
        from flashattn_triton import launch

        o, _ = launch.forward(q, k, v, True, scale)
        ctx.save_for_backward(q, k, v)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shape", default="128x512x64")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=200)
    a = ap.parse_args()
    from flashattn_triton import flash_attention

    heads, n, d = (int(x) for x in a.shape.split("x"))
    shape = (1, heads, n, d)
    q, k, v = (
        torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    do = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    scale = d**-0.5

    def sdpa() -> None:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(out, (q, k, v), do)

    def sdpa_py(releases: int) -> Callable[[], None]:
        def run() -> None:
            SdpaInPython.releases = releases
            torch.autograd.grad(SdpaInPython.apply(q, k, v, scale), (q, k, v), do)

        return run

    def ours() -> None:
        torch.autograd.grad(flash_attention(q, k, v, causal=True), (q, k, v), do)

    def ours_empty() -> None:
        torch.autograd.grad(OursEmptyBackward.apply(q, k, v, scale), (q, k, v), do)

    cases = {
        "sdpa": sdpa,
        "sdpa in Python": sdpa_py(0),
        "sdpa in Python, 3 GIL releases": sdpa_py(3),
        "ours": ours,
        "ours, empty backward": ours_empty,
    }
    samples: dict[str, dict[str, list[float]]] = {
        name: {"device": [], "calling": []} for name in cases
    }
    for r in range(a.rounds):
        for thread in ("device", "calling") if r % 2 == 0 else ("calling", "device"):
            with torch.autograd.set_multithreading_enabled(thread == "device"):
                for name, fn in cases.items():
                    samples[name][thread].append(per_call_us(fn, a.calls))
        print(f"round {r + 1}/{a.rounds} done", file=sys.stderr, flush=True)
    rows = []
    print(f"{'case':34} {'device us':>10} {'calling us':>11} {'device - calling':>17}")
    for name, by_thread in samples.items():
        dev, cal = (statistics.median(by_thread[t]) for t in ("device", "calling"))
        rows.append({"case": name, "device_us": dev, "calling_us": cal, "samples": by_thread})
        print(f"{name:34} {dev:10.1f} {cal:11.1f} {dev - cal:17.1f}")
    meta = {
        "shape": shape,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "rounds": a.rounds,
        "calls": a.calls,
    }
    with open(a.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
