"""The 3xTF32 GEMM of `lm_core.tf32x3_triton` for Hopper GPUs, written in Gluon.

Same split buffers, same sums: per K tile three TF32 products
(lo x hi, hi x lo, hi x hi) into a fresh accumulator, whose sum is added to the float32 total
in registers. What differs is the schedule, which Triton's `tl.dot` does not give:

- the three products run as asynchronous wgmma groups while the previous tile's sum is added
  (`warpgroup_mma_wait(num_outstanding=3)` keeps one tile in flight);
- one extra warp streams the hi and lo tiles of both operands through a ring of three
  shared-memory stages by TMA (warp specialization), so the math warps never issue a load.

On an H200 that is 2-8% faster than the Triton kernel on 14 of a small-model step's 15
products, all but one whose 128 x 128 tiles fill under a third of the GPU (lm-core DESIGN.md);
`tf32x3_triton.mm` times both on the first call per shape and keeps the faster. Gluon
(`triton.experimental.gluon`, Triton >= 3.5) is measured with Triton 3.6 and compiles with
3.9; without it, or on a GPU other than Hopper, `usable()` is False and the Triton kernel
runs. `LM_CORE_TF32X3_GLUON=0` (read once, at import) turns it off for experiments.
"""

from __future__ import annotations

import functools
import os

import torch

BM, BN, BK = 128, 128, 32  # K of the split buffers is a multiple of 32, rows of 256
STAGES = 3  # 3 x 64 KB of shared memory: hi and lo tiles of both operands per stage
GROUP_M = 8  # output tiles in L2-friendly groups of 8 rows of tiles
NUM_WARPS = 8  # two math warpgroups of 64 rows each; the loader warp comes on top
ENABLED = os.environ.get("LM_CORE_TF32X3_GLUON", "1") != "0"

try:  # Gluon ships with Triton >= 3.5
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    HAVE_GLUON = True
    # Triton 3.6 names the TMA load async_copy_global_to_shared; later ones async_load.
    _tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
except ImportError:  # older Triton, or none
    HAVE_GLUON = False


@functools.cache
def _is_hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] == 9


def usable(device: torch.device) -> bool:
    """Whether this GEMM can run on `device`: a Hopper GPU, Gluon importable, not turned off."""
    return ENABLED and HAVE_GLUON and device.type == "cuda" and _is_hopper(device.index or 0)


