"""``rlk-repro report``: plots and a summary table for run directories and matrix roots.

Each argument is a run directory or a matrix root (``rlk-repro matrix``: one directory per cell such as
``control-RR``, ``ffn-PR``, ``native-PP``; see :mod:`rlk_validate.matrix`), whose cells are then reported
side by side. Reads each run's ``manifest.json`` and ``metrics.jsonl`` (nothing else; run ``rlk-validate``
for the evidence checks) and writes into the output directory:

- ``consistency.png``: per round, the mismatch rate and count and the max / mean |diff| of train vs
  rollout log-probs;
- ``learning.png``: reward (mean; with the group-std band for one or two runs), the fraction of responses cut at
  their token limit, and how much each round's evidence says (issue 41, item 13): the entropy of the sampling
  distribution in nats against its ceiling ``log V`` (exact where the engine computes it, else estimated from the
  sampled tokens' log-probs, marked ``~``) and the share of informative tokens (rollout log-prob below -1e-3)
  against rlk-validate's bound (:data:`rlk_validate.evidence.MIN_INFORMATIVE_FRACTION`);
- ``optimization.png``: GRPO loss and gradient norm;
- ``performance.png``: rollout and training seconds per round and their tokens/s;
- ``matrix.png`` (for a matrix root): every cell's pooled mismatch rate, max / mean |diff| and throughput
  as bars side by side;
- ``metrics-summary.md`` / ``metrics-summary.json``: per run, the token exposure, cumulative mismatches,
  token-weighted mean |diff|, max |diff|, mean reward, truncation, round time and throughput (rounds
  after the first, which is warm-up and, on CUDA runs with R routes, compiles the Triton kernels), the entropy and
  the informative share of every round; a warning names a run whose informative share fell below the bound.

Runs are named by their routes (``consistency R/R``, ``ffn P/R``, ``native P/P``), and marked where they did
not end well (``[interrupted (130)]``, ``[unfinished (no exit-code)]``, ...); every run has its own colour, line
style and marker; a panel says which curves coincide exactly (drawn on top of each other) and says "no
differences" when every value is zero; log-prob differences are in nats. Every figure names the runs' model,
device, dtype, commit and run ids, notes where an R side ran the CPU reference, and warns when the compared runs
differ in anything but their routes (:mod:`rlk_repro.report_meta`); the summary has an exit-status and a
validated column. Plots need matplotlib (``pip install 'rlk-validate[plot]'``); without it only the summary is
written.
"""

from __future__ import annotations

import json
import math
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlk_core.errors import RlkConfigError
from rlk_repro import report_meta, report_pairs
from rlk_validate import evidence
from rlk_validate.evidence import METRICS_SCHEMA, MODULES

DPI = 100


@dataclass
class RunMetrics:
    label: str
    path: Path
    manifest: dict[str, Any]
    rows: list[dict[str, Any]]
    cell: str | None = None  # the matrix cell name when the run was found in a matrix root
    route: str = ""  # route_label() of the plan; ``label`` adds the directory name where two runs share it
    status: dict[str, Any] = field(default_factory=dict)  # report_meta.status(): exit status and validation

    def series(self, key: str) -> list[float]:
        return [float(r[key]) if r.get(key) is not None else float("nan") for r in self.rows]

    def entropy(self) -> tuple[list[float], bool]:
        """Per round, the mean entropy of the sampling distribution in nats: ``entropy_mean`` where the engine
        computed it exactly, else ``sampled_nll_mean`` (the sampled tokens' mean -log p, its estimate); the flag
        says whether any round is such an estimate. NaN where a row records neither (runs before issue 41)."""
        values, estimated = [], False
        for r in self.rows:
            if r.get("entropy_mean") is not None:
                values.append(float(r["entropy_mean"]))
            elif r.get("sampled_nll_mean") is not None:
                values.append(float(r["sampled_nll_mean"]))
                estimated = True
            else:
                values.append(float("nan"))
        return values, estimated

    @property
    def rounds(self) -> list[int]:
        return [int(r["round"]) for r in self.rows]

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def plan(self) -> dict[str, str]:
        plan = self.manifest.get("plan")
        return {str(k): str(v) for k, v in plan.items()} if isinstance(plan, dict) else {}

    @property
    def kernels_compiled(self) -> bool:
        return kernels_compiled(self.manifest)


def route_label(plan: dict[str, str], mode: str | None = None) -> str:
    """A run's name in legends and tables, from its routes: ``consistency R/R`` and ``native P/P`` for a
    uniform plan, ``ffn P/R`` for one module off R/R, ``attention P/R, ffn R/P`` for several."""
    cases = set(plan.values())
    if not plan:
        return mode or "?"
    if cases == {"R/R"}:
        return "consistency R/R"
    if cases == {"P/P"}:
        return "native P/P"
    if len(cases) == 1:
        return f"all {cases.pop()}"
    return ", ".join(f"{m} {c}" for m, c in sorted(plan.items(), key=_module_order) if c != "R/R")


