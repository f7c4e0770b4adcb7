"""`python -m perf_tools.plan`: which parallelism, and how many GPUs, for a model and a batch.

For a model (lm_core preset, the handout's xxl, a 70B-class model, or custom dims), a global
batch in tokens, device counts and a GPU kind, prints for DP, FSDP, TP and every FSDP x TP
factorization: compute time, communication time, step time with communication overlapped and
not (the handout's two cases), compute- or communication-bound, memory per device (weights,
gradients, optimizer state, activations with and without checkpointing) and whether it fits;
marks the recommended configuration per N; then the largest N at which each strategy is still
compute-bound. Formulas: `perf_tools.plan_model` (closed forms, ring collectives). These are
predictions, not measurements.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from perf_tools import _cli, report
from perf_tools.accounting import DTYPE_BYTES, Dtypes, ModelDims
from perf_tools.plan_model import (
    HARDWARE,
    STRATEGIES,
    Hardware,
    Workload,
    max_compute_bound,
    model_preset,
    plan_rows,
)

GPU_ALIASES = {"h100-sxm": "H100", "h200-sxm": "H200", "a100-sxm": "A100", "b200-sxm": "B200"}

TABLE_COLUMNS = (
    "N",
    "strategy",
    "grid",
    "micro_batch",
    "micro_steps",
    "ckpt",
    "compute_ms",
    "comm_ms",
    "step_overlap_ms",
    "step_serial_ms",
    "bound",
    "weights_GB",
    "grads_GB",
    "optim_GB",
    "act_GB",
    "act_ckpt_GB",
    "total_GB",
    "fits",
    "recommended",
)


def _devices(text: str) -> list[int]:
    """'64', '8,64,512' or 'A:B' (powers of two from A to B)."""
    out: list[int] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        if ":" in part:
            lo_text, hi_text = part.split(":", 1)
            lo, hi = _cli.positive_int(lo_text), _cli.positive_int(hi_text)
            if lo > hi:
                raise argparse.ArgumentTypeError(f"expected A:B with A <= B, got {part!r}")
            n = lo
            while n <= hi:
                out.append(n)
                n *= 2
        else:
            out.append(_cli.positive_int(part))
    if not out:
        raise argparse.ArgumentTypeError(f"expected device counts, got {text!r}")
    return out


def _tokens(text: str) -> int:
    """A positive token count; K, M suffixes (2^10, 2^20): '4M' = 4,194,304."""
    scale = {"k": 2**10, "m": 2**20}.get(text[-1:].lower(), 1)
    number = text[:-1] if scale > 1 else text
    try:
        value = int(float(number) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a token count like 1048576 or 4M, got {text!r}"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive token count, got {text!r}")
    return value


def _fraction(text: str) -> float:
    value = _cli.positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m perf_tools.plan",
        description="Predicted step time, communication and memory of DP, FSDP, TP and "
        "FSDP x TP for a model, a global batch and N GPUs (closed forms; see "
        "perf_tools.plan_model).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
        "  python -m perf_tools.plan --size 8B --seq 8192 --global-batch 4M --devices 8,64,512\n"
        "  python -m perf_tools.plan --size 70B --gpu H200 --devices 8:1024 --plot plan.png\n"
        "  python -m perf_tools.plan --size xxl --flops 4.6e14 --bandwidth 1.8e11 "
        "--memory 95 --devices 64\n\n"
        "GPU presets (bf16 dense TFLOP/s, memory GB, NVLink / NIC GB/s one way per GPU):\n"
        + "\n".join(
            f"  {k:10s} {h.flops / 1e12:7.1f} {h.memory / 1e9:5.0f} "
            f"{h.intra_bw / 1e9:5.0f} / {h.inter_bw / 1e9:3.0f}"
            for k, h in HARDWARE.items()
        ),
    )
    m = p.add_argument_group("model")
    m.add_argument("--size", default="8B", help="lm_core preset, xxl or 70B (default: 8B)")
    m.add_argument("--d-model", type=_cli.positive_int, help="custom: width D")
    m.add_argument("--d-ff", type=_cli.positive_int, help="custom: feed-forward width D_FF")
    m.add_argument("--num-layers", type=_cli.positive_int, help="custom: blocks")
    m.add_argument("--vocab-size", type=_cli.positive_int, default=10_000, help="custom")
    m.add_argument("--num-heads", type=_cli.positive_int, help="custom [D / 128]")
    m.add_argument("--ffn-only", action="store_true", help="custom: blocks of two linears only")
    w = p.add_argument_group("workload")
    w.add_argument(
        "--global-batch", type=_tokens, default=_tokens("4M"), help="tokens per step [4M]"
    )
    w.add_argument("--seq", type=_cli.positive_int, help="sequence length [the preset's]")
    w.add_argument(
        "--devices",
        type=_devices,
        nargs="+",
        default=[_devices("8:512")],
        help="N: counts and A:B power-of-two ranges [8:512]",
    )
    w.add_argument(
        "--micro-batch",
        type=_cli.positive_int,
        help="sequences per data-parallel group and micro-step [the fastest that fits]",
    )
    w.add_argument(
        "--comm-dtype", type=_cli.choice(list(DTYPE_BYTES)), default="bf16", help="[bf16]"
    )
    h = p.add_argument_group("hardware (a preset, or any field overridden)")
    h.add_argument(
        "--gpu",
        type=_cli.choice(list(HARDWARE), aliases=GPU_ALIASES),
        default="H100",
        help="GPU kind [H100]",
    )
    h.add_argument("--flops", type=_cli.positive_float, help="FLOP/s per GPU")
    h.add_argument("--memory", type=_cli.positive_float, help="GB per GPU")
    h.add_argument(
        "--bandwidth", type=_cli.positive_float, help="bytes/s one way per GPU, every link"
    )
    h.add_argument("--intra-bandwidth", type=_cli.positive_float, help="bytes/s in a node")
    h.add_argument("--inter-bandwidth", type=_cli.positive_float, help="bytes/s across nodes")
    h.add_argument("--gpus-per-node", type=_cli.positive_int, help="[8]")
    h.add_argument(
        "--usable-memory",
        type=_fraction,
        default=0.9,
        help="fraction of the memory the counted bytes may take [0.9]",
    )
    p.add_argument(
        "--all-columns", action="store_true", help="print every column (CSV/JSON always have)"
    )
    _cli.add_output_args(p)
    return p


@dataclass(frozen=True)
class PlanConfig:
    """What one plan computes (the CLI's flags, typed). The model: custom dims when all of
    d_model, d_ff and num_layers are given, else the preset `size`; the hardware: the `gpu`
    preset with each field that is not None overriding its value."""

    size: str = "8B"
    d_model: int | None = None
    d_ff: int | None = None
    num_layers: int | None = None
    vocab_size: int = 10_000  # custom models only (FFN-only ones have none)
    num_heads: int | None = None  # custom models; None: d_model // 128
    ffn_only: bool = False
    global_batch: int = 4 * 2**20  # tokens per step
    seq: int | None = None  # None: the preset's (2048 for custom models)
    devices: tuple[int, ...] = (8, 16, 32, 64, 128, 256, 512)
    micro_batch: int | None = None  # None: the fastest that fits
    comm_dtype: str = "bf16"
    gpu: str = "H100"
    flops: float | None = None  # FLOP/s per GPU
    memory: float | None = None  # GB per GPU
    bandwidth: float | None = None  # bytes/s, both intra- and inter-node
    intra_bandwidth: float | None = None
    inter_bandwidth: float | None = None
    gpus_per_node: int | None = None
    usable_memory: float = 0.9

    def __post_init__(self) -> None:
        # Sorted and unique: one plan per N, in order (a list is accepted).
        devices = _cli.config_tuple("devices", self.devices)
        devices = {_cli.config_int("devices", n, 1) for n in devices}
        object.__setattr__(self, "devices", tuple(sorted(devices)))
        ints = ("d_model", "d_ff", "num_layers", "vocab_size", "num_heads", "global_batch")
        for name in (*ints, "seq", "micro_batch", "gpus_per_node"):
            if getattr(self, name) is not None:
                _cli.config_int(name, getattr(self, name), 1)
        for name in ("flops", "memory", "bandwidth", "intra_bandwidth", "inter_bandwidth"):
            if getattr(self, name) is not None:
                _cli.config_number(name, getattr(self, name), 0)
        if self.comm_dtype not in DTYPE_BYTES:
            raise ValueError(
                f"comm_dtype: expected one of {', '.join(DTYPE_BYTES)}, got {self.comm_dtype!r}"
            )
        if self.gpu not in HARDWARE:
            raise ValueError(f"gpu: expected one of {', '.join(HARDWARE)}, got {self.gpu!r}")
        _cli.config_number(
            "usable_memory", self.usable_memory, 0, high=1, expected="a fraction in (0, 1]"
        )
        # The model last, on checked values. Its messages are the CLI's (plan.main prints
        # them), so they name the flags the user typed.
        custom = (self.d_model, self.d_ff, self.num_layers)
        if all(v is None for v in custom):
            try:
                model_preset(self.size)
            except ValueError as exc:
                raise ValueError(f"--size: {exc}") from None
        elif any(v is None for v in custom):
            raise ValueError("custom model: give all of --d-model, --d-ff and --num-layers")
        elif self.d_model % self.heads():
            raise ValueError(
                f"--num-heads: {self.heads()} does not divide --d-model {self.d_model}"
            )

    def heads(self) -> int:
        """Attention heads of a custom model: num_heads, else one per 128 of d_model."""
        return self.num_heads or max(1, (self.d_model or 0) // 128)


def config_from_args(a: argparse.Namespace) -> PlanConfig:
    """The parsed flags as a config (ValueError: a bad combination, named)."""
    return PlanConfig(
        **_cli.model_dim_fields(a),
        global_batch=a.global_batch,
        seq=a.seq,
        devices=tuple(_cli.flatten(a.devices)),
        micro_batch=a.micro_batch,
        comm_dtype=a.comm_dtype,
        gpu=a.gpu,
        flops=a.flops,
        memory=a.memory,
        bandwidth=a.bandwidth,
        intra_bandwidth=a.intra_bandwidth,
        inter_bandwidth=a.inter_bandwidth,
        gpus_per_node=a.gpus_per_node,
        usable_memory=a.usable_memory,
    )


def _model(cfg: PlanConfig) -> tuple[ModelDims, int]:
    """(dims, default sequence length) of the config's model."""
    if cfg.d_model is None or cfg.d_ff is None or cfg.num_layers is None:
        return model_preset(cfg.size)
    dims = ModelDims(
        "custom",
        cfg.d_model,
        cfg.d_ff,
        cfg.num_layers,
        0 if cfg.ffn_only else cfg.vocab_size,
        cfg.heads(),
        ffn_only=cfg.ffn_only,
    )
    return dims, 2048


def _hardware(cfg: PlanConfig) -> Hardware:
    """The GPU preset with the config's overrides (named in the hardware's name)."""
    hw = HARDWARE[cfg.gpu]
    fields: dict[str, Any] = {}
    if cfg.flops is not None:
        fields["flops"] = cfg.flops
    if cfg.memory is not None:
        fields["memory"] = cfg.memory * 1e9
    if cfg.bandwidth is not None:
        fields["intra_bw"] = fields["inter_bw"] = cfg.bandwidth
    if cfg.intra_bandwidth is not None:
        fields["intra_bw"] = cfg.intra_bandwidth
    if cfg.inter_bandwidth is not None:
        fields["inter_bw"] = cfg.inter_bandwidth
    if cfg.gpus_per_node is not None:
        fields["gpus_per_node"] = cfg.gpus_per_node
    if cfg.usable_memory != hw.usable:
        fields["usable"] = cfg.usable_memory
    if fields:
        hw = replace(hw, name=f"{hw.name} (overridden: {', '.join(sorted(fields))})", **fields)
    return hw


def run(cfg: PlanConfig) -> dict[str, list[dict[str, Any]]]:
    """The plan's tables as rows: 'plan' (every layout and N), 'max_n', 'setup'."""
    dims, default_seq = _model(cfg)
    seq = cfg.seq or default_seq
    work = Workload(dims, cfg.global_batch, seq, Dtypes(comm=DTYPE_BYTES[cfg.comm_dtype]))
    hw = _hardware(cfg)
    rows = plan_rows(list(cfg.devices), work, hw, cfg.micro_batch)
    max_n = [max_compute_bound(s, work, hw) for s in STRATEGIES]
    setup = [
        {
            "model": dims.name,
            "params_B": work.params / 1e9,
            "d_model": dims.d_model,
            "d_ff": dims.d_ff,
            "layers": dims.num_layers,
            "heads": dims.num_heads,
            "vocab": dims.vocab_size,
            "seq": seq,
            "global_batch_tokens": cfg.global_batch,
            "step_PFLOP": work.step_flops() / 1e15,
            "gpu": hw.name,
            "TFLOPs": hw.flops / 1e12,
            "memory_GB": hw.memory / 1e9,
            "usable": hw.usable,
            "intra_GBps": hw.intra_bw / 1e9,
            "inter_GBps": hw.inter_bw / 1e9,
            "gpus_per_node": hw.gpus_per_node,
        }
    ]
    return {"setup": setup, "plan": rows, "max_n": max_n}


def plot_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per N and strategy the overlapped step time of configurations that fit in memory;
    FSDP x TP at its best factorization."""
    best: dict[tuple[int, str], dict[str, Any]] = {}
    for r in rows:
        if not r["fits"]:
            continue
        key = (r["N"], r["strategy"])
        if key not in best or r["step_overlap_ms"] < best[key]["step_overlap_ms"]:
            best[key] = r
    return [
        {"N": n, "strategy": s, "step_s": r["step_overlap_ms"] / 1e3}
        for (n, s), r in sorted(best.items())
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        out = run(config_from_args(args))
    except ValueError as exc:
        parser.error(str(exc))
    setup = out["setup"][0]
    report.print_table(out["setup"], title="Setup (predictions, not measurements)")
    rows = out["plan"]
    shown = [{**r, "recommended": "<-" if r["recommended"] else ""} for r in rows]
    report.print_table(
        shown,
        columns=None if args.all_columns else TABLE_COLUMNS,
        title=f"Predicted per-step cost, {setup['model']} on {setup['gpu']}, "
        f"{setup['global_batch_tokens']:,} tokens per step (times in ms, memory in GB per GPU "
        "at the micro-batch shown; ckpt: activation checkpointing, its recompute in compute)",
    )
    report.print_table(
        out["max_n"],
        title="Largest N still compute-bound (comm <= compute, one micro-step) at this batch",
    )
    for n in sorted({r["N"] for r in rows}):
        best = [r for r in rows if r["N"] == n and r["recommended"]]
        if best:
            b = best[0]
            ckpt = ", activation checkpointing" if b["ckpt"] else ""
            print(
                f"N={n}: {b['strategy']} {b['grid']}, micro-batch {b['micro_batch']} x "
                f"{b['micro_steps']}{ckpt}: {b['step_overlap_ms']:.1f} ms per step overlapped "
                f"({b['step_serial_ms']:.1f} not), {b['bound']}-bound, "
                f"{b['total_GB']:.1f} GB per GPU"
            )
        else:
            usable = setup["memory_GB"] * setup["usable"]
            print(f"N={n}: nothing fits in {usable:g} GB per GPU")
    all_rows = [{"table": k, **r} for k, rs in out.items() for r in rs]
    report.save_rows(all_rows, csv_path=args.csv, json_path=args.json)
    if args.plot is not None:
        report.plot_lines(
            plot_rows(rows),
            x="N",
            y="step_s",
            group_by=["strategy"],
            path=args.plot,
            title=f"{setup['model']}, {setup['global_batch_tokens']:,} tokens/step on "
            f"{setup['gpu']}: predicted step (overlapped; only what fits)",
            logx=True,
            logy=True,
            ylabel="step time (s)",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
