"""The numbers a run claims about itself (``metrics.jsonl``, ``bitwise-validation.json``), recomputed.

Every count and statistic a producer writes is compared with the value recomputed from
``train-data/`` (see :mod:`rlk_validate.bitwise`), per round and in total, whatever the direction of the
difference: counts exactly, ``max_abs_diff`` within a relative 1e-5 and ``mean_abs_diff`` within a
relative 1e-3 (producers may reduce in float32; zero must be exactly zero), ``reward_mean`` within
1e-6 + a relative 1e-5 of the mean of the round's ``rewards`` tensor. Values are typed strictly: a JSON
boolean is not a number, an integer beyond the float range is a finding, not an overflow.
Work is bounded by the size of the files, never by a number they claim.
"""

from __future__ import annotations

import math
from typing import Any

from .evidence import BITWISE, BITWISE_SCHEMA, METRICS, METRICS_SCHEMA, PRESET_MODES, is_member
from .findings import Finding, finding
from .safeio import MAX_INT, InputError, Root, parse_json_text

CHECK = "run"
#: relative tolerance for max/mean |diff| written by producers (they may reduce in float32)
MAX_REL_TOL = 1e-5
MEAN_REL_TOL = 1e-3
#: reward_mean: absolute + relative (rewards are stored as float32, producers average float64)
REWARD_ABS_TOL = 1e-6
REWARD_REL_TOL = 1e-5
#: at most this many findings of one kind per file; the rest are counted in one more finding
SHOWN = 10
_INT_FIELDS = ("compared_tokens", "mismatch_count", "peak_memory_bytes", "informative_tokens",
               "informative_mismatch_count")
#: VIME's own per-step metric (train/train_rollout_logprob_abs_diff, a sum of per-sample means) for the
#: round's training steps; only its zero-ness is comparable with train-data (``rlk-validate import-vime``)
VIME_METRIC = "vime_train_rollout_logprob_abs_diff"
_NUM_FIELDS = ("max_abs_diff", "mean_abs_diff", "reward_mean", "loss", "rollout_tokens_per_s", "train_tokens_per_s")


def _f(code: str, msg: str, path: str | None = None, **kw: Any) -> Finding:
    return finding(code, msg, check=CHECK, path=path, **kw)


def is_int(v: Any, lo: int = 0) -> bool:
    """An integer (never a bool) in ``[lo, 2^63)``."""
    return type(v) is int and lo <= v <= MAX_INT


def is_num(v: Any) -> bool:
    """A finite JSON number (never a bool; an integer must fit a float)."""
    if type(v) is float:
        return math.isfinite(v)
    return type(v) is int and -MAX_INT <= v <= MAX_INT


def close(a: float, b: float, rel: float) -> bool:
    """Equal zero-ness, and equal within ``rel`` relative tolerance."""
    if (a == 0) != (b == 0):
        return False
    return a == b or abs(a - b) <= rel * max(abs(a), abs(b))


def reward_close(claimed: float, recomputed: float) -> bool:
    return abs(claimed - recomputed) <= REWARD_ABS_TOL + REWARD_REL_TOL * max(abs(claimed), abs(recomputed))


def all_rr(plan: dict[str, str] | None) -> bool:
    return bool(plan) and all(v == PRESET_MODES["consistency"] for v in plan.values())


def _capped(findings: list[Finding], rel: str, what: str) -> list[Finding]:
    if len(findings) <= SHOWN:
        return list(findings)
    first = findings[:SHOWN]
    rest = findings[SHOWN:]
    return [*first, finding(rest[0].code, f"{rel}: {len(rest)} more {what} like the above", check=CHECK, path=rel,
                            count=len(rest))]


def _first_absent(present: set[int], n: int, limit: int = 10) -> list[int]:
    """The first ``limit`` of ``range(n)`` not in ``present`` (at most ``len(present) + limit`` steps)."""
    out, r = [], 0
    while r < n and len(out) < limit:
        if r not in present:
            out.append(r)
        r += 1
    return out