def _module_order(item: tuple[str, str]) -> tuple[int, str]:
    return (MODULES.index(item[0]) if item[0] in MODULES else len(MODULES), item[0])


def kernels_compiled(manifest: dict[str, Any]) -> bool:
    """Whether round 0 of this run compiled kernels: a CUDA run (per the manifest's hardware / config
    device) with at least one R route, whose rlk ops run as Triton kernels built on first use."""
    device = (manifest.get("hardware") or {}).get("device") or (manifest.get("config") or {}).get("device") or ""
    plan = manifest.get("plan")
    has_r = isinstance(plan, dict) and any("R" in str(c) for c in plan.values())
    return str(device).startswith("cuda") and has_r


def load_run(path: str | Path, cell: str | None = None) -> RunMetrics:
    run = Path(path)
    if not run.is_dir():
        raise RlkConfigError(f"{run} is not a run directory")
    try:
        manifest = json.loads((run / "manifest.json").read_text(encoding="utf-8"))
        lines = (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise RlkConfigError(f"{run}: cannot read {Path(exc.filename).name if exc.filename else 'its files'} "
                             f"({exc.strerror}); is it an rlk-repro run directory or matrix root?") from None
    except json.JSONDecodeError as exc:
        raise RlkConfigError(f"{run}/manifest.json is not valid JSON ({exc})") from None
    if not isinstance(manifest, dict):
        raise RlkConfigError(f"{run}/manifest.json is not a JSON object")
    rows = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RlkConfigError(f"{run}/metrics.jsonl line {i} is not valid JSON ({exc})") from None
        if not isinstance(row, dict) or row.get("schema") != METRICS_SCHEMA:
            schema = row.get("schema") if isinstance(row, dict) else None
            raise RlkConfigError(f"{run}/metrics.jsonl line {i}: schema is {schema!r}, expected {METRICS_SCHEMA!r}")
        rows.append(row)
    if not rows:
        raise RlkConfigError(f"{run}/metrics.jsonl holds no rounds (the run stopped before its first round)")
    result = RunMetrics("", run, manifest, rows, cell)
    result.route = route_label(result.plan, manifest.get("mode"))
    result.status = report_meta.status(run)
    result.label = result.route + ("" if result.status["ok"] else f" [{result.status['exit']}]")
    return result


def matrix_cells(root: str | Path) -> list[Path] | None:
    """The cell directories of a matrix root in the matrix's own order (``control-RR``, the isolation
    cells module by module, ``native-PP``), or None when ``root`` is not a matrix root."""
    from rlk_validate.matrix import REQUIRED_CELLS, expected_plan  # control-RR, then the isolation cells

    root = Path(root)
    if not root.is_dir() or (root / "manifest.json").exists():
        return None
    order = {name: i for i, name in enumerate((*REQUIRED_CELLS, "native-PP"))}
    cells = [p for p in root.iterdir() if p.is_dir() and expected_plan(p.name) is not None]
    return sorted(cells, key=lambda p: (order.get(p.name, len(order)), p.name)) or None


def phase_cells(root: str | Path) -> list[Path] | None:
    """The run directories of a phase root (``phase-pair.json``), in the order they ran; None: not a phase root."""
    from rlk_repro.phase_pairs import read_pair_root

    doc = read_pair_root(root) if Path(root).is_dir() else None
    if doc is None:
        return None
    return [Path(root) / str(c.get("dir")) for c in doc["cells"] if isinstance(c, dict)] or None


@dataclass
class Loaded:
    runs: list[RunMetrics]
    skipped: list[str] = field(default_factory=list)  # "<cell dir>: why" for matrix cells that could not be read
    matrix_roots: list[Path] = field(default_factory=list)
    phase_roots: list[Path] = field(default_factory=list)  # issue 37: rlk-repro run --phase P --pair


def load_runs(paths: list[str | Path]) -> Loaded:
    """Load run directories and matrix roots (expanded into their cells). A matrix cell that cannot be read
    (it failed before its first round) is skipped and named; an unreadable run directory is an error.
    Runs that would share a label get their directory name appended."""
    loaded = Loaded([])
    for p in paths:
        cells = matrix_cells(p)
        if cells is None and phase_cells(p) is not None:  # issue 37: a phase root stands for its runs
            cells = phase_cells(p)
            loaded.phase_roots.append(Path(p))
        elif cells is not None:
            loaded.matrix_roots.append(Path(p))
        if cells is None:
            loaded.runs.append(load_run(p))
            continue
        skipped = []
        for cell in cells:
            try:
                loaded.runs.append(load_run(cell, cell=cell.name))
            except RlkConfigError as exc:
                skipped.append(str(exc))  # the message starts with the cell's path
        if len(skipped) == len(cells):
            raise RlkConfigError(f"{p}: a matrix root without a readable cell ({'; '.join(skipped)})")
        loaded.skipped += skipped
    labels = [r.label for r in loaded.runs]
    for r in loaded.runs:
        if labels.count(r.label) > 1:
            r.label = f"{r.label} ({r.name})"
    return loaded


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
        "label": run.label, "name": run.name, "cell": run.cell, "run_dir": str(run.path),
        "run_id": run.manifest.get("run_id"), "mode": run.manifest.get("mode"), "plan": run.manifest.get("plan"),
        "kernels_compiled": run.kernels_compiled, "rounds": len(rows),
        "compared_tokens": compared, "mismatch_count": sum(int(r["mismatch_count"]) for r in rows),
        "mean_abs_diff": (sum(float(r["mean_abs_diff"]) * int(r["compared_tokens"]) for r in rows) / compared
                          if compared else float("nan")),
        "max_abs_diff": max(float(r["max_abs_diff"]) for r in rows),
        "reward_mean": sum(float(r["reward_mean"]) for r in rows) / len(rows),
        "truncation": (1.0 - sum(int(r.get("eos_finished", 0)) for r in rows) / samples) if samples else float("nan"),
        "round_seconds": sum(float(r["rollout_seconds"]) + float(r["train_seconds"]) for r in steady) / len(steady),
        "rollout_tokens_per_s": rate("rollout"), "train_tokens_per_s": rate("train"),
        "exit": run.status.get("exit"), "exit_code": run.status.get("exit_code"),
        "validated": run.status.get("validated"), **report_meta.provenance(run.manifest),
        "reference_note": report_meta.reference_note(run.path, run.plan),
        "claims": report_meta.claims_text(run.manifest),  # issue 37: random weights / fixtures claim nothing
        **routing_summary(rows), **evidence_summary(run),
    }


