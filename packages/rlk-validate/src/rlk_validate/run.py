"""Run-level checks: manifest, exit code, run.log, metrics.jsonl, the run's own bitwise-validation.json."""

from __future__ import annotations

import math
import re
from typing import Any

from .evidence import BITWISE, BITWISE_SCHEMA, EXIT_CODE, MANIFEST, MANIFEST_SCHEMA, METRICS, METRICS_SCHEMA, RUN_LOG
from .findings import Finding, finding
from .readbacks import plan_problem
from .safeio import InputError, Root

CHECK = "run"
TRACEBACK = b"Traceback (most recent call last):"
_SHA_RE = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")
_HASH_RE = re.compile(r"sha256:[0-9a-f]{64}")
#: relative tolerance for max/mean |diff| written by producers (they may reduce in float32)
MAX_REL_TOL = 1e-5
MEAN_REL_TOL = 1e-3


def _f(code: str, msg: str, path: str | None = None, **kw: Any) -> Finding:
    return finding(code, msg, check=CHECK, path=path, **kw)


def _is_int(v: Any, lo: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def close(a: float, b: float, rel: float) -> bool:
    """Equal zero-ness, and equal within ``rel`` relative tolerance."""
    if (a == 0) != (b == 0):
        return False
    return a == b or abs(a - b) <= rel * max(abs(a), abs(b))


def all_rr(plan: dict[str, str] | None) -> bool:
    return bool(plan) and all(v == "R/R" for v in plan.values())


# -- manifest ---------------------------------------------------------------------------------
def _manifest_problems(m: dict[str, Any]) -> list[tuple[str, str]]:
    """(code, message) for each missing or invalid field."""
    out: list[tuple[str, str]] = []
    types: dict[str, tuple[type, ...]] = {
        "run_id": (str,),
        "created_at": (str,),
        "engine": (str,),
        "mode": (str,),
        "command": (list,),
        "plan": (dict,),
        "rounds": (int,),
        "ranks": (int,),
        "repos": (list,),
        "packages": (dict,),
        "hardware": (dict,),
        "inputs": (dict,),
        "seeds": (dict,),
    }
    for key, ty in types.items():
        if key not in m:
            out.append(("MANIFEST_FIELD_MISSING", f"manifest.json lacks {key!r}"))
        elif not isinstance(m[key], ty) or isinstance(m[key], bool):
            out.append(("MANIFEST_FIELD_INVALID", f"manifest.json {key!r} must be {ty[0].__name__}"))
    if out:
        return out
    for key in ("rounds", "ranks"):
        if not _is_int(m[key], 1):
            out.append(("MANIFEST_FIELD_INVALID", f"manifest.json {key!r} must be an integer >= 1"))
    if not m["repos"]:
        out.append(("MANIFEST_FIELD_MISSING", "manifest.json 'repos' is empty: no source revision recorded"))
    for i, r in enumerate(m["repos"]):
        if not isinstance(r, dict) or not isinstance(r.get("name"), str):
            out.append(("MANIFEST_FIELD_INVALID", f"manifest.json repos[{i}] needs a name"))
        else:
            name, sha, dirty = r["name"], r.get("sha"), r.get("dirty")
            if sha is None or dirty is None:
                what = "SHA" if sha is None else "dirty state"
                reason = f" ({r['error']})" if isinstance(r.get("error"), str) else ""
                out.append(("REPO_REVISION_UNKNOWN", f"manifest.json repos[{i}] ({name}) records no {what}{reason}"))
            if sha is not None and not (isinstance(sha, str) and _SHA_RE.fullmatch(sha)):
                out.append(
                    ("MANIFEST_FIELD_INVALID", f"manifest.json repos[{i}] ({name}) sha {sha!r} is not a full hex SHA")
                )
            if dirty is not None and not isinstance(dirty, bool):
                out.append(("MANIFEST_FIELD_INVALID", f"manifest.json repos[{i}] ({name}) dirty must be true or false"))
    if not m["packages"] or not all(isinstance(v, str) for v in m["packages"].values()):
        out.append(("MANIFEST_FIELD_INVALID", "manifest.json 'packages' must map package names to versions"))
    if not m["inputs"]:
        out.append(("MANIFEST_FIELD_MISSING", "manifest.json 'inputs' is empty: no input hashes recorded"))
    for k, v in m["inputs"].items():
        if not isinstance(v, str) or not _HASH_RE.fullmatch(v):
            out.append(("MANIFEST_FIELD_INVALID", f"manifest.json inputs.{k} = {v!r} is not 'sha256:<64 hex>'"))
    if not all(isinstance(c, str) for c in m["command"]):
        out.append(("MANIFEST_FIELD_INVALID", "manifest.json 'command' must be a list of strings"))
    return out


def check_manifest(root: Root) -> tuple[list[Finding], dict[str, Any]]:
    """Returns findings and ``{"plan", "rounds", "ranks", "run_id", "mode"}`` (None where unknown)."""
    info: dict[str, Any] = {"plan": None, "rounds": None, "ranks": None, "run_id": None, "mode": None}
    rel = MANIFEST
    if not root.lexists(rel):
        return [_f("MANIFEST_MISSING", "manifest.json is absent: the requested plan and inputs are unknown", rel)], info
    try:
        m = root.read_json(rel)
    except InputError as e:
        return [e.finding], info
    if not isinstance(m, dict) or m.get("schema") != MANIFEST_SCHEMA:
        got = m.get("schema") if isinstance(m, dict) else None
        return [
            finding(
                "SCHEMA_UNSUPPORTED",
                f"manifest.json: schema is {got!r}, expected {MANIFEST_SCHEMA!r}",
                check=CHECK,
                path=rel,
            )
        ], info
    out = [_f(code, msg, rel) for code, msg in _manifest_problems(m)]
    problem = plan_problem(m.get("plan"))
    if problem:
        out.append(_f("PLAN_INVALID", f"manifest.json plan: {problem}", rel))
    else:
        info["plan"] = m["plan"]
    for key in ("rounds", "ranks"):
        if _is_int(m.get(key), 1):
            info[key] = m[key]
    if isinstance(m.get("run_id"), str):
        info["run_id"] = m["run_id"]
    info["mode"] = m.get("mode")
    plan = info["plan"]
    if plan and m.get("mode") == "consistency" and not all_rr(plan):
        out.append(_f("MODE_PLAN_MISMATCH", f"mode is consistency but the plan is {plan}, not all R/R", rel))
    if plan and m.get("mode") == "native" and not all(v == "P/P" for v in plan.values()):
        out.append(_f("MODE_PLAN_MISMATCH", f"mode is native but the plan is {plan}, not all P/P", rel))
    for r in m.get("repos") or []:
        if isinstance(r, dict) and r.get("dirty") is True:
            out.append(
                _f(
                    "REPO_DIRTY",
                    f"repository {r.get('name')!r} had uncommitted changes at {r.get('sha')}",
                    rel,
                )
            )
    return out, info


# -- exit code and log ------------------------------------------------------------------------
def check_exit_and_log(root: Root) -> list[Finding]:
    out: list[Finding] = []
    rel = EXIT_CODE
    if not root.lexists(rel):
        out.append(_f("EXIT_CODE_MISSING", "exit-code is absent: the run has not finished, or was killed", rel))
    else:
        try:
            text = root.read_text(rel, root.caps.small_bytes).strip()
            if not re.fullmatch(r"-?\d{1,6}", text):
                out.append(_f("EXIT_CODE_INVALID", f"exit-code holds {text[:40]!r}, not one integer", rel))
            elif int(text) != 0:
                out.append(
                    _f(
                        "EXIT_CODE_NONZERO",
                        f"the run exited with status {int(text)}",
                        rel,
                        exit_code=int(text),
                    )
                )
        except InputError as e:
            out.append(e.finding)
    rel = RUN_LOG
    if not root.lexists(rel):
        out.append(_f("RUN_LOG_MISSING", "run.log is absent", rel))
    else:
        try:
            line = root.find_in_text(rel, TRACEBACK, root.caps.log_bytes)
            if line is not None:
                out.append(_f("TRACEBACK_IN_LOG", f"run.log has a Python traceback at line {line}", rel, line=line))
        except InputError as e:
            out.append(e.finding)
    return out


# -- metrics.jsonl ----------------------------------------------------------------------------
def check_metrics(root: Root, expected_rounds: int | None, bitwise: dict[str, Any] | None) -> list[Finding]:
    rel = METRICS
    if not root.lexists(rel):
        return [_f("METRICS_MISSING", "metrics.jsonl is absent", rel)]
    from .safeio import parse_json_text

    try:
        text = root.read_text(rel, root.caps.json_bytes)
    except InputError as e:
        return [e.finding]
    out: list[Finding] = []
    rows: dict[int, dict[str, Any]] = {}
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = parse_json_text(line)
        except (ValueError, RecursionError) as e:
            out.append(_f("METRICS_INVALID", f"metrics.jsonl line {i} is not valid JSON ({e})", rel, line=i))
            continue
        if not isinstance(obj, dict) or obj.get("schema") != METRICS_SCHEMA:
            out.append(
                _f(
                    "METRICS_INVALID",
                    f"metrics.jsonl line {i}: schema is not {METRICS_SCHEMA!r}",
                    rel,
                    line=i,
                )
            )
            continue
        rnd = obj.get("round")
        if not _is_int(rnd):
            out.append(_f("METRICS_INVALID", f"metrics.jsonl line {i}: round {rnd!r} is not an integer >= 0", rel))
        elif rnd in rows:
            out.append(_f("METRICS_INVALID", f"metrics.jsonl line {i}: round {rnd} appears twice", rel))
        elif expected_rounds is not None and rnd >= expected_rounds:
            out.append(
                _f(
                    "METRICS_INVALID",
                    f"metrics.jsonl line {i}: round {rnd} is beyond the {expected_rounds} expected",
                    rel,
                )
            )
        else:
            rows[rnd] = obj
    if expected_rounds is not None:
        lacking = [r for r in range(expected_rounds) if r not in rows]
        if lacking:
            out.append(_f("METRICS_MISSING", f"metrics.jsonl lacks round(s) {lacking[:10]}", rel))
    if bitwise:
        for r in bitwise["rounds"]:
            row = rows.get(r["round"])
            if row is None or not r["complete"]:
                continue
            for key, ours in (
                ("compared_tokens", r["element_count"]),
                ("mismatch_count", r["mismatch_count"]),
            ):
                if key in row and row[key] != ours:
                    out.append(
                        _f(
                            "METRICS_DISAGREE",
                            f"metrics.jsonl round {r['round']}: {key} = {row[key]!r}, "
                            f"recomputed from train-data: {ours}",
                            rel,
                        )
                    )
            for key, tol in (("max_abs_diff", MAX_REL_TOL), ("mean_abs_diff", MEAN_REL_TOL)):
                if key in row and not (_is_num(row[key]) and close(float(row[key]), r[key], tol)):
                    out.append(
                        _f(
                            "METRICS_DISAGREE",
                            f"metrics.jsonl round {r['round']}: {key} = {row[key]!r}, "
                            f"recomputed from train-data: {r[key]!r}",
                            rel,
                        )
                    )
    return out


# -- bitwise-validation.json ------------------------------------------------------------------
def check_bitwise_file(root: Root, plan: dict[str, str] | None, bitwise: dict[str, Any] | None) -> list[Finding]:
    rel = BITWISE
    if not root.lexists(rel):
        return [_f("BITWISE_FILE_MISSING", "bitwise-validation.json (the run's own comparison) is absent", rel)]
    try:
        doc = root.read_json(rel)
    except InputError as e:
        return [e.finding]
    if not isinstance(doc, dict) or doc.get("schema") != BITWISE_SCHEMA:
        got = doc.get("schema") if isinstance(doc, dict) else None
        return [
            finding(
                "SCHEMA_UNSUPPORTED",
                f"{rel}: schema is {got!r}, expected {BITWISE_SCHEMA!r}",
                check=CHECK,
                path=rel,
            )
        ]
    bad = []
    for key, ok in (
        ("require_exact", lambda v: isinstance(v, bool)),
        ("torch_equal", lambda v: isinstance(v, bool)),
        ("element_count", _is_int),
        ("mismatch_count", _is_int),
        ("max_abs_diff", _is_num),
        ("fallback_failures", _is_int),
        ("rounds", lambda v: isinstance(v, list)),
    ):
        if not ok(doc.get(key)):
            bad.append(key)
    if bad:
        return [_f("BITWISE_FILE_INVALID", f"{rel}: missing or invalid field(s) {', '.join(bad)}", rel)]
    out: list[Finding] = []
    if doc["fallback_failures"] > 0:
        out.append(_f("FALLBACK_FAILURES", f"{rel} reports {doc['fallback_failures']} fallback failure(s)", rel))
    if all_rr(plan) and not doc["require_exact"]:
        out.append(
            _f(
                "BITWISE_FILE_INVALID",
                f"{rel}: require_exact is false for an all-R/R plan",
                rel,
                severity="warning",
            )
        )
    if doc["torch_equal"] != (doc["mismatch_count"] == 0):
        out.append(
            _f(
                "BITWISE_FILE_INVALID",
                f"{rel}: torch_equal={doc['torch_equal']} contradicts its mismatch_count={doc['mismatch_count']}",
                rel,
            )
        )
    if bitwise is None:
        return out
    if bitwise["complete"]:  # totals over partial train-data say nothing; rounds are still compared
        out.extend(_compare_totals(rel, doc, bitwise))
    ours = {r["round"]: r for r in bitwise["rounds"] if r["complete"]}
    for i, r in enumerate(doc["rounds"]):
        if not isinstance(r, dict) or not _is_int(r.get("round")):
            out.append(_f("BITWISE_FILE_INVALID", f"{rel}: rounds[{i}] has no integer round", rel))
            continue
        mine = ours.get(r["round"])
        if mine is None:
            continue
        for key in ("element_count", "mismatch_count"):
            if key in r and r[key] != mine[key]:
                out.append(
                    _f(
                        "BITWISE_FILE_DISAGREES",
                        f"{rel}: round {r['round']} {key} = {r[key]!r}, recomputed: {mine[key]}",
                        rel,
                    )
                )
    return out


def _compare_totals(rel: str, doc: dict[str, Any], bitwise: dict[str, Any]) -> list[Finding]:
    out: list[Finding] = []
    for key in ("element_count", "mismatch_count"):
        if doc[key] != bitwise[key]:
            out.append(
                _f(
                    "BITWISE_FILE_DISAGREES",
                    f"{rel}: {key} = {doc[key]}, recomputed from train-data: {bitwise[key]}",
                    rel,
                    claimed=doc[key],
                    recomputed=bitwise[key],
                )
            )
    if not close(float(doc["max_abs_diff"]), bitwise["max_abs_diff"], MAX_REL_TOL):
        out.append(
            _f(
                "BITWISE_FILE_DISAGREES",
                f"{rel}: max_abs_diff = {doc['max_abs_diff']!r}, recomputed: {bitwise['max_abs_diff']!r}",
                rel,
            )
        )
    return out
