"""The ladder's numbers and drift classes for one rung (``docs/ladder.md``): :func:`rung_metrics` reads a checked
run (its drift statistics, one more pass over its train-data for the signed differences and the worst tokens'
context, its readbacks' backends and fallbacks, its batch layout), :func:`delta` compares it with its reference rung
and :func:`classify` names its drift class by the written rules. Torch-free, like the rest of rlk-validate."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

from .evidence import MANIFEST, METRICS, READBACKS_DIR, TRAIN_DATA_DIR
from .findings import ERROR, INCOMPLETE
from .readbacks import _list_readbacks
from .report import Report
from .safeio import InputError, Root
from .tensors import load_safetensors, parse_name
from .validate import Options

CHECK = "ladder"
MODULES = ("attention", "ffn", "logp")
#: the knobs of a rung that the manifest's ``sampling`` shows
SAMPLING_KNOBS = ("temperature", "top_p", "top_k", "min_p")
# -- drift classification thresholds (docs/ladder.md, "Classification") --------------------------------------------
#: a token whose log-prob moved by more than this many nats is not rounding
NUMERICAL_ABS_MAX = 1.0
#: more tokens than this fraction outside the PPO clip range is not rounding
NUMERICAL_CLIP_FRACTION = 1e-3
#: a rung that turns a filter on and whose mean |dlogp| grows by more than this factor over its reference rung
JUMP_FACTOR = 10.0
CLASSES = ("none", "expected numerical", "semantic", "framework", "candidate operator", "not run")

def all_rr(plan: dict[str, str] | None) -> bool:
    return bool(plan) and all(plan.get(m) == "R/R" for m in MODULES)


def filtered(knobs: dict[str, Any]) -> bool:
    return knobs.get("top_p", 1.0) < 1.0 or knobs.get("top_k", 0) > 0 or knobs.get("min_p", 0.0) > 0.0


# -- one rung's metrics ------------------------------------------------------------------------------------------------
def _train_data_pass(root: Root, worst: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[tuple, int]]:
    """One pass over a run's train-data: the signed ``train - rollout`` statistics over the compared tokens (finite on
    both sides, in the response mask) and the prompt length of each sequence a worst token is in."""
    wanted = {(w["round"], w["rank"], w["sample"]) for w in worst}
    total, n, lo, hi = 0.0, 0, math.inf, -math.inf
    prompt_len: dict[tuple, int] = {}
    try:
        names = sorted(root.listdir(TRAIN_DATA_DIR))
    except InputError:
        return {}, {}
    for name in names:
        parsed = parse_name(name)
        if parsed is None or parsed[2] != "safetensors":
            continue
        rnd, rank, _ = parsed
        try:
            td = load_safetensors(root, f"{TRAIN_DATA_DIR}/{name}", rnd, rank)
        except InputError:
            continue  # reported by the rung's own validation
        width = td.shape[1]
        rows = {s for (r, k, s) in wanted if (r, k) == (rnd, rank)}
        try:
            for c in td.chunks():
                ok = c.mask & np.isfinite(c.train) & np.isfinite(c.rollout)
                d = c.train[ok].astype(np.float64) - c.rollout[ok].astype(np.float64)
                if d.size:
                    total += float(d.sum())
                    n += int(d.size)
                    lo, hi = min(lo, float(d.min())), max(hi, float(d.max()))
                if rows:
                    (idx,) = np.nonzero(c.mask)
                    for flat in idx:
                        s, t = divmod(int(c.start + flat), width)
                        if s in rows and (rnd, rank, s) not in prompt_len:
                            prompt_len[(rnd, rank, s)] = t
        finally:
            td.close()
    stats = {"mean": total / n, "min": lo, "max": hi} if n else {}
    return stats, prompt_len


def _readback_backends(root: Root) -> dict[str, Any]:
    """Per side and module: the implementations and backend ids that ran, and every fallback with its reason, from
    the run's readbacks (what the processes recorded that they executed)."""
    out: dict[str, Any] = {}
    try:
        names = sorted(_list_readbacks(root) or [], key=lambda hn: (hn[0] or "", hn[1]))
    except InputError:
        return out
    for host, base in names:
        name = f"{host}/{base}" if host else base
        try:
            doc = root.read_json(f"{READBACKS_DIR}/{name}")
        except InputError:
            continue
        if not isinstance(doc, dict) or not isinstance(doc.get("modules"), dict):
            continue
        side = doc.get("side") if doc.get("side") in ("train", "rollout") else "unknown"
        for module, rec in doc["modules"].items():
            if not isinstance(rec, dict):
                continue
            entry = out.setdefault(side, {}).setdefault(module, {"implementations": [], "backend_ids": [],
                                                                  "fallbacks": []})
            for key, field_ in (("implementations", "implementation"), ("backend_ids", "backend_id")):
                if rec.get(field_) is not None and rec[field_] not in entry[key]:
                    entry[key].append(rec[field_])
            ops = rec.get("ops") if isinstance(rec.get("ops"), dict) else {}
            for op, orec in ((module, rec), *ops.items()):
                if isinstance(orec, dict) and orec.get("fallback"):
                    entry["fallbacks"].append({"op": op, "file": name, "reason": orec.get("fallback_reason")})
            for op, orec in ops.items():
                if isinstance(orec, dict) and orec.get("backend_id") is not None:
                    entry.setdefault("ops", {})[op] = orec["backend_id"]
    return out


