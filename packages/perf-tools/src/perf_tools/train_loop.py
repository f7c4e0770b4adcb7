"""A real training run's tokens/s beside the bench step: `python -m perf_tools.train_loop`.

`perf_tools.bench` times one step on one fixed batch; a training run also gathers a batch
from the token stream every step, copies it to the device, logs, and saves checkpoints.
This command runs both on the same model, batch, precision, compile and CUDA-graph settings
and prints three rows:

  bench step                              `perf_tools.bench`'s train step (forward, backward,
                                          AdamW), timed between device synchronizes
  train loop (data, logging)              `lm_core.train`'s own tokens/s (its metrics log),
                                          over the log windows after the first (compilation,
                                          warm-up and the graph capture fall in the first);
                                          the trainer's clock pauses while it saves
  train loop (data, logging, checkpoint)  the same steps by the wall clock, the checkpoint
                                          saves in between included

`vs_bench` is each row's tokens/s over the bench step's. The trainer runs on synthetic random
tokens with its defaults otherwise: gradient clipping at 1.0 costs a few kernels the bench
step has not (`--grad-clip 0` leaves them out), the save at the last step comes after the
last log line and is not counted.

Examples:
  python -m perf_tools.train_loop --size small --precision bf16 --compile --cuda-graph
  python -m perf_tools.train_loop --size xl --precision bf16 --compile --cuda-graph --batch 4
  python -m perf_tools.train_loop --size small --precision bf16 --compile   # no graph
  python -m perf_tools.train_loop --size tiny --context 32 --steps 6 --log-every 2   # CPU
"""

from __future__ import annotations

import argparse
import gc
import signal
import sys
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from perf_tools import _cli, report
from perf_tools.model_args import ATTENTIONS
from perf_tools.steps import PRECISIONS

