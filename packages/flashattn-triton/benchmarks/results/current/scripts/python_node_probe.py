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

With ``--bisect``, ours again with its backward's replayed launches (``replay_call``)
replaced: by nothing (``no launches``: the allocations and the key lookup remain), by two
releases of the interpreter lock without a system call (``two GIL releases``: hashing 4 KB,
which CPython does with the lock released, as Triton's launcher releases it around each
launch), and by the launches through ``compiled.run`` instead of the direct C launcher.

    python python_node_probe.py OUT.json [--shape 128x512x64] [--rounds 5] [--bisect]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
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
    ap.add_argument("--bisect", action="store_true")
    a = ap.parse_args()
    from flashattn_triton import fastlaunch, flash_attention, launch_backward

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

    replay_call = launch_backward.replay_call
    block = b"x" * 4096

    def no_launches(*args) -> bool:
        return True

    def gil_releases(*args) -> bool:
        hashlib.sha256(block).digest()
        hashlib.sha256(block).digest()
        return True

    @contextlib.contextmanager
    def patched(replacement=None, direct=True):
        launch_backward.replay_call = replacement or replay_call
        fastlaunch.DIRECT = direct
        try:
            yield
        finally:
            launch_backward.replay_call = replay_call
            fastlaunch.DIRECT = True

    def ours_with(replacement=None, direct=True) -> Callable[[], None]:
        def run() -> None:
            with patched(replacement, direct):
                ours()

        return run

    cases = {
        "sdpa": sdpa,
        "sdpa in Python": sdpa_py(0),
        "sdpa in Python, 3 GIL releases": sdpa_py(3),
        "ours": ours,
        "ours, empty backward": ours_empty,
    }
    if a.bisect:
        del cases["sdpa in Python, 3 GIL releases"]
        cases["ours, patched, unchanged"] = ours_with()
        cases["ours, backward: no launches"] = ours_with(no_launches)
        cases["ours, backward: two GIL releases"] = ours_with(gil_releases)
        cases["ours, launches through compiled.run"] = ours_with(direct=False)
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
