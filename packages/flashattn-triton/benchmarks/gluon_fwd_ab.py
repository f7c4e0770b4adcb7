"""The Gluon forward (``gluon_fwd``) against our Triton forward and SDPA (cuDNN, flash),
bf16, in one process: d = 128 per-tile variants, or (``--persistent``) the persistent kernel
at d = 128 and 64.

    python benchmarks/gluon_fwd_ab.py OUT.json [--quick] [--sweep]
    python benchmarks/gluon_fwd_ab.py OUT.json --persistent [--head-dims 128 64] [--rounds R]
    python benchmarks/gluon_fwd_ab.py --offline [--causal] [--kv-group G] [--persistent]

First checks each Gluon variant against a float32 reference on awkward shapes (ragged
lengths, Nq != Nk, grouped-query heads, causal and not), then times every variant and
provider per shape in interleaved rounds (``do_bench`` medians; the median over rounds is
reported). "ours_triton" is the package's forward with the Gluon forward switched off.
``--offline`` compiles the shipped d = 128 variant for sm_90 without a GPU and prints its
registers, shared memory and tensor-core instruction count (catches Gluon API drift).
``--persistent`` checks the persistent kernel (``fwd_persistent_kernel``) on awkward shapes
and times it over the sweep's batch-1 shapes beside the per-tile kernel, the package's
forward and SDPA: forward alone as GPU time (CUDA graphs), and the package's forward +
backward with it and without (``time_persistent``). ``--sweep`` adds the package's forward
with and without the Gluon forward (any length) over the attention sweep's batch-1 shapes,
forward alone and forward + backward: where the Gluon forward starts to pay
(``gluon_fwd.DEFAULTS``'s ``min_keys``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import statistics

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashattn_triton as fa
from flashattn_triton import gluon_fwd
from flashattn_triton.launch import clear_plans

D = 128


def reference(q, k, v, causal, scale):
    """float32 o and natural-log lse, bottom-right causal alignment."""
    s = torch.einsum("bhqd,bhkd->bhqk", q.float(), k.float()) * scale
    n_q, n_k = q.shape[2], k.shape[2]
    if causal:
        i = torch.arange(n_q, device=q.device)[:, None]
        j = torch.arange(n_k, device=q.device)[None, :]
        s = s.masked_fill(j > i + n_k - n_q, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.einsum("bhqk,bhkd->bhqd", p, v.float()), lse


def run(q, k, v, causal, **kw):
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], device=q.device, dtype=torch.float32)
    if kw.get("persistent") == -1:  # one program per SM
        kw = {**kw, "persistent": torch.cuda.get_device_properties(q.device).multi_processor_count}
    gluon_fwd.launch_fwd(q, k, v, o, lse, causal, 1 / math.sqrt(q.shape[-1]), **kw)
    return o, lse


# The persistent kernel (one program per SM looping over the tiles) beside the one program
# per tile of the shipped tiles, by head dim (``--persistent``).
# "_tma": o stored through shared memory by TMA (``launch_fwd(tma_store=True)``).
PERSISTENT_VARIANTS = {
    128: {
        "gluon": {"block_m": 128, "head_group": 4},
        "gluon_tma": {"block_m": 128, "head_group": 4, "tma_store": True},
        "persistent": {"block_m": 128, "persistent": -1},
        "persistent_tma": {"block_m": 128, "persistent": -1, "tma_store": True},
        "persistent_tma_serp": {
            "block_m": 128,
            "persistent": -1,
            "tma_store": True,
            "serpentine": True,
        },
        "persistent_s3": {"block_m": 128, "stages": 3, "persistent": -1},
        "persistent_n64": {"block_m": 128, "block_n": 64, "stages": 3, "persistent": -1},
    },
    64: {
        "gluon": {"block_m": 192, "consumer_regs": 160, "head_group": 4},
        "gluon_tma": {"block_m": 192, "consumer_regs": 160, "head_group": 4, "tma_store": True},
        "persistent": {"block_m": 192, "consumer_regs": 160, "persistent": -1},
        "persistent_m128": {"block_m": 128, "persistent": -1},
        "persistent_tma": {
            "block_m": 192,
            "consumer_regs": 160,
            "persistent": -1,
            "tma_store": True,
        },
        "persistent_m128_tma": {"block_m": 128, "persistent": -1, "tma_store": True},
    },
}


VARIANTS = {
    "nopp_s2_plain": {"block_n": 128, "stages": 2, "pingpong": False},
    "nopp_s2_group4": {"block_n": 128, "stages": 2, "pingpong": False, "head_group": 4},
    "nopp_s2_group8": {"block_n": 128, "stages": 2, "pingpong": False, "head_group": 8},
    "pp_s2_group8": {"block_n": 128, "stages": 2, "pingpong": True, "head_group": 8},
    "nopp_s3_group8": {"block_n": 128, "stages": 3, "pingpong": False, "head_group": 8},
}


def check(rows: list) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    for b, h, h_kv, n_q, n_k, causal in [
        (2, 3, 3, 1000, 1000, True),
        (2, 3, 3, 1000, 1000, False),
        (1, 2, 2, 77, 300, True),
        (1, 2, 2, 300, 77, False),
        (1, 2, 2, 300, 77, True),
        (1, 1, 1, 1, 129, True),
        (1, 4, 4, 4096, 4096, True),
        (2, 8, 2, 700, 700, True),
        (1, 6, 1, 513, 513, False),
    ]:
        q = torch.randn(b, h, n_q, D, device="cuda", generator=g).bfloat16()
        k = torch.randn(b, h_kv, n_k, D, device="cuda", generator=g).bfloat16()
        v = torch.randn(b, h_kv, n_k, D, device="cuda", generator=g).bfloat16()
        ke, ve = (t.repeat_interleave(h // h_kv, dim=1) for t in (k, v))
        o_ref, lse_ref = reference(q, ke, ve, causal, 1 / math.sqrt(D))
        sdpa_err = None
        if n_q == n_k or not causal:
            o_s = F.scaled_dot_product_attention(q, ke, ve, is_causal=causal)
            sdpa_err = (o_s.float() - o_ref).abs().max().item()
        fin = torch.isfinite(lse_ref)
        calls = {
            name: (lambda kw=kw, q=q, k=k, v=v, c=causal: run(q, k, v, c, **kw))
            for name, kw in VARIANTS.items()
        }

        def package(q=q, k=k, v=v, causal=causal):
            with gluon_forward(0):
                return fa.flash_attention(q, k, v, causal, return_lse=True)

        calls["package, gluon from 0 keys"] = package
        for name, call in calls.items():
            head = {"check": f"{b}x{h}/{h_kv}x{n_q}x{n_k}", "causal": causal, "variant": name}
            try:
                o, lse = call()
                torch.cuda.synchronize()
                row = {
                    **head, "o_err": (o.float() - o_ref).abs().max().item(),
                    "lse_err": (lse - lse_ref)[fin].abs().max().item() if fin.any() else 0.0,
                    "lse_inf_match": bool(torch.equal(torch.isinf(lse), ~fin)),
                    "sdpa_o_err": sdpa_err,
                }  # fmt: skip
            except Exception as e:  # a variant that fails to compile is reported, not fatal
                row = {**head, "error": repr(e)[:300]}
            rows.append(row)
            print(row, flush=True)


def sweep(rows: list, rounds: int) -> None:
    """The package's forward (and forward + backward) with the Gluon forward from any length
    against without it, over the attention sweep's batch-1 shapes at d = 128."""
    for h, n in [(128, 512), (64, 1024), (32, 2048), (16, 4096), (8, 8192), (16, 16384)]:
        for causal in (True, False):
            q, k, v = (
                torch.randn(1, h, n, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                for _ in range(3)
            )
            do = torch.randn_like(q)

            def fwd(q=q, k=k, v=v, causal=causal):
                with torch.no_grad():
                    fa.flash_attention(q, k, v, causal)

            def fwd_bwd(q=q, k=k, v=v, causal=causal, do=do):
                o = fa.flash_attention(q, k, v, causal)
                torch.autograd.grad(o, (q, k, v), do)

            times: dict[str, list[float]] = {}
            for _ in range(rounds):
                for label, min_keys in (("triton_fwd", None), ("gluon_fwd", 0)):
                    with gluon_forward(min_keys):
                        times.setdefault(label + " fwd", []).append(bench(fwd))
                        times.setdefault(label + " fwd+bwd", []).append(bench(fwd_bwd))
            for name, ts in times.items():
                row = {
                    "sweep": f"1x{h}x{n}", "causal": causal, "provider": name,
                    "ms": round(statistics.median(ts), 4), "rounds": [round(t, 4) for t in ts],
                }  # fmt: skip
                rows.append(row)
                print(row, flush=True)


# The shipped ``DEFAULTS`` (before any ``PackageDefaults`` block), and the persistent
# variants that ``--persistent`` also times inside the package's forward + backward.
SHIPPED = {d: dict(cfg) for d, cfg in gluon_fwd.DEFAULTS.items()}
PACKAGE_PERSISTENT = {
    128: ("persistent", "persistent_tma"),
    64: ("persistent", "persistent_m128"),
}


class PackageDefaults:
    """Within the block the package's Gluon forward at head dim d runs with ``cfg`` (None:
    the Triton forward); launch plans are cleared on entry and exit."""

    def __init__(self, d: int, cfg: dict | None):
        self.d, self.cfg = d, cfg

    def __enter__(self):
        self.saved = gluon_fwd.DEFAULTS.get(self.d)
        if self.cfg is None:
            gluon_fwd.DEFAULTS.pop(self.d, None)
        else:
            gluon_fwd.DEFAULTS[self.d] = self.cfg
        clear_plans()

    def __exit__(self, *exc):
        if self.saved is None:
            gluon_fwd.DEFAULTS.pop(self.d, None)
        else:
            gluon_fwd.DEFAULTS[self.d] = self.saved
        clear_plans()


def gluon_forward(min_keys: int | None) -> PackageDefaults:
    """Within the block the package's d = 128 forward uses the Gluon kernel from min_keys
    keys (None: never)."""
    cfg = None if min_keys is None else {**gluon_fwd.DEFAULTS[D], "min_keys": min_keys}
    return PackageDefaults(D, cfg)


def chosen(d: int, only: list[str] | None) -> dict[str, dict]:
    """The ``--persistent`` variants at head dim d, those named in ``only`` if given."""
    return {n: kw for n, kw in PERSISTENT_VARIANTS[d].items() if not only or n in only}


def check_persistent(rows: list, only: list[str] | None = None) -> None:
    """The persistent variants against a float32 reference on awkward shapes."""
    g = torch.Generator(device="cuda").manual_seed(1)
    for d in PERSISTENT_VARIANTS:
        variants = chosen(d, only)
        for b, h, h_kv, n_q, n_k, causal in [
            (2, 3, 3, 1000, 1000, True), (2, 3, 3, 1000, 1000, False), (1, 2, 2, 77, 300, True),
            (1, 2, 2, 300, 77, False), (1, 1, 1, 1, 129, True), (2, 8, 2, 700, 700, True),
            (1, 6, 1, 513, 513, False), (3, 50, 50, 512, 512, False),
        ]:  # fmt: skip
            q = torch.randn(b, h, n_q, d, device="cuda", generator=g).bfloat16()
            k = torch.randn(b, h_kv, n_k, d, device="cuda", generator=g).bfloat16()
            v = torch.randn(b, h_kv, n_k, d, device="cuda", generator=g).bfloat16()
            ke, ve = (t.repeat_interleave(h // h_kv, dim=1) for t in (k, v))
            o_ref, lse_ref = reference(q, ke, ve, causal, 1 / math.sqrt(d))
            fin = torch.isfinite(lse_ref)
            for name, kw in variants.items():
                shape = f"d{d} {b}x{h}/{h_kv}x{n_q}x{n_k}"
                head = {"check": shape, "causal": causal, "variant": name}
                try:
                    o, lse = run(q, k, v, causal, **kw)
                    torch.cuda.synchronize()
                    row = {
                        **head, "o_err": (o.float() - o_ref).abs().max().item(),
                        "lse_err": (lse - lse_ref)[fin].abs().max().item() if fin.any() else 0.0,
                        "lse_inf_match": bool(torch.equal(torch.isinf(lse), ~fin)),
                    }  # fmt: skip
                except Exception as e:
                    row = {**head, "error": repr(e)[:300]}
                rows.append(row)
                print(row, flush=True)


SWEEP_SHAPES = [(128, 512), (64, 1024), (32, 2048), (16, 4096), (8, 8192), (16, 16384)]


def time_persistent(
    rows: list, rounds: int, head_dims=(128, 64), only: list[str] | None = None,
    shapes=SWEEP_SHAPES, fwd_only: bool = False,
) -> None:  # fmt: skip
    """Over the attention sweep's batch-1 shapes, forward alone as GPU time (one CUDA
    graph; the kernel variants launch through Triton's dispatch, too slow a host to time
    otherwise): the package's forward (as shipped, and the Triton forward only), the Gluon
    kernel per tile and persistent, SDPA's cuDNN and flash backends; forward + backward: the
    package as shipped, with the Triton forward, with each persistent variant of
    ``PACKAGE_PERSISTENT`` (its tiles, non-causal calls on the persistent grid from any
    length), and both SDPA backends. Interleaved rounds, medians; "vs_cudnn": over cuDNN's
    time of the same kind."""
    for d in head_dims:
        variants = chosen(d, only)
        configs: dict[str, dict | None] = {"package": SHIPPED[d], "triton": None}
        for name in PACKAGE_PERSISTENT[d]:  # non-causal calls on the persistent grid
            if name not in variants:
                continue
            kw = {k: v for k, v in variants[name].items() if k != "persistent"}
            kw.setdefault("tma_store", False)  # the variant's store, not the shipped one
            configs[f"package {name}"] = {
                **SHIPPED[d],
                gluon_fwd.PERSISTENT_TILES: kw,
                "min_keys_persistent": 0,
            }
        for h, n in shapes:
            for causal in (False, True):
                _time_shape(rows, d, h, n, causal, variants, configs, rounds, fwd_only)


def _time_shape(rows, d, h, n, causal, variants, configs, rounds, fwd_only=False) -> None:
    q, k, v = (torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    do = torch.randn_like(q)

    def ours(grad: bool):
        def call():
            if not grad:
                return fa.flash_attention(q, k, v, causal)
            o = fa.flash_attention(qg, kg, vg, causal)
            return torch.autograd.grad(o, (qg, kg, vg), do)

        return call

    def sdpa(backend, grad: bool):
        def call():
            with sdpa_kernel(backend):
                if not grad:
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
            return torch.autograd.grad(o, (qg, kg, vg), do)

        return call

    # name -> (function, the package's Gluon forward config around it, or "as is")
    fns: dict[str, tuple] = {}
    for label in ("package", "triton"):
        fns[label] = (ours(False), configs[label])
    for name, kw in variants.items():
        fns[name] = ((lambda kw=kw: run(q, k, v, causal, **kw)), "as is")
    for label, cfg in configs.items():
        if not fwd_only:
            fns[label + " fwd+bwd"] = (ours(True), cfg)
    for grad in (False,) if fwd_only else (False, True):
        for label, backend in (
            ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
            ("sdpa_flash", SDPBackend.FLASH_ATTENTION),
        ):
            fns[label + (" fwd+bwd" if grad else "")] = (sdpa(backend, grad), "as is")
    times: dict[str, list[float]] = {}
    for _ in range(rounds):
        for name, (fn, cfg) in fns.items():
            context = contextlib.nullcontext() if cfg == "as is" else PackageDefaults(d, cfg)
            grad = "fwd+bwd" in name
            try:
                with context, torch.set_grad_enabled(grad):
                    times.setdefault(name, []).append(bench(fn) if grad else bench_graph(fn))
            except Exception as e:
                times.setdefault(name, []).append(float("nan"))
                print(name, repr(e)[:200], flush=True)
    line = {"d": d, "shape": f"1x{h}x{n}", "causal": causal}
    for name, ts in times.items():
        ms = statistics.median(ts)
        cudnn = statistics.median(
            times["sdpa_cudnn fwd+bwd" if "fwd+bwd" in name else "sdpa_cudnn"]
        )
        row = {
            **line, "provider": name, "ms": round(ms, 4), "vs_cudnn": round(ms / cudnn, 3),
            "rounds": [round(t, 4) for t in ts],
        }  # fmt: skip
        rows.append(row)
    print(line, " ".join(f"{k}={statistics.median(t):.4f}" for k, t in times.items()), flush=True)


def bench_graph(fn) -> float:
    """GPU time alone: ``fn``'s launches replayed from one CUDA graph."""
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=120, return_mode="median")


def timing(rows: list, shapes, rounds: int) -> None:
    for b, h, n, causal in shapes:
        q, k, v = (torch.randn(b, h, n, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))

        def triton_forward(q=q, k=k, v=v, causal=causal):
            return fa.flash_attention(q, k, v, causal)

        fns = {"ours_triton": triton_forward}  # timed inside gluon_forward(None), below
        for name, kw in VARIANTS.items():
            fns["gluon_" + name] = lambda kw=kw, q=q, k=k, v=v, c=causal: run(q, k, v, c, **kw)

        def sdpa(backend, q=q, k=k, v=v, causal=causal):
            def call():
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

            return call

        fns["sdpa_cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION)
        fns["sdpa_flash"] = sdpa(SDPBackend.FLASH_ATTENTION)
        times: dict[str, list[float]] = {}
        with torch.no_grad():
            for _ in range(rounds):
                for name, fn in fns.items():
                    # Around the whole timing, not each call: entering clears the launch
                    # plans, which would send every call through Triton's dispatch.
                    context = gluon_forward(None) if name == "ours_triton" else None
                    try:
                        with context or contextlib.nullcontext():
                            times.setdefault(name, []).append(bench(fn))
                    except Exception as e:
                        times.setdefault(name, []).append(float("nan"))
                        print(name, repr(e)[:200], flush=True)
        flops = 4 * b * h * n * n * D * (0.5 if causal else 1.0)
        best_sdpa = min(
            statistics.median(times["sdpa_cudnn"]), statistics.median(times["sdpa_flash"])
        )
        for name, ts in times.items():
            ms = statistics.median(ts)
            row = {
                "shape": f"{b}x{h}x{n}", "causal": causal, "provider": name, "ms": round(ms, 4),
                "tflops": round(flops / ms / 1e9, 1), "vs_best_sdpa": round(ms / best_sdpa, 3),
                "rounds": [round(t, 4) for t in ts],
            }  # fmt: skip
            rows.append(row)
            print(row, flush=True)


def offline(
    causal: bool, kv_group: int, head_dim: int = D, block_m: int = 0, regs: int = 240,
    persistent: bool = False, tma_store: bool = False,
) -> None:  # fmt: skip
    """Compile the shipped d = 128 variant (or, with ``head_dim`` / ``block_m`` / ``regs``,
    that kernel at another head dim, with 128 or 192 query rows, its math warpgroups'
    registers) for sm_90 on any machine and print its resources and SASS hash."""
    import sys
    from pathlib import Path

    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    sys.path.insert(0, str(Path(__file__).parent))
    from compile_offline import _resource_usage, sass_hash

    cfg = {k: v for k, v in gluon_fwd.DEFAULTS[D].items() if k != "min_keys"}
    cfg["block_m"] = block_m or cfg["block_m"]
    q = torch.empty(1, kv_group, 1024, head_dim, dtype=torch.bfloat16, device="meta")

    def desc(rows):
        block = [1, 1, rows, head_dim]
        layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
        return mangle_type(TensorDescriptor(q, list(q.shape), list(q.stride()), block, layout))

    sig = {"q_desc": desc(gluon_fwd.WG_ROWS), "k_desc": desc(cfg["block_n"])}
    sig["v_desc"] = sig["k_desc"]
    sig["o_desc"] = sig["q_desc"]
    sig.update(Out="*bf16", LSE="*fp32", qk_scale="fp32")
    names_i32 = ("stride_ob", "stride_oh", "stride_om", "n_heads", "n_q", "n_k", "kv_group")
    extra = ("n_m", "total") if persistent else ("head_group",)
    for name in (*names_i32, *extra):
        sig[name] = "i32"
    consts = {
        "BLOCK_M": cfg["block_m"], "BLOCK_N": cfg["block_n"], "HEAD_DIM": head_dim,
        "STAGES": cfg["stages"], "CAUSAL": causal, "CONSUMER_REGS": regs,
        "TMA_STORE": tma_store, "num_warps": 4,
    }  # fmt: skip
    if persistent:
        consts.update(SERPENTINE=causal)
    else:
        consts.update(PINGPONG=cfg["pingpong"], GROUPED=True)
    if kv_group == 1:
        consts["kv_group"] = 1  # as Triton specializes an argument equal to 1
    kernel = gluon_fwd.fwd_persistent_kernel if persistent else gluon_fwd.fwd_kernel
    names = kernel.arg_names
    sig.update(dict.fromkeys(consts, "constexpr"))
    src = GluonASTSource(kernel, sig, {(names.index(k),): v for k, v in consts.items()})
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ptx = c.asm["ptx"]
    print(_resource_usage(c.asm["cubin"]), "shared", c.metadata.shared)
    print("warps", c.metadata.num_warps, "wgmma", ptx.count("wgmma.mma_async"))
    print(
        "setmaxnreg", sorted(set(re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)))
    )
    print("sass", sass_hash(c.asm["cubin"]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?")
    ap.add_argument("--offline", action="store_true")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--kv-group", type=int, default=1)
    ap.add_argument("--head-dim", type=int, default=D, choices=(64, 128), help="--offline")
    ap.add_argument("--block-m", type=int, default=0, choices=(0, 128, 192), help="--offline")
    ap.add_argument("--regs", type=int, default=240, help="--offline: CONSUMER_REGS")
    ap.add_argument("--tma-store", action="store_true", help="--offline: TMA_STORE")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--rounds", type=int, default=0, help="--persistent: timing rounds (3)")
    ap.add_argument("--head-dims", type=int, nargs="+", default=[128, 64], help="--persistent")
    ap.add_argument("--variants", nargs="+", help="--persistent: only these variants")
    ap.add_argument(
        "--shapes", nargs="+", help="--persistent: HEADSxN shapes (default: the sweep's six)"
    )
    ap.add_argument("--fwd-only", action="store_true", help="--persistent: no fwd+bwd timings")
    ap.add_argument(
        "--persistent", action="store_true",
        help="the persistent kernel: check it, then time it over the sweep's shapes (only); "
        "with --offline: compile it",
    )  # fmt: skip
    args = ap.parse_args()
    if args.offline:
        offline(
            args.causal, args.kv_group, args.head_dim, args.block_m, args.regs, args.persistent,
            args.tma_store,
        )  # fmt: skip
        return
    if args.out is None:
        ap.error("OUT.json is required unless --offline")
    known = {name for variants in PERSISTENT_VARIANTS.values() for name in variants}
    if unknown := set(args.variants or ()) - known:
        ap.error(f"--variants: unknown {sorted(unknown)}; known: {sorted(known)}")
    rows: list = []
    if args.persistent:
        try:
            check_persistent(rows, args.variants)
            shapes = [tuple(map(int, x.split("x"))) for x in args.shapes or []] or SWEEP_SHAPES
            time_persistent(
                rows, args.rounds or 3, args.head_dims, args.variants, shapes, args.fwd_only
            )
        finally:  # a run stopped by Ctrl-C (or ``timeout -s INT``) keeps its finished rows
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)
        return
    check(rows)
    if args.sweep:
        sweep(rows, rounds=2)
    shapes = [(1, 16, 16384, True), (1, 16, 16384, False), (4, 32, 4096, True), (8, 8, 8192, True)]
    if not args.quick:
        shapes += [(4, 32, 2048, True), (2, 16, 8192, False), (1, 32, 32768, True)]
    timing(rows, shapes, rounds=2 if args.quick else 3)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