COLUMNS = [
    "what",
    "size",
    "precision",
    "compile",
    "cuda_graph",
    "bf16_weights",
    "batch",
    "context",
    "steps",
    "ms_per_step",
    "tokens_per_s",
    "vs_bench",
    "status",
]
BENCH, LOGGED, WALL = (
    "bench step",
    "train loop (data, logging)",
    "train loop (data, logging, checkpoint)",
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m perf_tools.train_loop",
        description=__doc__.split("\nExamples:")[0],
        epilog="Examples:" + __doc__.split("\nExamples:")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("model and step (both sides)")
    g.add_argument("--size", help="lm_core preset (default: small on a GPU, tiny on CPU)")
    g.add_argument("--context", type=_cli.positive_int, help="context (default 512 GPU, 64 CPU)")
    g.add_argument("--batch", type=_cli.positive_int, default=8, help="sequences (default 8)")
    g.add_argument(
        "--precision",
        type=_cli.choice(PRECISIONS),
        help="fp32 or bf16 autocast (default: bf16 on a GPU, fp32 on CPU)",
    )
    g.add_argument("--attention", type=_cli.choice(ATTENTIONS), help="lm_core backend")
    g.add_argument("--compile", action="store_true", help="torch.compile the model")
    g.add_argument(
        "--cuda-graph",
        action="store_true",
        help="the whole step in one CUDA graph (bench --cuda-graph, train --cuda-graph; GPU)",
    )
    g.add_argument("--fused-loss", action="store_true", help="lm_core's fused LM head + CE")
    g.add_argument(
        "--bf16-weights",
        action="store_true",
        help="with --precision bf16: linear weights held in bf16, fp32 masters in AdamW "
        "(train --bf16-weights, bench --matmul-weights bf16; lm_core.lowp_weights)",
    )
    g.add_argument("--tf32", action="store_true", help="allow TF32 matmuls")
    g.add_argument("--device", type=_cli.device_arg, help="cpu or cuda (default: cuda if any)")
    g.add_argument("--seed", type=int, default=0, help="weights and data")
    t = p.add_argument_group("the training run")
    t.add_argument("--steps", type=_cli.positive_int, help="steps (default 100 GPU, 6 CPU)")
    t.add_argument("--log-every", type=_cli.positive_int, help="(default 10 GPU, 2 CPU)")
    t.add_argument(
        "--ckpt-every", type=_cli.nonneg_int, help="steps between saves (default: steps / 2)"
    )
    t.add_argument(
        "--grad-clip",
        type=float,
        default=1.0,
        help="the trainer's clipping (default 1.0, its default; 0: off, as the bench step)",
    )
    t.add_argument(
        "--out-dir",
        type=Path,
        help="checkpoint and metrics.jsonl (default: a temporary directory, removed after)",
    )
    b = p.add_argument_group("the bench step")
    b.add_argument("--bench-warmup", type=_cli.nonneg_int, default=5, help="(default 5)")
    b.add_argument("--bench-steps", type=_cli.positive_int, help="(default 20 GPU, 3 CPU)")
    _cli.add_output_args(p, plot=False)
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    a = parser.parse_args(argv)
    a.device = a.device or torch.device(_cli.default_device())
    gpu = a.device.type == "cuda"
    a.size = a.size or ("small" if gpu else "tiny")
    from perf_tools.models import size_names

    if a.size not in size_names():
        parser.error(f"argument --size: expected one of {', '.join(size_names())}; got {a.size!r}")
    a.context = a.context or (512 if gpu else 64)
    a.precision = a.precision or ("bf16" if gpu else "fp32")
    a.steps = a.steps or (100 if gpu else 6)
    a.log_every = a.log_every or (10 if gpu else 2)
    a.ckpt_every = a.steps // 2 if a.ckpt_every is None else a.ckpt_every
    a.bench_steps = a.bench_steps or (20 if gpu else 3)
    if a.cuda_graph and not gpu:
        parser.error("argument --cuda-graph: CUDA graphs need a CUDA device (use --device cuda)")
    if a.steps < 2 * a.log_every:
        parser.error(
            f"argument --steps: {a.steps} steps give fewer than 2 log windows of --log-every "
            f"{a.log_every}; the first window (compilation, warm-up) is not counted"
        )
    if not a.grad_clip >= 0:  # NaN too
        parser.error(f"argument --grad-clip: expected >= 0, got {a.grad_clip}")
    if a.bf16_weights and a.precision != "bf16":
        parser.error("argument --bf16-weights: needs --precision bf16")
    return a


@dataclass(frozen=True)
class TrainLoopConfig:
    """One comparison (the flags, typed; `parse_args` fills the device-dependent defaults):
    the model and step of both sides, the training run, the bench step."""

    size: str
    context: int
    batch: int
    precision: str  # fp32, or bf16 autocast
    device: torch.device  # a name ('cpu', 'cuda:0') is accepted, held as a torch.device
    steps: int  # the training run's
    log_every: int
    ckpt_every: int  # steps between saves (0: at the end only)
    bench_steps: int
    attention: str | None = None  # None: the preset's backend
    compile: bool = False
    cuda_graph: bool = False
    fused_loss: bool = False
    bf16_weights: bool = False
    tf32: bool = False
    seed: int = 0
    grad_clip: float = 1.0  # 0: off, as the bench step
    out_dir: Path | None = None  # None: a temporary directory, removed after
    bench_warmup: int = 5

    def __post_init__(self) -> None:
        object.__setattr__(self, "device", _cli.config_device(self.device))
        if self.out_dir is not None:
            object.__setattr__(self, "out_dir", Path(self.out_dir))
        for name in ("context", "batch", "steps", "log_every", "bench_steps"):
            _cli.config_int(name, getattr(self, name), 1)
        for name in ("ckpt_every", "bench_warmup"):
            _cli.config_int(name, getattr(self, name), 0)
        _cli.config_int("seed", self.seed)
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision: expected one of {PRECISIONS}, got {self.precision!r}")
        if self.attention is not None and self.attention not in ATTENTIONS:
            raise ValueError(f"attention: expected one of {ATTENTIONS}, got {self.attention!r}")
        # the same checks as the CLI's (parse_args), for configs built in code
        if self.cuda_graph and self.device.type != "cuda":
            raise ValueError(f"cuda_graph: CUDA graphs need a CUDA device, got {self.device}")
        if self.steps < 2 * self.log_every:
            raise ValueError(
                f"steps: {self.steps} steps give fewer than 2 log windows of log_every "
                f"{self.log_every}; the first window (compilation, warm-up) is not counted"
            )
        _cli.config_number(  # inf: never clips
            "grad_clip", self.grad_clip, 0, closed=True, expected=">= 0", finite=False
        )
        if self.bf16_weights and self.precision != "bf16":
            raise ValueError("bf16_weights: needs precision bf16")


def config_from_args(a: argparse.Namespace) -> TrainLoopConfig:
    """The parsed flags (`parse_args`, defaults filled) as the comparison's config."""
    return TrainLoopConfig(
        size=a.size,
        context=a.context,
        batch=a.batch,
        precision=a.precision,
        device=a.device,
        steps=a.steps,
        log_every=a.log_every,
        ckpt_every=a.ckpt_every,
        bench_steps=a.bench_steps,
        attention=a.attention,
        compile=a.compile,
        cuda_graph=a.cuda_graph,
        fused_loss=a.fused_loss,
        bf16_weights=a.bf16_weights,
        tf32=a.tf32,
        seed=a.seed,
        grad_clip=a.grad_clip,
        out_dir=a.out_dir,
        bench_warmup=a.bench_warmup,
    )


def train_config(cfg: TrainLoopConfig, out_dir: Path) -> Any:
    """The `lm_core.train` options of this comparison."""
    from lm_core.train_config import TrainConfig

    model: dict[str, Any] = {"size": cfg.size, "context_length": cfg.context}
    if cfg.attention is not None:
        model["attention"] = cfg.attention
    return TrainConfig.from_dict(
        {
            "model": model,
            "data": {"synthetic": "random"},
            "training": {
                "steps": cfg.steps,
                "batch_size": cfg.batch,
                "seed": cfg.seed,
                "device": str(cfg.device),
                "bf16": cfg.precision == "bf16",
                "tf32": cfg.tf32,
                "compile": cfg.compile,
                "cuda_graph": cfg.cuda_graph,
                "fused_loss": cfg.fused_loss,
                "bf16_weights": cfg.bf16_weights,
            },
            "optim": {"grad_clip": cfg.grad_clip},
            "checkpoint": {"out_dir": str(out_dir), "every": cfg.ckpt_every, "overwrite": True},
            "logging": {"every": cfg.log_every, "progress": False},
        }
    )


def loop_rates(history: Sequence[dict[str, Any]], tokens_per_step: int) -> dict[str, float]:
    """Tokens/s of the logged windows after the first: the trainer's clock (`tokens_per_s`
    per window, weighted by its steps) and the wall clock (`elapsed_s`, saves included)."""
    if len(history) < 2:
        raise ValueError(f"need at least 2 log records, got {len(history)}")
    first, later = history[0], history[1:]
    steps = later[-1]["step"] - first["step"]
    tokens = steps * tokens_per_step
    previous = [first, *later[:-1]]
    seconds = sum(
        (h["step"] - p["step"]) * tokens_per_step / h["tokens_per_s"]
        for p, h in zip(previous, later)
    )
    wall = later[-1]["elapsed_s"] - first["elapsed_s"]
    return {"steps": steps, "logged": tokens / seconds, "wall": tokens / wall}


def bench_row(cfg: TrainLoopConfig) -> dict[str, Any]:
    """`perf_tools.bench`'s train cell for these settings."""
    from perf_tools.bench_dist import set_tf32
    from perf_tools.cells import OURS, BenchOptions, BenchSpec, run_sweep

    if cfg.tf32:
        set_tf32(True)
    spec = BenchSpec(
        OURS, cfg.size, cfg.attention, cfg.compile, cfg.precision, "train", cfg.context,
        cfg.cuda_graph, weights="bf16" if cfg.bf16_weights else "fp32",
    )  # fmt: skip
    opts = BenchOptions(
        device=cfg.device,
        batch=cfg.batch,
        warmup=cfg.bench_warmup,
        steps=cfg.bench_steps,
        overrides={},
        seed=cfg.seed,
        progress=False,
        fused_loss=cfg.fused_loss,
    )
    return run_sweep([spec], opts)[0]


def run(cfg: TrainLoopConfig) -> list[dict[str, Any]]:
    """The three rows (module docstring): the training run first, then the bench step."""
    from lm_core.train import run as train

    tokens_per_step = cfg.batch * cfg.context
    with tempfile.TemporaryDirectory(prefix="train_loop-") as tmp:
        result = train(train_config(cfg, cfg.out_dir or Path(tmp)))
    rates = loop_rates(result.history, tokens_per_step)
    del result
    torch._dynamo.reset()  # the bench compiles its own model
    gc.collect()  # the run's model, optimizer and CUDA graph (its memory pool) go now
    if cfg.device.type == "cuda":
        torch.cuda.empty_cache()
    bench = bench_row(cfg)
    common = {
        "size": cfg.size,
        "precision": cfg.precision,
        "compile": cfg.compile,
        "cuda_graph": cfg.cuda_graph,
        "bf16_weights": cfg.bf16_weights,
        "batch": cfg.batch,
        "context": cfg.context,
    }
    rows = [{"what": BENCH, **common, "steps": cfg.bench_steps, "status": bench.get("status")}]
    bench_tps = bench.get("tokens_per_s") if bench.get("status") == "ok" else None
    if bench_tps is not None:
        rows[0].update(ms_per_step=bench["mean_ms"], tokens_per_s=bench_tps, vs_bench=1.0)
    for what, key in ((LOGGED, "logged"), (WALL, "wall")):
        tps = rates[key]
        row = {"what": what, **common, "steps": rates["steps"], "status": "ok"}
        row.update(ms_per_step=1e3 * tokens_per_step / tps, tokens_per_s=tps)
        row["vs_bench"] = tps / bench_tps if bench_tps else None
        rows.append(row)
    return rows


SIGTERM_EXIT = 128 + signal.SIGTERM


def exit_on_sigterm() -> None:
    """Let SIGTERM (a `timeout`, a scheduler) end the run by SystemExit, so that the temporary
    checkpoint folder (gigabytes at xl) is removed instead of left behind to fill the disk."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    cfg = config_from_args(a)
    exit_on_sigterm()
    try:
        rows = run(cfg)
    except SystemExit as e:
        if e.code == SIGTERM_EXIT and threading.current_thread() is threading.main_thread():
            # The `with` blocks have unwound (the temporary folder is gone); the teardown of
            # what the step left half done is skipped. A stopped run once aborted (exit
            # status -6 instead of 143, not reproduced in 113 tries); the teardown is the
            # likely place, as for lm-core's `cli` and torchrun workers.
            _cli.exit_now(SIGTERM_EXIT)
        raise
    dev = report.run_metadata()["device"]
    title = (
        f"perf_tools.train_loop on {dev}: {cfg.size}, batch {cfg.batch} x {cfg.context}, "
        f"{cfg.precision}{', compiled' if cfg.compile else ''}"
        f"{', CUDA graph' if cfg.cuda_graph else ''}; training run of {cfg.steps} steps (log "
        f"every {cfg.log_every}, checkpoint every {cfg.ckpt_every}, first log window not "
        "counted)"
    )
    report.print_table(rows, COLUMNS, title=title)
    report.save_rows(rows, csv_path=a.csv, json_path=a.json)
    for what, path in (("csv", a.csv), ("json", a.json)):
        if path is not None:
            print(f"{what}: {path}")
    if any(r["status"] != "ok" for r in rows):
        print("the bench step failed (see status)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
