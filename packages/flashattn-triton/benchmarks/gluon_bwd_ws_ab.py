"""A/B of the two-warpgroup backward kernels (``flashattn_triton.gluon_bwd_ws``) against the
one-warpgroup Gluon kernels (``gluon_dkdv``, ``gluon_dq``) and cuDNN, d = 128, on a Hopper GPU.

    python benchmarks/gluon_bwd_ws_ab.py OUT.json [--rounds 3] [--quick]

``check``: the package's forward + backward with the two-warpgroup kernels on and off
against a float64 reference on awkward shapes (ragged lengths, Nq != Nk, grouped-query
heads, one key), errors next to SDPA's. ``kernels``: each kernel alone, the shipped
one-warpgroup kernel against two-warpgroup variants (stages, dQ key tiles), in interleaved
rounds (``do_bench`` medians; the median over rounds is reported). ``backward``: the
package's whole backward (``torch.autograd.grad`` of a retained graph) with each set of
kernels against SDPA cuDNN's and flash's backward, same inputs.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashattn_triton as fa
from flashattn_triton import gluon_bwd_ws, gluon_dkdv, gluon_dq
from flashattn_triton.launch import clear_plans

D = 128
LOG2E = 1.4426950408889634
DKDV_VARIANTS = {"ws_s2": {"stages": 2}, "ws_s3": {"stages": 3}}
DQ_VARIANTS = {
    "ws_n64_s2": {"block_n": 64, "stages": 2},
    "ws_n64_s3": {"block_n": 64, "stages": 3},
    "ws_n128_s2": {"block_n": 128, "stages": 2},
}


class TwoWarpgroups:
    """Within the block the package's backward uses the two-warpgroup kernels (on=True) or
    the one-warpgroup ones; launch plans are cleared on entry and exit."""

    def __init__(self, on: bool):
        self.on = on

    def __enter__(self):
        self.saved = (dict(gluon_bwd_ws.DKDV_DEFAULTS), dict(gluon_bwd_ws.DQ_DEFAULTS))
        if not self.on:
            gluon_bwd_ws.DKDV_DEFAULTS.clear()
            gluon_bwd_ws.DQ_DEFAULTS.clear()
        clear_plans()

    def __exit__(self, *exc):
        for table, saved in zip((gluon_bwd_ws.DKDV_DEFAULTS, gluon_bwd_ws.DQ_DEFAULTS), self.saved):
            table.clear()
            table.update(saved)
        clear_plans()


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median")


def reference_grads(q, k, v, do, causal):
    """float64 dq, dk, dv (k, v expanded over grouped heads, then summed back)."""
    group = q.shape[1] // k.shape[1]
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ke, ve = (t.repeat_interleave(group, dim=1) for t in (k64, v64))
    s = torch.einsum("bhqd,bhkd->bhqk", q64, ke) / math.sqrt(D)
    n_q, n_k = q.shape[2], k.shape[2]
    if causal:
        i = torch.arange(n_q, device=q.device)[:, None]
        j = torch.arange(n_k, device=q.device)[None, :]
        s = s.masked_fill(j > i + n_k - n_q, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    o = torch.einsum("bhqk,bhkd->bhqd", p, ve)
    return torch.autograd.grad(o, (q64, k64, v64), do.double())


def check(rows: list) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    for b, h, h_kv, n_q, n_k, causal in [
        (1, 4, 4, 4096, 4096, True),
        (2, 3, 3, 2500, 2500, True),
        (2, 3, 3, 2500, 2500, False),
        (1, 2, 2, 700, 3000, True),
        (1, 2, 2, 3000, 2100, True),
        (1, 2, 2, 3000, 2100, False),
        (1, 8, 2, 2048, 2048, True),
        (1, 6, 1, 2049, 2049, False),
        (1, 1, 1, 1, 2048, True),
    ]:
        q = torch.randn(b, h, n_q, D, device="cuda", generator=g).bfloat16()
        k = torch.randn(b, h_kv, n_k, D, device="cuda", generator=g).bfloat16()
        v = torch.randn(b, h_kv, n_k, D, device="cuda", generator=g).bfloat16()
        do = torch.randn(b, h, n_q, D, device="cuda", generator=g).bfloat16()
        ref = reference_grads(q, k, v, do, causal)
        errs = {}
        for on in (True, False):
            with TwoWarpgroups(on):
                qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
                o = fa.flash_attention(qg, kg, vg, causal)
                grads = torch.autograd.grad(o, (qg, kg, vg), do)
                torch.cuda.synchronize()
            errs[on] = grads
            row = {
                "check": f"{b}x{h}/{h_kv}x{n_q}x{n_k}", "causal": causal,
                "two_warpgroups": on,
                **{
                    f"{name}_err": (gr.double() - r).abs().max().item()
                    for name, gr, r in zip(("dq", "dk", "dv"), grads, ref)
                },
            }  # fmt: skip
            rows.append(row)
            print(row, flush=True)
        same = [torch.equal(a, b_) for a, b_ in zip(errs[True], errs[False])]
        ran = sorted(str(key[0]) for key in gluon_dkdv._COMPILED)
        print({"bitwise_same_dq_dk_dv": same, "compiled": ran}, flush=True)
        rows.append({"check": f"{b}x{h}/{h_kv}x{n_q}x{n_k}", "bitwise_same": same})


def inputs(b, h, h_kv, n, causal):
    """q, k, v, do and the statistics the backward kernels read (lse natural and log2,
    delta), from the package's forward."""
    q = torch.randn(b, h, n, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, h_kv, n, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    do = torch.randn_like(q)
    o, lse = fa.flash_attention(q, k, v, causal, return_lse=True)
    delta = (o.float() * do.float()).sum(-1).contiguous()
    lse2 = (lse * LOG2E).masked_fill(lse == float("-inf"), float("inf")).contiguous()
    return q, k, v, do, lse.contiguous(), lse2, delta


def kernels(rows: list, shapes, rounds: int) -> None:
    for shape in shapes:
        _kernels_one(rows, *shape, rounds)


def _kernels_one(rows: list, b, h, h_kv, n, causal, rounds: int) -> None:
    scale = 1 / math.sqrt(D)
    q, k, v, do, lse, lse2, delta = inputs(b, h, h_kv, n, causal)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    group = 4
    fns = {
        "dkdv_1wg": lambda: gluon_dkdv.launch_dkdv(
            q, k, v, do, lse2, delta, dk, dv, causal, scale, **gluon_dkdv.DEFAULTS[D],
            head_group=group, lse_log2=True,
        ),
        "dq_1wg": lambda: gluon_dq.launch_dq(
            q, k, v, do, lse, delta, dq, causal, scale, **gluon_dq.DEFAULTS[D],
            head_group=group,
        ),
    }  # fmt: skip
    for name, kw in DKDV_VARIANTS.items():
        fns["dkdv_" + name] = lambda kw=kw: gluon_bwd_ws.launch_dkdv(
            q, k, v, do, lse2, delta, dk, dv, causal, scale, **kw, head_group=group
        )
    for name, kw in DQ_VARIANTS.items():
        fns["dq_" + name] = lambda kw=kw: gluon_bwd_ws.launch_dq(
            q, k, v, do, lse, delta, dq, causal, scale, **kw, head_group=group
        )
    outs = {}
    for name, fn in fns.items():  # results first: every variant must match the shipped one
        dq.zero_(), dk.zero_(), dv.zero_()
        try:
            fn()
            torch.cuda.synchronize()
            outs[name] = (dq.clone(), dk.clone(), dv.clone())
        except Exception as e:
            print(name, "failed:", repr(e)[:300], flush=True)
            fns[name] = None
    for name in outs:
        ref = outs["dq_1wg" if name.startswith("dq") else "dkdv_1wg"]
        idx = (0,) if name.startswith("dq") else (1, 2)
        diff = max((outs[name][i].float() - ref[i].float()).abs().max().item() for i in idx)
        rows.append({"shape": f"{b}x{h}/{h_kv}x{n}", "causal": causal, "kernel": name,
                     "max_diff_vs_1wg": diff})  # fmt: skip
        print(rows[-1], flush=True)
    times: dict[str, list[float]] = {}
    for _ in range(rounds):
        for name, fn in fns.items():
            if fn is not None:
                times.setdefault(name, []).append(bench(fn))
    for name, ts in times.items():
        row = {
            "shape": f"{b}x{h}/{h_kv}x{n}", "causal": causal, "kernel": name,
            "ms": round(statistics.median(ts), 4), "rounds": [round(t, 4) for t in ts],
        }  # fmt: skip
        rows.append(row)
        print(row, flush=True)


def backward(rows: list, shapes, rounds: int) -> None:
    for shape in shapes:
        _backward_one(rows, *shape, rounds)


def _backward_one(rows: list, b, h, h_kv, n, causal, rounds: int) -> None:
    q = torch.randn(b, h, n, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (
        torch.randn(b, h_kv, n, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(2)
    )
    do = torch.randn_like(q)
    graphs = {on: fa.flash_attention(q, k, v, causal) for on in (True, False)}
    sdpa = {}
    for label, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION),
                           ("flash", SDPBackend.FLASH_ATTENTION)):  # fmt: skip
        try:
            with sdpa_kernel(backend):
                sdpa[label] = F.scaled_dot_product_attention(
                    q, k, v, is_causal=causal, enable_gqa=h != h_kv
                )
        except RuntimeError as e:  # a backend without grouped-query heads
            print(label, repr(e)[:200], flush=True)
    times: dict[str, list[float]] = {}
    for _ in range(rounds):
        for on in (True, False):
            with TwoWarpgroups(on):  # the switch outside the timed calls: plans stay warm
                times.setdefault("ours_2wg" if on else "ours_1wg", []).append(
                    bench(lambda on=on: torch.autograd.grad(
                        graphs[on], (q, k, v), do, retain_graph=True
                    ))
                )  # fmt: skip
        for label, o in sdpa.items():
            times.setdefault("sdpa_" + label, []).append(
                bench(lambda o=o: torch.autograd.grad(o, (q, k, v), do, retain_graph=True))
            )
    sdpa_ms = [statistics.median(times[n_]) for n_ in times if n_.startswith("sdpa")]
    best = min(sdpa_ms) if sdpa_ms else float("nan")
    for name, ts in times.items():
        ms = statistics.median(ts)
        row = {
            "backward": f"{b}x{h}/{h_kv}x{n}", "causal": causal, "provider": name,
            "ms": round(ms, 4), "vs_best_sdpa": round(ms / best, 3),
            "rounds": [round(t, 4) for t in ts],
        }  # fmt: skip
        rows.append(row)
        print(row, flush=True)


KERNEL_SHAPES = [  # (B, H, Hkv, N, causal)
    (1, 16, 16, 16384, True),
    (1, 32, 32, 32768, True),
    (4, 32, 32, 4096, True),
    (1, 16, 16, 4096, True),
    (1, 32, 32, 2048, True),
    (1, 16, 16, 16384, False),
    (2, 16, 16, 8192, False),
    (4, 32, 8, 4096, True),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="two shapes, one round")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    shapes = KERNEL_SHAPES[:1] + KERNEL_SHAPES[3:4] if args.quick else KERNEL_SHAPES
    rounds = 1 if args.quick else args.rounds
    rows: list = []
    try:
        check(rows)
        kernels(rows, shapes, rounds)
        backward(rows, shapes, rounds)
    finally:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