# -- metrics.jsonl ----------------------------------------------------------------------------
def _metrics_row_problem(obj: Any) -> str | None:
    if not isinstance(obj, dict) or not is_member(obj.get("schema"), (METRICS_SCHEMA,)):
        return f"schema is not {METRICS_SCHEMA!r}"
    if not is_int(obj.get("round")):
        return f"round {obj.get('round')!r} is not an integer >= 0"
    for key in _INT_FIELDS:
        if key in obj and not is_int(obj[key]):
            return f"{key} = {obj[key]!r} is not an integer >= 0"
    for key in _NUM_FIELDS:
        if key in obj and not is_num(obj[key]):
            return f"{key} = {obj[key]!r} is not a finite number"
    vime = obj.get(VIME_METRIC)
    if vime is not None and not (isinstance(vime, list) and vime and all(is_num(v) and v >= 0 for v in vime)):
        return f"{VIME_METRIC} = {vime!r} is not a non-empty list of finite numbers >= 0"
    if "weights_changed" in obj and type(obj["weights_changed"]) is not bool:
        return f"weights_changed = {obj['weights_changed']!r} is not true or false"
    return None


def check_metrics(root: Root, expected_rounds: int | None,
                  bitwise: dict[str, Any] | None) -> tuple[list[Finding], dict[int, dict[str, Any]]]:
    """Findings about ``metrics.jsonl``, and its well-formed rows by round."""
    rel = METRICS
    if not root.lexists(rel):
        return [_f("METRICS_MISSING", "metrics.jsonl is absent", rel)], {}
    try:
        text = root.read_text(rel, root.caps.json_bytes)
    except InputError as e:
        return [e.finding], {}
    bad: list[Finding] = []
    rows: dict[int, dict[str, Any]] = {}
    for i, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            obj = parse_json_text(line)
        except ValueError as e:
            bad.append(_f("METRICS_INVALID", f"metrics.jsonl line {i} is not valid JSON ({e})", rel, line=i))
            continue
        problem = _metrics_row_problem(obj)
        if problem:
            bad.append(_f("METRICS_INVALID", f"metrics.jsonl line {i}: {problem}", rel, line=i))
            continue
        rnd = obj["round"]
        if rnd in rows:
            bad.append(_f("METRICS_INVALID", f"metrics.jsonl line {i}: round {rnd} appears twice", rel, line=i))
        elif expected_rounds is not None and rnd >= expected_rounds:
            bad.append(_f("METRICS_INVALID", f"metrics.jsonl line {i}: round {rnd} is beyond the "
                          f"{expected_rounds} expected", rel, line=i))
        else:
            rows[rnd] = obj
    out = _capped(bad, rel, "malformed lines")
    if expected_rounds is not None and len(rows) < expected_rounds:
        first = _first_absent(set(rows), expected_rounds)
        out.append(_f("METRICS_MISSING", f"metrics.jsonl lacks {expected_rounds - len(rows)} round(s): {first}"
                      + (" ..." if expected_rounds - len(rows) > len(first) else ""), rel))
    if bitwise:
        out.extend(_compare_metrics(rel, rows, bitwise))
    return out, rows


