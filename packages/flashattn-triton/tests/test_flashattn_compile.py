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
    return {
        line.split()[0]: line
        for line in out.stdout.splitlines()
        if line.startswith(("attn_", "kv_"))
    }


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


def _compile_features(*argv: str) -> dict[str, str]:
    """kernel name -> its compile_offline line for a call with features (argv: the flags)."""
    env = {**os.environ, "PYTHONPATH": str(BENCH.parents[1] / "src")}
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run(
        [sys.executable, str(BENCH), *argv], capture_output=True, text=True, env=env, timeout=600
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return {
        line.split()[0]: line
        for line in out.stdout.splitlines()
        if line.startswith(("attn_", "kv_"))
    }


@pytest.mark.timeout(600)
def test_feature_kernels_compile_for_hopper():
    """The interpreter never compiles: the GQA / WINDOW / VARLEN variants and the decode
    kernels must also compile for sm_90 (TMA descriptors addressed by k/v head and by a
    packed sequence's first row, the dK/dV loop over a group's query heads, early exits)."""
    dense = _compile_features(
        "--causal", "--shape", "2,8,512,128", "--kv-heads", "2", "--window", "100,-1"
    )
    for kernel in ("attn_fwd_kernel", "attn_bwd_dq_kernel", "attn_bwd_dkdv_kernel"):
        assert "'GQA': True" in dense[kernel], dense[kernel]
        assert "'WINDOW': True" in dense[kernel], dense[kernel]
    packed = _compile_features(
        "--causal", "--shape", "4,4,256,64", "--kv-heads", "2", "--varlen", "4"
    )
    for kernel in ("attn_fwd_kernel", "attn_bwd_dq_kernel", "attn_bwd_dkdv_kernel"):
        assert "'VARLEN': True" in packed[kernel], packed[kernel]
        assert "'USE_TMA': True" in packed[kernel], packed[kernel]
    decode = _compile_features("--causal", "--shape", "8,32,1,128", "--nk", "65536")
    assert "'SPLIT': True" in decode["attn_fwd_decode_kernel"]
    assert "attn_fwd_combine_kernel" in decode
    # A KV cache with a key count per sequence (flash_attention_kvcache): decode and forward.
    cache = ("--causal", "--nk", "8192", "--kvcache", "--kv-heads", "8", "--window", "1024,-1")
    step = _compile_features("--shape", "8,32,4,128", *cache)
    assert "'KV_LENS': True" in step["attn_fwd_decode_kernel"], step
    assert "'SPLIT': True" in step["attn_fwd_decode_kernel"]
    # ... and a chunk of 300 new rows stored by the call first (k=, v=)
    chunk = _compile_features("--shape", "2,32,300,128", *cache, "--append", "300")
    assert "'KV_LENS': True" in chunk["attn_fwd_kernel"], chunk
    assert " local 0" in chunk["attn_fwd_kernel"], chunk  # no register spills
    assert " local 0" in chunk["kv_append_kernel"], chunk


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "argv",
    [
        ("--shape", "2,1,256,64"),
        ("--shape", "1,4,2048,128", "--bwd", "fused"),
        ("--shape", "2,4,512,64", "--window", "64,0", "--kv-heads", "2"),
        ("--shape", "2,8,1,64", "--nk", "4096"),  # the split-KV decode kernels
    ],
)
def test_kernels_compile_with_float64_scales(argv):
    """torch.compile types the Python float arguments of the kernels it launches (the traced
    ops) as float64; the kernels must still compile for sm_90 with pointer loads (before the
    scales were cast to float32 inside, the forward's and the decode kernel's dots failed on
    a float64 accumulator; the backward kernels' casts keep their math in float32)."""
    env = {**os.environ, "PYTHONPATH": str(BENCH.parents[1] / "src")}
    env.pop("TRITON_INTERPRET", None)
    args = [sys.executable, str(BENCH), "--causal", "--pointers", "--float64-scales", *argv]
    out = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    names = {line.split()[0] for line in out.stdout.splitlines() if line.startswith("attn_")}
    assert names & {"attn_fwd_kernel", "attn_fwd_decode_kernel"}, out.stdout
