"""Run-level checks: manifest and the run's end state (exit code, run.log).

The numbers a run claims about itself are checked in :mod:`rlk_validate.claims`.
"""

from __future__ import annotations

import re
from typing import Any

from .claims import is_int
from .evidence import EXIT_CODE, MANIFEST, MANIFEST_SCHEMA, PRESET_MODES, RUN_LOG, is_member
from .findings import Finding, finding
from .readbacks import plan_problem
from .safeio import InputError, Root

CHECK = "run"
TRACEBACK = b"Traceback (most recent call last):"
_SHA_RE = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")
_HASH_RE = re.compile(r"sha256:[0-9a-f]{64}")
#: engine and mode are open vocabularies of plain identifiers (a trailing newline is not a mode)
_IDENT_RE = re.compile(r"[a-z][a-z0-9_-]{0,63}")
#: exit-code: one ASCII integer and at most one newline
_EXIT_RE = re.compile(rb"-?[0-9]{1,6}\n?")
#: rounds and ranks beyond this are not a run (reported, never enumerated)
MAX_COUNT = 10**12


def _f(code: str, msg: str, path: str | None = None, **kw: Any) -> Finding:
    return finding(code, msg, check=CHECK, path=path, **kw)


def _printable(v: Any) -> bool:
    return type(v) is str and v.isprintable()


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
        if not (is_int(m[key], 1) and m[key] <= MAX_COUNT):
            out.append(("MANIFEST_FIELD_INVALID", f"manifest.json {key!r} must be an integer in [1, {MAX_COUNT}]"))
    for key in ("engine", "mode"):
        if not _IDENT_RE.fullmatch(m[key]):
            out.append(("MANIFEST_FIELD_INVALID", f"manifest.json {key!r} = {m[key][:40]!r} is not a plain name"))
    if not all(is_int(v, -(1 << 63)) and isinstance(k, str) for k, v in m["seeds"].items()):
        out.append(("MANIFEST_FIELD_INVALID", "manifest.json 'seeds' must map names to integers"))
    if "config" in m and not isinstance(m["config"], dict):
        out.append(("MANIFEST_FIELD_INVALID", "manifest.json 'config' must be an object"))
    if not m["repos"]:
        out.append(("MANIFEST_FIELD_MISSING", "manifest.json 'repos' is empty: no source revision recorded"))
    for i, r in enumerate(m["repos"]):
        if not isinstance(r, dict) or not _printable(r.get("name")) or not r["name"]:
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
            if dirty is not None and type(dirty) is not bool:
                out.append(("MANIFEST_FIELD_INVALID", f"manifest.json repos[{i}] ({name}) dirty must be true or false"))
    if not m["packages"] or not all(_printable(v) and v for v in m["packages"].values()):
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
    info: dict[str, Any] = {"plan": None, "rounds": None, "ranks": None, "run_id": None, "mode": None,
                            "engine": None, "static_weights": False}
    rel = MANIFEST
    if not root.lexists(rel):
        return [_f("MANIFEST_MISSING", "manifest.json is absent: the requested plan and inputs are unknown", rel)], info
    try:
        m = root.read_json(rel)
    except InputError as e:
        return [e.finding], info
    if not isinstance(m, dict) or not is_member(m.get("schema"), (MANIFEST_SCHEMA,)):
        got = str(m.get("schema"))[:80] if isinstance(m, dict) else None
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
        if is_int(m.get(key), 1) and m[key] <= MAX_COUNT:
            info[key] = m[key]
    if _printable(m.get("run_id")):
        info["run_id"] = m["run_id"]
    info["mode"] = m.get("mode") if _printable(m.get("mode")) else None
    info["engine"] = m.get("engine") if _printable(m.get("engine")) else None
    info["static_weights"] = isinstance(m.get("config"), dict) and m["config"].get("static_weights") is True
    plan = info["plan"]
    preset = PRESET_MODES.get(m.get("mode")) if is_member(m.get("mode"), PRESET_MODES) else None
    if plan and preset and not all(v == preset for v in plan.values()):
        out.append(_f("MODE_PLAN_MISMATCH", f"mode is {m['mode']} but the plan is {plan}, not all {preset}", rel))
    for r in m.get("repos") or []:
        if isinstance(r, dict) and r.get("dirty") is True:
            out.append(
                _f(
                    "REPO_DIRTY",
                    f"repository {str(r.get('name'))[:80]!r} had uncommitted changes at {str(r.get('sha'))[:80]}",
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
            raw = root.read_bytes(rel, root.caps.small_bytes)
            text = raw.decode("ascii", errors="replace").strip()
            if not _EXIT_RE.fullmatch(raw):
                out.append(_f("EXIT_CODE_INVALID", f"exit-code holds {raw[:40]!r}, not one ASCII integer", rel))
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


