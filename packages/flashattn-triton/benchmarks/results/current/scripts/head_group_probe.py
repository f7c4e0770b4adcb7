"""Launch order by head groups, three probes (interleaved rounds, cuDNN alongside):
onepass: the one-pass d = 128 backward's group (fwd+bwd), more shapes;
d64: the Triton forward / split backward's group at d = 64 (fwd+bwd);
gfwd: the Gluon d = 128 forward's group (forward only)."""

import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashattn_triton as fa
from flashattn_triton import gluon_bwd, gluon_fwd, launch, launch_backward
from flashattn_triton.launch_plans import clear_plans

T0 = time.time()
ORIG = {m: m.head_group_args for m in (gluon_bwd, launch, launch_backward)}


def fixed(setting, orig):
    def f(t, bh, n_rows, block_d):
        if setting == "auto":
            return orig(t, bh, n_rows, block_d)
        if setting == "off":
            return {"head_group": bh, "GROUPED": False}
        g = min(setting, bh)
        return {"head_group": g, "GROUPED": g < bh}

    return f


def set_group(mods, setting):
    for m in mods:
        m.head_group_args = fixed(setting, ORIG[m])
    clear_plans()


def reset():
    for m, f in ORIG.items():
        m.head_group_args = f
    clear_plans()


def make(b, h, hkv, n, d):
    g = torch.Generator(device="cuda").manual_seed(n + h + d)
    q, do = (
        torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2)
    )
    k, v = (
        torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
        for _ in range(2)
    )
    for t in (q, k, v):
        t.requires_grad_(True)
    return q, k, v, do


rows = []


def run(exp, shapes, settings, apply, fwd_only=False, rounds=3):
    for b, h, hkv, n, d, causal in shapes:
        q, k, v, do = make(b, h, hkv, n, d)
        gqa = hkv != h

        def ours():
            if fwd_only:
                with torch.no_grad():
                    return fa.flash_attention(q, k, v, causal)
            return torch.autograd.grad(fa.flash_attention(q, k, v, causal), (q, k, v), do)

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION if not gqa else SDPBackend.FLASH_ATTENTION):
                if fwd_only:
                    with torch.no_grad():
                        return F.scaled_dot_product_attention(
                            q, k, v, is_causal=causal, enable_gqa=gqa
                        )
                o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
                return torch.autograd.grad(o, (q, k, v), do)

        times = {}
        try:
            cudnn()
            ref_name = "cudnn" if not gqa else "sdpa_flash"
        except Exception:
            ref_name = None
        for _r in range(rounds):
            for s in settings:
                apply(s)
                times.setdefault(f"group={s}", []).append(
                    triton.testing.do_bench(ours, warmup=25, rep=200)
                )
            reset()
            if ref_name:
                times.setdefault(ref_name, []).append(
                    triton.testing.do_bench(cudnn, warmup=25, rep=200)
                )
        base = statistics.median(times[f"group={settings[0]}"])
        print(f"[{time.time() - T0:6.1f}s] == {exp} {(b, h, hkv, n, d, causal)}", flush=True)
        for name, ts in sorted(times.items(), key=lambda kv: statistics.median(kv[1])):
            med = statistics.median(ts)
            print(
                f"   {name:12s} {med:8.3f} ms  /first {med / base:6.3f}  rounds {' '.join(f'{x:.3f}' for x in ts)}",
                flush=True,
            )
            rows.append(
                {
                    "exp": exp,
                    "shape": [b, h, hkv, n, d, causal],
                    "setting": name,
                    "ms": med,
                    "rounds": ts,
                }
            )
        json.dump(rows, open(sys.argv[1], "w"), indent=1)


def gfwd_apply(s):
    gluon_fwd.DEFAULTS[128]["head_group"] = s
    clear_plans()


parts = sys.argv[2].split(",") if len(sys.argv) > 2 else ["onepass", "d64", "gfwd"]
if "onepass" in parts:
    run(
        "onepass",
        [
            (1, 32, 32, 32768, 128, True),
            (1, 32, 8, 16384, 128, True),
            (2, 16, 16, 16384, 128, True),
            (8, 16, 16, 2048, 128, True),
            (8, 16, 16, 2048, 128, False),
            (1, 16, 16, 16384, 128, False),
            (4, 32, 32, 4096, 128, False),
        ],
        ["auto", 2, 1],
        lambda s: set_group([gluon_bwd], s),
    )
if "d64" in parts:
    run(
        "d64",
        [
            (1, 16, 16, 16384, 64, False),
            (1, 8, 8, 8192, 64, False),
            (4, 16, 16, 4096, 64, False),
            (1, 16, 16, 16384, 64, True),
        ],
        ["auto", 2, 4, 8],
        lambda s: set_group([launch, launch_backward], s),
    )
if "gfwd" in parts:
    saved = gluon_fwd.DEFAULTS[128]["head_group"]
    run(
        "gfwd",
        [
            (1, 16, 16, 16384, 128, False),
            (1, 16, 16, 16384, 128, True),
            (2, 16, 16, 8192, 128, False),
            (4, 32, 32, 4096, 128, True),
        ],
        [saved, 1, 2, 8],
        gfwd_apply,
        fwd_only=True,
    )
    gluon_fwd.DEFAULTS[128]["head_group"] = saved
print("done", flush=True)
