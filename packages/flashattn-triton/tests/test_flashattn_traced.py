"""``traced_ops``: the launchers traced for torch.compile (``Options.traced_compile``).

On a CPU machine nothing compiled can run, but the trace can: AOTAutograd traces the ops on
fake CUDA tensors (a subprocess without TRITON_INTERPRET, whose kernels are real JIT
functions, with an H100's facts), which checks that the launchers read no address while
traced and record each kernel as a graph node; the ops also run eagerly under the
interpreter."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flashattn_triton as fa
from flashattn_triton import launch, traced_ops

SRC = Path(__file__).resolve().parents[1] / "src"

_TRACE = r"""
import contextlib, json, re, sys, warnings
import torch
from flashattn_triton import _device, gluon_dkdv, launch, launch_backward, launch_common
from flashattn_triton import fastlaunch, launch_plans
from flashattn_triton import traced_ops  # registers the ops
from flashattn_triton.options import set_options
from torch._functorch.aot_autograd import aot_function
from torch._subclasses.fake_tensor import FakeTensorMode
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

h, n, d, window, n_k, h_kv, smem_kb = (int(x) for x in sys.argv[1:8])
set_options(traced_compile={"auto": "auto", "1": True}[sys.argv[8]])
# An H100's facts (no GPU here): 132 SMs, 228 KB of shared memory per SM (227 KB per block,
# or smem_kb), sm_90, 50 MB of L2.
_device._cuda_sm_count = lambda i: 132
_device._cuda_smem_per_sm = lambda i: 228 * 1024
_device._cuda_smem_per_block = lambda i: smem_kb * 1024
_device.cuda_major = gluon_dkdv.cuda_major = lambda i: 9
_device._cuda_l2_bytes = lambda i: 50 * 2**20
launch_plans._device_guard = lambda t: contextlib.nullcontext()
graphs, tiles = [], {}
_launch_traced = fastlaunch._launch_traced

def record_tiles(kernel, grid, args, kwargs):  # each kernel's tile: rows, keys, stages
    tiles[kernel.fn.__name__] = [kwargs.get(x) for x in ("BLOCK_M", "BLOCK_N", "num_stages")]
    _launch_traced(kernel, grid, args, kwargs)

fastlaunch._launch_traced = record_tiles

# Triton's driver, stubbed with an H100's target, lets torch read which tensors each kernel
# writes from its Triton IR (on a GPU it reads the same; with no driver it assumes every
# tensor argument is written). The graph copies what it is told a kernel writes.
import triton
from triton.backends.compiler import GPUTarget
import torch._higher_order_ops.triton_kernel_wrap as wrap

class _H100Driver:
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

triton.runtime.driver.set_active(_H100Driver())
writes, copies, _read_writes = {}, [], wrap.get_mutated_tensors

def recorded(kernel_idx, *args):
    names = _read_writes(kernel_idx, *args)
    writes[wrap.kernel_side_table.get_kernel(kernel_idx).fn.__name__] = sorted(names)
    return names

wrap.get_mutated_tensors = recorded

def keep(gm, example_inputs):
    graphs.append(gm.code)
    # Inductor's pass that lets a kernel write its output buffer in place rather than a copy
    # of it (copies stay where the buffer is a view read again later)
    from torch._inductor.fx_passes.reinplace import reinplace_inplaceable_ops_core

    reinplace_inplaceable_ops_core(gm.graph)
    copies.extend(
        name for node in gm.graph.nodes if node.target is wrap.triton_kernel_wrapper_functional
        for name in node.kwargs["tensors_to_clone"]
    )
    raise SystemExit(0)  # traced: running it needs a GPU

