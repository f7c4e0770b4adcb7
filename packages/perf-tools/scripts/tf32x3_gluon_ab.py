"""lm_core's 3xTF32 matmul with and without the Gluon GEMM's plans, on every product of
one small-model train step in the model's layouts (GPU; Hopper for the Gluon kernel).

    python packages/perf-tools/scripts/tf32x3_gluon_ab.py OUT.json [--rounds 2]

Settings: "triton", `lm_core.tf32x3_gluon` off (the autotuned Triton kernel on every
product); "split_a", the Gluon kernel with both operands from the split kernel and whole K
per tile (`RAW_A` and `SPLIT_K` off); "auto", the shipped behaviour, every plan offered. In
each, the first call per shape times what it may use and keeps the fastest. Whole
`tf32x3_triton.mm` calls (splits included) are timed in CUDA graphs
(`triton.testing.do_bench_cudagraph`, median of 3), the settings interleaved over rounds;
each row also has what "auto" kept and its relative error against a float64 product beside
cuBLAS SGEMM's. Per-step totals weigh each product by its count.
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


SETTINGS = {  # name: (Gluon on, RAW_A, SPLIT_K)
    "triton": (False, False, False),
    "split_a": (True, False, False),
    "auto": (True, True, True),
}


def products() -> list[tuple[str, int, int, int, int]]:
    """(name, M, N, K, count per step) of the small model's linear layers at 2048 tokens; the
    weight gradients ("dW") read A transposed (dy^T), as `lm_core.matmul` computes them."""
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


def _operands(m: int, n: int, k: int, weight_grad: bool, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn((k, m) if weight_grad else (m, k), device="cuda", generator=gen)
    b = torch.randn(k, n, device="cuda", generator=gen) / k**0.5
    return (a.t() if weight_grad else a), b


def _kept(choice) -> str:
    if not isinstance(choice, tf32x3_gluon.Plan):
        return "triton"
    return ("raw_a" if choice.a_raw else "split_a") + (f"/k{choice.split_k}" * (choice.split_k > 1))


def _time(a: torch.Tensor, b: torch.Tensor, setting: str) -> tuple[float, str]:
    """ms per whole call under `setting`, and what the first call kept."""
    tf32x3_gluon.ENABLED, tf32x3_gluon.RAW_A, tf32x3_gluon.SPLIT_K = SETTINGS[setting]
    tt._best.clear()  # the first call chooses again under this setting
    tt.mm(a, b)
    kept = _kept(next(iter(tt._best.values())))
    times = [triton.testing.do_bench_cudagraph(lambda: tt.mm(a, b), rep=50) for _ in range(3)]
    return statistics.median(times), kept


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="JSON file for the rows and per-step totals")
    ap.add_argument("--rounds", type=positive_int, default=2)
    args = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    saved = (tf32x3_gluon.ENABLED, tf32x3_gluon.RAW_A, tf32x3_gluon.SPLIT_K)  # restored at the end
    rows, totals = [], dict.fromkeys(SETTINGS, 0.0)
    head = " ".join(f"{name + ' ms':>11}" for name in SETTINGS)
    print(f"{'product':10} {'M x N x K':>18} {head} {'kept':>12} {'err auto':>9} {'err SGEMM':>9}")
    for name, m, n, k, count in products():
        a, b = _operands(m, n, k, weight_grad=name.endswith("dW"))
        samples: dict[str, list[float]] = {setting: [] for setting in SETTINGS}
        kept = ""
        for _ in range(args.rounds):
            for setting in SETTINGS:
                ms, chosen = _time(a, b, setting)
                samples[setting].append(ms)
                kept = chosen if setting == "auto" else kept
        ref = a.double() @ b.double()
        row = {"product": name, "M": m, "N": n, "K": k, "count": count, "kept": kept}
        row.update({f"{setting}_ms": statistics.median(samples[setting]) for setting in SETTINGS})
        row["rel_err_auto"] = _rel_err(tt.mm(a, b), ref)
        row["rel_err_sgemm"] = _rel_err(a @ b, ref)
        for setting in totals:
            totals[setting] += row[f"{setting}_ms"] * count
        rows.append(row)
        times = " ".join(f"{row[f'{setting}_ms']:11.4f}" for setting in SETTINGS)
        errs = f"{row['rel_err_auto']:9.2e} {row['rel_err_sgemm']:9.2e}"
        print(f"{name:10} {f'{m}x{n}x{k}':>18} {times} {kept:>12} {errs}", flush=True)
    tf32x3_gluon.ENABLED, tf32x3_gluon.RAW_A, tf32x3_gluon.SPLIT_K = saved
    tt._best.clear()
    print("per step ms: " + ", ".join(f"{s} {t:.2f}" for s, t in totals.items()))
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "rounds": args.rounds}  # fmt: skip
    with open(args.out, "w") as fh:
        json.dump({"meta": meta, "rows": rows, "per_step_ms": totals}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