def _finite(values: list[float]) -> list[float]:
    return [v for v in values if not math.isnan(v)]


def evidence_summary(run: RunMetrics) -> dict[str, Any]:
    """How much the run's evidence says, per round (issue 41, item 13): the entropy (nats; ``~`` where estimated),
    its ceiling ``log V``, the informative share, and the rounds whose share is below rlk-validate's bound."""
    entropy, estimated = run.entropy()
    informative = run.series("informative_fraction")
    ceiling = _finite(run.series("max_entropy"))
    low = [rnd for rnd, f in zip(run.rounds, informative, strict=True)
           if not math.isnan(f) and f < evidence.MIN_INFORMATIVE_FRACTION]
    mark = "~" if estimated else ""
    return {
        "entropy_per_round": [None if math.isnan(v) else v for v in entropy], "entropy_estimated": estimated,
        "max_entropy": ceiling[0] if ceiling else None,
        "informative_per_round": [None if math.isnan(v) else v for v in informative],
        "informative_low_rounds": low,
        "entropy": (f"{mark}{_finite(entropy)[0]:.3g} -> {mark}{_finite(entropy)[-1]:.3g}" if _finite(entropy)
                    else "not recorded"),
        "informative": f"{100 * min(_finite(informative)):.0f}%" if _finite(informative) else "not recorded",
    }


def evidence_warnings(summaries: list[dict[str, Any]]) -> list[str]:
    """A run whose informative share fell below rlk-validate's bound in some round: its bitwise claim there is
    about saturated tokens (rlk-validate's INFORMATIVE_FRACTION_LOW)."""
    return [f"{s['label']}: informative tokens (rollout log-prob < {evidence.INFORMATIVE_LOGP:g}) below "
            f"rlk-validate's bound {evidence.MIN_INFORMATIVE_FRACTION:g} in round(s) "
            + ", ".join(map(str, s["informative_low_rounds"])) for s in summaries if s.get("informative_low_rounds")]


def _per_round(values: list[float | None], fmt: str) -> str:
    return ", ".join("-" if v is None else format(v, fmt) for v in values)


def routing_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Issue 36: an MoE run's tokens routed to another expert set by the rollout than by the trainer, all rounds
    (``rlk_repro.engine.routing``); a dense run's ``routing`` says so."""
    routed = [r for r in rows if "routing_compared_tokens" in r]
    if not routed:
        return {"routing_compared_tokens": None, "routing_mismatch_tokens": None, "routing": "dense"}
    n = sum(int(r["routing_compared_tokens"]) for r in routed)
    m = sum(int(r["routing_mismatch_tokens"]) for r in routed)
    return {"routing_compared_tokens": n, "routing_mismatch_tokens": m,
            "routing": f"{m} of {n} ({100 * m / n:.2g}%)" if n else "0 of 0"}


