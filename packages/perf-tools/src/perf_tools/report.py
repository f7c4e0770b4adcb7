"""Result tables: print to the terminal, save as CSV/JSON with run metadata, render Markdown.

Every perf_tools command produces a list of flat dicts (one per configuration) and hands them
here, so all tools print, save and describe their runs the same way.
"""

from __future__ import annotations

import csv
import datetime as _dt
import importlib
import importlib.metadata
import io
import json
import math
import os
import platform
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

Row = dict[str, Any]


# distribution name -> import name of this repo's packages, recorded in every run's metadata
PACKAGES = {
    "lm-core": "lm_core",
    "flashattn-triton": "flashattn_triton",
    "ddp-kit": "ddp_kit",
    "zero-shard": "zero_shard",
    "perf-tools": "perf_tools",
}


def run_metadata() -> dict[str, Any]:
    """Date, command, git commit, software versions (python, torch, triton, CUDA, cuDNN, NCCL,
    the NVIDIA driver, this repo's packages) and device: what a results table needs to be
    reproduced. Versions that do not apply here (CUDA on a CPU build) are None."""
    import torch

    meta: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "commit": _git_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _module_version("triton"),
        "cuda": torch.version.cuda,
        "cudnn": _cudnn_version(),
        "nccl": _nccl_version(),
        "driver": _driver_version(),
        "packages": {dist: _package_version(dist, mod) for dist, mod in PACKAGES.items()},
    }
    if torch.cuda.is_available():
        meta["device"] = torch.cuda.get_device_name(0)
        meta["device_count"] = torch.cuda.device_count()
    else:
        meta["device"] = f"cpu ({platform.processor() or platform.machine()})"
        meta["device_count"] = 0
    return meta


def _module_version(name: str) -> str | None:
    try:
        return str(importlib.import_module(name).__version__)
    except (ImportError, AttributeError):
        return None


def _package_version(dist: str, module: str) -> str | None:
    """The installed distribution's version, or the module's `__version__` when it runs from
    a source tree on PYTHONPATH (as on the GPU machine)."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return _module_version(module)


def _cudnn_version() -> int | None:
    import torch

    try:
        return torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    except RuntimeError:
        return None


def _nccl_version() -> str | None:
    import torch

    if not (torch.cuda.is_available() and hasattr(torch.cuda, "nccl")):
        return None
    try:
        version = torch.cuda.nccl.version()
    except (RuntimeError, AttributeError):
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _driver_version() -> str | None:
    """The NVIDIA kernel driver's version (e.g. '550.54.15'), None without one."""
    proc = Path("/proc/driver/nvidia/version")
    try:
        match = re.search(r"Kernel Module(?: for \S+)?\s+([\d.]+)", proc.read_text())
        if match:
            return match.group(1)
    except OSError:
        pass
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    first = out.stdout.strip().splitlines()[:1]
    return first[0].strip() if out.returncode == 0 and first else None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def ratio_trail(ratios: Sequence[float]) -> str:
    """Per-round ratios in round order as one cell, e.g. "0.743/0.906/1.008" (a drift, such
    as a slow first round, shows there and not in a median)."""
    return "/".join(f"{x:.3f}" for x in ratios)


