"""Host and wall time of the persistent Gluon forward against the Triton forward, and of
SDPA's cuDNN backend, at 128 x 512, d = 128, non-causal, bf16 (one process).

    python persistent_host_probe.py OUT.json

Five interleaved rounds of: ours as shipped (the persistent kernel from 512 keys), ours with
the Triton forward (``min_keys_persistent`` removed), ours with the backward on the calling
thread (``torch.autograd.set_multithreading_enabled(False)``), cuDNN, and cuDNN on the
calling thread. Per round: ``do_bench`` medians of forward + backward (``step_ms``) and of
the no-grad forward (``fwd_ms``), and host microseconds per call over 50 back-to-back calls
(``step_host_us``, ``fwd_host_us``). Prints the medians and how many launch plans replay.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashattn_triton as fa
from flashattn_triton import gluon_fwd, launch

SHIPPED = dict(gluon_fwd.DEFAULTS[128])
TRITON_FWD = {k: v for k, v in SHIPPED.items() if k != "min_keys_persistent"}
q, k, v = (
    torch.randn(1, 128, 512, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for _ in range(3)
)
do = torch.randn_like(q)


def ours_step():
    o = fa.flash_attention(q, k, v, False)
    torch.autograd.grad(o, (q, k, v), do)


def ours_fwd():
    with torch.no_grad():
        fa.flash_attention(q, k, v, False)


def cudnn_step():
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o = F.scaled_dot_product_attention(q, k, v)
    torch.autograd.grad(o, (q, k, v), do)


def cudnn_fwd():
    with torch.no_grad(), sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        F.scaled_dot_product_attention(q, k, v)


def host_us(fn, n: int = 50) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    elapsed = (time.perf_counter() - start) / n * 1e6
    torch.cuda.synchronize()
    return elapsed


CASES = (
    ("persistent", SHIPPED),
    ("triton_fwd", TRITON_FWD),
    ("persistent calling thread", SHIPPED),
    ("cudnn", None),
    ("cudnn calling thread", None),
)


def main() -> None:
    out: dict[str, dict] = {}
    for _ in range(5):
        for name, cfg in CASES:
            torch.autograd.set_multithreading_enabled("calling" not in name)
            if cfg is None:
                step, fwd = cudnn_step, cudnn_fwd
            else:
                step, fwd = ours_step, ours_fwd
                gluon_fwd.DEFAULTS[128] = cfg
            launch.clear_plans()
            for _ in range(3):
                step()
                fwd()
            rec = out.setdefault(
                name, {"step_ms": [], "step_host_us": [], "fwd_host_us": [], "fwd_ms": []}
            )
            rec["replays"], rec["plans"] = launch._PLANS.replays(), len(launch._PLANS)
            rec["step_ms"].append(
                triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median")
            )
            rec["fwd_ms"].append(
                triton.testing.do_bench(fwd, warmup=25, rep=100, return_mode="median")
            )
            rec["step_host_us"].append(host_us(step))
            rec["fwd_host_us"].append(host_us(fwd))
    for name, rec in out.items():
        medians = {k: round(statistics.median(v), 4) for k, v in rec.items() if isinstance(v, list)}
        print(name, "replays", rec["replays"], "/", rec["plans"], medians)
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
