"""Where an eager forward + backward's host time goes, and what autograd's device thread adds.

Host microseconds per call (50 back-to-back calls, clock stopped before synchronizing,
median of seven batches) at 1 x 128 x 512, bf16: d = 64 causal and d = 128 non-causal.

    python device_thread_probe.py parts OUT.json   # ours and SDPA cuDNN by part
    python device_thread_probe.py inside OUT.json  # our backward timed from inside it
    python device_thread_probe.py spin OUT.json    # a Python backward that waits X us
    python device_thread_probe.py replay OUT.json  # the backward's replay path by part
    python device_thread_probe.py pinned OUT.json  # the step with the threads on chosen cores

``parts``: three interleaved rounds of the whole step (``*_step``: backward on the device
thread; ``*_step_calling``: on the calling thread), the forward with and without grad, our
launchers called directly (``launch_fwd``, ``launch_bwd``), a trivial Python and C++
autograd node (``py_fn_step``, ``cpp_fn_step``) and three output allocations (``empty3``);
then a cProfile of 300 steps on the calling thread (printed).

``inside``: our forward launcher in an ``autograd.Function`` whose backward calls
``launch.backward`` and times itself (``inside_bwd_*``), the step around it
(``timed_step_*``), the same Function with a backward that only allocates
(``empty_step_*``), and ``launch.backward`` called on the main thread and on another
Python thread; ``fresh_thread_state_*``: the share of backwards that found the thread's
``threading.local`` empty (the device thread's Python state not kept between calls).

``replay``: the steps of ``launch.backward``'s replay path (saved tensors, call key, lookup,
allocations, addresses, stream, each launch) repeated inside a backward and timed one by
one, on each thread (us, medians).

``spin``: a one-tensor Function whose backward waits X us in Python; the step's host time on
each thread and the difference (``extra``).

``pinned``: ours, SDPA cuDNN and the trivial nodes' steps (backward on the device thread)
with the calling thread and autograd's device thread on chosen cores (Linux affinity, per
thread): ``free`` (every core for both), ``same_core`` (both on the core the calling thread
runs on: the device thread then finds the caches the forward just used), ``main_only``
(the calling thread on it, the device thread free) and ``apart`` (each on a core of its
own). Tells a cold core from the hand-off itself; three interleaved rounds.
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import threading
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashattn_triton as fa
from flashattn_triton import _device, launch, launch_backward, launch_plans

CASES = ((64, True), (128, False))  # (d, causal)


def host_us(fn, n: int = 50, reps: int = 7) -> float:
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(out)


def inputs(d: int):
    q, k, v = (
        torch.randn(1, 128, 512, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    return q, k, v, torch.randn_like(q)


def print_profile(prof: cProfile.Profile, title: str, lines: int) -> None:
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(lines)
    print(title, s.getvalue()[:6000], flush=True)


def ours_forward(causal: bool, scale: float) -> type[torch.autograd.Function]:
    """An autograd Function whose forward is our forward launcher, saving what the
    backward needs; the probes below give it their own backward."""

    class OursForward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            o, lse = launch.forward(q, k, v, causal, scale)
            ctx.save_for_backward(q, k, v, o, lse)
            return o

    return OursForward


class PyIdentity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g


def parts(d: int, causal: bool) -> dict:
    q, k, v, do = inputs(d)
    scale = d**-0.5
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    o, lse = launch.forward(qd, kd, vd, causal, scale)
    x = torch.randn(64, device="cuda", requires_grad=True)
    g = torch.randn(64, device="cuda")

    def ours_step():
        torch.autograd.grad(fa.flash_attention(q, k, v, causal), (q, k, v), do)

    def ours_fwd_nograd():
        with torch.no_grad():
            fa.flash_attention(q, k, v, causal)

    def sdpa(grad: bool):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), torch.set_grad_enabled(grad):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    fns = {
        "ours_step": ours_step,
        "ours_fwd_nograd": ours_fwd_nograd,
        "ours_fwd_grad": lambda: fa.flash_attention(q, k, v, causal),
        "launch_fwd": lambda: launch.forward(qd, kd, vd, causal, scale),
        "launch_bwd": lambda: launch.backward(do, qd, kd, vd, o, lse, causal, scale),
        "sdpa_step": lambda: torch.autograd.grad(sdpa(True), (q, k, v), do),
        "sdpa_fwd_nograd": lambda: sdpa(False),
        "sdpa_fwd_grad": lambda: sdpa(True),
        "py_fn_step": lambda: torch.autograd.grad(PyIdentity.apply(x), (x,), g),
        "cpp_fn_step": lambda: torch.autograd.grad(x.clone(), (x,), g),
        "empty3": lambda: [torch.empty_like(t) for t in (qd, kd, vd)],
    }
    for fn in fns.values():
        for _ in range(20):
            fn()
    samples: dict[str, list[float]] = {}
    for _ in range(3):
        for name, fn in fns.items():
            for threads in (True, False) if name.endswith("step") else (True,):
                with torch.autograd.set_multithreading_enabled(threads):
                    label = name if threads else f"{name}_calling"
                    samples.setdefault(label, []).append(host_us(fn))
    with torch.autograd.set_multithreading_enabled(False):
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(300):
            ours_step()
        prof.disable()
        torch.cuda.synchronize()
    print_profile(prof, f"d={d} causal={causal}: 300 steps on the calling thread", 22)
    return {name: round(statistics.median(s), 1) for name, s in samples.items()}


def inside(d: int, causal: bool) -> dict:
    q, k, v, do = inputs(d)
    scale = d**-0.5
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    o, lse = launch.forward(qd, kd, vd, causal, scale)
    durations: list[float] = []
    fresh: list[bool] = []  # per backward: this thread's `threading.local` was empty
    profiler: list[cProfile.Profile] = []

    class Timed(ours_forward(causal, scale)):
        @staticmethod
        def backward(ctx, g):
            t = time.perf_counter()
            fresh.append(not getattr(_device._thread, "context", False))
            if profiler:
                profiler[0].enable()
            q, k, v, o, lse = ctx.saved_tensors
            grads = launch.backward(g, q, k, v, o, lse, causal, scale)
            if profiler:
                profiler[0].disable()
            durations.append((time.perf_counter() - t) * 1e6)
            return grads

    class Empty(Timed):
        @staticmethod
        def backward(ctx, g):
            q, k, v, _o, _lse = ctx.saved_tensors
            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def step(fn):
        return lambda: torch.autograd.grad(fn.apply(q, k, v), (q, k, v), do)

    row = {}
    for threads in (True, False):
        tag = "device" if threads else "calling"
        with torch.autograd.set_multithreading_enabled(threads):
            for _ in range(20):
                step(Timed)()
            durations.clear()
            fresh.clear()
            row[f"timed_step_{tag}"] = host_us(step(Timed))
            row[f"inside_bwd_{tag}"] = statistics.median(durations)
            row[f"fresh_thread_state_{tag}"] = sum(fresh) / len(fresh)
            row[f"empty_step_{tag}"] = host_us(step(Empty))
    row["launch_bwd_main"] = host_us(lambda: launch.backward(do, qd, kd, vd, o, lse, causal, scale))
    other: dict[str, float] = {}

    def on_another_thread():
        for _ in range(20):
            launch.backward(do, qd, kd, vd, o, lse, causal, scale)
        other["us"] = host_us(lambda: launch.backward(do, qd, kd, vd, o, lse, causal, scale))

    thread = threading.Thread(target=on_another_thread)
    thread.start()
    thread.join()
    row["launch_bwd_other_thread"] = other["us"]
    for threads in (True, False):
        profiler[:] = [cProfile.Profile()]
        with torch.autograd.set_multithreading_enabled(threads):
            for _ in range(300):
                step(Timed)()
        torch.cuda.synchronize()
        print_profile(profiler[0], f"d={d}: inside the backward, device thread {threads}", 14)
        profiler.clear()
    return {name: round(us, 1) for name, us in row.items()}


def replay(d: int, causal: bool) -> dict:
    """The parts of ``launch.backward``'s replay path, repeated step by step inside a
    backward and timed there: medians over five interleaved rounds of 50 steps per thread."""
    q, k, v, do = inputs(d)
    scale = d**-0.5
    ns = time.perf_counter_ns
    parts: dict[str, dict[str, list[float]]] = {}
    thread = ["device"]

    class Parts(ours_forward(causal, scale)):
        @staticmethod
        def backward(ctx, g):
            t = [ns()]
            q, k, v, o, lse = ctx.saved_tensors
            t.append(ns())
            call = launch_plans.call_key((q, k, v, g, o, lse), causal, scale, -1, -1)
            t.append(ns())
            remembered = launch_backward._CALLS.get(call)
            if remembered is None:
                return launch.backward(g, q, k, v, o, lse, causal, scale)
            plan, (_packed, stats_shape, delta_offset, onepass) = remembered
            if stats_shape is None or onepass or any(s.direct is None for s in plan.steps):
                return launch.backward(g, q, k, v, o, lse, causal, scale)
            t.append(ns())
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            t.append(ns())
            addresses = [x.data_ptr() for x in (q, k, v, g, o, lse, dq, dk, dv)]
            base = lse.new_empty(stats_shape).data_ptr()
            addresses += (base, base + delta_offset)
            t.append(ns())
            _ = any(a & 15 for a in addresses[6:]) or len(set(addresses)) != len(addresses)
            _device.ensure_context()
            stream = torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())
            t.append(ns())
            for step in plan.steps:
                step.direct.run(step.compiled.function, step.grid, stream, addresses)
                t.append(ns())
            names = ["unpack", "call_key", "get", "empty3", "addresses", "stream"]
            names += [f"launch{i}" for i in range(len(plan.steps))]
            mine = parts.setdefault(thread[0], {})
            for name, a, b in zip(names, t, t[1:]):
                mine.setdefault(name, []).append((b - a) / 1e3)
            mine.setdefault("total", []).append((t[-1] - t[0]) / 1e3)
            return dq, dk, dv

    for _ in range(5):
        for threads in (True, False):
            thread[0] = "device" if threads else "calling"
            with torch.autograd.set_multithreading_enabled(threads):
                for _ in range(50):
                    torch.autograd.grad(Parts.apply(q, k, v), (q, k, v), do)
                torch.cuda.synchronize()
    return {
        tag: {name: round(statistics.median(us), 2) for name, us in p.items()}
        for tag, p in parts.items()
    }


def _current_cpu() -> int:
    """The core the calling thread runs on now (field 39 of its /proc stat line)."""
    with open(f"/proc/self/task/{threading.get_native_id()}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[36])


def _pin(main: set[int], device: set[int]) -> None:
    """The calling thread on ``main``, autograd's CUDA device thread on ``device`` (set from
    inside a backward, which runs there)."""
    os.sched_setaffinity(0, main)
    x = torch.zeros(1, device="cuda", requires_grad=True)

    class Pin(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            os.sched_setaffinity(0, device)
            return grad

    with torch.autograd.set_multithreading_enabled(True):
        torch.autograd.grad(Pin.apply(x), (x,), torch.ones_like(x))


def pinned(d: int, causal: bool) -> dict:
    q, k, v, do = inputs(d)
    x = torch.randn(64, device="cuda", requires_grad=True)
    g = torch.randn(64, device="cuda")

    def sdpa_step():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        torch.autograd.grad(o, (q, k, v), do)

    fns = {
        "ours_step": lambda: torch.autograd.grad(
            fa.flash_attention(q, k, v, causal), (q, k, v), do
        ),
        "sdpa_step": sdpa_step,
        "py_fn_step": lambda: torch.autograd.grad(PyIdentity.apply(x), (x,), g),
        "cpp_fn_step": lambda: torch.autograd.grad(x.clone(), (x,), g),
    }
    every = os.sched_getaffinity(0)
    here = _current_cpu()
    other = min(every - {here}, default=here)
    settings = {
        "free": (every, every),
        "same_core": ({here}, {here}),
        "main_only": ({here}, every),
        "apart": ({here}, {other}),
    }
    samples: dict[str, list[float]] = {}
    try:
        for _ in range(3):
            for tag, (main, device) in settings.items():
                _pin(main, device)
                for name, fn in fns.items():
                    for _ in range(20):
                        fn()
                    samples.setdefault(f"{name}_{tag}", []).append(host_us(fn))
    finally:
        _pin(every, every)
    res = {name: round(statistics.median(s), 1) for name, s in samples.items()}
    res["cores"] = {"calling": here, "apart": other, "count": len(every)}
    return res


def spin() -> dict:
    x = torch.randn(1, 128, 512, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)
    wait = [0.0]

    class Spin(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            end = time.perf_counter() + wait[0] * 1e-6
            while time.perf_counter() < end:
                pass
            return grad

    def step():
        torch.autograd.grad(Spin.apply(x), (x,), g)

    res = {}
    for us in (0, 10, 25, 50, 75, 100, 150, 200, 300):
        wait[0] = us
        samples: dict[str, list[float]] = {}
        for _ in range(3):
            for threads in (True, False):
                with torch.autograd.set_multithreading_enabled(threads):
                    for _ in range(5):
                        step()
                    samples.setdefault("device" if threads else "calling", []).append(host_us(step))
        row = {name: round(statistics.median(s), 1) for name, s in samples.items()}
        row["extra"] = round(row["device"] - row["calling"], 1)
        res[us] = row
        print("spin", us, row, flush=True)
    return res


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    if mode == "spin":
        res = spin()
    else:
        probe = {"parts": parts, "inside": inside, "replay": replay, "pinned": pinned}[mode]
        res = {}
        for d, causal in CASES:
            key = f"d{d}_{'causal' if causal else 'noncausal'}"
            res[key] = probe(d, causal)
            print(key, json.dumps(res[key], indent=1), flush=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
