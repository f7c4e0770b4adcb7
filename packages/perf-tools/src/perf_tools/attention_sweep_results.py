"""What an attention sweep's rows say: each provider's median, ours against the best SDPA
backend (timed and, with ``--graphed``, as GPU time alone), the per-round ratio range, the
summary line and the plot (``perf_tools.attention_sweep`` fills the rows)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from perf_tools.report import ratio_trail

# What a cell may time besides "ms" (fwd + bwd as timed): GPU time alone (``--graphed``)
# and host time to issue a call (``--host``); each gets ours over the best SDPA.
EXTRA_KINDS = ("graphed_ms", "host_us")
RATIOS = (
    ("ms", "ours_vs_best", ""),
    ("graphed_ms", "ours_graphed_vs_best", "as GPU time alone, "),
    ("host_us", "ours_host_vs_best", "as host time to issue a call, "),
)


def fill_medians(
    row: dict[str, Any],
    providers: Sequence[str],
    cells: dict[str, list[dict[str, float]]],
    notes: dict[str, str],
) -> None:
    """Each provider's median ms over its rounds (and of GPU-only ms and host us where timed),
    or None and why it did not run."""
    for p in providers:
        if p in notes:
            row[f"{p}_ms"] = None
            row[f"{p}_note"] = notes[p]
            continue
        for kind in ("ms", *(k for k in EXTRA_KINDS if k in cells[p][0])):
            row[f"{p}_{kind}"] = statistics.median(c[kind] for c in cells[p])


def ratio_range(
    row: dict[str, Any],
    providers: Sequence[str],
    cells: dict[str, list[dict[str, float]]],
    notes: dict[str, str],
) -> None:
    """The lowest and highest per-round ratio of ours to the best SDPA of the same round, and
    every round's ratio in round order (``ours_vs_best_rounds``, e.g. "0.96/1.59/1.58": a
    drift, such as a slow first round, shows there and not in the medians)."""
    sdpa = [p for p in providers if p != "ours" and p not in notes]
    if "ours" not in providers or "ours" in notes or not sdpa:
        return
    ratios = [
        cells["ours"][r]["ms"] / min(cells[p][r]["ms"] for p in sdpa)
        for r in range(len(cells["ours"]))
    ]
    row["ours_vs_best_min"] = min(ratios)
    row["ours_vs_best_max"] = max(ratios)
    row["ours_vs_best_rounds"] = ratio_trail(ratios)


def add_ratios(row: dict[str, Any], providers: Sequence[str]) -> None:
    """ours / best SDPA where both ran, and the same of the GPU-only times and host times
    where timed (``ours_graphed_vs_best``, ``ours_host_vs_best``: each against the backend
    best at that measure, not necessarily the one faster as timed)."""
    for kind, ratio, _ in RATIOS:
        ours = row.get(f"ours_{kind}")
        sdpa = [row.get(f"{p}_{kind}") for p in providers if p != "ours"]
        sdpa = [t for t in sdpa if t is not None]
        if ours is None or not sdpa:
            continue
        best = min(sdpa)
        row[ratio] = ours / best
        if kind == "ms":
            row["best_sdpa_ms"] = best
            row["ours_wins"] = ours <= best


def mode_label(row: dict[str, Any]) -> str:
    """The row's mode, with the autograd-thread setting where the sweep had both."""
    threads = row.get("autograd_threads")
    return row["mode"] if threads is None else f"{row['mode']} (autograd threads {threads})"


def shape_label(row: dict[str, Any]) -> str:
    """HEADSxN, or BxHEADSxN for rows of a batch."""
    batch = row.get("batch", 1)
    return f"{row['heads']}x{row['N']}" if batch == 1 else f"{batch}x{row['heads']}x{row['N']}"


def summary(rows: Sequence[dict[str, Any]]) -> str:
    """Rows where ours is at or under the best SDPA and the worst ratio: one line, and a
    second of the GPU-only times where the sweep timed them (``--graphed``)."""
    lines = []
    for _, ratio, what in RATIOS:
        rated = [r for r in rows if ratio in r]
        if not rated:
            continue
        wins = sum(r[ratio] <= 1 for r in rated)
        worst = max(rated, key=lambda r: r[ratio])
        where = f"{mode_label(worst)} causal={worst['causal']} d={worst['d']} {shape_label(worst)}"
        lines.append(
            f"{what}ours <= best SDPA on {wins}/{len(rated)} rows; "
            f"worst ratio {worst[ratio]:.3f} ({where})"
        )
    return "\n".join(lines) or "no row has both ours and an SDPA time"


def plot(rows: Sequence[dict[str, Any]], path) -> None:
    """ours / best SDPA per shape (x: heads x N), one line per (mode, causal, d); below the
    dotted line at 1 ours is faster. GPU-only times (``--graphed``) and host times
    (``--host``) get a panel each beside the timed one, so host-bound rows stand out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("ours_vs_best", "fwd+bwd time, host included")]
    for ratio, what in (
        ("ours_graphed_vs_best", "GPU time alone (one CUDA graph)"),
        ("ours_host_vs_best", "host time to issue a call"),
    ):
        if any(ratio in r for r in rows):
            panels.append((ratio, what))
    shapes = sorted({(r["heads"], r["N"]) for r in rows}, key=lambda s: (s[1], s[0]))
    fig, axes = plt.subplots(
        1, len(panels), figsize=(9 * len(panels), 5), sharey=True, squeeze=False
    )
    batch = rows[0].get("batch", 1) if rows else 1
    for ax, (ratio, what) in zip(axes[0], panels):
        _plot_ratio(ax, rows, shapes, ratio)
        ax.set_xlabel("heads x N" if batch == 1 else f"heads x N, batch {batch}")
        ax.set_title(f"ours / best SDPA: {what} (below 1: ours faster)", fontsize=10)
    axes[0][0].set_ylabel("ours / best SDPA")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_ratio(ax, rows: Sequence[dict[str, Any]], shapes: list, ratio: str) -> None:
    """One line per (mode, causal, d) of ``ratio`` over ``shapes`` on ``ax``."""
    groups = sorted({(mode_label(r), r["causal"], r["d"]) for r in rows}, key=str)
    for mode, causal, d in groups:
        pts = [
            (shapes.index((r["heads"], r["N"])), r[ratio])
            for r in rows
            if (mode_label(r), r["causal"], r["d"]) == (mode, causal, d) and ratio in r
        ]
        if pts:
            xs, ys = zip(*sorted(pts))
            style = "-" if mode.startswith("eager") else "--"
            label = f"{mode}, {'causal' if causal else 'full'}, d={d}"
            ax.plot(xs, ys, style, marker="o", label=label)
    ax.axhline(1.0, color="black", linestyle=":", linewidth=1)
    ax.set_xticks(range(len(shapes)), [f"{h}x{n}" for h, n in shapes], rotation=30)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # rows without a ratio (e.g. on a CPU) draw none
        ax.legend(fontsize=7)
