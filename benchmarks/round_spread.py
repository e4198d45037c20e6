"""Per-round rollout and training throughput of several local-engine runs of one workload, side by side.

    python benchmarks/round_spread.py RESULT_DIR [RESULT_DIR ...] --out DIR [--mode consistency]

Each RESULT_DIR is a ``bench_local_engine.py`` output (``<mode>/metrics.jsonl`` inside). The runs must have done the
same work round for round — the same tokens, steps, prefill steps and rewards (R/R runs of one seed and config are
bitwise reproducible, so this holds across commits of the same arithmetic); the script says so or stops. What differs
between them is then the machine's timing alone: a round slow in one run and fast in another is run-to-run noise,
not a compile or the round's work. Writes ``round_spread.md`` and ``round_spread.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

WORK = ("rollout_tokens", "rollout_steps", "prefill_steps", "train_tokens", "reward_mean")


def load(run: Path, mode: str) -> list[dict]:
    path = run / mode / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"{run}: no {mode}/metrics.jsonl (a bench_local_engine.py result folder?)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def same_work(runs: dict[str, list[dict]]) -> str | None:
    """None when every run did the same work each round, else what differs."""
    names = list(runs)
    first = runs[names[0]]
    for name in names[1:]:
        rows = runs[name]
        if len(rows) != len(first):
            return f"{name}: {len(rows)} rounds, {names[0]}: {len(first)}"
        for a, b in zip(first, rows, strict=True):
            for key in WORK:
                if a.get(key) != b.get(key):
                    return f"round {a['round']}: {key} {a.get(key)} ({names[0]}) vs {b.get(key)} ({name})"
    return None


def ratios(values: list[float]) -> list[float]:
    """Each round after round 0 against the median of those rounds (the bench's round criterion)."""
    med = statistics.median(values[1:])
    return [v / med for v in values]


def table(runs: dict[str, list[dict]], key: str) -> list[str]:
    names = list(runs)
    lines = [f"| round | {' | '.join(names)} |", f"|---|{'---|' * len(names)}"]
    cols = {n: [r[key] for r in rows] for n, rows in runs.items()}
    rel = {n: ratios(v) for n, v in cols.items()}
    for i in range(len(next(iter(cols.values())))):
        cells = [f"{cols[n][i]:.4g} ({rel[n][i]:.2f}x)" for n in names]
        lines.append(f"| {i} | {' | '.join(cells)} |")
    worst = [f"{min(rel[n][1:]):.2f}x (round {1 + rel[n][1:].index(min(rel[n][1:]))})" for n in names]
    lines.append(f"| slowest after 0 | {' | '.join(worst)} |")
    return lines


def plot(runs: dict[str, list[dict]], path: Path, mode: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, key, title in ((axes[0], "rollout_tokens_per_s", "rollout"), (axes[1], "train_tokens_per_s", "train")):
        for name, rows in runs.items():
            ax.plot([r["round"] for r in rows], ratios([r[key] for r in rows]), marker="o", label=name)
        ax.axhspan(0.9, 1.1, color="0.9", zorder=0)
        ax.axhline(0.9, color="0.5", lw=0.8, ls="--")
        ax.set(title=f"{title} tok/s / median of rounds 1-N ({mode})", xlabel="round", ylabel="x median")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--mode", default="consistency")
    args = ap.parse_args(argv)
    runs = {p.name: load(p, args.mode) for p in args.runs}
    differs = same_work(runs)
    if differs is not None:
        print(f"the runs did different work: {differs}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    md = [f"# Per-round throughput, {args.mode}, {len(runs)} runs of one workload", "",
          f"Every round did the same work in every run ({', '.join(WORK)} equal). Each cell: tok/s "
          "(x the median of that run's rounds after round 0).", "", "## rollout", "",
          *table(runs, "rollout_tokens_per_s"), "", "## train", "", *table(runs, "train_tokens_per_s"), ""]
    if plot(runs, args.out / "round_spread.png", args.mode):
        md += ["![per-round throughput](round_spread.png)", ""]
    (args.out / "round_spread.md").write_text("\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
