"""The naive-attention sweep of `python -m perf_tools.attention naive` (handout 1.2.1, 1.3 a).

lm_core's naive attention, eager and torch.compile'd, over a d x seq grid: forward ms, memory
in use before backward (measured and predicted by `naive_saved_bytes`), backward ms, OOM cells
marked, and the tensor-by-tensor memory accounting of one configuration (`print_accounting`).

`AttentionGrid` (the grid both attention sweeps share), the dtypes by name, `make_inputs` and
`failure` live here too: `perf_tools.attention` (the CLI and the flash sweep) imports this
module, never the reverse, so there is no import cycle.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from perf_tools import _cli, report, timing
from perf_tools.attention_providers import (
    PROVIDERS,
    UnsupportedError,
    is_unsupported_error,
    make_provider,
)
from perf_tools.harness import progress as _bar
from perf_tools.harness import release as _release

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
MiB = 2**20
NAIVE_PROVIDERS = ("naive", "naive-compiled")


@dataclass(frozen=True, kw_only=True)
class AttentionGrid:
    """The cells an attention sweep measures: every provider x dtype x d x seq at one batch."""

    device: torch.device  # a name ('cpu', 'cuda:0') is accepted, held as a torch.device
    batch: int
    seq: tuple[int, ...]  # lists are accepted, held as tuples
    d: tuple[int, ...]
    dtypes: tuple[str, ...]  # names, keys of DTYPES
    providers: tuple[str, ...]  # names, from attention_providers.PROVIDERS
    causal: bool = True
    seed: int = 0
    quiet: bool = False  # no progress bar

    def __post_init__(self) -> None:
        # lists and device names are accepted and stored as tuples / a torch.device, so that a
        # frozen config compares (and hashes) by value
        object.__setattr__(self, "device", _cli.config_device(self.device))
        _cli.config_int("batch", self.batch, 1)
        for name in ("seq", "d"):
            values = _cli.config_tuple(name, getattr(self, name))
            object.__setattr__(self, name, tuple(_cli.config_int(name, v, 1) for v in values))
        object.__setattr__(self, "dtypes", _cli.config_tuple("dtypes", self.dtypes, tuple(DTYPES)))
        object.__setattr__(
            self, "providers", _cli.config_tuple("providers", self.providers, PROVIDERS)
        )
        _cli.config_int("seed", self.seed)


@dataclass(frozen=True, kw_only=True)
class NaiveConfig(AttentionGrid):
    """One naive-attention sweep (the `naive` sub-command's flags, defaults filled in)."""

    passes: int = 100  # timed passes per cell
    warmup: int = 10  # untimed passes before them

    def __post_init__(self) -> None:
        super().__post_init__()
        _cli.config_int("passes", self.passes, 1)
        _cli.config_int("warmup", self.warmup, 0)


def naive_grid(gpu: bool, quick: bool) -> dict[str, Any]:
    """The default naive grid: tiny off the GPU, a subset with ``quick``, else the handout's."""
    if not gpu:
        base = {"batch": 2, "seq": [32, 64], "d": [16, 32], "dtype": ["fp32"], "passes": 3}
        base |= {"warmup": 1}
    elif quick:
        base = {"batch": 8, "seq": [1024, 4096, 16384], "d": [64], "dtype": ["fp32"]}
        base |= {"passes": 20, "warmup": 5}
    else:
        base = {"batch": 8, "seq": [256, 1024, 4096, 8192, 16384], "d": [16, 32, 64, 128]}
        base |= {"dtype": ["fp32"], "passes": 100, "warmup": 10}
    return base | {"providers": list(NAIVE_PROVIDERS)}


def make_inputs(
    batch: int, seq: int, d: int, dtype: torch.dtype, device: torch.device, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v (B, N, d) needing grad, and an upstream gradient dO (B, N, d)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    shape = (batch, seq, d)
    q, k, v, do = (torch.randn(shape, generator=gen).to(device=device, dtype=dtype) for _ in "qkvo")
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), do


def failure(provider: str, exc: BaseException) -> str:
    """The status of a cell of ``provider`` that raised ``exc``: OOM, unsupported or error."""
    if timing.is_oom(exc):
        return "OOM"
    if is_unsupported_error(provider, exc):
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"unsupported: {first[:120]}"
    return f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"


def naive_saved_bytes(batch: int, seq: int, d: int, dtype: torch.dtype, causal: bool) -> int:
    """Predicted memory in use between forward and backward of the naive attention.

    Inputs q, k, v and the output o: 4 * B*N*d elements. Saved for backward: the softmax
    output P (B*N*N; kept in fp32 by lm_core's causal path, which runs the softmax in fp32,
    plus its cast to the input dtype when that is not fp32, saved by the P @ V matmul) and the
    causal mask (N*N bools, saved by masked_fill). The plain (non-causal) path saves P only.
    """
    size = torch.empty((), dtype=dtype).element_size()
    total = 4 * batch * seq * d * size
    if causal:
        total += batch * seq * seq * 4 + seq * seq  # fp32 P and the bool mask
        if dtype != torch.float32:
            total += batch * seq * seq * size  # P cast back to the input dtype
    else:
        total += batch * seq * seq * size
    return total


def naive_accounting(batch: int, seq: int, d: int, dtype: torch.dtype, causal: bool) -> list[dict]:
    """Tensor-by-tensor memory of the naive attention at one size (MiB), forward and backward."""
    size = torch.empty((), dtype=dtype).element_size()
    nn_ = batch * seq * seq
    rows = [
        ("q, k, v, o (B, N, d) each x4", 4 * batch * seq * d * size, "inputs/output", "yes"),
        ("S = Q K^T / sqrt(d) (B, N, N)", nn_ * size, "forward, transient", "no"),
    ]
    if causal:
        rows += [
            ("causal mask (N, N) bool", seq * seq, "forward", "yes (masked_fill)"),
            ("masked S (B, N, N)", nn_ * size, "forward, transient", "no"),
        ]
        if dtype != torch.float32:
            rows.append(("S in fp32 for softmax (B, N, N)", nn_ * 4, "forward, transient", "no"))
        rows.append(("P = softmax(S), fp32 (B, N, N)", nn_ * 4, "forward", "yes (softmax)"))
        if dtype != torch.float32:
            rows.append(("P cast to input dtype (B, N, N)", nn_ * size, "forward", "yes (P @ V)"))
    else:
        rows.append(("P = softmax(S) (B, N, N)", nn_ * size, "forward", "yes (softmax, P @ V)"))
    rows += [
        ("dP = dO V^T (B, N, N)", nn_ * (4 if causal else size), "backward, transient", "-"),
        ("dS = softmax backward (B, N, N)", nn_ * (4 if causal else size), "backward", "-"),
    ]
    return [
        {"tensor": name, "mib": nbytes / MiB, "when": when, "saved_for_backward": saved}
        for name, nbytes, when, saved in rows
    ]


def run_naive(cfg: NaiveConfig) -> list[dict[str, Any]]:
    """Forward / backward timings and memory of naive attention, eager and compiled."""
    rows = []
    cells = [
        (p, dt, d, n)
        for p in cfg.providers
        for dt in cfg.dtypes
        for d in cfg.d
        for n in sorted(cfg.seq)
    ]
    bar = _bar(len(cells), "naive attention", cfg.quiet)
    for provider, dt_name, d, seq in cells:
        dtype = DTYPES[dt_name]
        row: dict[str, Any] = {
            "provider": provider,
            "dtype": dt_name,
            "batch": cfg.batch,
            "d": d,
            "seq": seq,
            "causal": cfg.causal,
            "status": None,
            "fwd_ms": None,
            "bwd_ms": None,
            "mib_before_bwd": None,
        }
        row["predicted_mib_before_bwd"] = (
            naive_saved_bytes(cfg.batch, seq, d, dtype, cfg.causal) / MiB
        )
        row.update(_naive_cell(cfg, provider, seq, d, dtype))
        rows.append(row)
        bar.update(1)
        _release(cfg.device)
    bar.close()
    return rows


def _naive_cell(
    cfg: NaiveConfig, provider: str, seq: int, d: int, dtype: torch.dtype
) -> dict[str, Any]:
    device = cfg.device
    out: dict[str, Any] = {"status": "ok"}
    try:
        if provider not in NAIVE_PROVIDERS:
            raise UnsupportedError("the naive sweep compares naive and naive-compiled only")
        fn = make_provider(provider, device, dtype, cfg.causal)
        q, k, v, do = make_inputs(cfg.batch, seq, d, dtype, device, cfg.seed)
        fwd = timing.time_steps(
            lambda: fn(q, k, v), warmup=cfg.warmup, iters=cfg.passes, device=device
        )
        out["fwd_ms"] = fwd.stats.mean * 1e3
        out["fwd_std_ms"] = fwd.stats.std * 1e3
        out["compile_or_first_s"] = (
            None if fwd.first_step_s != fwd.first_step_s else fwd.first_step_s
        )
        timing.synchronize(device)
        before = timing.memory_allocated_bytes(device)
        o = fn(q, k, v)
        timing.synchronize(device)
        after = timing.memory_allocated_bytes(device)
        if before is not None and after is not None:
            # what the forward left alive: o plus everything saved for backward, plus q, k, v
            out["mib_before_bwd"] = (after - before) / MiB + 3 * q.numel() * q.element_size() / MiB
        bwd = timing.time_steps(
            lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True),
            warmup=cfg.warmup,
            iters=cfg.passes,
            device=device,
        )
        out["bwd_ms"] = bwd.stats.mean * 1e3
        out["bwd_std_ms"] = bwd.stats.std * 1e3
        peak = timing.peak_memory_bytes(device)
        out["peak_mib"] = None if peak is None else peak / MiB
    except Exception as exc:
        out["status"] = failure(provider, exc)
        if out["status"].startswith("error"):
            import traceback

            traceback.print_exc()
    return out


