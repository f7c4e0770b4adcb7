"""Optimizer-state sharding: memory and step time (handout section 3,
`optimizer_state_sharding_accounting`): `python -m perf_tools.zero`.

Trains lm_core's TransformerLM data-parallel on N ranks (spawned here: one command does the
job) with each optimizer kind in turn, all around the same optimizer class:

    ddp            the plain optimizer on every rank (full state everywhere)
    zero-shard     zero_shard.ShardedOptimizer (this repo), owners broadcast parameters
    zero-shard-ag  the same with param_sync="allgather" (chunked all-gathers of flat shards)
    torch-zero     torch.distributed.optim.ZeroRedundancyOptimizer

For each it reports, at three points -- after model init (model, wrapper and optimizer
built), right before the optimizer step (after forward, backward and gradient sync) and
right after it -- the memory of parameters, gradients, optimizer state and activations,
computed from parameter counts and dtypes beside measured, plus the allocator's current and
peak bytes, and the time per step. Rows show the largest value over the ranks (the rank that
runs out first); the JSON keeps every rank.

Computed: parameters and gradients N * 4 bytes (fp32); optimizer state 2 * 4 bytes per
parameter this rank steps (AdamW's two moments; N for ddp, the rank's shard otherwise);
activations from `perf_tools.accounting.activation_elements` (lm_core formula).
Measured: parameters, gradients and optimizer state from the sizes of the live tensors
(`p.grad`, the optimizer's state tensors); activations = the bytes autograd saves for backward
in one forward (unique storages seen by `saved_tensors_hooks`, parameters excluded); on CUDA
also the allocator's `memory_allocated` / `max_memory_allocated` ("alloc" / "peak"), and
"other" = alloc - (params + grads + optimizer state): wrapper buffers such as torch DDP's
gradient buckets (one more gradient-sized copy). "peak" at before_step covers forward and
backward (activations live); at after_step it covers the step and the parameter sync.
On CPU (gloo) the allocator columns are empty.

Default (GPU): xl, 2 ranks over NCCL, fp32, 2 sequences of 512 per rank, torch AdamW, torch
DDP, 3 warm-up + 5 measured steps per optimizer. CPU: tiny, 2 ranks over gloo, short.

Examples:
  python -m perf_tools.zero                                   # xl on 2 GPUs (CPU: tiny)
  python -m perf_tools.zero --ddp bucketed --json zero.json --plot zero.png
  python -m perf_tools.zero --size tiny --device cpu --variants ddp zero-shard
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from perf_tools import _cli, _dist, harness, report, timing

VARIANTS = ("ddp", "zero-shard", "zero-shard-ag", "torch-zero")
WRAPPERS = ("torch", "naive", "flat", "individual", "bucketed")
_DDP_KIT = {
    "naive": "NaiveDDP",
    "flat": "FlatDDP",
    "individual": "DDPIndividualParameters",
    "bucketed": "DDPBucketed",
}
OPTIMIZERS = ("torch-adamw", "lm-adamw")
PHASES = ("init", "before_step", "after_step")
GIB = 2**30
COMPONENTS = ("params", "grads", "optim", "act")
TABLE_COLUMNS = [
    "variant",
    "phase",
    "status",
    *(f"{c}_{kind}_gib" for c in COMPONENTS for kind in ("calc", "meas")),
    "other_gib",
    "alloc_gib",
    "peak_gib",
    "step_ms",
]


@dataclasses.dataclass(frozen=True)
class Job:
    """What every rank runs (picklable: it travels to the spawned processes)."""

    size: str
    seq: int
    batch: int
    attention: str | None
    optimizer: str
    wrapper: str
    bucket_size_mb: float
    lr: float
    warmup: int
    steps: int
    backend: str
    device_type: str
    quiet: bool


# ------------------------------------------------------------------ rank side
def _build_model(job: Job, device: torch.device) -> tuple[nn.Module, Any]:
    from lm_core import TransformerLM, get_config

    overrides: dict[str, Any] = {"context_length": max(job.seq, 1)}
    if job.attention is not None:
        overrides["attention"] = job.attention
    config = get_config(job.size, **overrides)
    with torch.device(device):
        model = TransformerLM(config)
    return model, config


def _wrap(model: nn.Module, job: Job, device: torch.device) -> nn.Module:
    if job.wrapper == "torch":
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)
    import ddp_kit

    cls = getattr(ddp_kit, _DDP_KIT[job.wrapper])
    if job.wrapper == "bucketed":
        return cls(model, bucket_size_mb=job.bucket_size_mb)
    return cls(model)


def _optimizer(variant: str, model: nn.Module, job: Job) -> torch.optim.Optimizer:
    if job.optimizer == "lm-adamw":
        import lm_core

        cls: type[torch.optim.Optimizer] = lm_core.AdamW
    else:
        cls = torch.optim.AdamW
    kwargs = {"lr": job.lr, "weight_decay": 0.01}
    if variant == "ddp":
        return cls(model.parameters(), **kwargs)
    if variant in ("zero-shard", "zero-shard-ag"):
        from zero_shard import ShardedOptimizer

        sync = "allgather" if variant == "zero-shard-ag" else "broadcast"
        return ShardedOptimizer(model.parameters(), cls, param_sync=sync, **kwargs)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=cls, **kwargs)


def _local_optimizer(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds this rank's state (the wrapped one for the sharded kinds)."""
    for attr in ("local_optimizer", "optim"):
        inner = getattr(opt, attr, None)
        if isinstance(inner, torch.optim.Optimizer):
            return inner
    return opt