def _compare_metrics(rel: str, rows: dict[int, dict[str, Any]], bitwise: dict[str, Any]) -> list[Finding]:
    out: list[Finding] = []
    for r in bitwise["rounds"]:
        row = rows.get(r["round"])
        if row is None or not r["complete"]:
            continue
        where = f"metrics.jsonl round {r['round']}"
        for key, ours in (("compared_tokens", r["element_count"]), ("mismatch_count", r["mismatch_count"]),
                          ("informative_tokens", r["informative_count"]),
                          ("informative_mismatch_count", r["informative_mismatch_count"])):
            if key in row and row[key] != ours:
                out.append(_f("METRICS_DISAGREE", f"{where}: {key} = {row[key]!r}, recomputed from train-data: "
                              f"{ours}", rel, claimed=row[key], recomputed=ours))
        for key, tol in (("max_abs_diff", MAX_REL_TOL), ("mean_abs_diff", MEAN_REL_TOL)):
            if key in row and not close(float(row[key]), r[key], tol):
                out.append(_f("METRICS_DISAGREE", f"{where}: {key} = {row[key]!r}, recomputed from train-data: "
                              f"{r[key]!r}", rel))
        vime = row.get(VIME_METRIC)
        if vime is not None and (any(v != 0 for v in vime)) != (r["mismatch_count"] != 0):
            out.append(_f("VIME_METRIC_DISAGREES", f"{where}: VIME logged train_rollout_logprob_abs_diff {vime}, "
                          f"train-data has {r['mismatch_count']} mismatching token(s) of {r['element_count']}", rel,
                          claimed=vime, recomputed=r["mismatch_count"]))
        ours_reward = r.get("reward_mean")
        claimed = row.get("reward_mean")
        if claimed is not None and ours_reward is not None and not reward_close(float(claimed), ours_reward):
            out.append(_f("METRICS_DISAGREE", f"{where}: reward_mean = {row['reward_mean']!r}, the mean of the "
                          f"round's rewards tensor is {ours_reward!r}", rel))
    if bitwise.get("rewards") == "absent" and any("reward_mean" in row for row in rows.values()):
        out.append(_f("REWARDS_UNVERIFIED", "metrics.jsonl claims reward_mean, but train-data holds no rewards "
                      "tensor: the learning claims are unverified", rel))
    return _capped(out, rel, "disagreements")


# -- bitwise-validation.json ------------------------------------------------------------------
def _bitwise_problem(doc: dict[str, Any]) -> list[str]:
    bad = []
    for key, ok in (
        ("require_exact", lambda v: type(v) is bool),
        ("torch_equal", lambda v: type(v) is bool),
        ("element_count", is_int),
        ("mismatch_count", is_int),
        ("max_abs_diff", is_num),
        ("fallback_failures", is_int),
        ("rounds", lambda v: isinstance(v, list)),
    ):
        if not ok(doc.get(key)):
            bad.append(key)
    if "mean_abs_diff" in doc and not is_num(doc["mean_abs_diff"]):
        bad.append("mean_abs_diff")
    bad += [k for k in ("informative_count", "informative_mismatch_count") if k in doc and not is_int(doc[k])]
    return bad


def _round_problem(r: Any) -> str | None:
    if not isinstance(r, dict) or not is_int(r.get("round")):
        return "has no integer round"
    for key in ("element_count", "mismatch_count"):
        if not is_int(r.get(key)):
            return f"{key} = {r.get(key)!r} is not an integer >= 0"
    if not is_num(r.get("max_abs_diff")):
        return f"max_abs_diff = {r.get('max_abs_diff')!r} is not a finite number"
    if "mean_abs_diff" in r and not is_num(r["mean_abs_diff"]):
        return f"mean_abs_diff = {r['mean_abs_diff']!r} is not a finite number"
    for key in ("informative_count", "informative_mismatch_count"):
        if key in r and not is_int(r[key]):
            return f"{key} = {r[key]!r} is not an integer >= 0"
    return None


def check_bitwise_file(
    root: Root, plan: dict[str, str] | None, bitwise: dict[str, Any] | None, expected_rounds: int | None = None
) -> list[Finding]:
    rel = BITWISE
    if not root.lexists(rel):
        return [_f("BITWISE_FILE_MISSING", "bitwise-validation.json (the run's own comparison) is absent", rel)]
    try:
        doc = root.read_json(rel)
    except InputError as e:
        return [e.finding]
    if not isinstance(doc, dict) or not is_member(doc.get("schema"), (BITWISE_SCHEMA,)):
        got = doc.get("schema") if isinstance(doc, dict) else None
        return [finding("SCHEMA_UNSUPPORTED", f"{rel}: schema is {str(got)[:80]!r}, expected {BITWISE_SCHEMA!r}",
                        check=CHECK, path=rel)]
    bad = _bitwise_problem(doc)
    if bad:
        return [_f("BITWISE_FILE_INVALID", f"{rel}: missing or invalid field(s) {', '.join(bad)}", rel)]
    out: list[Finding] = []
    if doc["fallback_failures"] > 0:
        out.append(_f("FALLBACK_FAILURES", f"{rel} reports {doc['fallback_failures']} fallback failure(s)", rel))
    if all_rr(plan) and not doc["require_exact"]:
        out.append(_f("BITWISE_FILE_INVALID", f"{rel}: require_exact is false for an all-R/R plan", rel,
                      severity="warning"))
    if doc["torch_equal"] != (doc["mismatch_count"] == 0):
        out.append(_f("BITWISE_FILE_INVALID", f"{rel}: torch_equal={doc['torch_equal']} contradicts its "
                      f"mismatch_count={doc['mismatch_count']}", rel))
    if not doc["rounds"] or doc["element_count"] == 0:
        out.append(_f("NOTHING_COMPARED", f"{rel} claims {len(doc['rounds'])} round(s) and "
                      f"{doc['element_count']} compared token(s): an empty comparison is no evidence", rel))
    claimed, problems = _claimed_rounds(rel, doc, expected_rounds)
    out.extend(problems)
    if bitwise is not None:
        if bitwise["complete"]:  # totals over partial train-data say nothing; rounds are still compared
            out.extend(_compare(rel, "", doc, bitwise))
        ours = {r["round"]: r for r in bitwise["rounds"] if r["complete"]}
        per_round = []
        for rnd, r in claimed.items():
            if rnd in ours:
                per_round.extend(_compare(rel, f"round {rnd} ", r, ours[rnd]))
        out.extend(_capped(per_round, rel, "per-round disagreements"))
    return out


