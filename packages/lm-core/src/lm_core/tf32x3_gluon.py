"""The 3xTF32 GEMM of `lm_core.tf32x3_triton` for Hopper GPUs, written in Gluon.

Same split buffers, same sums: per K tile three TF32 products
(lo x hi, hi x lo, hi x hi) into a fresh accumulator, whose sum is added to the float32 total
in registers. What differs is the schedule, which Triton's `tl.dot` does not give:

- the three products run as asynchronous wgmma groups while the previous tile's sum is added
  (`warpgroup_mma_wait(num_outstanding=3)` keeps one tile in flight);
- one extra warp streams the tiles through a ring of three shared-memory stages by TMA (warp
  specialization), so the math warps never issue a load.

Each product shape runs under a `Plan`, two choices on top of that schedule:

- A in registers (`a_raw`): A is read as float32 by TMA, K-major or M-major (a weight
  gradient's dy^T), and split into hi and lo by the math warps, which feed wgmma A from
  registers; only B goes through the split kernel. The matrix unit reads 32-bit operands from
  shared memory only K-major, and B must come from shared memory, so B cannot do the same.
- split K (`split_k`): where the output tiles leave SMs idle, 2 or 4 programs per tile each
  sum a slice of K into a workspace, which one `torch.sum` adds up (in a fixed order: the
  result does not depend on timing).

`tf32x3_triton.mm` times the autotuned Triton kernel and every plan `plans` offers on the
first call per shape and keeps the fastest (lm-core DESIGN.md has the measurements). Gluon
(`triton.experimental.gluon`, Triton >= 3.5) is measured with Triton 3.6 and compiles with
3.9; without it, or on a GPU other than Hopper, `usable()` is False and the Triton kernel
runs. `LM_CORE_TF32X3_GLUON=0` (read once, at import) turns it off for experiments;
`RAW_A` and `SPLIT_K` withhold those plans.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch

BM, BN, BK = 128, 128, 32  # K of the split buffers is a multiple of 32, rows of 256
STAGES = 3  # 3 x 64 KB of shared memory: hi and lo tiles of both operands per stage
GROUP_M = 8  # output tiles in L2-friendly groups of 8 rows of tiles
NUM_WARPS = 8  # two math warpgroups of 64 rows each; the loader warp comes on top
ENABLED = os.environ.get("LM_CORE_TF32X3_GLUON", "1") != "0"
RAW_A = True  # offer plans that read A as float32 and split it in registers
SPLIT_K = True  # offer plans that cut K into slices where the output tiles leave SMs idle

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
    def _round_tf32(x):
        """x rounded to the nearest TF32 number, as `tf32x3_triton._round_tf32` does."""
        bits = x.to(gl.uint32, bitcast=True)
        bits = (bits + 0x1000) & 0xFFFFE000
        return bits.to(gl.float32, bitcast=True)

    @gluon.jit
    def _issue(
        i, a_smem, b_smem, ready, zero, a_layout: gl.constexpr, STAGES: gl.constexpr,
        A_RAW: gl.constexpr, A_KMAJOR: gl.constexpr,
    ):  # fmt: skip
        """Wait for K tile i, then issue its three products (small terms first) into a fresh
        accumulator: three wgmma groups in flight. A raw tile is split here, in registers."""
        stage = i % STAGES
        mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
        b_hi = b_smem.index(2 * stage).permute((1, 0))
        b_lo = b_smem.index(2 * stage + 1).permute((1, 0))
        if A_RAW:
            if A_KMAJOR:
                a = a_smem.index(stage).load(a_layout)
            else:
                a = a_smem.index(stage).permute((1, 0)).load(a_layout)
            a_hi = _round_tf32(a)
            a_lo = _round_tf32(a - a_hi)
        else:
            a_hi = a_smem.index(2 * stage)
            a_lo = a_smem.index(2 * stage + 1)
        part = warpgroup_mma(a_lo, b_hi, zero, use_acc=False, is_async=True)
        part = warpgroup_mma(a_hi, b_lo, part, is_async=True)
        return warpgroup_mma(a_hi, b_hi, part, is_async=True)

    @gluon.jit
    def _produce(
        a_desc, b_desc, a_smem, b_smem, ready, empty, m0, n0, rows_a, rows_b, k_first,
        n_k_tiles, STAGES: gl.constexpr, BK: gl.constexpr, A_RAW: gl.constexpr,
        A_KMAJOR: gl.constexpr,
    ):  # fmt: skip
        """Loader warp: each K tile's tiles (hi and lo of B; of A too, or A raw) once its
        stage is free."""
        # one raw A tile, or its hi and lo tiles; hi and lo of B
        nbytes: gl.constexpr = (2 - A_RAW) * a_desc.block_type.nbytes + 2 * b_desc.block_type.nbytes
        for i in range(n_k_tiles):
            stage = i % STAGES
            # a fresh mbarrier counts as having completed the phase before phase 0
            mbarrier.wait(empty.index(stage), ((i // STAGES) & 1) ^ 1)
            bar = ready.index(stage)
            mbarrier.expect(bar, nbytes)
            k = (k_first + i) * BK
            if A_RAW:
                if A_KMAJOR:
                    _tma_load(a_desc, [m0, k], bar, a_smem.index(stage))
                else:
                    _tma_load(a_desc, [k, m0], bar, a_smem.index(stage))
            else:
                _tma_load(a_desc, [m0, k], bar, a_smem.index(2 * stage))
                _tma_load(a_desc, [rows_a + m0, k], bar, a_smem.index(2 * stage + 1))
            _tma_load(b_desc, [n0, k], bar, b_smem.index(2 * stage))
            _tma_load(b_desc, [rows_b + n0, k], bar, b_smem.index(2 * stage + 1))

    @gluon.jit
    def _consume(
        a_smem, b_smem, ready, empty, C, M, N, m0, n0, n_k_tiles, stride_c,
        BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, A_RAW: gl.constexpr,
        A_KMAJOR: gl.constexpr, num_warps: gl.constexpr,
    ):  # fmt: skip
        """Math warps: the products, the per-tile sums, the masked store of C's tile."""
        layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BN, 8]
        )
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=layout, k_width=1)
        zero = gl.zeros([BM, BN], gl.float32, layout=layout)
        acc = gl.zeros([BM, BN], gl.float32, layout=layout)
        prev = _issue(0, a_smem, b_smem, ready, zero, a_layout, STAGES, A_RAW, A_KMAJOR)
        for i in range(1, n_k_tiles):
            part = _issue(i, a_smem, b_smem, ready, zero, a_layout, STAGES, A_RAW, A_KMAJOR)
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
        a_desc, b_desc, C, M, N, rows_a, rows_b, n_k_tiles, k_tiles_per_split, stride_c,
        stride_split,
        BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
        GROUP_M: gl.constexpr, A_RAW: gl.constexpr, A_KMAJOR: gl.constexpr,
        num_warps: gl.constexpr,
    ):  # fmt: skip
        """One (BM, BN) tile of C (M, N) = A @ B^T over one slice of K.

        b_desc: a 2-D TMA descriptor over B's split buffer seen as (2 rows_b, K'), hi rows
        then lo rows, zero-padded to whole tiles. a_desc: the same over A's split buffer, or
        with A_RAW over A itself (float32, (M, K) if A_KMAJOR else its transpose (K, M);
        TMA fills zeros past its edges). Program (t, s) sums K tiles s * k_tiles_per_split
        onwards (n_k_tiles = K' / BK in all) into C + s * stride_split."""
        pid = gl.program_id(0)
        n_m = gl.cdiv(M, BM)
        per_group = GROUP_M * gl.cdiv(N, BN)
        first_m = (pid // per_group) * GROUP_M
        size_m = gl.minimum(n_m - first_m, GROUP_M)
        m0 = (first_m + (pid % per_group) % size_m) * BM
        n0 = ((pid % per_group) // size_m) * BN
        k_first = gl.program_id(1) * k_tiles_per_split
        k_count = gl.minimum(k_tiles_per_split, n_k_tiles - k_first)
        C += gl.program_id(1).to(gl.int64) * stride_split

        if A_RAW:
            if A_KMAJOR:
                a_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BM, BK], a_desc.layout)
            else:
                a_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BK, BM], a_desc.layout)
        else:
            a_smem = gl.allocate_shared_memory(gl.float32, [2 * STAGES, BM, BK], a_desc.layout)
        b_smem = gl.allocate_shared_memory(gl.float32, [2 * STAGES, BN, BK], b_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=1)
        gl.warp_specialize(
            [
                (_consume, (a_smem, b_smem, ready, empty, C, M, N, m0, n0, k_count,
                            stride_c, BM, BN, STAGES, A_RAW, A_KMAJOR, num_warps)),
                (_produce, (a_desc, b_desc, a_smem, b_smem, ready, empty, m0, n0, rows_a,
                            rows_b, k_first, k_count, STAGES, BK, A_RAW, A_KMAJOR)),
            ],
            [1],
            [24],
        )  # fmt: skip
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(s))
            mbarrier.invalidate(empty.index(s))

    @functools.cache
    def _smem_layout(block: tuple[int, int]):
        return gl.NVMMASharedLayout.get_default_for(list(block), gl.float32)


