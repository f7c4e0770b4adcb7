"""The Gluon backward kernels (``flashattn_triton.gluon_dkdv``, ``gluon_dq``): offline
compile, check, timing (``--kernel dkdv``, the default, or ``dq``).

Why: Triton 3.6's ``tl.dot`` waits for every product before the next instruction that reads
it (the package's DESIGN.md); the Gluon kernel issues its products asynchronously
and waits only for the one it needs next. Its pipeline, layout requirements and switches are
described in the module ``flashattn_triton.gluon_dkdv``; this script times and checks
variants of it (``ws``: a warp-specialized loader warp).

Results on an H100: at d = 64 it only ties our Triton dK/dV kernel, and leaving out the
exponentials and dS entirely (``--ablate``) saves ~10%: that kernel is bound by its
products, not by their overlap with the exponentials. At d = 128, causal, it is 1.15-1.21x
faster than the Triton kernel, so the package uses it there (``gluon_dkdv.DEFAULTS``). The dQ
kernel alone is 1.17x faster than the Triton one at (8, 1, 16384, 128), causal, and slower
at d = 64; in the whole backward it wins on small grids and, with the head-grouped launch
order, wherever there are 2048 keys or more, where the package uses it
(``gluon_dq.DEFAULTS``, ``gluon_dq.small_grid``, ``gluon_dq.MIN_KEYS``).

Spec of a variant: ``BLOCK_M,BLOCK_N,STAGES,MAXNREG[,ws][,rt][,ts]`` (MAXNREG 0: Triton's
default; ``ws``, ``rt`` (lse / delta rows by TMA with Q / dO) and ``ts`` (dK, dV stored by
TMA through the K / V buffers) for dK/dV only; ``rt`` is in the d = 128 default).

    python benchmarks/gluon_dkdv.py offline 32,64,4,128 64,128,3,168,ws  # any machine
    python benchmarks/gluon_dkdv.py check 32,64,4,128 --out $OUT         # Hopper GPU
    python benchmarks/gluon_dkdv.py time 32,64,4,128 --ablate 1 2 3 --out $OUT
    python benchmarks/gluon_dkdv.py --kernel dq time 64,64,2,0 --shape 8,1,16384,128
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from flashattn_triton.gluon_dkdv import HAVE_GLUON, _desc, _flat_desc, launch_dkdv
from flashattn_triton.gluon_dq import launch_dq

if HAVE_GLUON:
    from flashattn_triton.gluon_dkdv import dkdv_kernel
    from flashattn_triton.gluon_dq import dq_kernel
LEADERBOARD = (16, 1, 16384, 64)  # B, H, N, d: q, k, v (16, 16384, 64) bf16, causal


def _dq_spec(spec: str) -> dict:
    """The dQ kernel's launch options (no warp specialization)."""
    o = parse_spec(spec)
    if o.pop("ws") or o.pop("row_tma", False) or o.pop("tma_store", False):
        raise ValueError(f"{spec!r}: the dQ kernel has no 'ws', 'rt' or 'ts' variant")
    return o


def parse_spec(spec: str) -> dict:
    """``BLOCK_M,BLOCK_N,STAGES,MAXNREG[,ws][,rt][,ts]`` -> launch options (``rt``: row
    statistics by TMA; ``ts``: dK, dV stored by TMA; dK/dV only)."""
    parts = spec.split(",")
    flags = set(parts[4:])
    if not flags <= {"ws", "rt", "ts"}:
        raise ValueError(f"{spec!r}: flags are ws, rt, ts")
    bm, bn, stages, maxnreg = (int(x) for x in parts[:4])
    out = {"block_m": bm, "block_n": bn, "stages": stages, "maxnreg": maxnreg or None}
    out |= {"ws": "ws" in flags} | ({"row_tma": True} if "rt" in flags else {})
    return out | ({"tma_store": True} if "ts" in flags else {})