LAYOUT_CONFIG = ("prompts_per_round", "samples_per_prompt", "max_new_tokens", "chunk_size", "page_size",
                 "max_num_seqs", "arrivals_per_step", "max_batched_tokens", "max_model_len", "tp",
                 "train_micro_tokens", "vllm_max_num_seqs", "vllm_max_num_batched_tokens", "enforce_eager")
LAYOUT_SUMS = ("rollout_steps", "prefill_steps", "decode_steps", "chunked_prompts", "batch_composition_changes",
               "samples", "response_tokens", "rollout_tokens", "train_tokens")


def _layout(root: Root, config: dict[str, Any]) -> dict[str, Any]:
    """The batch layout the rung ran with: its configured shape and what the rollout scheduler did (summed over
    rounds from ``metrics.jsonl``; ``max_batch`` is the largest)."""
    out: dict[str, Any] = {"config": {k: config[k] for k in LAYOUT_CONFIG if k in config}}
    try:
        text = root.read_text(METRICS, root.caps.json_bytes)
    except InputError:
        return out
    sums: dict[str, float] = {}
    max_batch = None
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if not isinstance(row, dict):
            continue
        for k in LAYOUT_SUMS:
            if type(row.get(k)) in (int, float):
                sums[k] = sums.get(k, 0) + row[k]
        if type(row.get("max_batch")) is int:
            max_batch = max(max_batch or 0, row["max_batch"])
    out["scheduler"] = {**sums, **({"max_batch": max_batch} if max_batch is not None else {})}
    return out