@dataclasses.dataclass(frozen=True)
class Plan:
    """How `mm_kernel` computes one product shape."""

    a_raw: bool = False  # A read as float32 by TMA and split in registers (no A split buffer)
    a_kmajor: bool = True  # with a_raw: A (M, K) has unit K stride, else unit M stride
    split_k: int = 1  # programs per output tile, each over a slice of K; their sum is C


def a_major(a: torch.Tensor) -> str | None:
    """'k' or 'm' where TMA can read a (M, K) float32 as it is (unit stride along K or M, the
    other stride and the base address 16-byte aligned), else None."""
    if a.data_ptr() % 16:
        return None
    if a.stride(1) == 1 and a.stride(0) % 4 == 0:
        return "k"
    if a.stride(0) == 1 and a.stride(1) % 4 == 0:
        return "m"
    return None


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def plans(m: int, n: int, k_pad: int, major: str | None, sms: int) -> list[Plan]:
    """The plans worth timing for a product (M, N, K' = k_pad) whose A has `major` layout, on
    a GPU of `sms` multiprocessors.

    A in registers needs A readable by TMA as it is (`a_major`). Split K into s slices is
    offered where it fills the GPU's waves of programs better by a tenth of a wave (fewer tiles
    than SMs, or a last wave mostly idle: 144 tiles on 132 SMs) and each slice keeps >= 8 K
    tiles."""
    kinds = [Plan()]
    if RAW_A and major is not None:
        kinds.append(Plan(a_raw=True, a_kmajor=major == "k"))
    splits = [1]
    if SPLIT_K:
        t = tiles(m, n)
        splits += [
            s
            for s in (2, 4)
            if k_pad // BK >= 8 * s and _wave_use(t * s, sms) >= _wave_use(t, sms) + 0.1
        ]
    return [dataclasses.replace(p, split_k=s) for p in kinds for s in splits]


