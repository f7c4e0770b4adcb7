"""Tile sweep of lm_core's q/k/v RoPE kernels alone (CUDA graphs, GPU time): elements per
program x warps, forward and backward, with the largest difference from the first variant
(float contraction differs between variants by at most a 16-bit rounding). Output:
rope_tiles.txt beside this file (one H200, 2026-11-29)."""

import torch
import triton

from lm_core import qkv_rope_triton as kernels
from lm_core.model import RotaryEmbedding


def sweep(b, t, n_q, n_kv, d):
    rope = RotaryEmbedding(d, t, 10000.0).cuda()
    qkv = torch.randn(b, t, n_q + 2 * n_kv, d, device="cuda", dtype=torch.bfloat16)
    grads = [
        torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        for h in (n_q, n_kv, n_kv)
    ]

    def fwd():
        return kernels.forward(qkv, rope.cos, rope.sin, n_q, n_kv)

    def bwd():
        return kernels.backward(*grads, rope.cos, rope.sin)

    first = None
    for elements in (512, 1024, 2048, 4096):
        for warps in (2, 4, 8):
            kernels.ELEMENTS, kernels.WARPS = elements, warps
            outs = (*fwd(), bwd())
            first = first or outs
            diff = max((a.float() - f.float()).abs().max().item() for a, f in zip(outs, first))
            f_us = triton.testing.do_bench_cudagraph(fwd, rep=50, return_mode="median") * 1e3
            b_us = triton.testing.do_bench_cudagraph(bwd, rep=50, return_mode="median") * 1e3
            print(
                f"{(b, t, n_q, n_kv, d)} elements {elements:5d} warps {warps}: fwd {f_us:6.1f} us "
                f"bwd {b_us:6.1f} us  max diff vs first {diff:.3g}",
                flush=True,
            )


for shape in [(4, 512, 25, 25, 64), (1, 4096, 32, 8, 128)]:
    sweep(*shape)
