"""Mixed-precision experiments of the handout (1.1.5): `python -m perf_tools.mixed_precision`.

  accumulate   the four accumulation variants (sum 0.01 a thousand times into an fp32 or fp16
               accumulator, adding fp32 or fp16 values), plus two bf16 variants, with the error
               against the exact 10.0.
  toy-dtypes   the dtypes seen inside torch.autocast (fp16 and bf16) for the handout's ToyModel:
               parameters inside the context, fc1 output, layer-norm output, logits, loss and
               gradients, read by forward hooks. On CUDA when present; else on CPU, whose
               autocast also runs bf16 and fp16 (the table says which device ran).

With no sub-command: both, accumulate then toy-dtypes.

Examples:
  python -m perf_tools.mixed_precision
  python -m perf_tools.mixed_precision accumulate
  python -m perf_tools.mixed_precision toy-dtypes --json dtypes.json
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from perf_tools import _cli, report

# name -> (accumulator dtype, addend dtype, cast the addend to the accumulator dtype first)
VARIANTS: dict[str, tuple[torch.dtype, torch.dtype, bool]] = {
    "fp32 += fp32": (torch.float32, torch.float32, False),
    "fp16 += fp16": (torch.float16, torch.float16, False),
    "fp32 += fp16": (torch.float32, torch.float16, False),
    "fp32 += fp16.to(fp32)": (torch.float32, torch.float16, True),
    "bf16 += bf16": (torch.bfloat16, torch.bfloat16, False),
    "fp32 += bf16": (torch.float32, torch.bfloat16, False),
}
HANDOUT_VARIANTS = tuple(list(VARIANTS)[:4])


def accumulate(
    acc_dtype: torch.dtype, add_dtype: torch.dtype, cast: bool, n: int = 1000, value: float = 0.01
) -> float:
    """Add `value` (stored as `add_dtype`) `n` times into a zero of `acc_dtype`, in place."""
    s = torch.tensor(0, dtype=acc_dtype)
    for _ in range(n):
        x = torch.tensor(value, dtype=add_dtype)
        s += x.type(acc_dtype) if cast else x
    return float(s)


def accumulate_rows(n: int = 1000, value: float = 0.01) -> list[dict[str, Any]]:
    """One row per variant: result, absolute and relative error against n * value."""
    exact = n * value
    rows = []
    for name, (acc, add, cast) in VARIANTS.items():
        got = accumulate(acc, add, cast, n, value)
        stored = float(torch.tensor(value, dtype=add))
        rows.append(
            {
                "variant": name,
                "handout": name in HANDOUT_VARIANTS,
                "accumulator": str(acc).removeprefix("torch."),
                "addend": str(add).removeprefix("torch."),
                "addend_stored": stored,
                "result": got,
                "exact": exact,
                "abs_error": abs(got - exact),
                "rel_error": abs(got - exact) / exact,
            }
        )
    return rows


class ToyModel(nn.Module):
    """The handout's toy model: fc1 -> ReLU -> LayerNorm -> fc2. (B, in) -> (B, out)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, 10, bias=False)
        self.ln = nn.LayerNorm(10)
        self.fc2 = nn.Linear(10, out_features, bias=False)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.fc1(x))
        x = self.ln(x)
        x = self.fc2(x)
        return x


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def toy_dtypes(device: torch.device, dtype: torch.dtype, seed: int = 0) -> list[dict[str, Any]]:
    """Dtypes inside `torch.autocast(device, dtype)` for ToyModel(in=16, out=4), batch 8."""
    torch.manual_seed(seed)
    model = ToyModel(16, 4).to(device)
    seen: dict[str, torch.dtype] = {}

    def hook(name: str) -> Any:
        def record(_mod: nn.Module, _inp: Any, out: torch.Tensor) -> None:
            seen[name] = out.dtype

        return record

    handles = [
        model.fc1.register_forward_hook(hook("fc1 output")),
        model.ln.register_forward_hook(hook("layer-norm output")),
        model.fc2.register_forward_hook(hook("logits (fc2 output)")),
    ]
    x = torch.randn(8, 16, device=device)
    y = torch.randint(0, 4, (8,), device=device)
    try:
        with torch.autocast(device_type=device.type, dtype=dtype):
            params = {p.dtype for p in model.parameters()}
            logits = model(x)
            loss = nn.functional.cross_entropy(logits, y)
        loss.backward()
    finally:
        for h in handles:
            h.remove()
    grads = {p.grad.dtype for p in model.parameters() if p.grad is not None}
    components = [
        ("parameters (inside autocast)", ", ".join(sorted(_name(d) for d in params))),
        ("fc1 output", _name(seen["fc1 output"])),
        ("layer-norm output", _name(seen["layer-norm output"])),
        ("logits (fc2 output)", _name(seen["logits (fc2 output)"])),
        ("loss (cross_entropy)", _name(loss.dtype)),
        ("gradients", ", ".join(sorted(_name(d) for d in grads))),
    ]
    return [
        {"device": device.type, "autocast": _name(dtype), "component": c, "dtype": d}
        for c, d in components
    ]