def _claimed_rounds(
    rel: str, doc: dict[str, Any], expected_rounds: int | None
) -> tuple[dict[int, dict[str, Any]], list[Finding]]:
    """The well-formed per-round claims, and findings about the list itself (shape, duplicates, coverage,
    and whether the per-round numbers add up to the totals the same file claims)."""
    claimed: dict[int, dict[str, Any]] = {}
    bad: list[Finding] = []
    for i, r in enumerate(doc["rounds"]):
        problem = _round_problem(r)
        if problem:
            bad.append(_f("BITWISE_FILE_INVALID", f"{rel}: rounds[{i}] {problem}", rel))
        elif r["round"] in claimed:
            bad.append(_f("BITWISE_FILE_INVALID", f"{rel}: round {r['round']} appears twice in rounds", rel))
        elif expected_rounds is not None and r["round"] >= expected_rounds:
            bad.append(_f("BITWISE_FILE_DISAGREES", f"{rel}: claims round {r['round']}, but the run has rounds "
                          f"0..{expected_rounds - 1}", rel))
        else:
            claimed[r["round"]] = r
    out = _capped(bad, rel, "malformed rounds")
    if expected_rounds is not None and doc["rounds"] and len(claimed) < expected_rounds:
        first = _first_absent(set(claimed), expected_rounds)
        out.append(_f("BITWISE_FILE_INVALID", f"{rel}: rounds lacks {expected_rounds - len(claimed)} of the "
                      f"{expected_rounds} expected round(s): {first}", rel, severity="incomplete"))
    if not bad and claimed:
        for key in ("element_count", "mismatch_count"):
            total = sum(r[key] for r in claimed.values())
            if total != doc[key]:
                out.append(_f("BITWISE_FILE_DISAGREES", f"{rel}: {key} = {doc[key]}, but its rounds add up to "
                              f"{total}", rel))
    return claimed, out


def _compare(rel: str, where: str, claim: dict[str, Any], ours: dict[str, Any]) -> list[Finding]:
    """Claimed counts and statistics (total or one round) against the recomputed ones."""
    out: list[Finding] = []
    for key in ("element_count", "mismatch_count", "informative_count", "informative_mismatch_count"):
        if key in claim and claim[key] != ours[key]:
            out.append(_f("BITWISE_FILE_DISAGREES", f"{rel}: {where}{key} = {claim[key]}, recomputed from "
                          f"train-data: {ours[key]}", rel, claimed=claim[key], recomputed=ours[key]))
    for key, tol in (("max_abs_diff", MAX_REL_TOL), ("mean_abs_diff", MEAN_REL_TOL)):
        if key in claim and not close(float(claim[key]), ours[key], tol):
            out.append(_f("BITWISE_FILE_DISAGREES", f"{rel}: {where}{key} = {claim[key]!r}, recomputed: "
                          f"{ours[key]!r}", rel))
    return out
