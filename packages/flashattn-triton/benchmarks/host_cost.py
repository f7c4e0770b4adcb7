"""Host time of one eager attention forward + backward, ours beside SDPA, broken down.

Where `host_overhead.py` stubs the launches out to time our Python alone, this one launches
the real kernels on a GPU, at a shape small enough that the GPU waits for the host, and times
back-to-back calls (wall time per call, one synchronize per batch of calls):

- forward + backward (`torch.autograd.grad`) of ours (also through the SDPA drop-in
  `scaled_dot_product_attention`, and on (H, N, d) inputs), SDPA's flash and cuDNN backends, with
  the backward on autograd's device thread (torch's default) and on the calling thread
  (`torch.autograd.set_multithreading_enabled(False)`);
- the pieces of ours: a no-grad forward, `launch.forward`, `launch.backward`;
- with `--compiled`, each of the three under `torch.compile(fullgraph=True)` as well;
- with `--profile`, cProfile's top entries of ours (backward on the calling thread, so that
  the profiler sees it);
- with `--handoff`, ours and SDPA flash with the backward on the device thread under
  settings that would shrink a contended interpreter hand-off if that is what the device
  thread costs: Python's garbage collector off, and a 10 us interpreter switch interval
  (`sys.setswitchinterval`; 5 ms by default);
- with `--breakdown`, where one `torch.autograd.grad` of ours spends its wall time on either
  thread: before our Python backward starts (the engine and the hand-off to its thread),
  inside it, and after it returns until `grad` does (medians of single calls).

    PYTHONPATH=packages/flashattn-triton/src python3 \\
        packages/flashattn-triton/benchmarks/host_cost.py --shape 128x512x64 [--profile]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import json
import pstats
import statistics
import sys
import time
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def per_call_us(fn: Callable[[], object], calls: int, repeats: int) -> float:
    """Median over `repeats` of the wall time per call of `calls` back-to-back calls."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples)


def backward_phases(q, k, v, do, calls: int) -> dict[str, float]:
    """Medians over `calls` single calls of where `torch.autograd.grad` of ours spends its wall
    time: until our Function's backward starts, inside it, after it until grad returns."""
    from flashattn_triton import autograd as fa_autograd
    from flashattn_triton import flash_attention

    fn = fa_autograd.CheckedFlashAttention
    inner = fn.backward
    stamps: list[float] = []

    def timed_backward(ctx, do_):
        stamps.append(time.perf_counter())
        try:
            return inner(ctx, do_)
        finally:
            stamps.append(time.perf_counter())

    fn.backward = staticmethod(timed_backward)
    before, inside, after, forward = [], [], [], []
    try:
        for _ in range(calls + 20):
            stamps.clear()
            t0 = time.perf_counter()
            o = flash_attention(q, k, v, causal=True)
            t1 = time.perf_counter()
            torch.autograd.grad(o, (q, k, v), do)
            t2 = time.perf_counter()
            forward.append(t1 - t0)
            before.append(stamps[0] - t1)
            inside.append(stamps[1] - stamps[0])
            after.append(t2 - stamps[1])
            if len(forward) % 50 == 0:
                torch.cuda.synchronize()  # keep the GPU queue short: host time only
    finally:
        fn.backward = staticmethod(inner)
    names = ("forward", "grad until our backward", "our backward", "after it until grad returns")
    cols = (forward, before, inside, after)
    return {n: statistics.median(c[20:]) * 1e6 for n, c in zip(names, cols, strict=True)}


@contextlib.contextmanager
def _gc_off() -> Iterator[None]:
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@contextlib.contextmanager
def _switch_interval(seconds: float) -> Iterator[None]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def handoff_settings() -> dict[str, Callable[[], contextlib.AbstractContextManager]]:
    """Settings under which `--handoff` times the device thread (each a context manager)."""

    @contextlib.contextmanager
    def both() -> Iterator[None]:
        with _gc_off(), _switch_interval(1e-5):
            yield

    return {"gc off": _gc_off, "switch interval 10 us": lambda: _switch_interval(1e-5),
            "both": both}  # fmt: skip


