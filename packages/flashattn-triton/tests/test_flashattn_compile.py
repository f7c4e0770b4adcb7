"""sm_90 compiles of the Triton kernels on a CPU machine (``benchmarks/compile_offline.py``):
properties of the generated code that timing depends on but no CPU result can show."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "compile_offline.py"


def _compile(*sets: str) -> dict[str, str]:
    """kernel name -> its compile_offline line, for the d = 64 causal kernels with overrides."""
    env = {**os.environ, "PYTHONPATH": str(BENCH.parents[1] / "src")}
    env.pop("TRITON_INTERPRET", None)
    args = [sys.executable, str(BENCH), "--causal", "--shape", "2,1,256,64"]
    for item in sets:
        args += ["--set", item]
    out = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return {line.split()[0]: line for line in out.stdout.splitlines() if line.startswith("attn_")}


def _field(line: str, pattern: str) -> int:
    m = re.search(pattern, line)
    assert m, (pattern, line)
    return int(m[1])


@pytest.mark.timeout(600)
def test_reg_flag_feeds_products_from_registers_and_caps_hold():
    """Without ``reg`` the dK/dV and dQ kernels read their fixed tiles (K, V; Q, dO) from
    shared memory for each product; with it none of their wgmma reads A from there (the
    trick in ``kernels._in_registers`` would silently stop working if Triton folded the
    multiply by 1). ``rN`` caps the registers."""
    plain = _compile("dkdv=32,64,4,3,tma", "dq=128,64,8,4,tma")
    reg = _compile("dkdv=32,64,4,3,tma,reg,r128", "dq=128,64,8,4,tma,reg")
    a_smem = r"A from smem (\d+)"
    for kernel in ("attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel"):
        assert _field(plain[kernel], a_smem) > 0, plain[kernel]
        assert _field(reg[kernel], a_smem) == 0, reg[kernel]
    assert " r128 " in reg["attn_bwd_dkdv_kernel"]
    assert _field(reg["attn_bwd_dkdv_kernel"], r"reg\s+(\d+)") <= 128
    assert _field(plain["attn_bwd_dkdv_kernel"], r"wgmma (\d+)") > 0