def _wave_use(programs: int, sms: int) -> float:
    """The busy fraction of the waves of one-program-per-SM that `programs` take."""
    return programs / (-(-programs // sms) * sms)


def k_slices(k_pad: int, split_k: int) -> tuple[int, int]:
    """(K tiles per slice, slices) when K' = k_pad is cut into at most split_k slices."""
    k_tiles = k_pad // BK
    per = -(-k_tiles // split_k)
    return per, -(-k_tiles // per)


def _desc(t: torch.Tensor, block: tuple[int, int]) -> TensorDescriptor:
    return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block), _smem_layout(block))


def launch_args(
    plan: Plan, a: torch.Tensor, a_split: torch.Tensor | None, b_split: torch.Tensor,
    out: torch.Tensor, per_slice: int,
) -> tuple:  # fmt: skip
    """mm_kernel's arguments (constexprs excluded) for A @ B^T into out, (M, N) or (slices, M,
    N): B's split buffer (2, N', K'); A's (2, M', K'), or A itself when plan.a_raw."""
    k_pad = b_split.shape[2]
    b_desc = _desc(b_split.view(-1, k_pad), (BN, BK))
    if plan.a_raw:
        rows_a = 0
        a2, block = (a, (BM, BK)) if plan.a_kmajor else (a.t(), (BK, BM))
    else:
        rows_a = a_split.shape[1]
        a2, block = a_split.view(-1, k_pad), (BM, BK)
    a_desc = _desc(a2, block)
    m, n = out.shape[-2:]
    stride_split = m * n if out.dim() == 3 else 0
    return (a_desc, b_desc, out, m, n, rows_a, b_split.shape[1], k_pad // BK, per_slice, n,
            stride_split)  # fmt: skip


@functools.cache  # per call on the launch path: built once per plan
def constants(plan: Plan) -> dict:
    """mm_kernel's constexprs for `plan`, in signature order."""
    return {"BM": BM, "BN": BN, "BK": BK, "STAGES": STAGES, "GROUP_M": GROUP_M,
            "A_RAW": plan.a_raw, "A_KMAJOR": plan.a_kmajor, "num_warps": NUM_WARPS}  # fmt: skip