SUMMARY_COLUMNS = [("label", "run"), ("name", "directory"), ("rounds", "rounds"),
                   ("compared_tokens", "compared tokens"), ("mismatch_count", "mismatches"),
                   ("routing", "tokens routed differently (MoE)"),
                   ("mean_abs_diff", "mean abs diff (token-weighted)"), ("max_abs_diff", "max abs diff"),
                   ("reward_mean", "reward"), ("entropy", "entropy (nats, first -> last round)"),
                   ("informative", "informative (lowest round)"),
                   ("truncation", "truncated"), ("round_seconds", "s / round"),
                   ("rollout_tokens_per_s", "rollout tok/s"), ("train_tokens_per_s", "train tok/s"),
                   ("exit", "exit status"), ("validated", "validated")]


def warmup_note(summaries: list[dict[str, Any]]) -> str:
    """What round 0 did, as the summary and the performance plot say it: warm-up, plus Triton kernel
    compilation only for the runs that compiled kernels."""
    compiled = [s["label"] for s in summaries if s.get("kernels_compiled")]
    note = "round 0 is warm-up"
    if compiled:
        every = len(compiled) == len(summaries)
        note += f" and compiles the Triton kernels ({'every run' if every else ', '.join(compiled)})"
    return note


def summary_markdown(summaries: list[dict[str, Any]], skipped: list[str] | None = None,
                     warnings: list[str] | None = None) -> str:
    lines = ["| " + " | ".join(h for _, h in SUMMARY_COLUMNS) + " |", "|" + "---|" * len(SUMMARY_COLUMNS)]
    for s in summaries:
        cells = [f"{s[k]:.3g}" if isinstance(s[k], float) else str(s[k]) for k, _ in SUMMARY_COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    text = ("# rlk-repro report\n\n" + "".join(f"**Warning: {w}**\n\n" for w in warnings or [])
            + "Throughput and s / round count the rounds after the first "
            f"({warmup_note(summaries)}). Truncated: responses that reached their token limit. Abs diffs are "
            "|train - rollout| log-prob differences in nats.\n\n" + "\n".join(lines) + "\n")
    text += ("\nPer round (issue 41: how much the evidence says): the entropy of the sampling distribution in nats "
             "(~: estimated from the sampled tokens' log-probs) of at most log V, and the informative tokens' share "
             f"(rollout log-prob < {evidence.INFORMATIVE_LOGP:g}; rlk-validate's bound "
             f"{evidence.MIN_INFORMATIVE_FRACTION:g}):\n\n" + "".join(
                 f"- {s['label']}: entropy {'~' if s['entropy_estimated'] else ''}"
                 f"[{_per_round(s['entropy_per_round'], '.3g')}]"
                 + (f" of {s['max_entropy']:.3g}" if s.get("max_entropy") else "")
                 + f"; informative [{_per_round(s['informative_per_round'], '.0%')}]\n" for s in summaries))
    text += "\nProvenance:\n\n" + "".join(
        f"- {s['label']}: run {s['run_id']}, model {s['model']}, {s['device']}, {s['dtype']}, commit {s['commit']}"
        + (f"; {s['reference_note']}" if s.get("reference_note") else "") + "\n" for s in summaries)
    text += "\nClaims (issue 37: a random-weight model, the stand-in reward or a developer fixture backs no " \
        "experiment or reward claim):\n\n" + "".join(f"- {s['label']}: {s['claims']}\n" for s in summaries)
    if skipped:
        text += "\nNot reported (no readable metrics):\n\n" + "".join(f"- {s}\n" for s in skipped)
    return text


# -- plots -------------------------------------------------------------------------------------------
# Matrix cells and the two modes keep one look across every report: the module picks the hue family,
# the case the line style; every cell has its own colour and marker.
CELL_STYLES: dict[str, tuple[str, str, str]] = {
    "consistency R/R": ("#000000", "-", "o"), "native P/P": ("#9467bd", ":", "s"),
    "attention P/R": ("#1f77b4", "--", "^"), "attention R/P": ("#17becf", "-.", "v"),
    "attention P/P": ("#0b2e6b", ":", "<"),
    "ffn P/R": ("#2ca02c", "--", "D"), "ffn R/P": ("#a5a313", "-.", "d"), "ffn P/P": ("#0e5a1c", ":", "P"),
    "logp P/R": ("#d62728", "--", ">"), "logp R/P": ("#ff7f0e", "-.", "X"), "logp P/P": ("#7a1616", ":", "*"),
}
EXTRA_COLORS = ("#e377c2", "#8c564b", "#7f7f7f", "#393b79", "#637939", "#843c39", "#7b4173", "#3182bd",
                "#e6550d", "#31a354", "#756bb1", "#636363")
EXTRA_LINESTYLES = ("-", "--", "-.", ":")
EXTRA_MARKERS = ("h", "p", "8", "H", "1", "2", "3", "4", "+", "x", "|", "_")


def run_styles(runs: list[RunMetrics]) -> list[dict[str, Any]]:
    """A distinct colour and a distinct (line style, marker) pair for every run: the fixed look of its
    route where that is still free, else the next unused colour and marker."""
    used_colors, used_markers, styles = set(), set(), []
    extra = 0
    for run in runs:
        style = CELL_STYLES.get(run.route or run.label)
        if style is None or style[0] in used_colors or style[2] in used_markers:
            colors = [c for c in EXTRA_COLORS if c not in used_colors]
            markers = [m for m in EXTRA_MARKERS if m not in used_markers]
            style = (colors[0] if colors else f"C{extra}", EXTRA_LINESTYLES[extra % len(EXTRA_LINESTYLES)],
                     markers[0] if markers else "o")
            extra += 1
        used_colors.add(style[0])
        used_markers.add(style[2])
        styles.append({"color": style[0], "linestyle": style[1], "marker": style[2]})
    return styles


def _key(values: list[float], rounds: list[int]) -> tuple:
    return tuple(rounds), tuple(None if math.isnan(v) else v for v in values)


def coincident_groups(curves: list[tuple[str, list[int], list[float]]]) -> list[list[str]]:
    """Labels of curves that are exactly equal (same rounds, same values, NaN equal to NaN), as groups of
    two or more in drawing order."""
    groups: dict[tuple, list[str]] = {}
    for label, rounds, values in curves:
        groups.setdefault(_key(values, rounds), []).append(label)
    return [g for g in groups.values() if len(g) > 1]


def _compact_log(axis) -> None:
    """Log-axis ticks at 1, 2, 5 x 10^k labelled ``2e-07`` (mathtext minor labels overlap on short ranges)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _pos: _short(v)))
    axis.set_minor_formatter(NullFormatter())


def _short(v: float) -> str:
    """``2e-07``, ``1.35e-07``, ``3000``: the fewest digits that still name the tick exactly."""
    if v >= 1e-2 or v <= 0:
        return f"{v:g}"
    for digits in range(4):
        text = f"{v:.{digits}e}"
        if abs(float(text) - v) <= 1e-6 * v:
            return text
    return f"{v:.3e}"


def save_png(fig, path: Path) -> None:
    """Write ``fig`` as a 256-colour PNG at :data:`DPI` (a third of the size of the full-colour file; plots
    have few colours, and no dithering keeps lines and text crisp)."""
    import io

    from PIL import Image  # matplotlib's own dependency

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    image = Image.open(buf).convert("RGB")
    image.quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(path, optimize=True)


def _spread(values: list[list[float]]) -> float | None:
    """The largest difference between curves at one round, for curves over the same rounds, else None."""
    if not values or len({len(v) for v in values}) != 1:
        return None
    spans = [max(col) - min(col) for col in zip(*values) if not any(math.isnan(v) for v in col)]
    return max(spans) if spans else None


def _wrap(text: str, width: int) -> str:
    return "\n".join(textwrap.wrap(text, width, break_long_words=False)) if text else ""


def _panel(ax, runs: list[RunMetrics], styles: list[dict[str, Any]], title: str, values: list[list[float]],
           log: bool = False, zero_floor: bool = True, width: int = 70) -> None:
    """Draw one curve per run; title the panel with what a reader cannot see: curves drawn on top of each
    other, zero curves left off a log axis, or that every value is zero ("no differences")."""
    finite = [v for vals in values for v in vals if not math.isnan(v)]
    notes = []
    if finite and all(v == 0 for v in finite) and zero_floor:
        for run, style, vals in zip(runs, styles, values, strict=True):
            ax.plot(run.rounds, vals, markersize=5, **style)
        ax.set_ylim(-0.02, 1)
        ax.set_yticks([0])
        ax.text(0.5, 0.55, "no differences:\n0 in every round for every run", transform=ax.transAxes,
                ha="center", va="center", fontsize=10, color="#333333")
        ax.set_title(title, loc="left")
        return
    log = log and any(v > 0 for v in finite)
    zero_runs = [run.label for run, vals in zip(runs, values, strict=True)
                 if log and all(v == 0 for v in vals if not math.isnan(v))]
    for run, style, vals in zip(runs, styles, values, strict=True):
        ax.plot(run.rounds, [v if v > 0 else float("nan") for v in vals] if log else vals, markersize=5, **style)
    if log:
        ax.set_yscale("log")
        _compact_log(ax.yaxis)
    elif zero_floor and finite and min(finite) >= 0:
        ax.set_ylim(bottom=0)
    curves = [(run.label, run.rounds, vals) for run, vals in zip(runs, values, strict=True)
              if run.label not in zero_runs]
    groups = coincident_groups(curves)
    if len(groups) == 1 and len(groups[0]) == len(runs) > 1:
        notes.append(f"all {len(runs)} curves coincide exactly" if len(runs) > 2 else
                     f"the two curves coincide exactly ({' = '.join(groups[0])})")
    elif groups:
        notes.append("coincide exactly: " + "; ".join(" = ".join(g) for g in groups))
    spread = _spread([vals for _, _, vals in curves])
    if len(curves) > 1 and not (len(groups) == 1 and len(groups[0]) == len(curves)) and spread is not None:
        top = max(abs(v) for v in finite)
        if 0 < spread <= 1e-3 * top:  # distinct curves that no eye can tell apart
            notes.append(f"{'the others' if groups else 'all curves'} differ by at most {spread:.2g}")
    if zero_runs:
        notes.append(f"0 in every round (not drawn on the log axis): {', '.join(zero_runs)}")
    ax.set_title("\n".join([title, *(_wrap(n, width) for n in notes)]), loc="left")


def _figure(runs: list[RunMetrics], styles: list[dict[str, Any]], nrows: int, ncols: int, title: str):
    """A figure with one legend for all its panels (outside the axes, so it never hides a curve), and under it
    the runs' provenance, notes and warnings (:func:`rlk_repro.report_meta.figure_footer`)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    wide = len(runs) > 3
    fig = Figure(figsize=(6.2 * ncols + (2.3 if wide else 0), 2.9 * nrows + (0.6 if nrows == 1 else 0) + 0.4),
                 layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, sharex=True, squeeze=False).ravel()
    fig.suptitle(title, fontsize=11, x=0.01, ha="left", fontweight="bold")
    fig.supxlabel(report_meta.figure_footer(runs), fontsize=7, x=0.01, ha="left", color="#444444")
    handles = [Line2D([], [], markersize=5, **s) for s in styles]
    labels = [r.label for r in runs]
    if wide:
        fig.legend(handles, labels, loc="outside right upper", fontsize="small", title="run (routes)")
    else:
        fig.legend(handles, labels, loc="outside upper center", ncols=len(runs), fontsize="small")  # footer below
    return fig, axes


def _save(fig, axes, out: Path, name: str, written: list[Path]) -> None:
    from matplotlib.ticker import MaxNLocator

    ncols = fig.axes[0].get_subplotspec().get_gridspec().ncols
    for start in range(0, len(axes), ncols):  # pad the titles of a row to one height: the row's axes align
        row = axes[start:start + ncols]
        lines = max(ax.get_title(loc="left").count("\n") for ax in row)
        for ax in row:
            title = ax.get_title(loc="left")
            ax.set_title("\n" * (lines - title.count("\n")) + title, fontsize=9 if lines else 10, loc="left")
    for i, ax in enumerate(axes):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=8)
        if i >= len(axes) - ncols:
            ax.set_xlabel("round", fontsize=9)
    save_png(fig, out / name)
    written.append(out / name)


