"""``rlk-repro report``: plots and a summary table for one or more run directories (e.g. native vs consistency).

Reads each run's ``manifest.json`` and ``metrics.jsonl`` (nothing else; run ``rlk-validate`` for the
evidence checks) and writes into the output directory:

- ``consistency.png``: per round, the mismatch rate, the mismatch count and the max / mean |diff| of
  train vs rollout log-probs;
- ``learning.png``: reward (mean, with the group-std band) and the fraction of responses cut at their
  token limit;
- ``optimization.png``: GRPO loss and gradient norm;
- ``performance.png``: rollout and training seconds per round and their tokens/s;
- ``metrics-summary.md`` / ``metrics-summary.json``: per run, the token exposure, cumulative mismatches, token-weighted
  mean |diff|, max |diff|, mean reward, truncation, round time and throughput (rounds after the first,
  which includes kernel compilation).

Plots need matplotlib (``pip install 'rlk-validate[plot]'``); without it only the summary is written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlk_core.errors import RlkConfigError

METRICS_SCHEMA = "rlk.metrics.v1"


@dataclass
class RunMetrics:
    label: str
    path: Path
    manifest: dict[str, Any]
    rows: list[dict[str, Any]]

    def series(self, key: str) -> list[float]:
        return [float(r[key]) if r.get(key) is not None else float("nan") for r in self.rows]

    @property
    def rounds(self) -> list[int]:
        return [int(r["round"]) for r in self.rows]


def load_run(path: str | Path) -> RunMetrics:
    run = Path(path)
    if not run.is_dir():
        raise RlkConfigError(f"{run} is not a run directory")
    try:
        manifest = json.loads((run / "manifest.json").read_text(encoding="utf-8"))
        lines = (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise RlkConfigError(f"{run}: cannot read {Path(exc.filename).name if exc.filename else 'its files'} "
                             f"({exc.strerror}); is it an rlk-repro run directory?") from None
    except json.JSONDecodeError as exc:
        raise RlkConfigError(f"{run}/manifest.json is not valid JSON ({exc})") from None
    rows = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RlkConfigError(f"{run}/metrics.jsonl line {i} is not valid JSON ({exc})") from None
        if row.get("schema") != METRICS_SCHEMA:
            raise RlkConfigError(f"{run}/metrics.jsonl line {i}: schema is {row.get('schema')!r}, "
                                 f"expected {METRICS_SCHEMA!r}")
        rows.append(row)
    if not rows:
        raise RlkConfigError(f"{run}/metrics.jsonl holds no rounds (the run stopped before its first round)")
    plan = manifest.get("plan") or {}
    cases = sorted(set(plan.values()))
    label = f"{manifest.get('mode', '?')} {cases[0] if len(cases) == 1 else plan} ({run.name})"
    return RunMetrics(label, run, manifest, rows)


def _tokens(row: dict[str, Any], phase: str) -> float:
    if f"{phase}_tokens" in row:
        return float(row[f"{phase}_tokens"])
    return float(row[f"{phase}_tokens_per_s"]) * float(row[f"{phase}_seconds"])  # older runs: rate x time


def pooled_rate(rows: list[dict[str, Any]], phase: str, tokens_key: str | None = None) -> float:
    """Tokens per second of ``phase`` (``rollout`` / ``train``) pooled over ``rows``: all tokens over all
    seconds (``tokens_key`` counts other tokens, e.g. ``response_tokens``), not a mean of rates."""
    seconds = sum(float(r[f"{phase}_seconds"]) for r in rows)
    tokens = sum(float(r[tokens_key]) if tokens_key else _tokens(r, phase) for r in rows)
    return tokens / seconds if seconds > 0 else float("nan")


def summarize(run: RunMetrics) -> dict[str, Any]:
    rows = run.rows
    steady = rows[1:] or rows
    compared = sum(int(r["compared_tokens"]) for r in rows)
    samples = sum(int(r.get("samples", 0)) for r in rows)

    def rate(phase: str) -> float:
        return pooled_rate(steady, phase)

    return {
        "label": run.label, "run_dir": str(run.path), "run_id": run.manifest.get("run_id"),
        "mode": run.manifest.get("mode"), "plan": run.manifest.get("plan"), "rounds": len(rows),
        "compared_tokens": compared, "mismatch_count": sum(int(r["mismatch_count"]) for r in rows),
        "mean_abs_diff": (sum(float(r["mean_abs_diff"]) * int(r["compared_tokens"]) for r in rows) / compared
                          if compared else float("nan")),
        "max_abs_diff": max(float(r["max_abs_diff"]) for r in rows),
        "reward_mean": sum(float(r["reward_mean"]) for r in rows) / len(rows),
        "truncation": (1.0 - sum(int(r.get("eos_finished", 0)) for r in rows) / samples) if samples else float("nan"),
        "round_seconds": sum(float(r["rollout_seconds"]) + float(r["train_seconds"]) for r in steady) / len(steady),
        "rollout_tokens_per_s": rate("rollout"), "train_tokens_per_s": rate("train"),
    }


SUMMARY_COLUMNS = [("label", "run"), ("rounds", "rounds"), ("compared_tokens", "compared tokens"),
                   ("mismatch_count", "mismatches"), ("mean_abs_diff", "mean abs diff (token-weighted)"),
                   ("max_abs_diff", "max abs diff"), ("reward_mean", "reward"), ("truncation", "truncated"),
                   ("round_seconds", "s / round"), ("rollout_tokens_per_s", "rollout tok/s"),
                   ("train_tokens_per_s", "train tok/s")]


def summary_markdown(summaries: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(h for _, h in SUMMARY_COLUMNS) + " |", "|" + "---|" * len(SUMMARY_COLUMNS)]
    for s in summaries:
        cells = [f"{s[k]:.3g}" if isinstance(s[k], float) else str(s[k]) for k, _ in SUMMARY_COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return ("# rlk-repro report\n\nThroughput and s / round: rounds after the first (round 0 compiles kernels). "
            "Truncated: responses that reached their token limit.\n\n" + "\n".join(lines) + "\n")


def _figure(rows: int, cols: int = 1):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8 * cols, 3.0 * rows), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _positive_or_gap(values: list[float], log: bool) -> list[float]:
    """On a log axis exact zeros (an all-R/R run) are drawn as gaps; the summary table has the zeros."""
    return [v if v > 0 else float("nan") for v in values] if log else values


def write_plots(runs: list[RunMetrics], out: Path) -> list[Path]:
    from matplotlib.ticker import MaxNLocator

    written = []

    def save(fig, name: str) -> None:
        for ax in fig.axes:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(alpha=0.3)
        fig.axes[-1].set_xlabel("round")
        fig.savefig(out / name, dpi=110)
        written.append(out / name)

    fig = _figure(3)
    a1, a2, a3 = fig.subplots(3, 1, sharex=True)
    log = any(v > 0 for run in runs for v in run.series("max_abs_diff"))
    for run in runs:
        counts, compared = run.series("mismatch_count"), run.series("compared_tokens")
        a1.plot(run.rounds, [m / c if c else float("nan") for m, c in zip(counts, compared)], marker="o",
                label=run.label)
        a2.plot(run.rounds, counts, marker="o", label=run.label)
        zero = " (0 every round)" if log and not any(v > 0 for v in run.series("max_abs_diff")) else ""
        (line,) = a3.plot(run.rounds, _positive_or_gap(run.series("max_abs_diff"), log), marker="o",
                          label=f"{run.label}: max{zero}")
        a3.plot(run.rounds, _positive_or_gap(run.series("mean_abs_diff"), log), marker=".", linestyle="--",
                color=line.get_color(), label=f"{run.label}: mean")
    if log:
        a3.set_yscale("log")
    a1.set_ylabel("mismatch rate")
    a1.set_title("train vs rollout log-probs of the sampled tokens")
    a2.set_ylabel("mismatched tokens")
    a3.set_ylabel("abs(train - rollout)")
    a1.legend(fontsize="small")
    a3.legend(fontsize="x-small")
    save(fig, "consistency.png")

    fig = _figure(2)
    a1, a2 = fig.subplots(2, 1, sharex=True)
    for run in runs:
        mean, std = run.series("reward_mean"), run.series("reward_std")
        (line,) = a1.plot(run.rounds, mean, marker="o", label=run.label)
        a1.fill_between(run.rounds, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                        color=line.get_color(), alpha=0.15)
        trunc = [1.0 - e / n if n else float("nan") for e, n in zip(run.series("eos_finished"), run.series("samples"))]
        a2.plot(run.rounds, trunc, marker="o", label=run.label)
    a1.set_ylabel("reward (mean ± std)")
    a1.set_title("learning")
    a2.set_ylabel("truncated responses")
    a1.legend(fontsize="small")
    save(fig, "learning.png")

    fig = _figure(2)
    a1, a2 = fig.subplots(2, 1, sharex=True)
    for run in runs:
        a1.plot(run.rounds, run.series("loss"), marker="o", label=run.label)
        a2.plot(run.rounds, run.series("grad_norm"), marker="o", label=run.label)
    a1.set_ylabel("GRPO loss")
    a1.set_title("optimization")
    a2.set_ylabel("gradient norm")
    a1.legend(fontsize="small")
    save(fig, "optimization.png")

    fig = _figure(2)
    a1, a2 = fig.subplots(2, 1, sharex=True)
    for run in runs:
        (line,) = a1.plot(run.rounds, run.series("rollout_seconds"), marker="o", label=f"{run.label}: rollout")
        a1.plot(run.rounds, run.series("train_seconds"), marker="s", linestyle="--", color=line.get_color(),
                label=f"{run.label}: train")
        (line,) = a2.plot(run.rounds, run.series("rollout_tokens_per_s"), marker="o", label=f"{run.label}: rollout")
        a2.plot(run.rounds, run.series("train_tokens_per_s"), marker="s", linestyle="--", color=line.get_color(),
                label=f"{run.label}: train")
    a1.set_ylabel("seconds per round")
    a1.set_title("performance")
    a2.set_ylabel("tokens / s")
    a2.set_yscale("log")
    a1.legend(fontsize="x-small")
    save(fig, "performance.png")
    return written


def write_report(run_dirs: list[str], output: str | None) -> tuple[list[dict[str, Any]], list[Path], str | None]:
    """Load the runs, write the summary (and the plots when matplotlib is there) into ``output`` (default:
    the ``report/`` folder of a single run). Returns ``(summaries, files written, why plots were skipped)``."""
    runs = [load_run(d) for d in run_dirs]
    if output is None:
        if len(runs) > 1:
            raise RlkConfigError("--output is required when reporting more than one run")
        out = runs[0].path / "report"
    else:
        out = Path(output)
    if out.exists() and not out.is_dir():
        raise RlkConfigError(f"--output {out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    summaries = [summarize(r) for r in runs]
    doc = {"schema": "rlk.repro-report.v1", "runs": summaries}
    (out / "metrics-summary.json").write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    (out / "metrics-summary.md").write_text(summary_markdown(summaries), encoding="utf-8")
    written = [out / "metrics-summary.json", out / "metrics-summary.md"]
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        return summaries, written, "matplotlib is not installed (pip install 'rlk-validate[plot]')"
    return summaries, written + write_plots(runs, out), None
