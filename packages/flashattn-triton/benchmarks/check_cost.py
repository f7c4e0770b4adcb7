"""Host time of the input checks one call pays, this tree's ``_checks`` against another
revision's, interleaved rounds in one process (CPU tensors: the checks read only metadata).

    PYTHONPATH=packages/flashattn-triton/src python3 \
        packages/flashattn-triton/benchmarks/check_cost.py --against HEAD~1

Cases: a decode step's ``check_kvcache`` (32 query heads over 8 k/v heads), ``check_qkv`` on
grouped-query heads and on plain ones, and ``check_kv_append`` where the other revision has it.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from flashattn_triton import _checks

SOURCE = "packages/flashattn-triton/src/flashattn_triton/_checks.py"


def load_revision(rev: str):
    """``_checks`` as of git revision ``rev``, imported as a sibling module of this one."""
    root = Path(__file__).resolve().parents[3]
    text = subprocess.run(
        ["git", "show", f"{rev}:{SOURCE}"], cwd=root, check=True, capture_output=True, text=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / "_checks_other.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("flashattn_triton._checks_other", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def per_call_us(fn, module, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(module)
    return (time.perf_counter() - t0) / calls * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", default="HEAD~1", help="git revision to compare with")
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=9)
    a = ap.parse_args(argv)
    other = load_revision(a.against)
    q = torch.randn(8, 32, 1, 128, dtype=torch.bfloat16)
    k = torch.randn(8, 8, 1024, 128, dtype=torch.bfloat16)
    v = k.clone()
    lens = torch.zeros(8, dtype=torch.int32)
    new = torch.randn(8, 8, 1, 128, dtype=torch.bfloat16)
    cases = {
        "check_kvcache": lambda m: m.check_kvcache(q, k, v, lens, True),
        "check_qkv, grouped-query": lambda m: m.check_qkv(q, new, new, True),
        "check_qkv, plain": lambda m: m.check_qkv(q, q, q, True),
    }
    if hasattr(other, "check_kv_append"):
        cases["check_kv_append"] = lambda m: m.check_kv_append(new, new, k, v, lens)
    print(f"us per call, medians of {a.rounds} interleaved rounds; {a.against} against this tree")
    for name, fn in cases.items():
        for m in (other, _checks):  # warm-up
            per_call_us(fn, m, a.calls // 10)
        rounds = [(per_call_us(fn, other, a.calls), per_call_us(fn, _checks, a.calls))
                  for _ in range(a.rounds)]  # fmt: skip
        was, now = (statistics.median(r[i] for r in rounds) for i in (0, 1))
        ratios = sorted(r[1] / r[0] for r in rounds)
        print(f"{name:26s} {was:6.2f} -> {now:6.2f}  ({now / was:.2f}x, rounds "
              f"{ratios[0]:.2f}-{ratios[-1]:.2f})")  # fmt: skip
    if not hasattr(other, "check_kv_append"):
        t = statistics.median(
            per_call_us(lambda m: m.check_kv_append(new, new, k, v, lens), _checks, a.calls)
            for _ in range(a.rounds)
        )
        print(f"{'check_kv_append':26s}   (new) {t:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
