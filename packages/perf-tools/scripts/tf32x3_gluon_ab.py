"""lm_core's 3xTF32 matmul with and without the Gluon GEMM, on every product of one
small-model train step (GPU; Hopper for the Gluon kernel).

    python packages/perf-tools/scripts/tf32x3_gluon_ab.py OUT.json [--rounds 2]

"triton": `lm_core.tf32x3_gluon` off, the autotuned Triton kernel on every product; "auto":
the shipped behaviour, the first call per shape timing both kernels and keeping the faster.
Whole `tf32x3_triton.mm` calls (split included) are timed in CUDA graphs
(`triton.testing.do_bench_cudagraph`, median of 3), the two settings interleaved over
rounds; each row also has the kernel "auto" kept and its relative error against a float64
product beside cuBLAS SGEMM's. Per-step totals weigh each product by its count.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton

from lm_core import tf32x3_gluon
from lm_core import tf32x3_triton as tt
from perf_tools._cli import positive_int

T, D, F, V, LAYERS = 2048, 768, 3072, 10000, 12


def products() -> list[tuple[str, int, int, int, int]]:
    """(name, M, N, K, count per step) of the small model's linear layers at 2048 tokens."""
    rows = []
    for name, d_in, d_out, count in (
        ("qkv", D, 3 * D, LAYERS),
        ("out", D, D, LAYERS),
        ("w13", D, 2 * F, LAYERS),
        ("w2", F, D, LAYERS),
        ("head", D, V, 1),
    ):
        rows += [
            (f"{name} fwd", T, d_out, d_in, count),
            (f"{name} dx", T, d_in, d_out, count),
            (f"{name} dW", d_out, d_in, T, count),
        ]
    return rows


def _rel_err(c: torch.Tensor, ref: torch.Tensor) -> float:
    return ((c.double() - ref).norm() / ref.norm()).item()


def _time(a: torch.Tensor, b: torch.Tensor, gluon: bool) -> tuple[float, str]:
    """ms per whole call with the Gluon kernel allowed or not, and the kernel kept."""
    tf32x3_gluon.ENABLED = gluon
    tt._best.clear()  # the first call tunes (and times Gluon) again under this setting
    tt.mm(a, b)
    key = next(iter(tt._best))
    kept = "gluon" if tt._best[key] is tt.GLUON else "triton"
    times = [triton.testing.do_bench_cudagraph(lambda: tt.mm(a, b), rep=50) for _ in range(3)]
    return statistics.median(times), kept


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="JSON file for the rows and per-step totals")
    ap.add_argument("--rounds", type=positive_int, default=2)
    args = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    enabled = tf32x3_gluon.ENABLED  # restored at the end (LM_CORE_TF32X3_GLUON's choice)
    rows, totals = [], {"triton": 0.0, "auto": 0.0}
    print(f"{'product':10} {'M x N x K':>18} {'triton ms':>10} {'auto ms':>9} {'kept':>7} "
          f"{'err auto':>9} {'err SGEMM':>9}")  # fmt: skip
    for name, m, n, k, count in products():
        gen = torch.Generator(device="cuda").manual_seed(0)
        a = torch.randn(m, k, device="cuda", generator=gen)
        b = torch.randn(k, n, device="cuda", generator=gen) / k**0.5
        samples: dict[str, list[float]] = {"triton": [], "auto": []}
        kept = "triton"
        for _ in range(args.rounds):
            for setting in ("triton", "auto"):
                ms, chosen = _time(a, b, gluon=setting == "auto")
                samples[setting].append(ms)
                kept = chosen if setting == "auto" else kept
        ref = a.double() @ b.double()
        row = {
            "product": name, "M": m, "N": n, "K": k, "count": count, "kept": kept,
            "triton_ms": statistics.median(samples["triton"]),
            "auto_ms": statistics.median(samples["auto"]),
            "rel_err_auto": _rel_err(tt.mm(a, b), ref), "rel_err_sgemm": _rel_err(a @ b, ref),
        }  # fmt: skip
        for setting in totals:
            totals[setting] += row[f"{setting}_ms"] * count
        rows.append(row)
        errs = f"{row['rel_err_auto']:9.2e} {row['rel_err_sgemm']:9.2e}"
        times = f"{row['triton_ms']:10.4f} {row['auto_ms']:9.4f}"
        print(f"{name:10} {f'{m}x{n}x{k}':>18} {times} {kept:>7} {errs}", flush=True)
    tf32x3_gluon.ENABLED = enabled
    print(f"per step: triton {totals['triton']:.2f} ms, auto {totals['auto']:.2f} ms "
          f"({totals['auto'] / totals['triton']:.3f}x)")  # fmt: skip
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__}  # fmt: skip
    with open(args.out, "w") as fh:
        json.dump({"meta": meta, "rows": rows, "per_step_ms": totals}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