def _storage_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors`."""
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[(str(t.device), st.data_ptr())] = st.nbytes()
    return sum(seen.values())


def _state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [
        v for s in _local_optimizer(opt).state.values() for v in s.values() if torch.is_tensor(v)
    ]


def _local_numel(opt: torch.optim.Optimizer) -> int:
    return sum(p.numel() for g in _local_optimizer(opt).param_groups for p in g["params"])


def saved_activation_bytes(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """Bytes autograd saves for backward in one forward + loss (parameters excluded)."""
    from lm_core import cross_entropy

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = cross_entropy(model(x), y)
    del loss
    return sum(seen.values())


def _run_variant(variant: str, job: Job, rank: int, device: torch.device) -> dict[str, Any]:
    """Build, warm up and measure one optimizer kind on this rank."""

    from lm_core import cross_entropy

    timing.reset_peak_memory(device)
    model, config = _build_model(job, device)
    wrapped = _wrap(model, job, device)
    opt = _optimizer(variant, model, job)
    out: dict[str, Any] = {
        "variant": variant,
        "rank": rank,
        "n_params": sum(p.numel() for p in model.parameters()),
        "local_numel": _local_numel(opt),
        "init_alloc": timing.memory_allocated_bytes(device),
        "init_peak": timing.peak_memory_bytes(device),
        "init_params": _storage_bytes(list(model.parameters())),
    }
    gen = torch.Generator().manual_seed(1234 + rank)
    tokens = torch.randint(0, config.vocab_size, (job.batch, job.seq + 1), generator=gen)
    x = tokens[:, :-1].contiguous().to(device)  # (B, T)
    y = tokens[:, 1:].contiguous().to(device)  # (B, T)
    probe: dict[str, Any] = {}

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        timing.reset_peak_memory(device)
        a0 = timing.memory_allocated_bytes(device)
        loss = cross_entropy(wrapped(x), y)
        a1 = timing.memory_allocated_bytes(device)
        loss.backward()
        if job.wrapper != "torch":
            wrapped.finish_gradient_synchronization()
        probe["act_alloc"] = None if a0 is None or a1 is None else a1 - a0
        probe["before_alloc"] = timing.memory_allocated_bytes(device)
        probe["before_peak"] = timing.peak_memory_bytes(device)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        probe["grads"] = _storage_bytes(grads)
        timing.reset_peak_memory(device)
        opt.step()
        probe["after_alloc"] = timing.memory_allocated_bytes(device)
        probe["after_peak"] = timing.peak_memory_bytes(device)

    label = None if job.quiet or rank != 0 else f"{variant} ({job.wrapper} DDP)"
    result = timing.time_steps(
        step, warmup=job.warmup, iters=job.steps, device=device, progress=label
    )
    out.update(probe)
    out["params"] = _storage_bytes(list(model.parameters()))
    out["optim"] = _storage_bytes(_state_tensors(opt))
    out["step_ms"] = result.stats.median * 1e3
    out["step_ms_mean"] = result.stats.mean * 1e3
    out["first_step_s"] = result.first_step_s
    opt.zero_grad(set_to_none=True)
    out["act_saved"] = saved_activation_bytes(model, x, y)
    if hasattr(wrapped, "close"):
        wrapped.close()
    return out


def _rank_variant(rank: int, world: int, job: Job, variant: str) -> dict[str, Any]:
    """One rank of one optimizer kind, in a process of its own (`_dist.run_ranks`)."""
    if job.device_type == "cuda":
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    return _run_variant(variant, job, rank, device)


def _launch(job: Job, world: int, variants: list[str], timeout: float) -> dict[str, Any]:
    """Run `variants` on `world` spawned ranks; per variant: list of rank dicts or a failure.

    Each variant gets fresh processes: torch DDP's reducer keeps its model, gradient buckets
    and optimizer reachable after the variant ends (its hooks cannot be removed), which in
    one long-lived process added ~15 GiB per variant to the next one's memory (xl, seen on
    2x H200). A variant that fails (OOM or error) costs its own row only.
    """
    out: dict[str, Any] = {}
    with harness.Sweep(len(variants), "zero", device="cpu", quiet=job.quiet) as sweep:
        for variant in variants:
            measured = sweep.measure(partial(_spawn_variant, job, world, variant, timeout))
            out[variant] = measured.get("ranks", measured["status"])
    return out


def _spawn_variant(job: Job, world: int, variant: str, timeout: float) -> dict[str, Any]:
    ranks = _dist.run_ranks(
        _rank_variant, world, backend=job.backend, args=(job, variant), timeout_s=timeout
    )
    return {"ranks": ranks}


# ------------------------------------------------------------------ table
def computed(job: Job, rank_row: dict[str, Any], device_type: str) -> dict[str, float]:
    """Bytes each component should take on this rank, from counts and dtypes (fp32)."""
    from perf_tools import accounting

    n = rank_row["n_params"]
    dims = accounting.preset(job.size)
    attention = job.attention or "sdpa"
    tokens = job.batch * job.seq
    act = accounting.activation_elements(
        dims, tokens, job.seq, attention, composite_norm=device_type == "cpu"
    )
    return {
        "params": 4 * n,
        "grads": 4 * n,
        "optim": 2 * 4 * rank_row["local_numel"],
        "act": 4 * act + accounting.lse_bytes(dims, tokens, attention),
    }


def rows_for(job: Job, variant: str, ranks: Any, device_type: str) -> list[dict[str, Any]]:
    """The three phase rows of one variant (largest value over ranks)."""
    if isinstance(ranks, str):
        return [{"variant": variant, "phase": p, "status": ranks} for p in PHASES]
    rows = []
    for phase in PHASES:
        per_rank = []
        for r in ranks:
            calc = computed(job, r, device_type)
            if phase == "init":
                calc.update(grads=0, optim=0, act=0)  # AdamW allocates its state at step 1
                meas = {"params": r["init_params"], "grads": 0, "optim": 0, "act": 0}
                alloc, peak = r["init_alloc"], r["init_peak"]
            elif phase == "before_step":
                meas = {
                    "params": r["params"],
                    "grads": r["grads"],
                    "optim": r["optim"],
                    "act": r["act_saved"],
                }
                alloc, peak = r["before_alloc"], r["before_peak"]
            else:
                calc["act"] = 0
                meas = {"params": r["params"], "grads": r["grads"], "optim": r["optim"], "act": 0}
                alloc, peak = r["after_alloc"], r["after_peak"]
            row: dict[str, Any] = {"variant": variant, "phase": phase, "status": "ok"}
            for c in COMPONENTS:
                row[f"{c}_calc_gib"] = calc[c] / GIB
                row[f"{c}_meas_gib"] = meas[c] / GIB
            states = meas["params"] + meas["grads"] + meas["optim"]
            row["other_gib"] = None if alloc is None else (alloc - states) / GIB
            row["alloc_gib"] = None if alloc is None else alloc / GIB
            row["peak_gib"] = None if peak is None else peak / GIB
            row["step_ms"] = r["step_ms"]
            per_rank.append(row)
        rows.append(_max_over_ranks(per_rank))
    return rows


def display_rows(rows: list[dict[str, Any]], scale: float) -> list[dict[str, Any]]:
    """Short column names for the terminal ("c" computed, "m" measured), values * `scale`."""
    out = []
    for r in rows:
        d: dict[str, Any] = {"variant": r["variant"], "phase": r["phase"], "status": r["status"]}
        for c in COMPONENTS:
            for kind in ("calc", "meas"):
                v = r.get(f"{c}_{kind}_gib")
                d[f"{c} {kind[0]}"] = None if v is None else v * scale
        for key in ("other", "alloc", "peak"):
            v = r.get(f"{key}_gib")
            d[key] = None if v is None else v * scale
        d["ms/step"] = r.get("step_ms") if r["phase"] == "after_step" else None
        out.append(d)
    return out


def _max_over_ranks(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    out = dict(per_rank[0])
    for key, value in out.items():
        if isinstance(value, float):
            vals = [r[key] for r in per_rank if isinstance(r.get(key), float)]
            out[key] = max(vals) if vals else None
    return out


def plot(rows: list[dict[str, Any]], path: Path) -> Path:
    """Grouped bars: peak (CUDA) or computed total (CPU) GiB per phase, one group per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = list(dict.fromkeys(r["variant"] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(PHASES)
    use_peak = any(r.get("peak_gib") is not None for r in rows)
    for i, phase in enumerate(PHASES):
        heights = []
        for v in variants:
            row = next((r for r in rows if r["variant"] == v and r["phase"] == phase), {})
            if use_peak:
                val = row.get("peak_gib")
            else:
                parts = [row.get(f"{c}_calc_gib") for c in COMPONENTS]
                val = sum(parts) if all(isinstance(p, float) for p in parts) else None
            heights.append(val if val is not None else math.nan)
        xs = [j + (i - 1) * width for j in range(len(variants))]
        ax.bar(xs, heights, width, label=phase)
    ax.set_xticks(range(len(variants)), variants)
    ax.set_ylabel("peak GiB (max over ranks)" if use_peak else "computed GiB (max over ranks)")
    ax.set_title("Memory with and without optimizer-state sharding")
    ax.legend()
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ------------------------------------------------------------------ CLI
def build_parser() -> argparse.ArgumentParser:
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(
        prog="python -m perf_tools.zero",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--size", default="xl" if gpu else "tiny", help="lm_core preset")
    p.add_argument("--seq", type=_cli.positive_int, default=512 if gpu else 32, help="tokens")
    p.add_argument("--batch", type=_cli.positive_int, default=2, help="sequences per rank")
    p.add_argument("--attention", default=None, help="lm_core attention backend (default sdpa)")
    p.add_argument("--world-size", type=_cli.positive_int, default=2, help="ranks to spawn")
    p.add_argument("--device", type=_cli.choice(["cuda", "cpu"]), default="cuda" if gpu else "cpu")
    p.add_argument(
        "--variants",
        type=_cli.listed(_cli.choice(VARIANTS)),
        nargs="+",
        default=[list(VARIANTS)],
        help="optimizer kinds to compare",
    )
    p.add_argument(
        "--ddp", type=_cli.choice(WRAPPERS), default="torch", help="data-parallel wrapper"
    )
    p.add_argument("--bucket-size-mb", type=_cli.positive_float, default=25.0)
    p.add_argument("--optimizer", type=_cli.choice(OPTIMIZERS), default="torch-adamw")
    p.add_argument("--lr", type=_cli.positive_float, default=1e-4)
    p.add_argument("--warmup", type=_cli.nonneg_int, default=3 if gpu else 1)
    p.add_argument("--steps", type=_cli.positive_int, default=5 if gpu else 2)
    p.add_argument("--timeout", type=_cli.positive_float, default=600.0, help="seconds per variant")
    _cli.add_output_args(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    variants = _cli.flatten(args.variants) or list(VARIANTS)
    if args.device == "cuda":
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have < args.world_size:
            parser.error(f"--world-size {args.world_size}: needs that many GPUs, found {have}")
        import torch.distributed as dist

        if not dist.is_nccl_available():
            parser.error("--device cuda: this torch has no NCCL")
    from perf_tools.accounting import preset

    try:
        preset(args.size)
    except ValueError as exc:
        parser.error(str(exc))
    if args.ddp != "torch":
        try:
            import ddp_kit  # noqa: F401
        except ImportError:
            parser.error(f"--ddp {args.ddp}: needs the ddp-kit package (pip install ddp-kit)")
    job = Job(
        size=args.size,
        seq=args.seq,
        batch=args.batch,
        attention=args.attention,
        optimizer=args.optimizer,
        wrapper=args.ddp,
        bucket_size_mb=args.bucket_size_mb,
        lr=args.lr,
        warmup=args.warmup,
        steps=args.steps,
        backend="nccl" if args.device == "cuda" else "gloo",
        device_type=args.device,
        quiet=args.quiet,
    )
    results = _launch(job, args.world_size, variants, args.timeout)
    rows = [r for v in variants for r in rows_for(job, v, results[v], args.device)]
    title = (
        f"{args.size}, {args.world_size} ranks ({job.backend}), {args.batch}x{args.seq} tokens "
        f"per rank, fp32, {args.optimizer}, {args.ddp} DDP: memory (GiB, max over ranks), "
        "computed (calc) vs measured (meas)"
    )
    unit, scale = ("GiB", 1.0) if args.device == "cuda" else ("MiB", 1024.0)
    report.print_table(display_rows(rows, scale), title=title.replace("GiB", unit))
    meta = report.run_metadata()
    meta["config"] = dataclasses.asdict(job) | {"world_size": args.world_size}
    meta["per_rank"] = {v: results[v] for v in variants}
    report.save_rows(rows, csv_path=args.csv, json_path=args.json, meta=meta)
    if args.plot is not None:
        print(f"plot: {plot(rows, args.plot)}")
    failed = [v for v in variants if isinstance(results[v], str) and results[v] != "OOM"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
