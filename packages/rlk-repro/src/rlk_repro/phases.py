"""The seeds' experiment phases and the paired-seed estimate (issue 37): the table, ``run --phase`` (and
``--pair``: :mod:`rlk_repro.phase_pairs`), the statistics and the merge rule, which ``report`` applies to a phase's
pairs (:mod:`rlk_repro.report_pairs`).

=============  =====  ==================  ==================================================================
phase          steps  seeds               decision
=============  =====  ==================  ==================================================================
short          8      1234                state transition, weight update and cache issues
precision      30     1234, 2345, 3456    the drift distribution; reward / throughput / overhead uncertainty
convergence    200    1234                the main evidence: learning and performance curves
=============  =====  ==================  ==================================================================

Each phase runs as native / consistency pairs in the same seed order; an estimate over paired seeds is the mean
of the per-seed differences with a 95% confidence interval (Student's t). Runs whose code revision, checkpoint,
prompt hash or CUDA-graph settings differ are never merged into one estimate (:func:`merge_problem`).
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from rlk_core.errors import RlkConfigError

PHASES: dict[str, dict[str, Any]] = {
    "short": {"steps": 8, "seeds": (1234,)},
    "precision": {"steps": 30, "seeds": (1234, 2345, 3456)},
    # min_steps: how far --phase-rounds may shorten it (issue 37: the convergence phase cut to what fits a device
    # call, >= 100 rounds); a phase without it is not shortened
    "convergence": {"steps": 200, "seeds": (1234,), "min_steps": 100},
}
# two-sided 95% Student t quantiles by degrees of freedom (1..30); beyond 30, the normal 1.96
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def phase_settings(phase: str, seed: int | None, rounds: int | None = None) -> tuple[int, int]:
    """(rounds, seed) of one run of ``phase``; ``seed`` must be one of the phase's (default: its first); ``rounds``
    (``--phase-rounds``) shortens the phase, down to its ``min_steps`` (a phase without one is not shortened)."""
    if phase not in PHASES:
        raise RlkConfigError(f"--phase {phase!r} is not one of {', '.join(PHASES)}")
    spec = PHASES[phase]
    if rounds is not None:
        low = spec.get("min_steps", spec["steps"])
        if not low <= rounds <= spec["steps"]:
            raise RlkConfigError(f"--phase-rounds {rounds}: the {phase} phase runs {spec['steps']} rounds and is "
                                 + (f"shortened to no fewer than {low}" if low < spec["steps"] else "not shortened"))
    if seed is None:
        seed = spec["seeds"][0]
    if seed not in spec["seeds"]:
        raise RlkConfigError(f"--phase {phase} runs seeds {', '.join(map(str, spec['seeds']))}; --seed {seed} is not "
                             "one of them")
    return (spec["steps"] if rounds is None else rounds), seed


def mean_ci(values: list[float]) -> dict[str, Any]:
    """Mean of ``values`` (one per seed) and its 95% confidence interval, Student's t (None with one value)."""
    if not values:
        raise RlkConfigError("an estimate over seeds needs at least one value")
    mean = statistics.fmean(values)
    if len(values) < 2:
        return {"n": 1, "mean": mean, "ci95": None}
    sd = statistics.stdev(values)
    t = _T95[len(values) - 2] if len(values) - 1 <= len(_T95) else 1.96
    half = t * sd / math.sqrt(len(values))
    return {"n": len(values), "mean": mean, "ci95": [mean - half, mean + half]}


def paired_estimate(pairs: list[tuple[float, float]]) -> dict[str, Any]:
    """Mean of ``b - a`` over paired seeds and its 95% confidence interval (None with one pair)."""
    if not pairs:
        raise RlkConfigError("a paired estimate needs at least one native / consistency pair")
    return mean_ci([b - a for a, b in pairs])


def _merge_view(manifest: dict[str, Any]) -> dict[str, Any]:
    repos = manifest.get("repos") or [{}]
    config = manifest.get("config") or {}
    inputs = manifest.get("inputs") or {}
    return {"code revision": (repos[0].get("sha"), repos[0].get("dirty")), "checkpoint": inputs.get("checkpoint"),
            "prompt hash": inputs.get("prompts"),
            "CUDA-graph settings": (config.get("enforce_eager"), config.get("cuda_graphs"))}


def merge_problem(manifests: list[dict[str, Any]]) -> str | None:
    """Why these runs cannot go into one estimate (None: they can): the first of code revision, checkpoint, prompt
    hash and CUDA-graph settings that differs, or a dirty checkout, whose revision says nothing."""
    views = [_merge_view(m) for m in manifests]
    for key in views[0] if views else ():
        values = [v[key] for v in views]
        if any(v != values[0] for v in values[1:]):
            return f"the runs' {key} differ ({', '.join(sorted({str(v) for v in values}))}): not merged"
    if views and views[0]["code revision"][1]:
        return "the runs come from a dirty checkout: its code revision does not say what ran; not merged"
    return None