def _precise(row: dict[str, Any]) -> dict[str, Any]:
    """Floats as text with 8 significant digits: the errors live in the last places."""
    return {k: f"{v:.8g}" if isinstance(v, float) else v for k, v in row.items()}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m perf_tools.mixed_precision",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    _cli.add_output_args(p, plot=False)
    sub = p.add_subparsers(dest="cmd", metavar="{accumulate,toy-dtypes}")
    a = sub.add_parser("accumulate", help="the four accumulation variants (and bf16)")
    a.add_argument("--n", type=_cli.positive_int, default=1000, help="additions (default 1000)")
    a.add_argument("--value", type=float, default=0.01, help="value added (default 0.01)")
    _cli.add_output_args(a, plot=False, inherit=True)
    t = sub.add_parser("toy-dtypes", help="dtypes inside autocast for the ToyModel")
    t.add_argument("--device", type=_cli.device_arg, default=None, help="default: cuda if any")
    t.add_argument(
        "--dtype",
        nargs="+",
        type=_cli.listed(_cli.choice(("fp16", "bf16"))),
        help="autocast dtypes (default fp16 bf16)",
    )
    _cli.add_output_args(t, plot=False, inherit=True)
    return p


def run_accumulate(n: int = 1000, value: float = 0.01) -> tuple[list[dict[str, Any]], str]:
    """The accumulation table and its title."""
    return accumulate_rows(n, value), f"sum of {value} added {n} times (exact {n * value:g})"


def run_toy_dtypes(
    device: torch.device | None = None, names: Sequence[str] = ("fp16", "bf16")
) -> tuple[list[dict[str, Any]], str]:
    """The autocast dtype table (a row per component and dtype) and its title."""
    device = device or torch.device(_cli.default_device())
    rows = []
    for name in names:
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[name]
        try:
            rows.extend(toy_dtypes(device, dtype))
        except RuntimeError as exc:  # an autocast dtype this device does not support
            rows.append(
                {
                    "device": device.type,
                    "autocast": name,
                    "component": "(not supported here)",
                    "dtype": str(exc).splitlines()[0][:120],
                }
            )
    return rows, f"dtypes inside torch.autocast for ToyModel on {device.type}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run one experiment, or both (accumulate, then toy-dtypes) without a sub-command; with
    both, --csv / --json FILE become FILE-accumulate / FILE-toy-dtypes."""
    args = build_parser().parse_args(argv)
    cmds = [args.cmd] if args.cmd else ["accumulate", "toy-dtypes"]
    for cmd in cmds:
        if cmd == "accumulate":
            rows, title = run_accumulate(getattr(args, "n", 1000), getattr(args, "value", 0.01))
        else:
            names = _cli.flatten(getattr(args, "dtype", None)) or ["fp16", "bf16"]
            rows, title = run_toy_dtypes(getattr(args, "device", None), names)
        report.print_table([_precise(r) for r in rows], title=title)
        csv_path = _suffixed(args.csv, cmd, len(cmds) > 1)
        json_path = _suffixed(args.json, cmd, len(cmds) > 1)
        report.save_rows(rows, csv_path=csv_path, json_path=json_path)
        for what, path in (("csv", csv_path), ("json", json_path)):
            if path is not None:
                print(f"{what}: {path}")
    return 0


def _suffixed(path: Path | None, name: str, several: bool) -> Path | None:
    """FILE.csv -> FILE-<name>.csv when one command writes several tables."""
    if path is None or not several:
        return path
    return path.with_name(f"{path.stem}-{name}{path.suffix}")


if __name__ == "__main__":
    sys.exit(main())