def write_plots(runs: list[RunMetrics], out: Path, matrix: bool = False) -> list[Path]:
    written: list[Path] = []
    styles = run_styles(runs)
    width = 62 if len(runs) > 3 else 70

    fig, ax = _figure(runs, styles, 2, 2, "train vs rollout log-probs of the sampled tokens")
    rates = [[m / c if c else float("nan") for m, c in zip(r.series("mismatch_count"), r.series("compared_tokens"))]
             for r in runs]
    _panel(ax[0], runs, styles, "mismatch rate (tokens whose log-probs differ)", rates, width=width)
    _panel(ax[1], runs, styles, "mismatched tokens", [r.series("mismatch_count") for r in runs], width=width)
    _panel(ax[2], runs, styles, "max abs(train - rollout)", [r.series("max_abs_diff") for r in runs], log=True,
           width=width)
    _panel(ax[3], runs, styles, "mean abs(train - rollout)", [r.series("mean_abs_diff") for r in runs], log=True,
           width=width)
    for a, unit in zip(ax, ("fraction of compared tokens", "tokens", "nats (log-prob)", "nats (log-prob)"),
                       strict=True):
        a.set_ylabel(unit, fontsize=8)
    _save(fig, ax, out, "consistency.png", written)

    fig, ax = _figure(runs, styles, 2, 2, "learning")
    _panel(ax[0], runs, styles, "reward (mean" + (", band: ± std)" if len(runs) <= 2 else ")"),
           [r.series("reward_mean") for r in runs], zero_floor=False, width=width)
    if len(runs) <= 2:
        for run, style in zip(runs, styles, strict=True):
            mean, std = run.series("reward_mean"), run.series("reward_std")
            ax[0].fill_between(run.rounds, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                               color=style["color"], alpha=0.12)
    trunc = [[1.0 - e / n if n else float("nan") for e, n in zip(r.series("eos_finished"), r.series("samples"))]
             for r in runs]
    _panel(ax[1], runs, styles, "responses cut at the token limit (fraction)", trunc, width=width)
    _evidence_panels(ax[2], ax[3], runs, styles, width)
    _save(fig, ax, out, "learning.png", written)

    fig, ax = _figure(runs, styles, 1, 2, "optimization")
    _panel(ax[0], runs, styles, "GRPO loss", [r.series("loss") for r in runs], zero_floor=False, width=width)
    _panel(ax[1], runs, styles, "gradient norm", [r.series("grad_norm") for r in runs], zero_floor=False,
           width=width)
    _save(fig, ax, out, "optimization.png", written)

    compiled = [r.label for r in runs if r.kernels_compiled]
    which = "every run" if len(compiled) == len(runs) else ", ".join(compiled)
    fig, ax = _figure(runs, styles, 2, 2, "performance" + (f" (round 0 compiles the Triton kernels: {which})"
                                                           if compiled else ""))
    _panel(ax[0], runs, styles, "rollout seconds per round", [r.series("rollout_seconds") for r in runs], width=width)
    _panel(ax[1], runs, styles, "training seconds per round", [r.series("train_seconds") for r in runs], width=width)
    _panel(ax[2], runs, styles, "rollout tokens / s", [r.series("rollout_tokens_per_s") for r in runs], log=True,
           width=width)
    _panel(ax[3], runs, styles, "training tokens / s", [r.series("train_tokens_per_s") for r in runs], log=True,
           width=width)
    for a, unit in zip(ax, ("seconds", "seconds", "tokens / s", "tokens / s"), strict=True):
        a.set_ylabel(unit, fontsize=8)
    _save(fig, ax, out, "performance.png", written)

    if matrix:
        write_matrix_plot(runs, styles, out)
        written.append(out / "matrix.png")
    return written


