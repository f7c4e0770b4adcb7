"""Compile the kernels for a GPU target without a GPU; print registers, spills, shared memory.

Runs the real launchers on meta tensors, captures each kernel launch (arguments, constexprs,
num_warps, num_stages) and hands it to ``triton.compile`` for the chosen target (default
sm_90, H100). Catches compile errors before spending GPU time and shows register pressure.

    python benchmarks/compile_offline.py --shape 16,1,16384,64 --dtype bf16 --causal
    python benchmarks/compile_offline.py --bwd fused --sweep   # every default/override variant
    python benchmarks/compile_offline.py --causal --schedule   # + each kernel's wgmma schedule
    python benchmarks/compile_offline.py --shape 2,32,4096,128 --kv-heads 8 --window 512,-1 \
        --causal                                               # grouped-query heads, a window
    python benchmarks/compile_offline.py --shape 1,16,16384,128 --varlen 8 --causal
    python benchmarks/compile_offline.py --shape 8,32,1,128 --nk 65536 --causal   # decode
    python benchmarks/compile_offline.py --causal --sass        # + a hash of each kernel's SASS

``--sass`` hashes the SASS with parameter offsets blanked out: two source trees whose hashes
match compile to the same machine code for that call (e.g. a change that must leave the plain
kernels as they were, checked against ``git archive`` of the previous commit).

``--schedule`` prints the order, in the PTX, of the tensor-core work and what waits for it:
``M4`` four wgmma instructions (one tl.dot), ``C`` a commit of the group, ``[W0]`` a wait
until at most 0 groups are in flight (``[W1]``: 1), ``e32`` 32 exp2 instructions, ``b`` a
wait on a TMA/async-copy barrier, ``|`` a CTA-wide ``bar.sync`` (``|3``: three in a row).
A ``[W0]`` right after each dot means the dot is not
overlapped with the exponentials that follow (inside one warpgroup; other CTAs on the SM can
still fill the gap).
"""

from __future__ import annotations

import argparse
import inspect
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TRITON_TY = {
    torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
}  # fmt: skip


class _MetaDescriptor:
    """Stands in for a TMA tensor descriptor of a meta tensor: only its type matters here."""

    def __init__(self, t: torch.Tensor, block_shape: list[int]):
        self.dtype, self.block_shape = t.dtype, block_shape

    @property
    def signature(self) -> str:
        return f"tensordesc<{TRITON_TY[self.dtype]}{self.block_shape}>"