def _inputs(shape, n_k=None, dtype=torch.bfloat16, device="cuda"):
    b, h, n_q, d = shape
    n_k = n_q if n_k is None else n_k
    q, do = (torch.randn(b, h, n_q, d, device=device, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(b, h, n_k, d, device=device, dtype=dtype) for _ in range(2))
    return q, k, v, do


def _stats(q, k, v, do, causal, scale):
    from flashattn_triton import launch

    o, lse = launch.forward(q, k, v, causal, scale)
    delta = (do.float() * o.float()).sum(-1).contiguous()
    return o, lse, delta


def offline(
    specs: list[str],
    shape=LEADERBOARD,
    kernel: str = "dkdv",
    grouped: bool = False,
    kv_group: int = 1,
) -> int:
    """Compile each variant for sm_90 with no GPU (a stand-in driver); print registers, the
    setmaxnreg split of a warp-specialized kernel, shared memory and the wgmma schedule.
    kv_group > 1: the grouped-query variant (that many q heads per k/v head)."""
    import re

    sys.path.insert(0, str(Path(__file__).parent))
    from compile_offline import _resource_usage, use_hopper_driver, wgmma_schedule

    use_hopper_driver()
    b, h, n, d = shape
    q = torch.empty(b, h, n, d, dtype=torch.bfloat16, device="meta")
    lse = torch.empty(b, h, n, dtype=torch.float32, device="meta")
    for spec in specs:
        o = parse_spec(spec)
        descs = (_desc(q, o["block_m"]), _desc(q, o["block_n"]), _desc(q, o["block_n"]))
        descs += (_desc(q, o["block_m"]),)
        tiles = {"BLOCK_M": o["block_m"], "BLOCK_N": o["block_n"], "HEAD_DIM": d}
        opts = {"STAGES": o["stages"], "CAUSAL": True, "grid": (1,)}
        opts.update({"maxnreg": o["maxnreg"]} if o["maxnreg"] else {})
        if kernel == "dq":
            c = dq_kernel.warmup(
                *descs, lse, lse, q, *q.stride()[:3], h, n, n, n, 0.18, 0.125, 2, kv_group,
                **tiles, **opts, GROUPED=grouped, GQA=kv_group > 1, num_warps=o["block_m"] // 16,
            )  # fmt: skip
        else:
            rt = o.get("row_tma", False)
            rows = (_flat_desc(lse, o["block_m"]),) * 2 if rt else (None, None)
            ts = o.get("tma_store", False)
            c = dkdv_kernel.warmup(
                *descs, lse, lse, q, q, *q.stride()[:3], *q.stride()[:3], h, n, n, n, 0.18, 0.125,
                2, *rows, kv_group, descs[1], descs[2], **tiles, **opts, WARP_SPEC=o["ws"],
                ABLATE=0, GROUPED=grouped, ROW_TMA=rt, LSE_LOG2=True, GQA=kv_group > 1,
                TMA_STORE=ts, num_warps=o["block_n"] // 16,
            )  # fmt: skip
        ptx = c.asm["ptx"]
        split = sorted(set(re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)))
        print(f"{spec:18s} {_resource_usage(c.asm['cubin'])} setmaxnreg {split or '-'} "
              f"smem {c.metadata.shared // 1024}K")  # fmt: skip
        print(f"    schedule: {wgmma_schedule(ptx)}")
    return 0


def _triton_only(fn):
    """Run fn with the Gluon kernels switched off (our Triton kernels, the yardstick); the
    caller's options are restored afterwards."""
    from flashattn_triton.options import use_options

    with use_options(gluon=False):
        return fn()


def check(specs: list[str], out: Path | None, kernel: str = "dkdv") -> int:
    """dK, dV (or dQ) against float64 on awkward shapes, with our Triton kernels' error as
    the yardstick; returns 1 if any variant is off."""
    from flashattn_triton import launch
    from flashattn_triton.reference import attention_reference

    shapes = [  # B, H, n_q, n_k, d, causal
        (2, 3, 1024, 1024, 64, True), (2, 3, 1024, 1024, 64, False), (1, 2, 1000, 1000, 64, True),
        (2, 2, 777, 777, 64, False), (1, 2, 384, 640, 64, True), (1, 2, 640, 384, 64, True),
        (1, 2, 384, 640, 64, False), (2, 2, 512, 512, 128, True), (1, 3, 999, 999, 128, True),
        (1, 1, 70, 70, 64, False), (1, 2, 1, 1, 128, True), (1, 2, 640, 384, 128, True),
        (1, 2, 130, 130, 128, False),
    ]  # fmt: skip
    rows, bad = [], 0
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        for b, h, n_q, n_k, d, causal in shapes:
            q, k, v, do = _inputs((b, h, n_q, d), n_k, dtype)
            scale = d**-0.5
            o, lse, delta = _stats(q, k, v, do, causal, scale)
            q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
            attention_reference(q64, k64, v64, causal, scale)[0].backward(do.double())
            dq_t, dk_t, dv_t = _triton_only(
                lambda: launch.backward(do, q, k, v, o, lse, causal, scale)  # noqa: B023
            )

            def err(x, ref):
                return ((x.double() - ref).norm() / ref.norm()).item()

            if kernel == "dq":
                yard = err(dq_t, q64.grad)
            else:
                yard = max(err(dk_t, k64.grad), err(dv_t, v64.grad))
            for spec in specs:
                dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
                try:
                    if kernel == "dq":
                        launch_dq(q, k, v, do, lse, delta, dq, causal, scale, **_dq_spec(spec))
                        e = err(dq, q64.grad)
                    else:
                        launch_dkdv(
                            q, k, v, do, lse, delta, dk, dv, causal, scale, **parse_spec(spec)
                        )
                        e = max(err(dk, k64.grad), err(dv, v64.grad))
                    status = "ok" if e <= 1.5 * yard + 1e-3 else "WRONG"
                except Exception as ex:  # e.g. ptxas out of registers at d = 128
                    e, status = float("nan"), f"no compile ({type(ex).__name__})"
                bad += status == "WRONG"
                rows.append({"spec": spec, "dtype": str(dtype)[6:], "shape": [b, h, n_q, n_k, d],
                             "causal": causal, "rel_err": e, "triton_rel_err": yard,
                             "status": status})  # fmt: skip
                print(f"{spec:18s} {rows[-1]['dtype']:9s} {b},{h},{n_q},{n_k},{d} "
                      f"causal={causal!s:5s} err {e:.2e} (triton {yard:.2e}) {status}",
                      flush=True)  # fmt: skip
    if out:
        (out / f"gluon_{kernel}_check.json").write_text(json.dumps(rows, indent=1))
    print(f"{len(rows)} comparisons, {bad} wrong")
    return int(bad > 0)


