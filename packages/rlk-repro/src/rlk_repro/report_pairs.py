"""The paired section of ``rlk-repro report`` (issue 37): a phase's native / consistency runs paired by seed.

Reported for phase roots (``rlk-repro run --phase P --pair``) and for run directories that all record a phase
(``run --phase P``) where some seed has both a native and a consistency run. Over the seeds that have both runs:
the mean and 95% confidence interval (Student's t, :func:`rlk_repro.phases.mean_ci`; none with one seed) of each
side's reward, throughput and round time, of their
per-seed difference (consistency - native), and of the overhead (consistency's round time over native's, minus 1;
native's tokens/s over consistency's, minus 1); and the seeds' summary table (active-token exposure, cumulative
bitwise mismatches, token-weighted mean |diff|, max |diff|, reward, truncation, round time, throughput).

Runs are not merged (exit 2, one line) where :func:`rlk_repro.phases.merge_problem` says so (code revision,
checkpoint, prompt hash, CUDA-graph settings, a dirty checkout), where their phases differ, where a seed has two
runs of one mode, or where the two runs of a seed start from different checkpoints. A random-weight preset draws
its weights from the seed, so across seeds its checkpoint is compared as the preset and its shape, within a pair
by hash.
"""

from __future__ import annotations

import copy
from typing import Any

from rlk_core.errors import RlkConfigError
from rlk_repro.phases import PHASES, mean_ci, merge_problem, paired_estimate

#: (summary key, name) of the quantities estimated over seeds
QUANTITIES = (("reward_mean", "reward"), ("rollout_tokens_per_s", "rollout tok/s"),
              ("train_tokens_per_s", "train tok/s"), ("round_seconds", "s / round"))
#: (name, summary key, higher is slower): overhead of consistency over native, per seed
OVERHEADS = (("round time", "round_seconds", True), ("rollout throughput", "rollout_tokens_per_s", False),
             ("train throughput", "train_tokens_per_s", False))
SEED_COLUMNS = (("compared_tokens", "active-token exposure"), ("mismatch_count", "cumulative mismatches"),
                ("mean_abs_diff", "mean abs diff (token-weighted)"), ("max_abs_diff", "max abs diff"),
                ("reward_mean", "reward"), ("truncation", "truncated"), ("round_seconds", "s / round"),
                ("rollout_tokens_per_s", "rollout tok/s"), ("train_tokens_per_s", "train tok/s"))


def phase_of(manifest: dict[str, Any]) -> str | None:
    return (manifest.get("config") or {}).get("phase")


def seed_of(manifest: dict[str, Any]) -> int | None:
    seeds = manifest.get("seeds") or {}
    return seeds.get("train", (manifest.get("config") or {}).get("seed"))


def wanted(runs: list[Any], phase_roots: list[Any]) -> bool:
    """Whether the report pairs these runs: a phase root was given (what cannot be paired is then refused), or every
    run directory records a phase, is native or consistency, and some seed has both runs."""
    if phase_roots:
        return True
    if len(runs) < 2 or not all(phase_of(r.manifest) and r.manifest.get("mode") in ("native", "consistency")
                                for r in runs):
        return False
    modes: dict[Any, set[str]] = {}
    for r in runs:
        modes.setdefault(seed_of(r.manifest), set()).add(r.manifest["mode"])
    return any(len(m) == 2 for m in modes.values())


