"""``--report DIR``: ``consistency.png`` and ``drift.png`` (needs matplotlib; no pyplot global state)."""

from __future__ import annotations

import os
from typing import Any


def matplotlib_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def _figure(rows: int):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 3.2 * rows), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _integer_rounds(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def write_plots(report: Any, out_dir: str) -> list[str]:
    """Write the plots of a run report into ``out_dir``; returns the paths written."""
    b, d = report.bitwise, report.drift
    if not b or not d:
        return []
    os.makedirs(out_dir, exist_ok=True)
    written = []
    rounds = [r["round"] for r in b["rounds"]]

    fig = _figure(2)
    ax1, ax2 = fig.subplots(2, 1, sharex=True)
    ax1.bar(rounds, [r["mismatch_count"] for r in b["rounds"]], color="tab:red")
    ax1.set_ylabel("mismatched tokens")
    ax1.set_title(f"train vs rollout log-probs ({'bitwise required' if report.require_exact else 'diagnostic'})")
    mx = [r["max_abs_diff"] for r in b["rounds"]]
    mn = [r["mean_abs_diff"] for r in b["rounds"]]
    if any(v > 0 for v in mx):  # log scale; exact zeros are left out of the lines
        ax2.set_yscale("log")
        mx = [v if v > 0 else float("nan") for v in mx]
        mn = [v if v > 0 else float("nan") for v in mn]
    ax2.plot(rounds, mx, marker="o", label="max |diff|")
    ax2.plot(rounds, mn, marker="s", label="mean |diff|")
    ax2.set_xlabel("round")
    ax2.set_ylabel("|train - rollout|")
    ax2.legend()
    _integer_rounds(ax2)
    path = os.path.join(out_dir, "consistency.png")
    fig.savefig(path, dpi=100)
    written.append(path)

    fig = _figure(2)
    ax1, ax2 = fig.subplots(2, 1)
    h = d.get("abs_histogram") or {}
    edges, counts = h.get("log10_edges") or [], h.get("counts") or []
    if edges:
        ax1.stairs(counts, edges, fill=True)
        used = [i for i, c in enumerate(counts) if c]
        if used:
            ax1.set_xlim(edges[used[0]] - 0.5, edges[used[-1] + 1] + 0.5)
    ax1.set_xlabel("log10 |train - rollout| (nonzero tokens)")
    ax1.set_ylabel("tokens")
    ax1.set_title(f"drift distribution: {h.get('zero', 0)} token(s) exactly equal")
    for key in ("abs_p50", "abs_p90", "abs_p99", "abs_max"):
        ax2.plot(rounds, [r.get(key, 0.0) for r in d["rounds"]], marker=".", label=key)
    ax2.set_xlabel("round")
    ax2.set_ylabel("|diff|")
    ax2.legend()
    _integer_rounds(ax2)
    path = os.path.join(out_dir, "drift.png")
    fig.savefig(path, dpi=100)
    written.append(path)
    return written
