"""Host time per call of each piece of our launchers, at a model's layout, beside SDPA's ops.

A compiled model calls ``flashattn_triton::fwd_launch`` / ``bwd_launch`` once per layer; when
the step is host-bound (small models under ``torch.compile``) every microsecond of those calls
is step time. This times back-to-back calls (wall time per call, GPU kept behind the host) of:

- the whole ops through the dispatcher, and ``launch.forward`` / ``launch.backward`` directly;
- their pieces: output allocation, the plan key, the plan replay alone (outputs given);
- SDPA's cuDNN and flash forward ops through the dispatcher, for scale;
- the packed-sequence launchers (``launch_varlen``) on the same tokens split into documents;
- each launcher again with remembered calls switched off (``call_key`` returning None: the
  plan-key path every call took before calls were remembered);
- the forward and backward cycling over ``--layers`` sets of buffers at their own addresses,
  as a model's layers call them (a replay fills each TMA descriptor once per base address
  and keeps up to 64 per descriptor: more layers than that refill them on every call);

with q, k, v the model's views ((B, T, H, d) buffers seen as (B, H, T, d), as lm_core makes
them). Prints a table and writes JSON.

    python packages/flashattn-triton/benchmarks/launch_cost.py --shape 4,12,1024,64
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_cost import per_call_us  # a sibling script, not a package


def model_views(b: int, h: int, n: int, d: int, dtype: torch.dtype):
    """q, k, v as lm_core's attention makes them: transposed views of (B, T, *, d) buffers."""
    qkv = torch.randn(b, n, 3 * h, d, device="cuda", dtype=dtype)
    qk = torch.randn(b, n, 2 * h, d, device="cuda", dtype=dtype)  # the rotated q and k
    q = qk[:, :, :h].transpose(1, 2)
    k = qk[:, :, h:].transpose(1, 2)
    v = qkv[:, :, 2 * h :].transpose(1, 2)
    return q, k, v


def packed_views(q, k, v, docs: int, seed: int = 0):
    """The B*N tokens of (B, H, N, d) views as lm_core packs them ((B*N, H, d) copies), and
    int32 offsets of ``docs`` documents of random lengths over them (the longest: max_len)."""
    b, _, n, d = q.shape
    packed = [x.transpose(1, 2).reshape(b * n, x.shape[1], d) for x in (q, k, v)]
    views = [x.transpose(0, 1).unsqueeze(0) for x in packed]  # (1, H, B*N, d)
    g = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(b * n - 1, generator=g)[: docs - 1].add(1).sort().values.tolist()
    bounds = [0, *cuts, b * n]
    cu = torch.tensor(bounds, dtype=torch.int32, device=q.device)
    max_len = max(hi - lo for lo, hi in itertools.pairwise(bounds))
    return views, cu, max_len