def rung_metrics(r: Report, knobs: dict[str, Any], worst_k: int = 5) -> dict[str, Any]:
    """The ladder's numbers for one rung (a run ``r`` checked by :func:`~rlk_validate.validate.validate_run`): the
    log-prob drift ``d = train - rollout`` over the compared tokens — ``abs_mean`` (VIME's
    ``train_rollout_logprob_abs_diff``), the signed ``mean`` / ``min`` / ``max``, ``abs_max`` / p50 / p90 / p99 —, the
    mismatch count and rate, the k3 KL estimate, the clip fraction; the worst tokens with their context; the batch
    layout; the backends and fallbacks the readbacks record."""
    root = Root(r.run_dir, Options().caps, check=CHECK)
    b = r.bitwise or {}
    o = (r.drift or {}).get("overall") or {}
    try:
        manifest = root.read_json(MANIFEST)
    except InputError:
        manifest = {}
    manifest = manifest if isinstance(manifest, dict) else {}
    config = manifest.get("config") if isinstance(manifest.get("config"), dict) else {}
    worst = list((r.drift or {}).get("worst_tokens") or [])[:worst_k]
    signed, prompt_len = _train_data_pass(root, worst)
    vocab = (config.get("model_config") or {}).get("vocab_size") if isinstance(config.get("model_config"), dict) \
        else None
    tp = config.get("tp", 1) if type(config.get("tp", 1)) is int else 1
    shard = -(-vocab // tp) if type(vocab) is int and vocab > 0 else None
    examples = []
    for w in worst:
        plen = prompt_len.get((w["round"], w["rank"], w["sample"]))
        examples.append({
            **w, "context_length": w["position"], "prompt_length": plen,
            "response_index": None if plen is None else w["position"] - plen,
            "vocab_shard": None if shard is None else w["token_id"] // shard, "tp": tp,
            "filtered": filtered(knobs),  # the rung sampled with a filter; per-token kept sets are not recorded
        })
    n = b.get("element_count") or 0
    return {
        "verdict": r.verdict,
        "tokens": n,
        "mismatch_count": b.get("mismatch_count"),
        "mismatch_rate": (b["mismatch_count"] / n) if n else None,
        "informative_tokens": b.get("informative_count"),
        "informative_mismatch_count": b.get("informative_mismatch_count"),
        "nonfinite_diff_count": sum(int(x.get("nonfinite_diff_count") or 0) for x in b.get("rounds") or []) or 0,
        "dlogp": {
            "abs_mean": o.get("abs_mean"), "mean": signed.get("mean"), "min": signed.get("min"),
            "max": signed.get("max"), "abs_max": o.get("abs_max"), "abs_p50": o.get("abs_p50"),
            "abs_p90": o.get("abs_p90"), "abs_p99": o.get("abs_p99"),
        },
        "k3_kl": o.get("approx_kl0"),
        "clip_fraction": o.get("clip_fraction"),
        "clip_eps": o.get("clip_eps"),
        "rounds": [{"round": x["round"], "abs_mean": x.get("abs_mean"), "abs_max": x.get("abs_max")}
                   for x in (r.drift or {}).get("rounds") or []],
        "worst_tokens": examples,
        "sampling": manifest.get("sampling"),
        "plan": r.plan,
        "batch_layout": _layout(root, config),
        "backends": _readback_backends(root),
        "findings": sorted({f.code for f in r.findings if f.severity in (ERROR, INCOMPLETE)}),
    }


#: the metrics a delta and a figure are drawn for: (key, how to read it from a rung's metrics)
DELTA_METRICS = ("abs_mean", "mean", "abs_max", "abs_p50", "abs_p90", "abs_p99", "mismatch_rate", "k3_kl",
                 "clip_fraction")


def metric(m: dict[str, Any], key: str) -> float | None:
    v = m.get("dlogp", {}).get(key) if key in m.get("dlogp", {}) else m.get(key)
    return float(v) if type(v) in (int, float) else None


def delta(m: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    """This rung minus its reference rung, per metric, and the ratio of the mean |dlogp| (None where undefined)."""
    out: dict[str, Any] = {}
    for k in DELTA_METRICS:
        a, b = metric(m, k), metric(ref, k)
        out[k] = None if a is None or b is None else a - b
    a, b = metric(m, "abs_mean"), metric(ref, "abs_mean")
    out["abs_mean_ratio"] = None if a is None or not b else a / b
    return out


# -- classification ---------------------------------------------------------------------------------------------------
def _fallbacks(m: dict[str, Any]) -> list[str]:
    return [f"{side} {module} {f['op']}: {f.get('reason')}" for side, mods in (m.get("backends") or {}).items()
            for module, e in mods.items() for f in e.get("fallbacks", [])]


#: findings that say what ran is not what was asked for (readbacks, routes, the rung's knobs)
FRAMEWORK_CODES = ("READBACK", "MODULE_RECORD_MISSING", "MODULE_NOT_EXECUTED", "CASE_MISMATCH", "R_NOT_RLK",
                   "R_CONTRACT_MISSING", "FALLBACK", "BACKEND_DIVERGES", "P_NOT_PRODUCTION", "P_REPORTS_RLK",
                   "PLAN_INVALID", "MODE_PLAN_MISMATCH", "LADDER_RUNG_KNOBS_MISMATCH")
#: findings that say the two sides computed different distributions
SEMANTIC_CODES = ("SAMPLING_SEMANTICS_DIFFER", "KEPT_SET_MISMATCH", "GREEDY_NOT_COMPARABLE")


def classify(rung: dict[str, Any], m: dict[str, Any], ref: dict[str, Any] | None,
             ref_rung: dict[str, Any] | None, codes: list[str]) -> dict[str, Any]:
    """The drift class of one rung that ran, by the first rule that applies (``docs/ladder.md``):

    1. ``framework``: what ran is not what the rung asked for — a readback fallback, a route or hook finding, or the
       manifest does not show the rung's knobs; nothing about the arithmetic can be concluded.
    2. ``semantic``: the two sides computed different distributions — different log-prob semantics under a filter,
       kept sets of different sizes, greedy (argmax) rollout requests compared, a log-prob finite on one side only,
       or (a rung that turns a filter on) a mean
       |dlogp| more than :data:`JUMP_FACTOR` times its reference rung's.
    3. ``none``: bitwise equal.
    4. ``candidate operator``: an all-R/R rung that differs (the contracts promise equal bits), or drift beyond
       rounding (a token off by more than :data:`NUMERICAL_ABS_MAX` nats, or more than :data:`NUMERICAL_CLIP_FRACTION`
       of the tokens outside the clip range) on a rung without quantization.
    5. ``expected numerical``: the rest — production kernels (and quantization) rounding differently on each side.
    """
    fb = _fallbacks(m)
    framework = [c for c in codes if c.startswith(FRAMEWORK_CODES)]
    if fb or framework:
        why = "fallbacks: " + "; ".join(fb) if fb else "findings: " + ", ".join(framework)
        return drift_class("framework", "1", why, "fix the routes or the environment first (rlk-validate RUN_DIR "
                           "names what ran), then rerun the rung")
    semantic = [c for c in codes if c in SEMANTIC_CODES]
    if m.get("nonfinite_diff_count"):
        semantic.append(f"{m['nonfinite_diff_count']} token(s) with a log-prob finite on one side only")
    if ref is not None and ref_rung is not None and filtered(rung["knobs"]) and not filtered(ref_rung["knobs"]):
        a, b = metric(m, "abs_mean"), metric(ref, "abs_mean")
        ratio = a / b if a is not None and b else None
        if ratio is not None and ratio > JUMP_FACTOR:
            semantic.append(f"mean |dlogp| {ratio:.3g}x that of {ref_rung['name']} once the filter is on")
    if semantic:
        return drift_class("semantic", "2", "; ".join(semantic), "compare the kept sets and the log-prob semantics "
                           "of the two sides (`rlk-repro attribute RUN_DIR`, probes 1 and 6); use processed log-probs "
                           "on both")
    if m.get("mismatch_count") == 0 and m.get("tokens"):
        return drift_class("none", "3", f"bitwise equal over {m['tokens']} tokens", None)
    if all_rr(rung.get("plan")):
        return drift_class("candidate operator", "4", f"an all-R/R rung differs in {m.get('mismatch_count')} of "
                           f"{m.get('tokens')} tokens: an rlk op broke its contract", "`rlk-repro attribute RUN_DIR` "
                           "names the first layer and operator where the bits part")
    abs_max, clip = metric(m, "abs_max") or 0.0, metric(m, "clip_fraction") or 0.0
    quantized = rung["knobs"].get("quantization", "none") != "none"
    if not quantized and (abs_max > NUMERICAL_ABS_MAX or clip > NUMERICAL_CLIP_FRACTION):
        return drift_class("candidate operator", "4", f"drift beyond rounding: max |dlogp| {abs_max:.3g} nats, clip "
                           f"fraction {clip:.3g}", "`rlk-repro attribute RUN_DIR`: probes 3-5 and the per-layer "
                           "comparison")
    why = (f"mean |dlogp| {metric(m, 'abs_mean') or 0:.3g}, max {abs_max:.3g} nats, clip fraction {clip:.3g}: "
           "rounding of different kernels" + (" and of the quantized rollout" if quantized else ""))
    return drift_class("expected numerical", "5", why, "route the rung R/R to remove it (its rlk rung), or accept it")


def drift_class(name: str, rule: str, why: str, next_step: str | None) -> dict[str, Any]:
    return {"class": name, "rule": rule, "why": why, "next": next_step}
