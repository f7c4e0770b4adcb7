"""Host time per call, ours beside SDPA, and where ours goes (cProfile's top entries): a
no-grad decode call (1 x 32 q / 8 kv heads, 1 query, 16K keys, d = 128), its pieces
(``check_qkv``, ``launch.forward``, one ``empty_like``), and an eager forward + backward at
1 x 128 x 512 x 64 causal with the backward on autograd's device thread and on the calling
thread. Wall time per call of back-to-back calls, medians of 5 x 500.

    python host_profile_probe.py
"""

import cProfile
import io
import pstats
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from flashattn_triton import flash_attention, launch
from flashattn_triton._checks import check_qkv


def per_call(fn, calls=500, reps=5):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(out)


def prof(fn, n=1000):
    p = cProfile.Profile()
    p.enable()
    for _ in range(n):
        fn()
    p.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(p, stream=s).sort_stats("tottime").print_stats(22)
    return s.getvalue()


dev = "cuda"
# decode: B1, 32 q / 8 kv heads, 1 query, 16K keys
q = torch.randn(1, 32, 1, 128, device=dev, dtype=torch.bfloat16)
k, v = (torch.randn(1, 8, 16384, 128, device=dev, dtype=torch.bfloat16) for _ in range(2))
with torch.no_grad():
    rows = {
        "decode ours": per_call(lambda: flash_attention(q, k, v, True)),
        "decode launch.forward": per_call(lambda: launch.forward(q, k, v, True, 128**-0.5)),
        "decode check_qkv": per_call(lambda: check_qkv(q, k, v, True)),
        "decode sdpa": per_call(
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=False, enable_gqa=True)
        ),
        "empty_like": per_call(lambda: torch.empty_like(q)),
    }
    print(prof(lambda: flash_attention(q, k, v, True)))
# eager fwd+bwd at 128 x 512 x 64
shape = (1, 128, 512, 64)
qs = [torch.randn(shape, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
do = torch.randn(shape, device=dev, dtype=torch.bfloat16)


def ours():
    torch.autograd.grad(flash_attention(*qs, causal=True), qs, do)


def sdpa():
    torch.autograd.grad(F.scaled_dot_product_attention(*qs, is_causal=True), qs, do)


for threads in (True, False):
    with torch.autograd.set_multithreading_enabled(threads):
        rows[f"fwdbwd ours threads={threads}"] = per_call(ours)
        rows[f"fwdbwd sdpa threads={threads}"] = per_call(sdpa)
with torch.no_grad():
    rows["128x512 no-grad ours"] = per_call(lambda: flash_attention(*qs, causal=True))
    rows["128x512 no-grad sdpa"] = per_call(
        lambda: F.scaled_dot_product_attention(*qs, is_causal=True)
    )
for name, us in rows.items():
    print(f"{name:40s} {us:8.1f} us")
with torch.autograd.set_multithreading_enabled(False):
    print(prof(ours))
sys.stdout.flush()