with FakeTensorMode(), warnings.catch_warnings():
    warnings.simplefilter("error")  # e.g. a Gluon kernel "failing to compile" while traced
    q, k, v = (
        torch.empty(2, length, heads, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        for length, heads in ((n, h), (n_k, h_kv), (n_k, h_kv))
    )
    win = (window, 0) if window >= 0 else ()

    def both(q, k, v):
        o, lse = torch.ops.flashattn_triton.fwd_traced(q, k, v, True, d**-0.5, *win)
        if n == 1:  # decode: forward only
            return o, lse
        return torch.ops.flashattn_triton.bwd_traced(o, q, k, v, o, lse, True, d**-0.5, *win)

    try:
        aot_function(both, fw_compiler=keep)(q, k, v)
    except SystemExit:
        pass
code = graphs[0]
idx = sorted({int(i) for i in re.findall(r"kernel_idx = (\d+)", code)})
names = [kernel_side_table.get_kernel(i).fn.__name__ for i in idx]
print(json.dumps({
    "kernels": names,
    "tiles": tiles,
    "opaque": len(re.findall(r"flashattn_triton\.(?:fwd|bwd)_launch", code)),
    "writes": writes,
    "copies": copies,
    "tma": "'USE_TMA': True" in code,
    "maxnreg": "maxnreg" in code,
    "scatters": code.count("scatter"),
    "plans": len(launch_plans._PLANS),
    "calls": len(launch._CALLS) + len(launch_backward._CALLS),
    "choices": len(launch_backward._BWD_SCHEMES) + len(launch._DECODE_PLANS),
    "shrunk": len(launch_common._SHRUNK), "padding": len(launch_backward._PADDING_ROWS),
    "gluon_failed": len(gluon_dkdv._FAILED), "gluon_compiled": len(gluon_dkdv._COMPILED),
}))
"""


# What each kernel writes, as torch reads it from the kernel's Triton IR (the dQ kernel
# computes D and L2 itself unless the preprocess kernel ran).
_WRITES = {
    "attn_fwd_kernel": ["LSE", "Out"],
    "attn_bwd_preprocess_kernel": ["DELTA", "LSE2"],
    "attn_bwd_dq_kernel": ["DELTA", "DQ", "LSE2"],
    "attn_bwd_dkdv_kernel": ["DK", "DV"],
    "attn_fwd_decode_kernel": ["LSE_PART", "O_PART"],
    "attn_fwd_combine_kernel": ["LSE", "Out"],
}


def _trace(
    h: int, n: int, d: int, window: int, n_k: int, h_kv: int, smem_kb: int = 227, traced="auto"
) -> dict:
    """The trace script's summary (above) in a subprocess: the sizes, the GPU's shared
    memory per block (KB) and the ``traced_compile`` setting ("auto" or "1")."""
    env = {**os.environ, "PYTHONPATH": str(SRC), "CUDA_VISIBLE_DEVICES": ""}
    env.pop("TRITON_INTERPRET", None)
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # newer Tritons warn when it is unset
    out = subprocess.run(
        [sys.executable, "-c", _TRACE, *map(str, (h, n, d, window, n_k, h_kv, smem_kb, traced))],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


_SPLIT = ["attn_fwd_kernel", "attn_bwd_dq_kernel", "attn_bwd_dkdv_kernel"]  # D in the dQ kernel


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("h", "h_kv", "n", "d", "window", "n_k", "kernels"),
    [
        # d = 64: the dQ kernel computes D itself (no preprocess launch)
        (8, 8, 512, 64, -1, 512, _SPLIT),
        # d = 128 on "Hopper" with 4096 keys: Gluon kernels eagerly, Triton ones when traced
        (4, 4, 4096, 128, -1, 4096, [
            "attn_fwd_kernel", "attn_bwd_preprocess_kernel", "attn_bwd_dq_kernel",
            "attn_bwd_dkdv_kernel",
        ]),
        # a sliding window
        (2, 2, 512, 64, 64, 512, _SPLIT),
        # grouped-query heads (8 query heads, 2 key / value heads)
        (8, 2, 512, 64, -1, 512, _SPLIT),
        # a window and 700 queries: row statistics padded to 768
        (4, 4, 700, 64, 128, 700, _SPLIT),
        # one query against 4096 keys, forward only: the split-KV decode kernels
        (8, 8, 1, 64, -1, 4096, ["attn_fwd_decode_kernel", "attn_fwd_combine_kernel"]),
    ],
)  # fmt: skip
def test_traced_ops_record_each_kernel_and_touch_no_address_or_cache(
    h, h_kv, n, d, window, n_k, kernels
):
    """Traced on fake CUDA tensors, forward + backward become Triton kernel nodes (Gluon
    kernels and TMA loads, whose host descriptors the nodes cannot carry, make way for
    Triton's kernels with pointer loads; an address read would raise inside the trace), and
    no launch plan, remembered call, per-key choice, shrunk tile, padding buffer or Gluon
    compile record is kept from the fake tensors. The row statistics (L2 and D, padded or
    not) and the decode splits' partial results are whole buffers the kernels write in
    place: no write into a view of a shared buffer, which the graph would turn into copies
    scattered back (``scatters``), and after inductor's in-place pass no kernel writes a copy
    of its output buffer (``copies``)."""
    got = _trace(h, n, d, window, n_k, h_kv)
    assert sorted(got.pop("kernels")) == sorted(kernels)
    assert sorted(got.pop("tiles")) == sorted(kernels)
    # Each kernel writes its outputs and nothing the caller passed in (q, k, v, dO, O, L):
    # the graph copies no input, and orders a reader of D and L2 after their writer.
    writes = {"attn_bwd_dq_kernel": ["DQ"]} if "attn_bwd_preprocess_kernel" in kernels else {}
    assert got.pop("writes") == {name: writes.get(name, _WRITES[name]) for name in kernels}
    assert got == {
        "opaque": 0, "copies": [], "tma": False, "maxnreg": False, "scatters": 0, "plans": 0,
        "calls": 0, "choices": 0, "shrunk": 0, "padding": 0, "gluon_failed": 0,
        "gluon_compiled": 0,
    }  # fmt: skip


_KINDS = {"attn_fwd_kernel": "fwd", "attn_bwd_dq_kernel": "dq", "attn_bwd_dkdv_kernel": "dkdv"}


@pytest.mark.timeout(600)
def test_traced_tiles_fit_a_gpu_with_less_shared_memory():
    """A traced kernel is compiled by inductor, where a tile too large for the GPU cannot be
    shrunk and retried as the eager launchers do. On a GPU with 99 KB of shared memory per
    block (desktop Ada and Ampere parts): ``auto`` keeps the opaque ops (the tables were
    measured on Hopper), and ``True`` traces with every tile fitted to the GPU by the
    estimate, where Hopper's 227 KB keeps the tables' larger tiles."""
    from flashattn_triton import configs

    small = _trace(4, 4096, 128, -1, 4096, 4, smem_kb=99, traced="1")
    hopper = _trace(4, 4096, 128, -1, 4096, 4, smem_kb=227, traced="1")
    assert small["opaque"] == hopper["opaque"] == 0
    limit = 99 * 1024 - configs.SMEM_RESERVE_BYTES
    shrunk = 0
    for name, kind in _KINDS.items():
        m, n, stages = small["tiles"][name]
        cfg = configs.TileConfig(m, n, 4, stages)
        assert configs.fits(kind, cfg, 128, 2, limit), (name, cfg)
        shrunk += small["tiles"][name] != hopper["tiles"][name]
    assert shrunk, (small["tiles"], hopper["tiles"])  # the tables' tiles do not fit 99 KB
    kept = _trace(8, 512, 64, -1, 512, 8, smem_kb=99, traced="auto")
    assert kept["kernels"] == []
    assert kept["opaque"] == 2


@pytest.mark.parametrize("causal", [False, True])
def test_traced_ops_run_eagerly_like_the_launchers(causal, set_options):
    """Outside torch.compile the ops give the launchers' results (interpreter, float32;
    ``True``: ``auto`` would send CPU tensors to the opaque ops)."""
    set_options(traced_compile=True)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 16) for _ in range(3))
    do = torch.randn(1, 2, 40, 16)
    o, lse = traced_ops.fwd_traced(q, k, v, causal, 0.25)
    o_ref, lse_ref = launch.forward(q, k, v, causal, 0.25)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=0)
    torch.testing.assert_close(lse, lse_ref, rtol=0, atol=0)
    grads = traced_ops.bwd_traced(do, q, k, v, o, lse, causal, 0.25)
    for g, ref in zip(grads, launch.backward(do, q, k, v, o, lse, causal, 0.25)):
        torch.testing.assert_close(g, ref, rtol=0, atol=0)


def test_static_sizes_refuses_symbolic_sizes():
    """Dynamic shapes keep the opaque ops: a symbolic size would reach the tile tables."""
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import (
        DimDynamic,
        ShapeEnv,
        StatelessSymbolicContext,
    )

    real = torch.empty(2, 3, 4, 8)
    assert traced_ops.static_sizes(real, real.transpose(1, 2))
    mode = FakeTensorMode(shape_env=ShapeEnv())
    ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * 4)
    sym = mode.from_tensor(real, source=ConstantSource("x"), symbolic_context=ctx)
    assert not traced_ops.static_sizes(real, sym)


def test_traced_ops_hand_symbolic_sizes_and_scales_to_the_opaque_ops(monkeypatch, set_options):
    """Dynamic shapes, and floats torch.compile made symbolic on a recompile, reach the
    traced ops' bodies as symbolic numbers that the launchers' caches cannot hash: there the
    bodies call the opaque ops (seen from dynamo a symbolic int's type is int, so only the
    bodies can tell). Concrete calls record Triton kernels as before. ``True``: ``auto``
    would send these CPU tensors to the opaque ops whatever their sizes."""
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import (
        DimDynamic,
        ShapeEnv,
        StatelessSymbolicContext,
    )

    from flashattn_triton import ops

    set_options(traced_compile=True)
    opaque = []
    for name in ("fwd_launch", "bwd_launch"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _r=real, _n=name: opaque.append(_n) or _r(*a))
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * 4)
    base = torch.empty(1, 2, 64, 16)
    sym = [mode.from_tensor(base, source=ConstantSource(n), symbolic_context=ctx) for n in "qkv"]
    with mode:
        o, lse = torch.ops.flashattn_triton.fwd_traced(*sym, True, 0.25)
        grads = torch.ops.flashattn_triton.bwd_traced(o, *sym, o, lse, True, 0.25)
        assert opaque == ["fwd_launch", "bwd_launch"]
        assert o.shape == sym[0].shape
        assert [g.shape for g in grads] == [t.shape for t in sym]
        source = ConstantSource("scale")
        symbol = env.create_unspecified_symbol(0.25, source, dynamic_dim=DimDynamic.DYNAMIC)
        scale = env.create_symfloatnode(symbol, hint=0.25, source=source)
        plain = [mode.from_tensor(base) for _ in range(3)]
        torch.ops.flashattn_triton.fwd_traced(*plain, True, scale)
    assert opaque == ["fwd_launch", "bwd_launch", "fwd_launch"]
    assert traced_ops._concrete(0.25, (-1, -1), base)
    assert not traced_ops._concrete(1, (-1, -1), base)
    assert not traced_ops._concrete(0.25, (env.create_unbacked_symint(), 0), base)


@pytest.mark.timeout(300)
def test_compiled_dynamic_shapes_lower_through_the_opaque_ops(monkeypatch, set_options):
    """Compiled with dynamic shapes, the traced ops get symbolic sizes; their bodies call the
    opaque ops, which inductor lowers like any op, and the results equal the eager call's.
    Run on the CPU (the interpreter) with the traced choice forced, which a CPU call never
    makes on its own; without ``_concrete`` this raised ``unhashable type: non-nested
    SymInt``, as a recompiled graph did on a GPU."""
    from torch._inductor.utils import run_and_get_code

    from flashattn_triton import autograd

    monkeypatch.setattr(autograd, "_use_traced_ops", lambda causal, q, k, *more: True)
    set_options(traced_compile=True)  # ``auto`` would keep CPU tensors opaque by their device

    def attn(q, k, v):
        return fa.flash_attention(q, k, v, causal=True, backend="triton")

    torch._dynamo.reset()
    compiled = torch.compile(attn, dynamic=True)
    try:
        for n in (24, 40):
            torch.manual_seed(n)
            q, k, v = (torch.randn(1, 2, n, 16, requires_grad=True) for _ in range(3))
            do = torch.randn(1, 2, n, 16)
            o, codes = run_and_get_code(compiled, q, k, v)
            assert any("fwd_traced" in c and "fwd_launch" in c for c in codes)
            grads = torch.autograd.grad(o, (q, k, v), do)
            eager = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            o_eager = attn(*eager)
            grads_eager = torch.autograd.grad(o_eager, eager, do)
            torch.testing.assert_close(o, o_eager)
            for got, want in zip(grads, grads_eager):
                torch.testing.assert_close(got, want)
    finally:
        torch._dynamo.reset()


def test_traced_decode_runs_eagerly_like_the_launcher(monkeypatch, set_options):
    """A split decode call (one query, 2048 keys) through the traced op, whose partial
    results are buffers of their own, gives the launcher's results, which share one
    workspace (interpreter, float32)."""
    from flashattn_triton import launch as launch_module

    layouts = []
    views = launch_module.workspace_views

    def spy(shapes, device, layout=None):
        out = views(shapes, device, layout)
        layouts.append(len({t.untyped_storage().data_ptr() for t in out}))
        return out

    monkeypatch.setattr(launch_module, "workspace_views", spy)
    # drops remembered calls (the launcher's call below takes its full path); ``True``:
    # ``auto`` would send CPU tensors to the opaque op
    set_options(traced_compile=True)
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 2048, 16), torch.randn(1, 2, 2048, 16)
    o, lse = traced_ops.fwd_traced(q, k, v, False, 0.25)
    o_ref, lse_ref = launch.forward(q, k, v, False, 0.25)
    assert layouts == [2, 1]  # split: separate buffers traced, one workspace in the launcher
    torch.testing.assert_close(o, o_ref, rtol=0, atol=0)
    torch.testing.assert_close(lse, lse_ref, rtol=0, atol=0)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("graphs", ["for_cuda_graphs", "reduce-overhead"])
def test_auto_keeps_the_opaque_ops_in_graphs_for_cuda_graphs(monkeypatch, set_options, graphs):
    """A graph that will be replayed from a CUDA graph pays no host time per call, so
    ``auto`` keeps its calls on the opaque ops: inside ``for_cuda_graphs()`` and under
    inductor's CUDA graphs (``mode="reduce-overhead"``, whose config patch is held here
    around the whole call: on the CPU dynamo's own fake run of the traced body, before
    inductor patches, would read addresses under the interpreter; the GPU test below
    compiles with the mode itself). Run on the CPU with the traced choice forced; the
    compiled results equal the eager call's."""
    from torch._inductor.utils import run_and_get_code

    from flashattn_triton import autograd

    monkeypatch.setattr(autograd, "_use_traced_ops", lambda causal, q, k, *more: True)
    # CPU tensors count as a Hopper GPU's here: the graph hint alone keeps the opaque ops
    monkeypatch.setattr(traced_ops._device, "tables_fit", lambda t: True)
    set_options(traced_compile="auto")

    def attn(q, k, v):
        return fa.flash_attention(q, k, v, causal=True, backend="triton")

    torch._dynamo.reset()
    compiled = torch.compile(attn)
    if graphs == "for_cuda_graphs":
        block = fa.for_cuda_graphs()
    else:
        from torch._inductor import config

        block = config.patch({"triton.cudagraphs": True})
    try:
        torch.manual_seed(3)
        q, k, v = (torch.randn(1, 2, 24, 16, requires_grad=True) for _ in range(3))
        do = torch.randn(1, 2, 24, 16)
        with block:
            o, codes = run_and_get_code(compiled, q, k, v)
            grads = torch.autograd.grad(o, (q, k, v), do)
        assert any("fwd_launch" in c for c in codes)
        assert not any("attn_fwd_kernel" in c for c in codes)
        eager = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        o_eager = attn(*eager)
        torch.testing.assert_close(o, o_eager)
        for got, want in zip(grads, torch.autograd.grad(o_eager, eager, do)):
            torch.testing.assert_close(got, want)
    finally:
        torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("b", "h", "h_kv", "n", "d", "causal", "window"),
    [
        (2, 8, 8, 512, 64, True, (-1, -1)),
        (1, 4, 4, 300, 64, False, (-1, -1)),  # padded row statistics
        (1, 8, 2, 1024, 128, True, (-1, -1)),  # grouped-query heads, d = 128
        (1, 4, 4, 2048, 128, True, (-1, -1)),  # Gluon and TMA eagerly, Triton when traced
        (2, 4, 4, 700, 64, True, (128, 0)),  # a window
    ],
)
def test_compiled_traced_matches_eager(set_options, b, h, h_kv, n, d, causal, window):
    """A compiled forward + backward through the traced ops (inductor launching our Triton
    kernels) gives what SDPA's error allows against float64, like the eager call, and the
    compiled graphs call no opaque op of ours. Freed memory is filled with NaN before each
    call, so a read of a buffer no kernel wrote fails every time (the windowed case once
    gave NaN in dK and passed on other runs)."""
    from flashattn_testutil import poison_cuda_cache, reference_features
    from torch._inductor.utils import run_and_get_code

    set_options(traced_compile=True)
    torch.manual_seed(n + d)
    q = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, h_kv, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    do = torch.randn_like(q)

    def attn(q, k, v):
        return fa.flash_attention(q, k, v, causal=causal, window_size=window)

    torch._dynamo.reset()
    compiled = torch.compile(attn, fullgraph=True)
    outs = {}
    for name, fn in (("eager", attn), ("compiled", compiled)):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))

        def step(fn=fn, qq=qq, kk=kk, vv=vv):
            o = fn(qq, kk, vv)
            o.backward(do)
            return o

        if name == "compiled":
            # compiles the forward, then the backward at its first call
            codes = run_and_get_code(step)[1]
            assert len(codes) >= 2
            assert not any("_launch.default" in c for c in codes)  # no opaque op
            # no copy of a buffer: torch.compile knew which tensors each kernel writes, and
            # each kernel writes its outputs in place (the CPU trace test checks the graph)
            assert [c.count("clone") for c in codes] == [0] * len(codes)  # forward, backward
            for t in (qq, kk, vv):
                t.grad = None
        poison_cuda_cache()
        o = step()
        outs[name] = {"o": o.detach(), "dq": qq.grad, "dk": kk.grad, "dv": vv.grad}
    ref = reference_features(q, k, v, do, causal=causal, window=window)
    for name in ("o", "dq", "dk", "dv"):
        err_eager = (outs["eager"][name].double() - ref[name]).abs().max().item()
        err = (outs["compiled"][name].double() - ref[name]).abs().max().item()
        assert err <= 2 * err_eager + 1e-3, (name, err, err_eager)


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", ["none", "for_cuda_graphs", "reduce-overhead"])
def test_auto_compiles_for_cuda_graphs_through_the_opaque_ops(set_options, graphs):
    """With ``auto``, a small call compiled for a CUDA graph (``for_cuda_graphs()`` around
    the compiling call, or ``mode="reduce-overhead"``) runs the opaque op, and one compiled
    without either runs the traced kernels; each matches the eager call."""
    from torch._inductor.utils import run_and_get_code

    # (with ``cpp_launch_compiled``, the default, auto traces nothing the C++ path serves)
    set_options(traced_compile="auto", cpp_launch_compiled=False)
    torch._dynamo.reset()

    def attn(q, k, v):
        return fa.flash_attention(q, k, v, causal=True)

    mode = "reduce-overhead" if graphs == "reduce-overhead" else None
    compiled = torch.compile(attn, mode=mode)
    block = fa.for_cuda_graphs() if graphs == "for_cuda_graphs" else contextlib.nullcontext()
    torch.manual_seed(5)
    q, k, v, do = (
        torch.randn(2, 4, 256, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4)
    )
    got = {}
    try:
        for name in ("eager", "compiled"):
            qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
            with block if name == "compiled" else contextlib.nullcontext():
                if name == "compiled":
                    o, codes = run_and_get_code(compiled, qq, kk, vv)
                else:
                    o = attn(qq, kk, vv)
                o.backward(do)
            got[name] = (o.detach().clone(), qq.grad, kk.grad, vv.grad)
    finally:
        torch._dynamo.reset()
    opaque = any("fwd_launch" in c for c in codes)
    traced = any("attn_fwd_kernel" in c for c in codes)
    assert (opaque, traced) == ((False, True) if graphs == "none" else (True, False))
    for a, b in zip(got["eager"], got["compiled"]):
        err = (a.float() - b.float()).abs().max().item()
        assert err <= 0.05 * b.float().abs().max().item(), (graphs, err)