def _merge_manifest(manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest as the merge rule sees it across seeds: a random-weight preset's checkpoint is its preset and
    shape (its weights come from the seed)."""
    model = manifest.get("model") or {}
    if model.get("kind") != "random-weight preset":
        return manifest
    out = copy.deepcopy(manifest)
    shape = (manifest.get("config") or {}).get("model_config")
    out.setdefault("inputs", {})["checkpoint"] = f"random-weight preset {model.get('preset')} {shape}"
    return out


def pairs(runs: list[Any]) -> tuple[list[tuple[int, Any, Any]], list[str]]:
    """``(seed, native run, consistency run)`` for every seed with both, in seed order, and the runs left unpaired;
    a seed with two runs of one mode, or a run of another mode, is refused."""
    by_seed: dict[int, dict[str, Any]] = {}
    for r in runs:
        mode = r.manifest.get("mode")
        if mode not in ("native", "consistency"):
            raise RlkConfigError(f"{r.path}: a {mode} run ({r.route}); a phase pairs native (P/P) and consistency "
                                 "(R/R) runs")
        slot = by_seed.setdefault(seed_of(r.manifest), {})
        if mode in slot:
            raise RlkConfigError(f"two {mode} runs of seed {seed_of(r.manifest)} ({slot[mode].path}, {r.path}): "
                                 "give one of each mode per seed")
        slot[mode] = r
    out, unpaired = [], []
    for seed in sorted(by_seed, key=lambda s: (s is None, s)):
        slot = by_seed[seed]
        if len(slot) == 2:
            out.append((seed, slot["native"], slot["consistency"]))
        else:
            unpaired += [f"{r.path} (seed {seed}, {m}: its other run is missing)" for m, r in slot.items()]
    return out, unpaired


def _overhead(native: dict[str, Any], cons: dict[str, Any], key: str, slower_is_higher: bool) -> float:
    a, b = float(native[key]), float(cons[key])
    return b / a - 1.0 if slower_is_higher else a / b - 1.0


def paired_section(runs: list[Any], summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """The paired document of ``runs`` (with their :func:`rlk_repro.report.summarize` rows, same order); raises
    :class:`RlkConfigError` where the runs cannot be merged."""
    phases = sorted({str(phase_of(r.manifest)) for r in runs})
    if len(phases) != 1:
        raise RlkConfigError(f"the runs' phases differ ({', '.join(phases)}): not merged")
    found, unpaired = pairs(runs)
    if not found:
        raise RlkConfigError("no seed has both a native and a consistency run: nothing to pair"
                             + (f" ({'; '.join(unpaired)})" if unpaired else ""))
    for seed, native, cons in found:
        a, b = ((r.manifest.get("inputs") or {}).get("checkpoint") for r in (native, cons))
        if a != b:
            raise RlkConfigError(f"seed {seed}: the native and consistency runs start from different checkpoints "
                                 f"({a}, {b}): not merged")
    problem = merge_problem([_merge_manifest(r.manifest) for _, n, c in found for r in (n, c)])
    if problem:
        raise RlkConfigError(problem)
    counts = sorted({int(r.manifest.get("rounds") or 0) for _, n, c in found for r in (n, c)})
    if len(counts) != 1:  # a shortened phase (--phase-rounds) is not pooled with another length
        raise RlkConfigError(f"the runs' rounds differ ({', '.join(map(str, counts))}): not merged")
    row = {id(r): s for r, s in zip(runs, summaries, strict=True)}
    seeds = [(seed, row[id(n)], row[id(c)]) for seed, n, c in found]
    estimates = {}
    for key, name in QUANTITIES:
        estimates[key] = {"name": name, "native": mean_ci([float(n[key]) for _, n, _ in seeds]),
                          "consistency": mean_ci([float(c[key]) for _, _, c in seeds]),
                          "difference": paired_estimate([(float(n[key]), float(c[key])) for _, n, c in seeds])}
    overhead = {name: mean_ci([_overhead(n, c, key, slow) for _, n, c in seeds]) for name, key, slow in OVERHEADS}
    table = [{"seed": seed, "mode": mode, "run": s["name"], **{k: s[k] for k, _ in SEED_COLUMNS}}
             for seed, n, c in seeds for mode, s in (("native", n), ("consistency", c))]
    return {"phase": phases[0], "rounds": counts[0], "phase_steps": (PHASES.get(phases[0]) or {}).get("steps"),
            "seeds": [s for s, _, _ in seeds], "unpaired": unpaired, "estimates": estimates, "overhead": overhead,
            "table": table}


def _ci(est: dict[str, Any]) -> str:
    if est["ci95"] is None:
        return f"{est['mean']:.4g} (one seed: no interval)"
    lo, hi = est["ci95"]
    return f"{est['mean']:.4g} [{lo:.4g}, {hi:.4g}]"


def markdown(doc: dict[str, Any]) -> str:
    n = len(doc["seeds"])
    cut = doc.get("phase_steps") and doc.get("rounds") and doc["rounds"] != doc["phase_steps"]
    short = f", shortened to {doc['rounds']} of its {doc['phase_steps']} rounds" if cut else ""
    lines = [f"\n## Phase {doc['phase']}{short}: {n} paired seed(s) ({', '.join(map(str, doc['seeds']))})\n",
             "Mean over the paired seeds with its 95% confidence interval (Student's t); difference: consistency - "
             "native, per seed. Throughput and s / round count the rounds after the first.\n",
             "| quantity | native | consistency | consistency - native |", "|---|---|---|---|"]
    for est in doc["estimates"].values():
        lines.append(f"| {est['name']} | {_ci(est['native'])} | {_ci(est['consistency'])} | "
                     f"{_ci(est['difference'])} |")
    lines += ["", "Overhead of consistency over native (round time: consistency / native - 1; throughput: native / "
              "consistency - 1):", "", "| overhead | mean [95% CI] |", "|---|---|"]
    lines += [f"| {name} | {_ci(est)} |" for name, est in doc["overhead"].items()]
    lines += ["", "The seeds' summary table:", "",
              "| seed | mode | run | " + " | ".join(h for _, h in SEED_COLUMNS) + " |",
              "|" + "---|" * (3 + len(SEED_COLUMNS))]
    for r in doc["table"]:
        cells = [f"{r[k]:.3g}" if isinstance(r[k], float) else str(r[k]) for k, _ in SEED_COLUMNS]
        lines.append(f"| {r['seed']} | {r['mode']} | {r['run']} | " + " | ".join(cells) + " |")
    if doc["unpaired"]:
        lines += ["", "Not paired:", ""] + [f"- {u}" for u in doc["unpaired"]]
    return "\n".join(lines) + "\n"
