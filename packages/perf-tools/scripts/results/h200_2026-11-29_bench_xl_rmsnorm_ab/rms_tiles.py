"""Tile sweep of lm_core's RMSNorm kernels alone (CUDA graphs, GPU time) at the xl block's
shapes (2048 rows x 1600, fp32 stream, bf16 branch and output), against inductor's kernels
for the same op (the plain ops compiled), forward + backward through autograd. Output:
rms_tiles.txt; rms_tiles_without_prefetch.txt is the same sweep (without the "kernel alone"
column) of an earlier backward that loaded each row block only when it reached it and
summed dw on every iteration."""

import torch
import triton

from lm_core import rmsnorm_triton as kernels
from lm_core.rmsnorm import rms_norm

ROWS, D = 2048, 1600
F32, BF16 = torch.float32, torch.bfloat16
x = torch.randn(ROWS, D, device="cuda")
r = torch.randn(ROWS, D, device="cuda", dtype=BF16)
w = torch.rand(D, device="cuda") + 0.5
dy = torch.randn(ROWS, D, device="cuda", dtype=BF16)
ds = torch.randn(ROWS, D, device="cuda")
fwd_bytes = ROWS * D * (4 + 2 + 4 + 2)
bwd_bytes = ROWS * D * (4 + 2 + 4 + 4 + 2)


def bench(fn):
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3


def fwd():
    return kernels.forward(x, r, w, 1e-5, BF16, F32)


s0, _, rstd = fwd()


def bwd():
    return kernels.backward(s0, w, rstd, dy, ds, BF16)


def bwd_kernel_only():
    d_s, d_s2 = torch.empty_like(s0), torch.empty_like(dy)
    rows, block_d, _ = kernels._tiles(D)
    programs = min(triton.cdiv(ROWS, rows), kernels.BWD_PROGRAMS)
    part = torch.empty(programs, D, device="cuda")
    kernels.rms_norm_bwd_kernel[(programs,)](
        s0, w, rstd, dy, ds, d_s, d_s2, part, ROWS, D, D, D, D, D, D,
        HAS_DS_IN=True, HAS_DS2=True, ROWS=rows, BLOCK_D=block_d, num_warps=kernels.WARPS,
    )  # fmt: skip
    return part


first = None
print(f"{ROWS} x {D}: forward moves {fwd_bytes / 1e6:.1f} MB, backward {bwd_bytes / 1e6:.1f} MB")
for elements in (4096, 8192, 16384):
    for warps in (4, 8, 16):
        for programs in (132, 264, 396):
            kernels.ELEMENTS, kernels.WARPS, kernels.BWD_PROGRAMS = elements, warps, programs
            try:
                outs = (*fwd()[1:], *bwd())
            except Exception as exc:  # too many registers / shared memory
                print(f"elements {elements} warps {warps}: {type(exc).__name__}", flush=True)
                continue
            first = first or outs
            diff = max((a.float() - f.float()).abs().max().item() for a, f in zip(outs, first))
            f_us, b_us, k_us = bench(fwd), bench(bwd), bench(bwd_kernel_only)
            print(
                f"elements {elements:5d} warps {warps:2d} programs {programs:4d}:"
                f" fwd {f_us:6.1f} us"
                f" ({fwd_bytes / f_us / 1e6:.2f} TB/s) bwd {b_us:6.1f} us, kernel alone"
                f" {k_us:6.1f} us ({bwd_bytes / k_us / 1e6:.2f} TB/s) max diff vs first {diff:.3g}",
                flush=True,
            )
kernels.ELEMENTS, kernels.WARPS, kernels.BWD_PROGRAMS = 4096, 8, 264


def step(backend):
    leaves = [t.detach().requires_grad_() for t in (x, r, w)]

    def run():
        s, y = rms_norm(leaves[0], leaves[2], residual=leaves[1], out_dtype=BF16, backend=backend)
        return torch.autograd.grad((s, y), leaves, (ds, dy))

    return run


for name, backend, compiled in [
    ("inductor (plain ops compiled)", "torch", True),
    ("ours, eager autograd", "triton", False),
    ("ours, compiled", "triton", True),
]:
    torch._dynamo.reset()
    fn = step(backend)
    fn = torch.compile(fn) if compiled else fn
    for _ in range(3):
        fn()
    print(f"add + norm forward + backward, {name}: {bench(fn):6.1f} us", flush=True)