def through_public_ops(run: Callable[[], None]) -> Callable[[], None]:
    """`run` with the compiled graph calling the public custom ops (`ops.attention_fwd`, ...)
    instead of the plain launch ops: the A/B of the two registrations, in one process."""
    from flashattn_triton import ops

    plain = (ops.fwd_launch, ops.bwd_launch)
    public = (
        getattr(torch.ops, ops.NAMESPACE).fwd.default,
        getattr(torch.ops, ops.NAMESPACE).bwd.default,
    )

    def call() -> None:
        ops.fwd_launch, ops.bwd_launch = public  # what dynamo traced (and guards on)
        try:
            run()
        finally:
            ops.fwd_launch, ops.bwd_launch = plain

    return call


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="128x512x64", help="HEADSxNxD (batch 1, bf16, causal)")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--profile", action="store_true", help="print cProfile's top entries (compiled ours too)"
    )
    ap.add_argument("--compiled", action="store_true", help="also each case compiled")
    ap.add_argument("--breakdown", action="store_true", help="time the phases of one grad call")
    ap.add_argument(
        "--handoff", action="store_true", help="the device thread with gc off / a short switch"
    )
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (host_overhead.py times our Python without one)")
    from flashattn_triton import flash_attention, launch, scaled_dot_product_attention

    heads, n, d = (int(x) for x in a.shape.split("x"))
    shape = (1, heads, n, d)
    q, k, v = (
        torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    do = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    scale = d**-0.5
    o, lse = launch.forward(qd, kd, vd, True, scale)

    def ours() -> None:
        torch.autograd.grad(flash_attention(q, k, v, causal=True), (q, k, v), do)

    def sdpa(backend: SDPBackend) -> Callable[[], None]:
        def run() -> None:
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            torch.autograd.grad(out, (q, k, v), do)

        return run

    def ours_dropin() -> None:  # the SDPA drop-in: its checks, then the same call
        out = scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(out, (q, k, v), do)

    q3, k3, v3 = (t.detach()[0].requires_grad_() for t in (q, k, v))

    def ours_3d() -> None:  # (H, N, d) inputs, as the C++ path takes them too
        torch.autograd.grad(flash_attention(q3, k3, v3, causal=True), (q3, k3, v3), do[0])

    def ours_no_grad() -> None:
        with torch.no_grad():
            flash_attention(q, k, v, causal=True)

    cases = {
        "ours": ours,
        "ours through the SDPA drop-in": ours_dropin,
        "ours, 3-D inputs": ours_3d,
        "sdpa flash": sdpa(SDPBackend.FLASH_ATTENTION),
        "sdpa cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
    }
    if a.compiled:

        def compiled(attend: Callable[..., torch.Tensor]) -> Callable[[], None]:
            fn = torch.compile(attend, fullgraph=True, dynamic=False)
            return lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), do)

        def sdpa_attend(backend: SDPBackend) -> Callable[..., torch.Tensor]:
            def attend(q_, k_, v_):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q_, k_, v_, is_causal=True)

            return attend

        cases["ours compiled"] = compiled(lambda q_, k_, v_: flash_attention(q_, k_, v_, True))
        cases["ours compiled, public custom ops"] = through_public_ops(
            compiled(lambda q_, k_, v_: flash_attention(q_, k_, v_, True))
        )
        cases["sdpa flash compiled"] = compiled(sdpa_attend(SDPBackend.FLASH_ATTENTION))
        cases["sdpa cudnn compiled"] = compiled(sdpa_attend(SDPBackend.CUDNN_ATTENTION))
    rows: dict[str, float] = {}
    for threads in (True, False):
        where = "device thread" if threads else "calling thread"
        with torch.autograd.set_multithreading_enabled(threads):
            for name, fn in cases.items():
                rows[f"{name} fwd+bwd, backward on the {where}"] = per_call_us(
                    fn, a.calls, a.repeats
                )
    if a.handoff:
        for setting, enter in handoff_settings().items():
            with enter():
                for name in ("ours", "sdpa flash"):
                    rows[f"{name} fwd+bwd, device thread, {setting}"] = per_call_us(
                        cases[name], a.calls, a.repeats
                    )
    rows["ours fwd, no grad"] = per_call_us(ours_no_grad, a.calls, a.repeats)
    rows["launch.forward"] = per_call_us(
        lambda: launch.forward(qd, kd, vd, True, scale), a.calls, a.repeats
    )
    rows["launch.backward"] = per_call_us(
        lambda: launch.backward(do, qd, kd, vd, o, lse, True, scale), a.calls, a.repeats
    )
    print(f"host us per call, (1, {heads}, {n}, {d}) bf16 causal, {torch.cuda.get_device_name()}")
    for name, us in rows.items():
        print(f"  {name:55s} {us:8.1f}")
    print(json.dumps({"shape": list(shape), "us_per_call": rows}))
    if a.breakdown:
        for threads in (True, False):
            where = "device thread" if threads else "calling thread"
            with torch.autograd.set_multithreading_enabled(threads):
                phases = backward_phases(q, k, v, do, a.calls)
            print(f"  grad() of ours, backward on the {where}: " + ", ".join(
                f"{name} {us:.1f} us" for name, us in phases.items()))  # fmt: skip
            print(json.dumps({"breakdown": where, "us": phases}))
    if a.profile:
        profiler = cProfile.Profile()
        with torch.autograd.set_multithreading_enabled(False):
            profiler.enable()
            for _ in range(200):
                (cases["ours compiled"] if a.compiled else ours)()
            profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
        print(text.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
