"""Does an SM carve-out for cuBLAS let AdamW run beside the backward's matmuls? (xl shapes)

Times, per carve-out: the matmuls of NB block backwards alone, the AdamW master-kernel
updates of NB blocks alone, and both at once (AdamW on a low-priority stream)."""

import json
import statistics
import sys
import time

import torch

from lm_core.adamw_triton import adamw_master_step

T = 2048
LINEARS = [(1600, 4800), (1600, 1600), (1600, 12800), (6400, 1600)]
NB = 24
SETS = 6
dev = "cuda"
torch.manual_seed(0)
bf = {"device": dev, "dtype": torch.bfloat16}
blocks = []
for _s in range(SETS):
    mats = []
    for i, o in LINEARS:
        mats.append(
            (
                torch.randn(T, o, **bf),
                torch.randn(T, i, **bf),
                torch.randn(o, i, **bf),
                torch.empty(T, i, **bf),
                torch.empty(o, i, **bf),
            )
        )
    params = []
    for i, o in LINEARS:
        n = i * o
        params.append(
            (
                torch.zeros(n, **bf),
                torch.randn(n, device=dev),
                torch.randn(n, **bf) * 1e-3,
                torch.zeros(n, device=dev),
                torch.zeros(n, device=dev),
            )
        )
    blocks.append((mats, params))
step = torch.ones((), device=dev)


def matmuls():
    for b in range(NB):
        for dy, x, w, dx, dw in blocks[b % SETS][0]:
            torch.mm(dy, w, out=dx)
            torch.mm(dy.t(), x, out=dw)


def adamw():
    for b in range(NB):
        for p, m, g, ea, eas in blocks[b % SETS][1]:
            adamw_master_step(
                p,
                m,
                g,
                ea,
                eas,
                step,
                lr=1e-4,
                beta1=0.9,
                beta2=0.95,
                eps=1e-8,
                weight_decay=0.1,
                stochastic=False,
            )


lo = torch.cuda.Stream(priority=0)
hi = torch.cuda.Stream(priority=-1)


def timed(fn, reps=5):
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def both():
    cur = torch.cuda.current_stream()
    hi.wait_stream(cur)
    lo.wait_stream(cur)
    with torch.cuda.stream(lo):
        adamw()
    with torch.cuda.stream(hi):
        matmuls()
    cur.wait_stream(hi)
    cur.wait_stream(lo)


def both_graph():
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream(priority=-1)
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        both()
    torch.cuda.synchronize()
    with torch.cuda.graph(g, stream=hi):
        both()
    return g


rows = []
for lib in ("default", "cublaslt"):
    if lib == "cublaslt":
        torch.backends.cuda.preferred_blas_library("cublaslt")
    for carve in (0, 8, 16, 24, 32, 48):
        torch._C._set_sm_carveout_experimental(carve if carve else None)
        for _ in range(2):
            matmuls()
            adamw()
            both()
        r = {
            "lib": lib,
            "carveout": carve,
            "matmuls_ms": timed(matmuls),
            "adamw_ms": timed(adamw),
            "both_ms": timed(both),
        }
        try:
            g = both_graph()
            g.replay()
            r["both_graph_ms"] = timed(g.replay)
            del g
        except Exception as e:
            r["both_graph_ms"] = repr(e)[:100]
        r["sum_ms"] = r["matmuls_ms"] + r["adamw_ms"]
        rows.append(r)
        print(
            json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}),
            flush=True,
        )
with open(sys.argv[1], "w") as f:
    json.dump(rows, f, indent=1)
