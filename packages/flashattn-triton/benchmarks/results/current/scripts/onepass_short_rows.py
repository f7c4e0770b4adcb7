"""Forward + backward at d = 128 on short rows as GPU time: the one-pass backward (with
``gluon_bwd.MIN_KEYS`` lowered so that it runs there) against the split kernels and SDPA
cuDNN. Each provider's call is captured in one CUDA graph and replayed (20 replays, median
of seven), three interleaved rounds; then the torch profiler's per-kernel times of five
eager calls. Produced ``h100_onepass_short_rows.json``:

    python onepass_short_rows.py OUT.json [MIN_KEYS]
"""

from __future__ import annotations

import json
import statistics
import sys

import torch
import torch.nn.functional as F
from kernel_time_by_mode import kernel_times  # this folder: run the script from any directory
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashattn_triton import flash_attention, gluon_bwd, launch_plans, use_options

SHAPES = [  # heads, N, causal (batch 1)
    (128, 512, False),
    (64, 1024, False),
    (128, 512, True),
    (64, 1024, True),
    (32, 2048, False),
]


def graph_of(fn) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def replay_ms(graph: torch.cuda.CUDAGraph, replays: int = 20, samples: int = 7) -> float:
    times = []
    for _ in range(samples):
        start, end = torch.cuda.Event(True), torch.cuda.Event(True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / replays)
    return statistics.median(times)


def measure(heads: int, n: int, causal: bool) -> dict:
    q, k, v = (
        torch.randn(1, heads, n, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    do = torch.randn_like(q)

    def onepass():
        torch.autograd.grad(flash_attention(q, k, v, causal=causal), (q, k, v), do)

    def split():
        with use_options(backward="split"):
            onepass()

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            torch.autograd.grad(o, (q, k, v), do)

    fns = {"onepass": onepass, "split": split, "cudnn": cudnn}
    graphs = {name: graph_of(fn) for name, fn in fns.items()}
    row: dict = {"shape": [1, heads, n, 128], "causal": causal, "min_keys": gluon_bwd.MIN_KEYS}
    for _ in range(3):
        for name, graph in graphs.items():
            row.setdefault(name, []).append(round(replay_ms(graph), 5))
    for name, fn in fns.items():
        row[name + "_kernels_ms"] = kernel_times(fn, warmup=0, width=50)
    return row


def main(argv: list[str]) -> None:
    gluon_bwd.MIN_KEYS = int(argv[1]) if len(argv) > 1 else 512
    launch_plans.clear_plans()
    rows = []
    for shape in SHAPES:
        rows.append(measure(*shape))
        print({k: v for k, v in rows[-1].items() if not k.endswith("kernels_ms")}, flush=True)
        torch.cuda.empty_cache()
    with open(argv[0], "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
