"""The experiment scripts under packages/perf-tools/scripts still run (CPU dry runs)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def test_fp32_gemm_dry_run_checks_every_triton_variant():
    """Tiny products in every layout through the Triton GEMM (interpreter on a CPU) against
    float64; the script exits non-zero when a variant errs or exceeds 1e-5."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "fp32_gemm.py"), "--dry-run"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = proc.stdout
    for variant in ("triton-ieee", "triton-tf32x3", "triton-tf32x3-kahan", "triton-tf32x3-kmajor"):
        for layout in ("nt", "nn", "tn"):
            assert f'"layout": "{layout}", "count": 1, "variant": "{variant}"' in out
    assert "dry run: ok" in out