def _signature(fn, kwargs: dict):
    sig, consts, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        val = kwargs[name]
        if isinstance(val, _MetaDescriptor):
            sig[name] = val.signature
        elif val is None:  # an unused descriptor: the JIT specializes None as a constant
            sig[name] = "constexpr"
            consts[name] = None
        elif i in fn.constexprs or (fn.params[i].is_constexpr):
            sig[name] = "constexpr"
            consts[name] = val
        elif isinstance(val, torch.Tensor):
            sig[name] = "*" + TRITON_TY[val.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(val, bool):
            sig[name] = "i1"
        elif isinstance(val, int):
            if val == 1:  # the JIT turns ints equal to 1 into constants
                sig[name] = "constexpr"
                consts[name] = 1
            else:
                sig[name] = "i32" if abs(val) < 2**31 else "i64"
                if val % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(val, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{name}: {type(val)}")
    return sig, consts, attrs


def wgmma_schedule(ptx: str) -> str:
    """The PTX's sequence of wgmma / commit / wait / exp2 / barrier-wait instructions, runs
    of the same instruction compressed (see the module docstring)."""
    seq = []
    for line in ptx.splitlines():
        op = line.strip()
        if op.startswith("wgmma.mma_async"):
            seq.append("M")
        elif op.startswith("wgmma.commit_group"):
            seq.append("C")
        elif op.startswith("wgmma.wait_group"):
            n = re.search(r"wait_group\.sync\.aligned\s+(\d+)", op)
            seq.append(f"[W{n[1] if n else '?'}]")
        elif op.startswith("ex2.approx"):
            seq.append("e")
        elif op.startswith(("mbarrier.try_wait", "cp.async.wait_group")):
            seq.append("b")
        elif op.startswith(("bar.sync", "barrier.sync")):
            seq.append("|")
    text = "".join(seq)
    return re.sub(r"([Me|])\1+", lambda m: f"{m[1]}{len(m[0])}", text)


def wgmma_a_from_smem(ptx: str) -> int:
    """How many wgmma instructions read their A operand from shared memory (a descriptor)
    rather than from registers (a {...} register list after the accumulators)."""
    count = 0
    for ins in re.findall(r"wgmma\.mma_async[^;]*;", ptx, re.S):
        operands = ins.split("}", 1)[1].lstrip(" \t\n,")
        count += not operands.startswith("{")
    return count


def sass_hash(cubin: bytes) -> str:
    """12 hex digits of the SASS instructions, constant-bank offsets (parameters) blanked."""
    import hashlib

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True).stdout
    ins = [m[1] for m in re.finditer(r"/\*[0-9a-f]+\*/\s*(.*?);", out)]
    text = "\n".join(re.sub(r"c\[0x0\]\[0x[0-9a-f]+\]", "c[P]", i) for i in ins)
    return f"{hashlib.sha1(text.encode()).hexdigest()[:12]} ({len(ins)} instructions)"


def use_hopper_driver() -> None:
    """Make Triton's active driver a stand-in for an sm_90 GPU: just enough for
    ``JITFunction.warmup`` to compile Gluon kernels on a machine without one."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class _Hopper:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    driver.set_active(_Hopper())


def _resource_usage(cubin: bytes) -> str:
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run(
            [str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True
        ).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    return f"reg {m[1]:>3} stack {m[2]:>3} smem {int(m[3]) // 1024:>3}K local {m[4]}" if m else out


class _Capture:
    def __init__(self, fn, log):
        self.fn, self.log = fn, log

    def __getitem__(self, grid):
        def launch(*args, num_warps=4, num_stages=3, maxnreg=None, **kwargs):
            bound = dict(zip(self.fn.arg_names, args))
            bound.update(kwargs)
            for name, param in inspect.signature(self.fn.fn).parameters.items():
                if name not in bound and param.default is not inspect.Parameter.empty:
                    bound[name] = param.default  # as Triton's launcher binds defaults
            self.log.append((self.fn, grid, bound, num_warps, num_stages, maxnreg))

        return launch


def capture_launches(
    shape, n_k, dtype, causal, scheme, tma=True, kv_heads=None, window=(-1, -1), varlen=0,
    kvcache=False, append=0,
):  # fmt: skip
    """Run the launchers on meta tensors; return the kernel launches they would make.

    With ``tma`` the launchers see a Hopper GPU's TMA support, so configs marked ``tma``
    compile with descriptors as they run there; without it, every load uses pointers.
    ``kv_heads``, ``window``: grouped-query heads and a sliding window; ``varlen``: that
    many packed sequences of at most N tokens (B*N tokens in all), through
    ``launch_varlen``; ``kvcache``: a forward over a cache of n_k rows with a key count per
    sequence, through ``launch_kvcache``, storing ``append`` new rows first where nonzero."""
    from flashattn_triton import (
        kernels,
        launch,
        launch_backward,
        launch_common,
        launch_kvcache,
        launch_varlen,
    )

    log: list = []

    class K:
        LOG2E = kernels.LOG2E

    for name in dir(kernels):
        if name.startswith(("attn_", "kv_")):
            setattr(K, name, _Capture(getattr(kernels, name), log))

    def packed_rows(lse2, delta):  # meta tensors have no addresses to compare
        n = lse2.shape[-1]
        if lse2.stride(-2) != 2 * n:
            return None
        return lse2.as_strided((lse2.numel() // n, 2, n), (2 * n, n, 1))

    stubs = {
        "_kernels": lambda: K,
        "require_runnable": lambda t: None,
        "interpreting": lambda: False,
        "tma_usable": lambda t: tma,
        "_descriptor": lambda t, rows, block_d: _MetaDescriptor(t, [1, 1, rows, block_d]),
        "_rows_descriptor": lambda rows, block: _MetaDescriptor(rows, [1, 2, block]),
        "_packed_rows": packed_rows,
    }
    # Each launcher module binds the helpers it calls: replace them wherever they are bound.
    for module in (launch, launch_backward, launch_common, launch_varlen, launch_kvcache):
        for name, stub in stubs.items():
            if hasattr(module, name):
                setattr(module, name, stub)
    from flashattn_triton.options import set_options

    set_options(backward=scheme)
    b, h, n, d = shape
    h_kv = kv_heads or h
    if varlen:
        q = torch.empty((1, h, b * n, d), dtype=dtype, device="meta")
        k = torch.empty((1, h_kv, b * n_k, d), dtype=dtype, device="meta")
        cu = torch.empty((varlen + 1,), dtype=torch.int32, device="meta")
        args = (cu, cu, n, n_k, causal, d**-0.5, *window)
        o, lse = launch_varlen.forward_varlen(q, k, k, *args)
        launch_varlen.backward_varlen(o, q, k, k, o, lse, *args)
        return log
    q = torch.empty((b, h, n, d), dtype=dtype, device="meta")
    k = torch.empty((b, h_kv, n_k, d), dtype=dtype, device="meta")
    if kvcache:
        seqlens = torch.empty((b,), dtype=torch.int32, device="meta")
        new = [torch.empty((b, h_kv, append, d), dtype=dtype, device="meta")] * 2 if append else ()
        launch_kvcache.forward_kvcache(q, k, k, seqlens, causal, d**-0.5, *window, *new)
        return log
    o, lse = launch.forward(q, k, k, causal, d**-0.5, *window)
    if o.shape[2] > 16:  # a decode-sized forward runs no backward here
        launch.backward(o, q, k, k, o, lse, causal, d**-0.5, *window)
    return log


def compile_launch(fn, bound, num_warps, num_stages, cc, maxnreg=None, float64=False):
    """Compile one captured launch; ``float64``: Python float arguments typed float64, as
    torch.compile types them in the kernels it launches (``traced_ops``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, consts, attrs = _signature(fn, bound)
    if float64:
        sig = {
            k: "fp64" if isinstance(bound[k], float) and v == "fp32" else v for k, v in sig.items()
        }
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    t0 = time.time()
    opts = {"num_warps": num_warps, "num_stages": num_stages}
    if maxnreg:
        opts["maxnreg"] = maxnreg
    c = triton.compile(src, target=GPUTarget("cuda", cc, 32), options=opts)
    ptx = c.asm["ptx"]
    return {
        "secs": time.time() - t0,
        "usage": _resource_usage(c.asm["cubin"]),
        "wgmma": ptx.count("wgmma.mma_async"),
        "wgmma_a_smem": wgmma_a_from_smem(ptx),
        "mma": ptx.count("mma.sync"),
        "ex2": ptx.count("ex2.approx"),
        "sts": ptx.count("st.shared"),
        "shfl": ptx.count("shfl.sync"),
        "shared": c.metadata.shared,
        "schedule": wgmma_schedule(ptx),
        "sass": sass_hash(c.asm["cubin"]),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="16,1,16384,64", help="B,H,N,d")
    ap.add_argument("--nk", type=int, default=None)
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--bwd", default="split", choices=("split", "fused", "atomic"))
    ap.add_argument("--cc", type=int, default=90)
    ap.add_argument("--schedule", action="store_true", help="print each kernel's wgmma schedule")
    ap.add_argument("--sass", action="store_true", help="print a hash of each kernel's SASS")
    ap.add_argument(
        "--pointers", action="store_true", help="compile pointer loads where a config asks for TMA"
    )
    ap.add_argument(
        "--set", action="append", default=[], help="e.g. dkdv=32,64,4,3,tma,reg (TileConfig.parse)"
    )
    ap.add_argument("--kv-heads", type=int, help="k/v heads (grouped-query attention)")
    ap.add_argument("--window", default="-1,-1", help="window_size left,right (-1: unbounded)")
    ap.add_argument("--varlen", type=int, default=0, help="B packed sequences of up to N tokens")
    ap.add_argument("--kvcache", action="store_true", help="a forward over a KV cache of --nk rows")
    ap.add_argument("--append", type=int, default=0, help="with --kvcache: new rows stored first")
    ap.add_argument(
        "--float64-scales",
        action="store_true",
        help="type float arguments float64, as torch.compile does for the kernels it launches",
    )
    a = ap.parse_args(argv)
    from flashattn_triton import configs

    for item in a.set:
        kind, vals = item.split("=")
        configs.OVERRIDES[kind] = configs.TileConfig.parse(vals)
    shape = tuple(int(x) for x in a.shape.split(","))
    window = tuple(int(x) for x in a.window.split(","))
    log = capture_launches(
        shape, a.nk or shape[2], DTYPES[a.dtype], a.causal, a.bwd, tma=not a.pointers,
        kv_heads=a.kv_heads, window=window, varlen=a.varlen, kvcache=a.kvcache,
        append=a.append,
    )  # fmt: skip
    features = ("USE_TMA", "REG_A", "GQA", "WINDOW", "VARLEN", "SPLIT", "KV_LENS")
    for fn, _grid, bound, w, s, maxnreg in log:
        meta = {k: v for k, v in bound.items() if k.startswith(("BLOCK", "EVEN"))}
        meta |= {k: v for k, v in bound.items() if k in features and v}
        try:
            r = compile_launch(fn, bound, w, s, a.cc, maxnreg, a.float64_scales)
            cap = f" r{maxnreg}" if maxnreg else ""
            print(
                f"{fn.__name__:28s} w{w} s{s}{cap} {meta} | {r['usage']} | wgmma {r['wgmma']} "
                f"(A from smem {r['wgmma_a_smem']}) mma {r['mma']} ex2 {r['ex2']} "
                f"st.shared {r['sts']} shfl {r['shfl']} dyn-smem {r['shared'] // 1024}K | "
                f"{r['secs']:.1f}s",
                flush=True,
            )
            if a.schedule:
                print(f"    schedule: {r['schedule']}", flush=True)
            if a.sass:
                print(f"    sass: {r['sass']}", flush=True)
        except Exception as e:
            print(f"{fn.__name__}: COMPILE FAILED {type(e).__name__}: {str(e)[:2000]}")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