@pytest.mark.gpu
@pytest.mark.parametrize("traced", [False, "auto", True])
def test_compiled_recompiles_with_a_new_scale_length_and_window(set_options, traced):
    """One compiled function called with a second scale, other lengths, then other windows:
    torch.compile recompiles (dynamic sizes, the scale and the window bound as inputs), and
    the traced ops hand calls with symbolic numbers to the opaque ops. Every call's output
    and gradients match the eager call's (the same kernels or the traced ones: bf16 rounding
    apart)."""
    set_options(traced_compile=traced)
    torch._dynamo.reset()

    def attn(q, k, v, scale, left):
        return fa.flash_attention(q, k, v, causal=True, softmax_scale=scale, window_size=(left, 0))

    compiled = torch.compile(attn)
    calls = [(256, 0.125, -1), (256, 0.1, -1), (384, 0.1, -1), (512, 0.09, -1)]
    calls += [(512, 0.09, 128), (512, 0.09, 64), (512, 0.09, 200)]
    for n, scale, left in calls:
        torch.manual_seed(n + left)
        q, k, v, do = (
            torch.randn(2, 4, n, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4)
        )
        got = {}
        for name, fn in (("eager", attn), ("compiled", compiled)):
            qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
            o = fn(qq, kk, vv, scale, left)
            o.backward(do)
            got[name] = (o.detach(), qq.grad, kk.grad, vv.grad)
        for a, b in zip(got["eager"], got["compiled"]):
            err = (a.float() - b.float()).abs().max().item()
            assert err <= 0.05 * b.float().abs().max().item(), (n, scale, left, err)