def format_value(value: Any) -> str:
    """Compact, table-friendly text for one cell."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if value == 0:
            return "0"
        mag = abs(value)
        if mag >= 1000:
            return f"{value:,.0f}"
        if mag >= 100:
            return f"{value:.1f}"
        if mag >= 1:
            return f"{value:.2f}"
        if mag >= 0.01:
            return f"{value:.3f}"
        return f"{value:.2e}"
    return str(value)


def _columns(rows: Sequence[Row], columns: Sequence[str] | None) -> list[str]:
    if columns is not None:
        return list(columns)
    seen: dict[str, None] = {}
    for row in rows:
        for key in row:
            seen.setdefault(key, None)
    return list(seen)


def to_markdown(rows: Sequence[Row], columns: Sequence[str] | None = None) -> str:
    """A GitHub Markdown table of `rows` (missing cells print as '-')."""
    cols = _columns(rows, columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(format_value(row.get(c)) for c in cols) + " |")
    return "\n".join(lines)


def print_table(
    rows: Sequence[Row], columns: Sequence[str] | None = None, title: str | None = None
) -> None:
    """Print `rows` as a table: rich when installed, Markdown otherwise."""
    cols = _columns(rows, columns)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        if title:
            print(f"\n{title}")
        print(to_markdown(rows, cols))
        return
    table = Table(title=title, show_lines=False)
    for c in cols:
        table.add_column(c, justify="right" if _numeric(rows, c) else "left")
    for row in rows:
        table.add_row(*(format_value(row.get(c)) for c in cols))
    Console(width=max(120, 12 * len(cols))).print(table)


def _numeric(rows: Sequence[Row], col: str) -> bool:
    vals = [r.get(col) for r in rows if r.get(col) is not None]
    return bool(vals) and all(isinstance(v, int | float) and not isinstance(v, bool) for v in vals)


def save_rows(
    rows: Sequence[Row],
    *,
    csv_path: str | Path | None = None,
    json_path: str | Path | None = None,
    meta: dict[str, Any] | None = None,
    summary: Sequence[Row] | None = None,
) -> None:
    """Write `rows` to CSV and/or JSON. The JSON carries `meta` (run_metadata() by default)
    and, when given, `summary` (e.g. the median over rounds per configuration). Each file is
    replaced whole (written beside it, then renamed), so a run stopped while saving leaves
    the previous file, never a truncated one."""
    if csv_path is not None:
        cols = _columns(rows, None)
        text = io.StringIO(newline="")
        writer = csv.DictWriter(text, fieldnames=cols)
        writer.writeheader()
        for row in rows:
            writer.writerow({c: row.get(c) for c in cols})
        _replace_file(Path(csv_path), text.getvalue())
    if json_path is not None:
        payload = {"meta": meta if meta is not None else run_metadata(), "rows": list(rows)}
        if summary is not None:
            payload["summary"] = list(summary)
        _replace_file(Path(json_path), json.dumps(payload, indent=2, default=_json_default) + "\n")


def rows_saver(
    csv_path: str | Path | None, json_path: str | Path | None
) -> Callable[[Sequence[Row]], None]:
    """``save(rows)``: `save_rows` to these paths with one run's metadata, read now. A tool
    calls it as rows finish and once at the end, so a run stopped part-way keeps its rows;
    without a path it does nothing."""
    meta = run_metadata() if csv_path is not None or json_path is not None else None

    def save(rows: Sequence[Row]) -> None:
        if meta is not None:
            save_rows(rows, csv_path=csv_path, json_path=json_path, meta=meta)

    return save


def _replace_file(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file in the same folder and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("w", newline="") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "item"):
        return obj.item()
    return str(obj)


def plot_lines(
    rows: Sequence[Row],
    *,
    x: str,
    y: str,
    group_by: Sequence[str],
    path: str | Path,
    title: str,
    logx: bool = False,
    logy: bool = False,
    ylabel: str | None = None,
) -> Path:
    """One line per distinct value of `group_by` columns, `y` against `x`; saved as PNG.

    Rows whose `y` is missing (an OOM cell, a skipped provider) are left out of the lines.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[tuple, list[tuple[float, float]]] = {}
    for row in rows:
        yv = row.get(y)
        if not isinstance(yv, int | float) or isinstance(yv, bool) or math.isnan(yv):
            continue
        key = tuple(row.get(g) for g in group_by)
        groups.setdefault(key, []).append((row[x], yv))
    fig, ax = plt.subplots(figsize=(8, 5))
    for key, pts in sorted(groups.items(), key=lambda kv: str(kv[0])):
        pts.sort()
        label = ", ".join(f"{g}={v}" for g, v in zip(group_by, key))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(x)
    ax.set_ylabel(ylabel or y)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if groups:
        ax.legend(fontsize=7)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