class RememberedCallsOff:
    """Within the block, every launcher takes the plan-key path (``call_key`` -> None)."""

    def __enter__(self):
        from flashattn_triton import launch, launch_backward, launch_varlen

        self.saved = [(m, m.call_key) for m in (launch, launch_backward, launch_varlen)]
        for module, _ in self.saved:
            module.call_key = lambda *a: None
        return self

    def __exit__(self, *exc) -> None:
        for module, real in self.saved:
            module.call_key = real


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="4,12,1024,64", help="B,H,N,d")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--docs", type=int, default=8, help="documents in the packed rows")
    ap.add_argument(
        "--layers", type=int, nargs="*", default=[12, 100], help="buffer sets to cycle over"
    )
    ap.add_argument("--calls", type=int, default=200, help="back-to-back calls per sample")
    ap.add_argument("--repeats", type=int, default=7, help="samples (the median is shown)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    b, h, n, d = (int(x) for x in args.shape.split(","))
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16

    import flashattn_triton  # noqa: F401  (registers the ops)
    from flashattn_triton import (
        launch,
        launch_backward,
        launch_common,
        launch_plans,
        launch_varlen,
    )

    torch.manual_seed(0)
    q, k, v = model_views(b, h, n, d, dtype)
    scale = d**-0.5
    o, lse = launch.forward(q, k, v, True, scale)
    do = torch.randn(b, n, h, d, device="cuda", dtype=dtype).transpose(1, 2)
    ops = torch.ops.flashattn_triton
    stream = torch.cuda.current_stream().cuda_stream
    fkey = launch_plans._layout_key((q, k, v), "fwd", True, scale, None)
    faddr = [t.data_ptr() for t in (q, k, v, o, lse)]
    bargs = (do, q, k, v, o, lse, True, scale)
    dq, dk, dv = launch.backward(*bargs)
    binputs = (q, k, v, do, o, lse)
    bkey = launch_plans._layout_key(binputs, "bwd", True, scale, None)
    plan = launch_backward._BWD_SCHEMES[bkey]
    stats = launch_backward._stats_buffers(lse, n, plan[3])
    bouts = (dq, dk, dv, stats[1], stats[2]) + ((stats[0],) if stats[0] is not lse else ())
    baddr = [t.data_ptr() for t in binputs + bouts]

    (vq, vk, vv), cu, max_len = packed_views(q, k, v, args.docs)
    vargs = (cu, cu, max_len, max_len, True, scale)
    vo, vlse = launch_varlen.forward_varlen(vq, vk, vv, *vargs)
    vdo = torch.randn_like(vo)
    vbargs = (vdo, vq, vk, vv, vo, vlse, *vargs)
    launch_varlen.backward_varlen(*vbargs)

    def plan_key_path(fn: Callable[[], object]) -> Callable[[], object]:
        def run() -> object:
            with RememberedCallsOff():
                return fn()

        return run

    def never() -> None:
        raise AssertionError("the plan must replay")

    cases: dict[str, Callable[[], object]] = {
        "fwd op (dispatcher)": lambda: ops.fwd_launch(q, k, v, True, scale),
        "launch.forward": lambda: launch.forward(q, k, v, True, scale),
        "  out_like(q)": lambda: launch_common.out_like(q),
        "  torch.empty lse": lambda: torch.empty((b, h, n), dtype=torch.float32, device=q.device),
        "  plan key": lambda: launch_plans._layout_key((q, k, v), "fwd", True, scale, None),
        "  plan replay": lambda: launch_plans._PLANS.run(fkey, faddr, stream, never),
        "bwd op (dispatcher)": lambda: ops.bwd_launch(*bargs),
        "launch.backward": lambda: launch_backward.backward(*bargs),
        "  stats buffers": lambda: launch_backward._stats_buffers(lse, n, plan[3]),
        "  plan key (bwd)": lambda: launch_plans._layout_key(binputs, "bwd", True, scale, None),
        "  plan replay (bwd)": lambda: launch_plans._PLANS.run(bkey, baddr, stream, never),
        "varlen forward": lambda: launch_varlen.forward_varlen(vq, vk, vv, *vargs),
        "varlen backward": lambda: launch_varlen.backward_varlen(*vbargs),
        "launch.forward, plan-key path": plan_key_path(
            lambda: launch.forward(q, k, v, True, scale)
        ),
        "launch.backward, plan-key path": plan_key_path(lambda: launch_backward.backward(*bargs)),
        "varlen forward, plan-key path": plan_key_path(
            lambda: launch_varlen.forward_varlen(vq, vk, vv, *vargs)
        ),
        "varlen backward, plan-key path": plan_key_path(
            lambda: launch_varlen.backward_varlen(*vbargs)
        ),
        "SDPA cuDNN fwd op": lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, True, False, scale=scale
        ),
        "SDPA flash fwd op": lambda: torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, True, False, scale=scale
        ),
        "torch.empty_like(q)": lambda: torch.empty_like(q),
    }
    for n_layers in args.layers:
        cases.update(_layer_cases(n_layers, (b, h, n, d), dtype, scale))
    rows = []
    for name, fn in cases.items():
        try:
            us = per_call_us(fn, args.calls, args.repeats)
        except Exception as exc:  # e.g. an SDPA backend this build lacks
            rows.append({"case": name, "us_per_call": None, "error": str(exc)[:80]})
            continue
        rows.append({"case": name, "us_per_call": round(us, 2)})
    print(f"{torch.cuda.get_device_name()}  shape {args.shape} {args.dtype}, model views")
    for r in rows:
        value = f"{r['us_per_call']:9.2f} us" if r["us_per_call"] is not None else r["error"]
        print(f"  {r['case']:<32} {value}")
    if args.json:
        args.json.write_text(json.dumps({"shape": args.shape, "rows": rows}, indent=1))
    return 0


def _layer_cases(
    n_layers: int, shape: tuple[int, int, int, int], dtype: torch.dtype, scale: float
) -> dict[str, Callable[[], object]]:
    """Forward, backward and SDPA's flash forward, each call on the next of ``n_layers`` sets
    of model-layout buffers (a model's layers, each at its own addresses)."""
    from flashattn_triton import launch

    b, h, n, d = shape
    layers = []
    for _ in range(n_layers):
        q, k, v = model_views(b, h, n, d, dtype)
        o, lse = launch.forward(q, k, v, True, scale)
        do = torch.randn(b, n, h, d, device="cuda", dtype=dtype).transpose(1, 2)
        layers.append((do, q, k, v, o, lse))
    fwd, bwd, sdpa = (itertools.cycle(layers) for _ in range(3))

    def forward() -> object:
        _, q, k, v, _, _ = next(fwd)
        return launch.forward(q, k, v, True, scale)

    def backward() -> object:
        return launch.backward(*next(bwd), True, scale)

    def sdpa_forward() -> object:
        _, q, k, v, _, _ = next(sdpa)
        return torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, True, False, scale=scale
        )

    return {
        f"launch.forward, {n_layers} layers": forward,
        f"launch.backward, {n_layers} layers": backward,
        f"SDPA flash fwd op, {n_layers} layers": sdpa_forward,
    }


if __name__ == "__main__":
    raise SystemExit(main())
