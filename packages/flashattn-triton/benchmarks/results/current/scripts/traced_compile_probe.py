"""Compiled forward + backward per call: SDPA, ours through the opaque op, ours through the
traced ops (``Options.traced_compile``), in one process; q, k, v (1, H, N, d) views of
(1, N, H, d) buffers as lm-core makes them, causal, bf16. Errors against float32 SDPA,
do_bench medians over three interleaved rounds, back-to-back wall time per call.

    python traced_compile_probe.py OUT_DIR D HxN [HxN ...]
"""

import json
import os
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F
import triton
from torch._inductor.utils import run_and_get_code

import flashattn_triton as fa

out_dir, d = sys.argv[1], int(sys.argv[2])
shapes = [tuple(int(x) for x in s.split("x")) for s in sys.argv[3:]]
T0 = time.time()
rows = []
# one Options object per setting, reused: compiled frames guard on the options they read
OPTS = {True: fa.Options(traced_compile=True), False: fa.Options(traced_compile=False)}


def host_us(fn, n=50):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        ts.append((time.perf_counter() - t) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(ts)


for h, n in shapes:
    torch.manual_seed(0)
    q, k, v = (
        torch.randn(1, n, h, d, device="cuda", dtype=torch.bfloat16)
        .transpose(1, 2)
        .requires_grad_(True)
        for _ in range(3)
    )
    do = torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    gref = torch.autograd.grad(ref, (q, k, v), do.float())
    provs = [
        ("sdpa", False, lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
        ("ours-opaque", False, lambda q, k, v: fa.flash_attention(q, k, v, causal=True)),
        ("ours-traced", True, lambda q, k, v: fa.flash_attention(q, k, v, causal=True)),
    ]
    fns = {}
    for name, traced, fn in provs:
        row = {"shape": [h, n, d], "provider": name}
        try:
            fa.set_options(OPTS[traced])
            cf = torch.compile(fn, fullgraph=True, dynamic=False)
            t = time.time()
            if name == "ours-traced" and not os.path.exists(f"{out_dir}/code_d{d}.py"):
                o, codes = run_and_get_code(cf, q, k, v)
                open(f"{out_dir}/code_d{d}.py", "w").write("\n\n#####\n\n".join(codes))
            else:
                o = cf(q, k, v)
            g = torch.autograd.grad(o, (q, k, v), do)
            row["compile_s"] = time.time() - t
            row["err_o"] = (o.float() - ref).abs().max().item()
            row["err_g"] = max((a.float() - b).abs().max().item() for a, b in zip(g, gref))

            def step(cf=cf):
                return torch.autograd.grad(cf(q, k, v), (q, k, v), do)

            fns[name] = (traced, step)
            row["host_us"] = host_us(step)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
            traceback.print_exc()
        fa.set_options(OPTS[False])
        rows.append(row)
    # GPU time, interleaved rounds (the traced option is baked into each compiled fn)
    gpu = {name: [] for name in fns}
    for _ in range(3):
        for name, (traced, step) in fns.items():
            fa.set_options(OPTS[traced])
            gpu[name].append(triton.testing.do_bench(step, warmup=25, rep=150))
    fa.set_options(OPTS[False])
    for row in rows:
        if row["shape"] == [h, n, d] and row["provider"] in gpu:
            row["gpu_ms"] = statistics.median(gpu[row["provider"]])
    for row in rows:
        if row["shape"] == [h, n, d]:
            print(f"[{time.time() - T0:6.1f}s]", json.dumps(row)[:700], flush=True)
    json.dump(rows, open(f"{out_dir}/traced_d{d}.json", "w"), indent=1)
print("done", flush=True)