def tiles(m: int, n: int) -> int:
    """Output tiles (programs) of an (m, n) product."""
    return -(-m // BM) * -(-n // BN)


if HAVE_GLUON:

    @gluon.jit
    def _issue(i, a_smem, b_smem, ready, zero, STAGES: gl.constexpr):
        """Wait for K tile i, then issue its three products (small terms first) into a fresh
        accumulator: three wgmma groups in flight."""
        stage = i % STAGES
        mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
        a_hi = a_smem.index(2 * stage)
        a_lo = a_smem.index(2 * stage + 1)
        b_hi = b_smem.index(2 * stage).permute((1, 0))
        b_lo = b_smem.index(2 * stage + 1).permute((1, 0))
        part = warpgroup_mma(a_lo, b_hi, zero, use_acc=False, is_async=True)
        part = warpgroup_mma(a_hi, b_lo, part, is_async=True)
        return warpgroup_mma(a_hi, b_hi, part, is_async=True)

    @gluon.jit
    def _produce(
        a_desc, b_desc, a_smem, b_smem, ready, empty, m0, n0, rows_a, rows_b, n_k_tiles,
        STAGES: gl.constexpr, BK: gl.constexpr,
    ):  # fmt: skip
        """Loader warp: each K tile's four tiles (hi, lo of A and B) once its stage is free."""
        nbytes: gl.constexpr = 2 * a_desc.block_type.nbytes + 2 * b_desc.block_type.nbytes
        for i in range(n_k_tiles):
            stage = i % STAGES
            # a fresh mbarrier counts as having completed the phase before phase 0
            mbarrier.wait(empty.index(stage), ((i // STAGES) & 1) ^ 1)
            bar = ready.index(stage)
            mbarrier.expect(bar, nbytes)
            k = i * BK
            _tma_load(a_desc, [m0, k], bar, a_smem.index(2 * stage))
            _tma_load(a_desc, [rows_a + m0, k], bar, a_smem.index(2 * stage + 1))
            _tma_load(b_desc, [n0, k], bar, b_smem.index(2 * stage))
            _tma_load(b_desc, [rows_b + n0, k], bar, b_smem.index(2 * stage + 1))

    @gluon.jit
    def _consume(
        a_smem, b_smem, ready, empty, C, M, N, m0, n0, n_k_tiles, stride_c,
        BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr,
    ):  # fmt: skip
        """Math warps: the products, the per-tile sums, the masked store of C's tile."""
        layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BN, 8]
        )
        zero = gl.zeros([BM, BN], gl.float32, layout=layout)
        acc = gl.zeros([BM, BN], gl.float32, layout=layout)
        prev = _issue(0, a_smem, b_smem, ready, zero, STAGES)
        for i in range(1, n_k_tiles):
            part = _issue(i, a_smem, b_smem, ready, zero, STAGES)
            # this tile's three groups may stay in flight; the previous tile's sum is final
            done = warpgroup_mma_wait(num_outstanding=3, deps=(prev,))
            acc = acc + done
            mbarrier.arrive(empty.index((i - 1) % STAGES))
            prev = part
        acc = acc + warpgroup_mma_wait(num_outstanding=0, deps=(prev,))
        offs_m = m0 + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
        offs_n = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
        ptrs = C + offs_m.to(gl.int64)[:, None] * stride_c + offs_n[None, :]
        gl.store(ptrs, acc, mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])

    @gluon.jit
    def mm_kernel(
        a_desc, b_desc, C, M, N, rows_a, rows_b, n_k_tiles, stride_c,
        BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
        GROUP_M: gl.constexpr, num_warps: gl.constexpr,
    ):  # fmt: skip
        """One (BM, BN) tile of C (M, N) = A @ B^T. a_desc / b_desc: 2-D TMA descriptors over
        the split buffers seen as (2 rows_a, K') and (2 rows_b, K'), hi rows then lo rows,
        zero-padded to whole tiles; n_k_tiles = K' / BK."""
        pid = gl.program_id(0)
        n_m = gl.cdiv(M, BM)
        per_group = GROUP_M * gl.cdiv(N, BN)
        first_m = (pid // per_group) * GROUP_M
        size_m = gl.minimum(n_m - first_m, GROUP_M)
        m0 = (first_m + (pid % per_group) % size_m) * BM
        n0 = ((pid % per_group) // size_m) * BN

        a_smem = gl.allocate_shared_memory(gl.float32, [2 * STAGES, BM, BK], a_desc.layout)
        b_smem = gl.allocate_shared_memory(gl.float32, [2 * STAGES, BN, BK], b_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=1)
        gl.warp_specialize(
            [
                (_consume, (a_smem, b_smem, ready, empty, C, M, N, m0, n0, n_k_tiles,
                            stride_c, BM, BN, STAGES, num_warps)),
                (_produce, (a_desc, b_desc, a_smem, b_smem, ready, empty, m0, n0, rows_a,
                            rows_b, n_k_tiles, STAGES, BK)),
            ],
            [1],
            [24],
        )  # fmt: skip
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(s))
            mbarrier.invalidate(empty.index(s))

    @functools.cache
    def _smem_layout(rows: int):
        return gl.NVMMASharedLayout.get_default_for([rows, BK], gl.float32)


def launch_args(a_split: torch.Tensor, b_split: torch.Tensor, c: torch.Tensor) -> tuple:
    """mm_kernel's arguments for C = A @ B^T over split buffers (2, M', K'), (2, N', K')."""
    k_pad = a_split.shape[2]
    a2, b2 = a_split.view(-1, k_pad), b_split.view(-1, k_pad)
    a_desc = TensorDescriptor(a2, list(a2.shape), list(a2.stride()), [BM, BK], _smem_layout(BM))
    b_desc = TensorDescriptor(b2, list(b2.shape), list(b2.stride()), [BN, BK], _smem_layout(BN))
    m, n = c.shape
    rows_a, rows_b = a_split.shape[1], b_split.shape[1]
    return (a_desc, b_desc, c, m, n, rows_a, rows_b, k_pad // BK, c.stride(0))


CONSTANTS = {"BM": BM, "BN": BN, "BK": BK, "STAGES": STAGES, "GROUP_M": GROUP_M}
