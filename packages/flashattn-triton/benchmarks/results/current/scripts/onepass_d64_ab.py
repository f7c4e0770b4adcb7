"""The one-pass Gluon backward at head dim 64 against the split kernels, GPU time of forward +
backward through ``flash_attention`` (CUDA-graph replays, ``do_bench`` medians of three
interleaved rounds), SDPA cuDNN alongside.

    python onepass_d64_ab.py probe OUT.json   # split / one-pass, two heads / one-pass, L2 rule
    python onepass_d64_ab.py final OUT.json   # the package / the package with HEAD_DIMS (128,)

``probe`` turns the kernel on at d = 64 by ``gluon_bwd.HEAD_DIMS`` (as before it was on) and
first compares each path's output and gradients with a float64 reference; ``final`` times
the package's rule (``gluon_bwd.enough_keys``) against the split kernels it replaced.
"""

import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashattn_triton as fa
from flashattn_triton import gluon_bwd
from flashattn_triton.launch_plans import clear_plans

SHAPES = [(1, 32, 2048), (1, 16, 4096), (1, 8, 8192), (1, 16, 16384), (8, 16, 2048),
          (2, 16, 8192), (4, 32, 4096)]  # fmt: skip
# name: (gluon_bwd.HEAD_DIMS, gluon_bwd.MAX_HEAD_GROUP, gluon_bwd.D64_KEY_FACTOR or None)
ANY_KEYS = {(c, w): 1 for c in (False, True) for w in (False, True)}
MODES = {
    "probe": {
        "split": ((128,), 2, None),
        "onepass two heads": ((64, 128), 2, ANY_KEYS),
        "onepass L2 rule": ((64, 128), 10**9, ANY_KEYS),
    },
    "final": {"new": ((64, 128), 2, None), "old": ((128,), 2, None)},
}
SHIPPED = (gluon_bwd.HEAD_DIMS, gluon_bwd.MAX_HEAD_GROUP, gluon_bwd.D64_KEY_FACTOR)


def use(setting) -> None:
    dims, cap, factor = setting
    gluon_bwd.HEAD_DIMS, gluon_bwd.MAX_HEAD_GROUP = dims, cap
    gluon_bwd.D64_KEY_FACTOR = factor or SHIPPED[2]
    clear_plans()


def grads(fn, q, k, v, do, causal):
    x = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    o = fn(*x, causal)
    return (o, *torch.autograd.grad(o, x, do))


def cudnn(q, k, v, causal):
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def check(variants) -> None:
    """Max abs error of o, dq, dk, dv against float64, each variant and cuDNN."""
    for b, h, n, causal in [(1, 4, 2048, True), (1, 4, 2176, False), (2, 3, 3000, True)]:
        g = torch.Generator(device="cuda").manual_seed(n)
        q, k, v, do = (
            torch.randn(b, h, n, 64, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(4)
        )
        ref = grads(
            lambda a, b_, c, s: F.scaled_dot_product_attention(a, b_, c, is_causal=s),
            *(t.double() for t in (q, k, v, do)), causal,
        )  # fmt: skip
        for name, setting in [*variants.items(), ("cudnn", None)]:
            if setting:
                use(setting)
            got = grads(cudnn if setting is None else fa.flash_attention, q, k, v, do, causal)
            errs = [f"{(a.double() - r).abs().max().item():.2e}" for a, r in zip(got, ref)]
            print(f"check {b}x{h}x{n} causal={causal} {name}: o dq dk dv {errs}", flush=True)


def main() -> None:
    if len(sys.argv) != 3 or sys.argv[1] not in MODES:
        sys.exit(f"usage: onepass_d64_ab.py {{{','.join(MODES)}}} OUT.json")
    mode, out = sys.argv[1], sys.argv[2]
    variants = MODES[mode]
    if mode == "probe":
        check(variants)
    t0, rows = time.time(), []
    for causal in (False, True):
        for b, h, n in SHAPES:
            g = torch.Generator(device="cuda").manual_seed(n + h)
            q, k, v, do = (
                torch.randn(b, h, n, 64, device="cuda", dtype=torch.bfloat16, generator=g)
                for _ in range(4)
            )
            for t in (q, k, v):
                t.requires_grad_(True)

            def sdpa():
                return torch.autograd.grad(cudnn(q, k, v, causal), (q, k, v), do)

            def ours():
                o = fa.flash_attention(q, k, v, causal)
                return torch.autograd.grad(o, (q, k, v), do)

            def graphed(fn):
                fn()
                fn()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    fn()
                return triton.testing.do_bench(graph.replay, warmup=25, rep=200)

            ref, times = sdpa(), {}
            for r in range(3):
                for name, setting in variants.items():
                    use(setting)
                    if r == 0:
                        err = max((a - b_).abs().max().item() for a, b_ in zip(ours(), ref))
                        assert err < 0.1, (name, err)
                    times.setdefault(name, []).append(graphed(ours))
                use(SHIPPED)
                times.setdefault("cudnn", []).append(graphed(sdpa))
            med = {k_: statistics.median(v_) for k_, v_ in times.items()}
            rows.append({"shape": [b, h, n, 64], "causal": causal, **med, "rounds": times})
            print(f"[{time.time() - t0:6.1f}s] {b}x{h}x{n} causal={causal!s:5s} "
                  + " ".join(f"{k_} {v_:.3f}" for k_, v_ in med.items()), flush=True)  # fmt: skip
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, open(out, "w"))


if __name__ == "__main__":
    main()