def _evidence_panels(ax_entropy, ax_informative, runs: list[RunMetrics], styles: list[dict[str, Any]],
                     width: int) -> None:
    """Entropy per round against its ceiling log V, and the informative share against rlk-validate's bound
    (issue 41, item 13): a run whose policy collapses shows both falling."""
    entropies = [r.entropy() for r in runs]
    estimated = [r.label for r, (_, est) in zip(runs, entropies, strict=True) if est]
    values = [v for v, _ in entropies]
    # zero_floor off: an all-zero panel here is a collapsed policy, not "no differences"
    _panel(ax_entropy, runs, styles, "entropy of the sampling distribution (mean per sampled token)", values,
           zero_floor=False, width=width)
    ceilings = sorted({c for r in runs for c in _finite(r.series("max_entropy"))})
    notes = []
    for c in ceilings:
        ax_entropy.axhline(c, color="#888888", linestyle=":", linewidth=1)
    if ceilings:
        notes.append("dotted: the ceiling log V = " + ", ".join(f"{c:.3g}" for c in ceilings) + " nats")
    top = max([*ceilings, *_finite([v for vals in values for v in vals]), 1.0])
    ax_entropy.set_ylim(0, 1.05 * top)
    if estimated:
        notes.append("estimated from the sampled tokens' log-probs: " + ", ".join(estimated))
    if not _finite([v for vals in values for v in vals]):
        notes.append("not recorded by these runs (before issue 41)")
    ax_entropy.set_title("\n".join([ax_entropy.get_title(loc="left"), *(_wrap(n, width) for n in notes)]),
                         loc="left")
    ax_entropy.set_ylabel("nats", fontsize=8)
    informative = [r.series("informative_fraction") for r in runs]
    _panel(ax_informative, runs, styles, f"informative tokens (rollout log-prob < {evidence.INFORMATIVE_LOGP:g})",
           informative, zero_floor=False, width=width)
    bound = evidence.MIN_INFORMATIVE_FRACTION
    ax_informative.axhline(bound, color="#d62728", linestyle=":", linewidth=1)
    notes = [f"dotted: rlk-validate's bound {bound:g} (INFORMATIVE_FRACTION_LOW below it)"]
    if not _finite([v for vals in informative for v in vals]):
        notes.append("not recorded by these runs (before issue 41)")
    ax_informative.set_title("\n".join([ax_informative.get_title(loc="left"), *(_wrap(n, width) for n in notes)]),
                             loc="left")
    ax_informative.set_ylim(0, 1.05)
    ax_informative.set_ylabel("fraction of compared tokens", fontsize=8)