NAIVE_COLUMNS = [
    "provider", "dtype", "d", "seq", "status", "fwd_ms", "bwd_ms", "mib_before_bwd",
    "predicted_mib_before_bwd", "peak_mib", "compile_or_first_s",
]  # fmt: skip


def plot_naive(rows: list[dict[str, Any]], path: Path) -> Path:
    """Forward ms against seq, one line per (provider, dtype, d), log-log."""
    return report.plot_lines(
        rows, x="seq", y="fwd_ms", group_by=["provider", "dtype", "d"], path=path,
        title="naive attention forward (ms)", logx=True, logy=True, ylabel="forward ms",
    )  # fmt: skip


def print_accounting(rows: list[dict[str, Any]], causal: bool) -> list[dict[str, Any]]:
    """Memory accounting of the smallest OOM configuration (else the largest that ran)."""
    ooms = [r for r in rows if str(r.get("status", "")).startswith("OOM")]
    if ooms:
        pick = min(ooms, key=lambda r: (r["seq"], r["d"]))
        why = "smallest configuration that ran out of memory"
    else:
        pick = max(rows, key=lambda r: (r["seq"], r["d"]))
        why = "largest configuration (none ran out of memory)"
    dtype = DTYPES[pick["dtype"]]
    acc = naive_accounting(pick["batch"], pick["seq"], pick["d"], dtype, causal)
    title = (
        f"memory accounting, {why}: batch {pick['batch']}, seq {pick['seq']}, d {pick['d']}, "
        f"{pick['dtype']} (one N x N matrix = B*N*N*bytes; saved-for-backward N x N memory "
        "grows as N^2: a tiled kernel that recomputes P in backward removes it)"
    )
    report.print_table(acc, title=title)
    return acc
