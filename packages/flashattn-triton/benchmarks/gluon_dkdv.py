"""Experiment: dK/dV on Hopper in Gluon, with explicit asynchronous wgmma and waits.

Why. Triton 3.6's ``tl.dot`` waits for every product before the next instruction that reads
it (NOTES.md, "What Triton 3.6 emits"), so within a warpgroup the exponentials never run
while the tensor cores work. This kernel, in Gluon (``triton.experimental.gluon``, Triton
>= 3.5), issues the products itself and waits only for the one it needs next:

    issue S^T = K Q^T and dP^T = V dO^T          (two groups in flight)
    wait for S^T only; P^T = exp2(S^T - lse)     (dP^T still running)
    issue dV += P^T dO; wait for dP^T only       (dV still running)
    dS^T = P^T (dP^T - delta); issue dK += dS^T Q
    next tile: issue its S^T, dP^T behind dV, dK; wait for S^T ...

Q and dO tiles stream through a ring of shared-memory stages filled by TMA (by the math warps,
or with ``ws`` by one extra loader warp: warp specialization); K and V stay in shared memory.
One program owns BLOCK_N keys of one (batch, head), one warpgroup per 64 keys. The inputs are
seen as 2-D (rows, d) arrays, so q, k, v, dO must be contiguous (B, H, N, d); a tile running
past its head's last row reads the next head's rows, which are masked out of P.

Result (NOTES.md, "Run 16"): at its best tiles it ties our Triton dK/dV kernel, and leaving
out the exponentials and dS entirely (``--ablate``) saves only ~10%: the kernel is bound by
its products, not by their overlap with the exponentials. The package does not use it.

Spec of a variant: ``BLOCK_M,BLOCK_N,STAGES,MAXNREG[,ws]`` (MAXNREG 0: Triton's default).

    python benchmarks/gluon_dkdv.py offline 32,64,4,128 64,128,3,168,ws  # any machine
    python benchmarks/gluon_dkdv.py check 32,64,4,128 --out $OUT         # Hopper GPU
    python benchmarks/gluon_dkdv.py time 32,64,4,128 --ablate 1 2 3 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

try:  # Gluon ships with Triton >= 3.5
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_init,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    HAVE_GLUON = True
except ImportError:
    HAVE_GLUON = False

LOG2E = 1.4426950408889634
GL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
LEADERBOARD = (16, 1, 16384, 64)  # B, H, N, d: q, k, v (16, 16384, 64) bf16, causal


if HAVE_GLUON:

    @gluon.jit
    def _query_tile(
        i, lo, q_desc, do_desc, q_smem, do_smem, ready, row_q0,
        STAGES: gl.constexpr, BLOCK_M: gl.constexpr, pred,
    ):  # fmt: skip
        """Start the TMA loads of the i-th query tile (Q and dO) into its ring stage."""
        stage = i % STAGES
        bar = ready.index(stage)
        mbarrier.expect(bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes, pred=pred)
        row = row_q0 + lo + i * BLOCK_M
        tma.async_copy_global_to_shared(q_desc, [row, 0], bar, q_smem.index(stage), pred=pred)
        tma.async_copy_global_to_shared(do_desc, [row, 0], bar, do_smem.index(stage), pred=pred)

    @gluon.jit
    def _row_stats(lse_base, delta_base, offs_m, n_q):
        """log2-domain log-sum-exp (+inf for rows that saw no key: P = 0) and delta of the
        query rows offs_m; rows past n_q read as +inf / 0."""
        in_rows = offs_m < n_q
        lse = gl.load(lse_base + offs_m, mask=in_rows, other=float("inf"))
        delta = gl.load(delta_base + offs_m, mask=in_rows, other=0.0)
        lse2 = gl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
        return lse2, delta

    @gluon.jit
    def _produce(
        q_desc, do_desc, k_desc, v_desc, k_smem, v_smem, q_smem, do_smem, ready, empty,
        kv_ready, row_q0, row_k0, start_n, lo, n_tiles,
        STAGES: gl.constexpr, BLOCK_M: gl.constexpr,
    ):  # fmt: skip
        """Loader warp (warp-specialized variant): K, V once, then every query tile's Q, dO
        as soon as the consumers release its stage."""
        mbarrier.expect(kv_ready, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [row_k0 + start_n, 0], kv_ready, k_smem)
        tma.async_copy_global_to_shared(v_desc, [row_k0 + start_n, 0], kv_ready, v_smem)
        for i in range(n_tiles):
            # A fresh mbarrier counts as having completed the phase before phase 0.
            mbarrier.wait(empty.index(i % STAGES), ((i // STAGES) & 1) ^ 1)
            _query_tile(
                i, lo, q_desc, do_desc, q_smem, do_smem, ready, row_q0, STAGES, BLOCK_M, True
            )

    @gluon.jit
    def _consume(
        q_desc, do_desc, k_smem, v_smem, q_smem, do_smem, ready, empty, kv_ready,
        LSE, DELTA, DK, DV, pid_bh, row_q0, row_k0, start_n, lo, n_tiles, n_q, n_k,
        qk_scale, sm_scale,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
        STAGES: gl.constexpr, CAUSAL: gl.constexpr, WARP_SPEC: gl.constexpr,
        ABLATE: gl.constexpr, num_warps: gl.constexpr,
    ):  # fmt: skip
        """The math: accumulate dK, dV over the query tiles, then store them."""
        dtype: gl.constexpr = q_desc.dtype
        # S^T tiles (BLOCK_N keys x BLOCK_M queries) and the dK, dV accumulators
        # (BLOCK_N x HEAD_DIM): one warpgroup per 64 key rows.
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_M, 16]
        )
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 16]
        )
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

        causal_off = n_k - n_q
        offs_n = start_n + gl.arange(0, BLOCK_N, layout=row_layout)
        offs_tm = gl.arange(0, BLOCK_M, layout=col_layout)
        zero_s = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=s_layout)
        dk = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=acc_layout))
        dv = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=acc_layout))
        lse_base = LSE + pid_bh.to(gl.int64) * n_q
        delta_base = DELTA + pid_bh.to(gl.int64) * n_q
        # A tile needs a mask if a query in it cannot see a key of ours (the diagonal) or if
        # it runs past n_q.
        mask_below = start_n + BLOCK_N - 1 - causal_off
        mbarrier.wait(kv_ready, 0)

        for i in range(n_tiles):
            stage = i % STAGES
            start_m = lo + i * BLOCK_M
            offs_m = start_m + offs_tm
            lse2, delta = _row_stats(lse_base, delta_base, offs_m, n_q)
            mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
            q_s = q_smem.index(stage)
            do_s = do_smem.index(stage)
            s_tok = warpgroup_mma(k_smem, q_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            dp_tok = warpgroup_mma(
                v_smem, do_s.permute((1, 0)), zero_s, use_acc=False, is_async=True
            )
            # Waiting for S^T also retires the previous tile's dV, dK: its stage is free.
            s_t = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))
            if WARP_SPEC:
                mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), pred=i > 0)
            else:
                nxt = i + STAGES - 1
                _query_tile(
                    nxt, lo, q_desc, do_desc, q_smem, do_smem, ready, row_q0, STAGES, BLOCK_M,
                    nxt < n_tiles,
                )  # fmt: skip
            if ABLATE % 2 == 1:  # timing experiment: no exponentials
                p_t = s_t * qk_scale - lse2[None, :]
            else:
                p_t = gl.exp2(s_t * qk_scale - lse2[None, :])
            needs_mask = start_m + BLOCK_M > n_q
            if CAUSAL:
                needs_mask = needs_mask | (start_m < mask_below)
            if needs_mask:
                keep = (offs_m < n_q)[None, :]
                if CAUSAL:
                    keep = keep & (offs_n[:, None] <= offs_m[None, :] + causal_off)
                p_t = gl.where(keep, p_t, 0.0)
            dv = warpgroup_mma(gl.convert_layout(p_t.to(dtype), a_layout), do_s, dv, is_async=True)
            dp_t = warpgroup_mma_wait(num_outstanding=1, deps=(dp_tok,))
            if ABLATE >= 2:  # timing experiment: no element-wise dS
                ds_t = dp_t
            else:
                ds_t = p_t * (dp_t - delta[None, :])
            dk = warpgroup_mma(gl.convert_layout(ds_t.to(dtype), a_layout), q_s, dk, is_async=True)

        dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
        out_rows = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_layout))
        out_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
        offs = (row_k0 + out_rows).to(gl.int64)[:, None] * HEAD_DIM + out_cols[None, :]
        store_mask = (out_rows < n_k)[:, None]
        gl.store(DK + offs, (dk * sm_scale).to(dtype), mask=store_mask)
        gl.store(DV + offs, dv.to(dtype), mask=store_mask)

    @gluon.jit
    def dkdv_kernel(
        q_desc, k_desc, v_desc, do_desc, LSE, DELTA, DK, DV, n_q, n_k, qk_scale, sm_scale,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
        STAGES: gl.constexpr, CAUSAL: gl.constexpr, WARP_SPEC: gl.constexpr,
        ABLATE: gl.constexpr, num_warps: gl.constexpr,
    ):  # fmt: skip
        """One program: dK, dV (rows of DK, DV: (B*H*n_k, HEAD_DIM)) of one key tile.

        LSE holds natural-log row log-sum-exps and DELTA rowsum(dO * O), both (B*H, n_q).
        WARP_SPEC: one extra warp issues the TMA loads (the math warps never wait for each
        other); otherwise the math warps issue them STAGES - 1 tiles ahead."""
        pid_bh = gl.program_id(0)
        start_n = gl.program_id(1) * BLOCK_N
        dtype: gl.constexpr = q_desc.dtype
        row_q0 = pid_bh * n_q
        row_k0 = pid_bh * n_k

        k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], v_desc.layout)
        q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], do_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=1)
        mbarrier.init(kv_ready, count=1)

        # Query tiles [lo, n_q): with a causal mask the rows before the tile's first key
        # (shifted by n_k - n_q, the bottom-right alignment) see none of it.
        if CAUSAL:
            lo = gl.maximum(start_n - (n_k - n_q), 0) // BLOCK_M * BLOCK_M
        else:
            lo = 0
        n_tiles = gl.cdiv(n_q - lo, BLOCK_M)
        if WARP_SPEC:
            gl.warp_specialize(
                [
                    (
                        _consume,
                        (
                            q_desc, do_desc, k_smem, v_smem, q_smem, do_smem, ready, empty,
                            kv_ready, LSE, DELTA, DK, DV, pid_bh, row_q0, row_k0, start_n, lo,
                            n_tiles, n_q, n_k, qk_scale, sm_scale, BLOCK_M, BLOCK_N, HEAD_DIM,
                            STAGES, CAUSAL, WARP_SPEC, ABLATE, num_warps,
                        ),
                    ),
                    (
                        _produce,
                        (
                            q_desc, do_desc, k_desc, v_desc, k_smem, v_smem, q_smem, do_smem,
                            ready, empty, kv_ready, row_q0, row_k0, start_n, lo, n_tiles,
                            STAGES, BLOCK_M,
                        ),
                    ),
                ],
                [1],
                [24],
            )  # fmt: skip
        else:
            mbarrier.expect(kv_ready, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [row_k0 + start_n, 0], kv_ready, k_smem)
            tma.async_copy_global_to_shared(v_desc, [row_k0 + start_n, 0], kv_ready, v_smem)
            for i in gl.static_range(STAGES - 1):
                _query_tile(
                    i, lo, q_desc, do_desc, q_smem, do_smem, ready, row_q0, STAGES, BLOCK_M,
                    i < n_tiles,
                )  # fmt: skip
            _consume(
                q_desc, do_desc, k_smem, v_smem, q_smem, do_smem, ready, empty, kv_ready,
                LSE, DELTA, DK, DV, pid_bh, row_q0, row_k0, start_n, lo, n_tiles, n_q, n_k,
                qk_scale, sm_scale, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, WARP_SPEC,
                ABLATE, num_warps,
            )  # fmt: skip
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(s))
            mbarrier.invalidate(empty.index(s))
        mbarrier.invalidate(kv_ready)


def _desc(t: torch.Tensor, block_rows: int) -> TensorDescriptor:
    d = t.shape[-1]
    flat = t.view(-1, d)
    layout = gl.NVMMASharedLayout.get_default_for([block_rows, d], getattr(gl, GL_DTYPES[t.dtype]))
    return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [block_rows, d], layout)


def parse_spec(spec: str) -> dict:
    """``BLOCK_M,BLOCK_N,STAGES,MAXNREG[,ws]`` -> launch options."""
    parts = spec.split(",")
    ws = parts[-1] == "ws"
    bm, bn, stages, maxnreg = (int(x) for x in parts[:4])
    return {"block_m": bm, "block_n": bn, "stages": stages, "maxnreg": maxnreg or None, "ws": ws}


def dkdv(q, k, v, do, lse, delta, dk, dv, causal: bool, scale: float, *, block_m: int,
         block_n: int, stages: int, maxnreg: int | None, ws: bool, ablate: int = 0):  # fmt: skip
    """Write dK, dV of contiguous (B, H, N, d) 16-bit q, k, v, do into dk, dv; lse, delta:
    (B, H, n_q) float32. ``ablate`` (timing only, wrong results): 1 drops the exponentials,
    2 the element-wise dS, 3 both."""
    b, h, n_q, d = q.shape
    n_k = k.shape[2]
    kernel = dkdv_kernel[(b * h, -(-n_k // block_n))]
    return kernel(
        _desc(q, block_m), _desc(k, block_n), _desc(v, block_n), _desc(do, block_m),
        lse, delta, dk, dv, n_q, n_k, scale * LOG2E, scale,
        BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=d, STAGES=stages, CAUSAL=causal,
        WARP_SPEC=ws, ABLATE=ablate, num_warps=block_n // 16,
        **({"maxnreg": maxnreg} if maxnreg else {}),
    )  # fmt: skip


def _inputs(shape, n_k=None, dtype=torch.bfloat16, device="cuda"):
    b, h, n_q, d = shape
    n_k = n_q if n_k is None else n_k
    q, do = (torch.randn(b, h, n_q, d, device=device, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(b, h, n_k, d, device=device, dtype=dtype) for _ in range(2))
    return q, k, v, do


def _stats(q, k, v, do, causal, scale):
    from flashattn_triton import launch

    o, lse = launch.forward(q, k, v, causal, scale)
    delta = (do.float() * o.float()).sum(-1).contiguous()
    return o, lse, delta


def offline(specs: list[str], shape=LEADERBOARD) -> int:
    """Compile each variant for sm_90 with no GPU (a stand-in driver); print registers, the
    setmaxnreg split of a warp-specialized kernel, shared memory and the wgmma schedule."""
    import re

    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    sys.path.insert(0, str(Path(__file__).parent))
    from compile_offline import _resource_usage, wgmma_schedule

    class _Hopper:  # just enough driver for JITFunction.warmup
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    driver.set_active(_Hopper())
    b, h, n, d = shape
    q = torch.empty(b, h, n, d, dtype=torch.bfloat16, device="meta")
    lse = torch.empty(b, h, n, dtype=torch.float32, device="meta")
    for spec in specs:
        o = parse_spec(spec)
        c = dkdv_kernel.warmup(
            _desc(q, o["block_m"]), _desc(q, o["block_n"]), _desc(q, o["block_n"]),
            _desc(q, o["block_m"]), lse, lse, q, q, n, n, 0.18, 0.125,
            BLOCK_M=o["block_m"], BLOCK_N=o["block_n"], HEAD_DIM=d, STAGES=o["stages"],
            CAUSAL=True, WARP_SPEC=o["ws"], ABLATE=0, num_warps=o["block_n"] // 16, grid=(1,),
            **({"maxnreg": o["maxnreg"]} if o["maxnreg"] else {}),
        )  # fmt: skip
        ptx = c.asm["ptx"]
        split = sorted(set(re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)))
        print(f"{spec:18s} {_resource_usage(c.asm['cubin'])} setmaxnreg {split or '-'} "
              f"smem {c.metadata.shared // 1024}K")  # fmt: skip
        print(f"    schedule: {wgmma_schedule(ptx)}")
    return 0


def check(specs: list[str], out: Path | None) -> int:
    """dK, dV against float64 on awkward shapes, with our Triton kernels' error as the
    yardstick; returns 1 if any variant is off."""
    from flashattn_triton import launch
    from flashattn_triton.reference import attention_reference

    shapes = [  # B, H, n_q, n_k, d, causal
        (2, 3, 1024, 1024, 64, True), (2, 3, 1024, 1024, 64, False), (1, 2, 1000, 1000, 64, True),
        (2, 2, 777, 777, 64, False), (1, 2, 384, 640, 64, True), (1, 2, 640, 384, 64, True),
        (1, 2, 384, 640, 64, False), (2, 2, 512, 512, 128, True), (1, 3, 999, 999, 128, True),
        (1, 1, 70, 70, 64, False),
    ]  # fmt: skip
    rows, bad = [], 0
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        for b, h, n_q, n_k, d, causal in shapes:
            q, k, v, do = _inputs((b, h, n_q, d), n_k, dtype)
            scale = d**-0.5
            o, lse, delta = _stats(q, k, v, do, causal, scale)
            q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
            attention_reference(q64, k64, v64, causal, scale)[0].backward(do.double())
            _, dk_t, dv_t = launch.backward(do, q, k, v, o, lse, causal, scale)

            def err(x, ref):
                return ((x.double() - ref).norm() / ref.norm()).item()

            yard = max(err(dk_t, k64.grad), err(dv_t, v64.grad))
            for spec in specs:
                dk, dv = torch.empty_like(k), torch.empty_like(v)
                try:
                    dkdv(q, k, v, do, lse, delta, dk, dv, causal, scale, **parse_spec(spec))
                    e = max(err(dk, k64.grad), err(dv, v64.grad))
                    status = "ok" if e <= 1.5 * yard + 1e-3 else "WRONG"
                except Exception as ex:  # e.g. ptxas out of registers at d = 128
                    e, status = float("nan"), f"no compile ({type(ex).__name__})"
                bad += status == "WRONG"
                rows.append({"spec": spec, "dtype": str(dtype)[6:], "shape": [b, h, n_q, n_k, d],
                             "causal": causal, "rel_err": e, "triton_rel_err": yard,
                             "status": status})  # fmt: skip
                print(f"{spec:18s} {rows[-1]['dtype']:9s} {b},{h},{n_q},{n_k},{d} "
                      f"causal={causal!s:5s} err {e:.2e} (triton {yard:.2e}) {status}",
                      flush=True)  # fmt: skip
    if out:
        (out / "gluon_dkdv_check.json").write_text(json.dumps(rows, indent=1))
    print(f"{len(rows)} comparisons, {bad} wrong")
    return int(bad > 0)


def time_specs(
    specs: list[str], ablate: list[int], rep: int, out: Path | None, shape=LEADERBOARD
) -> int:
    """Median ms at the leaderboard shape: our Triton dK/dV kernel (before and after) and each
    Gluon variant, side by side in one process."""
    import triton

    from flashattn_triton import launch

    torch.manual_seed(0)
    q, k, v, do = _inputs(shape)
    scale = shape[-1] ** -0.5
    o, lse, delta = _stats(q, k, v, do, True, scale)
    dk, dv = torch.empty_like(k), torch.empty_like(v)

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=50, rep=rep, return_mode="median")

    def ours():
        launch.backward(do, q, k, v, o, lse, True, scale, only="dkdv")

    rows = [{"variant": "triton dkdv (package default)", "ms": bench(ours)}]
    for spec in specs:
        for ab in [0, *ablate] if spec == specs[0] else [0]:  # ablations: first spec only
            fn = lambda s=spec, a=ab: dkdv(
                q, k, v, do, lse, delta, dk, dv, True, scale, **parse_spec(s), ablate=a
            )  # fmt: skip
            label = f"gluon {spec}" + (f" ablate={ab}" if ab else "")
            rows.append({"variant": label, "ms": bench(fn)})
            print(f"{label:40s} {rows[-1]['ms']:.3f} ms", flush=True)
    rows.append({"variant": "triton dkdv (again)", "ms": bench(ours)})
    base = (rows[0]["ms"] + rows[-1]["ms"]) / 2
    print("\n| variant | ms | ours / it |\n| --- | --- | --- |")
    for r in rows:
        r["speedup_vs_triton"] = base / r["ms"]
        print(f"| {r['variant']} | {r['ms']:.3f} | {r['speedup_vs_triton']:.2f}x |")
    if out:
        (out / "gluon_dkdv_time.json").write_text(json.dumps(rows, indent=1))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("offline", "check", "time"))
    ap.add_argument("specs", nargs="+", help="BLOCK_M,BLOCK_N,STAGES,MAXNREG[,ws]")
    ap.add_argument(
        "--ablate", type=int, nargs="*", default=[], choices=(1, 2, 3), help="first spec only"
    )
    ap.add_argument("--rep", type=int, default=300, help="do_bench time budget, ms")
    ap.add_argument(
        "--shape", default=",".join(map(str, LEADERBOARD)), help="B,H,N,d (offline, time)"
    )
    ap.add_argument("--out", type=Path, default=None, help="folder for the JSON results")
    a = ap.parse_args(argv)
    if not HAVE_GLUON:
        ap.error("this Triton has no Gluon (triton.experimental.gluon); Triton >= 3.5 does")
    for spec in a.specs:
        try:
            parse_spec(spec)
        except ValueError:
            ap.error(f"bad spec {spec!r}: want BLOCK_M,BLOCK_N,STAGES,MAXNREG[,ws]")
    shape = tuple(int(x) for x in a.shape.split(","))
    if len(shape) != 4 or shape[-1] not in (64, 128):
        ap.error(f"--shape {a.shape!r}: want B,H,N,d with d 64 or 128")
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
    if a.mode == "offline":
        return offline(a.specs, shape)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        ap.error(f"'{a.mode}' needs a Hopper GPU (sm_90); 'offline' runs anywhere")
    if a.mode == "check":
        return check(a.specs, a.out)
    return time_specs(a.specs, a.ablate, a.rep, a.out, shape)


if __name__ == "__main__":
    sys.exit(main())