def write_matrix_plot(runs: list[RunMetrics], styles: list[dict[str, Any]], out: Path) -> None:
    """``matrix.png``: the cells side by side, one bar each per quantity (pooled over all rounds; throughput
    over the rounds after the first). A zero bar is labelled 0, as it cannot be drawn on a log axis."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    sums = [summarize(r) for r in runs]
    fig = Figure(figsize=(13, 0.36 * len(runs) + 1.6), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 4, sharey=True)
    fig.suptitle("matrix cells side by side (all rounds pooled; throughput after round 0)", fontsize=11, x=0.01,
                 ha="left", fontweight="bold")
    fig.supxlabel(report_meta.figure_footer(runs), fontsize=7, x=0.01, ha="left", color="#444444")
    y = list(range(len(runs)))
    colors = [s["color"] for s in styles]
    panels = [("mismatch rate", [s["mismatch_count"] / s["compared_tokens"] if s["compared_tokens"] else float("nan")
                                 for s in sums], False),
              ("max abs diff (nats)", [s["max_abs_diff"] for s in sums], True),
              ("mean abs diff, token-weighted (nats)", [s["mean_abs_diff"] for s in sums], True)]
    for ax, (title, vals, log) in zip(axes, panels, strict=False):
        ax.set_title(title, fontsize=9, loc="left")
        positive = [v for v in vals if v > 0]
        if log and positive:
            ax.set_xscale("log")
            ax.set_xlim(min(positive) / 3, max(positive) * 3)
            _compact_log(ax.xaxis)
        elif positive:
            ax.set_xlim(0, max(positive) * 1.25)
        else:
            ax.set_xlim(0, 1)
            ax.text(0.5, 0.5, "no differences", transform=ax.transAxes, ha="center", fontsize=10)
        ax.barh(y, [v if (v > 0 or not log) else float("nan") for v in vals], height=0.7, color=colors)
        for i, v in enumerate(vals):
            text = "0 (bitwise equal)" if v == 0 else (f"{v:.2f}" if not log else "")
            if text:
                ax.annotate(text, (0 if v == 0 else v, i), xytext=(3, 0), textcoords="offset points", va="center",
                            fontsize=7, xycoords=("axes fraction", "data") if v == 0 else "data")
    ax = axes[3]
    ax.set_title("tokens / s: rollout (solid), training (hatched)", fontsize=9, loc="left")
    rates = [(s["rollout_tokens_per_s"], s["train_tokens_per_s"]) for s in sums]
    ax.barh([i - 0.2 for i in y], [r for r, _ in rates], height=0.38, color=colors)
    ax.barh([i + 0.2 for i in y], [t for _, t in rates], height=0.38, color=colors, alpha=0.45, hatch="///",
            edgecolor="#444444", linewidth=0)
    finite = [v for pair in rates for v in pair if v > 0 and not math.isnan(v)]
    if finite:
        ax.set_xscale("log")
        ax.set_xlim(min(finite) / 2, max(finite) * 4)
    for i, (r, t) in enumerate(rates):
        for dy, v in ((-0.2, r), (0.2, t)):
            if v > 0:
                ax.annotate(f"{v:,.0f}", (v, i + dy), xytext=(2, 0), textcoords="offset points", va="center",
                            fontsize=6.5)
    for a in axes:
        a.tick_params(labelsize=8)
        a.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(y, [r.label for r in runs], fontsize=9)
    axes[0].invert_yaxis()
    save_png(fig, out / "matrix.png")


def write_report(run_dirs: list[str], output: str | None
                 ) -> tuple[list[dict[str, Any]], list[Path], str | None, list[str], list[str]]:
    """Load the runs (a matrix root stands for its cells), write the summary (and the plots when
    matplotlib is there) into ``output`` (default: the ``report/`` folder of a single run or matrix root).
    Returns ``(summaries, files written, why plots were skipped, matrix cells not reported and why, warnings)``;
    a warning says where the compared runs differ in more than their routes."""
    loaded = load_runs(run_dirs)
    runs = loaded.runs
    if output is None:
        if len(run_dirs) > 1:
            raise RlkConfigError("--output is required when reporting more than one run or matrix root")
        out = Path(run_dirs[0]) / "report"
    else:
        out = Path(output)
    if out.exists() and not out.is_dir():
        raise RlkConfigError(f"--output {out} exists and is not a directory")
    summaries = [summarize(r) for r in runs]
    paired = None
    if report_pairs.wanted(runs, loaded.phase_roots):  # issue 37: refused (exit 2) before anything is written
        paired = report_pairs.paired_section(runs, summaries)
    out.mkdir(parents=True, exist_ok=True)
    diffs = report_meta.config_differences([r.manifest for r in runs], [r.label for r in runs])
    warnings = ["the compared runs differ in more than their routes: " + "; ".join(diffs)] if diffs else []
    warnings += evidence_warnings(summaries)
    doc = {"schema": "rlk.repro-report.v1", "runs": summaries, "matrix_roots": [str(p) for p in loaded.matrix_roots],
           "skipped": loaded.skipped, "warnings": warnings, "phase_roots": [str(p) for p in loaded.phase_roots],
           "paired": paired}
    evidence.write_json_atomic(out / "metrics-summary.json", doc, indent=1)
    text = summary_markdown(summaries, loaded.skipped, warnings) + (report_pairs.markdown(paired) if paired else "")
    (out / "metrics-summary.md").write_text(text, encoding="utf-8")
    written = [out / "metrics-summary.json", out / "metrics-summary.md"]
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        return (summaries, written, "matplotlib is not installed (pip install 'rlk-validate[plot]')", loaded.skipped,
                warnings)
    return summaries, written + write_plots(runs, out, matrix=bool(loaded.matrix_roots)), None, loaded.skipped, warnings