def time_specs(
    specs: list[str],
    ablate: list[int],
    rep: int,
    out: Path | None,
    shape=LEADERBOARD,
    causal: bool = True,
    kernel: str = "dkdv",
) -> int:
    """Median ms at the leaderboard shape (or ``shape``): our Triton dK/dV (or dQ) kernel,
    before and after, and each Gluon variant, side by side in one process."""
    import triton

    from flashattn_triton import launch

    torch.manual_seed(0)
    q, k, v, do = _inputs(shape)
    scale = shape[-1] ** -0.5
    o, lse, delta = _stats(q, k, v, do, causal, scale)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=50, rep=rep, return_mode="median")

    def ours():  # the Triton kernel, even where the package would pick the Gluon one
        _triton_only(lambda: launch.backward(do, q, k, v, o, lse, causal, scale, only=kernel))

    rows = [{"variant": f"triton {kernel}", "ms": bench(ours)}]
    for spec in specs:
        for ab in [0, *ablate] if spec == specs[0] else [0]:  # ablations: first spec only
            if kernel == "dq":
                fn = lambda s=spec: launch_dq(
                    q, k, v, do, lse, delta, dq, causal, scale, **_dq_spec(s)
                )  # fmt: skip
            else:
                fn = lambda s=spec, a=ab: launch_dkdv(
                    q, k, v, do, lse, delta, dk, dv, causal, scale, **parse_spec(s), ablate=a
                )  # fmt: skip
            label = f"gluon {spec}" + (f" ablate={ab}" if ab else "")
            rows.append({"variant": label, "ms": bench(fn)})
            print(f"{label:40s} {rows[-1]['ms']:.3f} ms", flush=True)
    rows.append({"variant": f"triton {kernel} (again)", "ms": bench(ours)})
    base = (rows[0]["ms"] + rows[-1]["ms"]) / 2
    print("\n| variant | ms | ours / it |\n| --- | --- | --- |")
    for r in rows:
        r["speedup_vs_triton"] = base / r["ms"]
        print(f"| {r['variant']} | {r['ms']:.3f} | {r['speedup_vs_triton']:.2f}x |")
    if out:
        (out / f"gluon_{kernel}_time.json").write_text(json.dumps(rows, indent=1))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("offline", "check", "time"))
    ap.add_argument("--kernel", choices=("dkdv", "dq"), default="dkdv", help="which kernel")
    ap.add_argument("specs", nargs="+", help="BLOCK_M,BLOCK_N,STAGES,MAXNREG[,ws][,rt]")
    ap.add_argument(
        "--ablate", type=int, nargs="*", default=[], choices=(1, 2, 3), help="first spec only"
    )
    ap.add_argument("--rep", type=int, default=300, help="do_bench time budget, ms")
    ap.add_argument(
        "--shape", default=",".join(map(str, LEADERBOARD)), help="B,H,N,d (offline, time)"
    )
    ap.add_argument("--noncausal", action="store_true", help="time without the causal mask")
    ap.add_argument(
        "--grouped", action="store_true", help="offline: the head-grouped launch order's variant"
    )
    ap.add_argument(
        "--kv-group", type=int, default=1, help="offline: q heads per k/v head (GQA variant)"
    )
    ap.add_argument("--out", type=Path, default=None, help="folder for the JSON results")
    a = ap.parse_args(argv)
    if not HAVE_GLUON:
        ap.error("this Triton has no Gluon (triton.experimental.gluon); Triton >= 3.5 does")
    for spec in a.specs:
        try:
            _dq_spec(spec) if a.kernel == "dq" else parse_spec(spec)
        except ValueError:
            ap.error(
                f"bad spec {spec!r}: want BLOCK_M,BLOCK_N,STAGES,MAXNREG[,ws][,rt] (ws, rt: dkdv)"
            )
    if a.kernel == "dq" and a.ablate:
        ap.error("--ablate applies to the dK/dV kernel only")
    shape = tuple(int(x) for x in a.shape.split(","))
    if len(shape) != 4 or shape[-1] not in (64, 128):
        ap.error(f"--shape {a.shape!r}: want B,H,N,d with d 64 or 128")
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
    if a.mode == "offline":
        return offline(a.specs, shape, a.kernel, a.grouped, a.kv_group)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        ap.error(f"'{a.mode}' needs a Hopper GPU (sm_90); 'offline' runs anywhere")
    if a.mode == "check":
        return check(a.specs, a.out, a.kernel)
    return time_specs(a.specs, a.ablate, a.rep, a.out, shape, not a.noncausal, a.kernel)


if __name__ == "__main__":
    sys.exit(main())
