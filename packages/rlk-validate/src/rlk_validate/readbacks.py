"""Readback checks (``rlk.readback.v1``): what each process says actually executed.

Rules (docs/evidence.md): the plan each process saw equals the requested plan; every planned module
has an executed record (call_count > 0) on both sides; an R side reports implementation ``rlk``, an
``rlk.*`` (or explicitly allowed) backend, a contract id and no fallback anywhere in the record; a P
side reports implementation ``production`` and names no rlk backend anywhere; no duplicate files.
For a module that is R on both sides, both sides ran the same rlk backends: an op both sides call
ran the same backend on each, and the module's set of backends is the same on each (a contract's
bits are those of one backend's kernels: ``rlk.triton`` on one side and ``rlk.reference`` on the
other agree within tolerance, not bit for bit).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from .evidence import (
    CASES,
    EXECUTION_MODES,
    FALLBACK_KEYS,
    FRAMEWORK_TARGETS,
    IMPLEMENTATIONS,
    LETTERS,
    MODES,
    MODULES,
    PRODUCTION,
    PRODUCTION_BACKEND_PREFIX,
    READBACK_SCHEMA,
    READBACKS_DIR,
    RLK,
    RLK_BACKEND_PREFIX,
    SIDES,
    TARGET_SIDE,
    bits_of,
    is_member,
    is_rlk_backend,
    readback_name,
    side_letter,
)
from .findings import Finding, finding
from .safeio import MAX_INT, InputError, Root

CHECK = "readbacks"
DIR = READBACKS_DIR
SCHEMA = READBACK_SCHEMA


def _f(code: str, msg: str, path: str | None = None, **kw: Any) -> Finding:
    return finding(code, msg, check=CHECK, path=path, **kw)


def plan_problem(plan: Any) -> str | None:
    """Why ``plan`` is not a valid plan (every module, each an exact ``X/Y`` case), or None."""
    if not isinstance(plan, dict) or not plan:
        return "the plan must be a non-empty object"
    for k, v in plan.items():
        if not is_member(k, MODULES):
            return f"unknown module {k!r} (known: {', '.join(MODULES)})"
        if not is_member(v, CASES):
            return f"module {k!r} has case {v!r}, expected X/Y with X, Y in {{P, R}}"
    lacking = [m for m in MODULES if m not in plan]
    if lacking:
        return f"the plan lacks module(s) {', '.join(lacking)}: every module needs a case"
    return None


def letter(plan: dict[str, str], module: str, side: str) -> str:
    return side_letter(plan[module], side)


def _is_int(v: Any, lo: int = 0) -> bool:
    return type(v) is int and lo <= v <= MAX_INT


def _is_name(v: Any) -> bool:
    return type(v) is str and 0 < len(v) <= 200 and v.isprintable()


def _walk(obj: Any, path: str) -> Iterator[tuple[str, str, Any]]:
    """Every (path, key, value) of nested dicts and lists (depth is bounded when read)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            p = f"{path}.{k}"
            yield p, str(k), v
            yield from _walk(v, p)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _walk(v, f"{path}[{i}]")


def _truthy(v: Any) -> bool:
    """A fallback flag counts as set unless it is false, 0, null or empty (no normalisation of strings)."""
    if v is None or v is False:
        return False
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return v != 0
    if isinstance(v, (str, list, dict)):
        return len(v) > 0
    return True


def _is_fallback_key(k: str) -> bool:
    return k in FALLBACK_KEYS or (k.startswith("fallback_") and k.endswith(("count", "calls")))


def _record_problem(rec: Any, where: str, is_op: bool) -> str | None:
    """Why a module or op record does not have the fields and types of ``rlk.readback.v1``, or None."""
    if not isinstance(rec, dict):
        return f"{where} must be an object"
    if not _is_int(rec.get("call_count")):
        return f"{where}.call_count must be an integer in [0, 2^63), got {rec.get('call_count')!r}"
    if not _is_name(rec.get("backend_id")):
        return f"{where}.backend_id must be a non-empty printable string, got {rec.get('backend_id')!r}"
    if rec.get("contract_id") is not None and not _is_name(rec.get("contract_id")):
        return f"{where}.contract_id must be a printable string or null"
    if not is_member(rec.get("execution_mode"), EXECUTION_MODES):
        return f"{where}.execution_mode {rec.get('execution_mode')!r} is not one of {', '.join(EXECUTION_MODES)}"
    if type(rec.get("fallback")) is not bool:
        return f"{where}.fallback must be true or false, got {rec.get('fallback')!r}"
    if rec.get("fallback_reason") is not None and type(rec.get("fallback_reason")) is not str:
        return f"{where}.fallback_reason must be a string or null"
    if is_op:
        if "provenance" in rec and not isinstance(rec["provenance"], dict):
            return f"{where}.provenance must be an object"
        return None
    if not is_member(rec.get("case"), LETTERS):
        return f"{where}.case {rec.get('case')!r} is not P or R"
    if not is_member(rec.get("implementation"), IMPLEMENTATIONS):
        return f"{where}.implementation {rec.get('implementation')!r} is not one of {', '.join(IMPLEMENTATIONS)}"
    ops = rec.get("ops")
    if not isinstance(ops, dict):
        return f"{where}.ops must be an object"
    for name, op in ops.items():
        if not _is_name(name):
            return f"{where}.ops has an invalid op name {name!r}"
        problem = _record_problem(op, f"{where}.ops.{name}", True)
        if problem:
            return problem
    # the module's numbers are claims about its ops: recompute them
    if rec["call_count"] and not ops:
        return f"{where} claims {rec['call_count']} call(s) but records no op"
    if ops:
        total = sum(op["call_count"] for op in ops.values())
        if total != rec["call_count"]:
            return f"{where}.call_count is {rec['call_count']}, its ops sum to {total}"
        if rec["backend_id"] not in {op["backend_id"] for op in ops.values()}:
            return f"{where}.backend_id {rec['backend_id']!r} is not the backend of any of its ops"
    return None


def _annotations_problem(a: Any) -> str | None:
    """Why a readback's ``annotations`` (topic -> ``{counts: {name: integer >= 0}, mark: JSON scalar}``) is
    malformed, or None."""
    if not isinstance(a, dict):
        return "annotations must be an object"
    for topic, body in a.items():
        if not _is_name(topic) or not isinstance(body, dict):
            return f"annotations.{str(topic)[:64]} must be an object under a printable name"
        counts = body.get("counts", {})
        if not isinstance(counts, dict) or not all(_is_name(k) and _is_int(v) for k, v in counts.items()):
            return f"annotations.{topic}.counts must map names to integers in [0, 2^63)"
        for k, v in body.items():
            if k != "counts" and not (_is_name(k) and (v is None or type(v) in (str, bool, int, float))):
                return f"annotations.{topic}.{str(k)[:64]} must be a JSON scalar (string, boolean, number or null)"
    return None


def _validate_doc(doc: Any, rel: str) -> str | None:
    if not isinstance(doc, dict):
        return "the document is not a JSON object"
    fw, tg, side = doc.get("framework"), doc.get("target"), doc.get("side")
    if not is_member(fw, FRAMEWORK_TARGETS):
        return f"framework {fw!r} is not one of {', '.join(FRAMEWORK_TARGETS)}"
    if not is_member(tg, FRAMEWORK_TARGETS[fw]):
        return f"target {tg!r} is not valid for framework {fw!r}"
    if not is_member(side, SIDES) or side != TARGET_SIDE[tg]:
        return f"side {side!r} does not match target {tg!r} (expected {TARGET_SIDE[tg]!r})"
    for key, lo in (("pid", 0), ("rank", 0), ("world_size", 1)):
        if not _is_int(doc.get(key), lo):
            return f"{key} must be an integer in [{lo}, 2^63), got {doc.get(key)!r}"
    if doc["rank"] >= doc["world_size"]:
        return f"rank {doc['rank']} is not below world_size {doc['world_size']}"
    if not is_member(doc.get("mode"), MODES):
        return f"mode {doc.get('mode')!r} is not strict or audit"
    if doc.get("run_id") is not None and not _is_name(doc.get("run_id")):
        return "run_id must be a printable string or null"
    if not isinstance(doc.get("modules"), dict):
        return "modules must be an object"
    if "hooks" in doc and not isinstance(doc["hooks"], list):
        return "hooks must be a list"
    if "annotations" in doc:
        problem = _annotations_problem(doc["annotations"])
        if problem:
            return problem
    for m, rec in doc["modules"].items():
        if not is_member(m, MODULES):
            return f"modules has an unknown module {m!r} (known: {', '.join(MODULES)})"
        problem = _record_problem(rec, f"modules.{m}", False)
        if problem:
            return problem
    return None


def _fallbacks(rec: dict[str, Any], where: str, rel: str) -> list[Finding]:
    out = []
    for p, k, v in _walk(rec, where):
        if _is_fallback_key(k) and _truthy(v):
            reason = rec.get("fallback_reason")
            out.append(_f("FALLBACK", f"{rel}: {p} = {v!r} on an R side: a fallback ran", rel, field=p,
                          reason=reason if isinstance(reason, str) else None))
    return out


def _check_record(rec: dict[str, Any], module: str, want: str, rel: str, allowed: frozenset[str]) -> list[Finding]:
    out: list[Finding] = []
    where = f"modules.{module}"
    if rec["case"] != want:
        out.append(_f("CASE_MISMATCH", f"{rel}: {where}.case is {rec['case']!r}, the plan says {want!r}", rel))
    if want == "R":
        backend = rec["backend_id"]
        if rec["implementation"] != RLK or not is_rlk_backend(backend, allowed):
            out.append(_f("R_NOT_RLK", f"{rel}: {where} is an R side but reports implementation "
                          f"{rec['implementation']!r}, backend {backend!r}", rel, module=module))
        if not rec["contract_id"]:
            out.append(_f("R_CONTRACT_MISSING", f"{rel}: {where} is an R side without a contract_id", rel))
        for name, op in rec["ops"].items():
            if not is_rlk_backend(op["backend_id"], allowed):
                out.append(_f("R_NOT_RLK", f"{rel}: {where}.ops.{name} ran backend {op['backend_id']!r}, "
                              "which is not an rlk backend, on an R side", rel, module=module, op=name))
            if not op["contract_id"]:
                out.append(_f("R_CONTRACT_MISSING", f"{rel}: {where}.ops.{name} is on an R side without a "
                              "contract_id", rel))
        out.extend(_fallbacks(rec, where, rel))
        for p, k, v in _walk(rec, where):
            if ("backend" in k and isinstance(v, str) and v.startswith(PRODUCTION_BACKEND_PREFIX)) or (
                k == "implementation" and v == PRODUCTION
            ):
                out.append(_f("R_NOT_RLK", f"{rel}: {p} = {v!r} inside an R side's record", rel, field=p))
    else:
        if rec["implementation"] != PRODUCTION:
            out.append(_f("P_NOT_PRODUCTION", f"{rel}: {where} is a P side but reports implementation "
                          f"{rec['implementation']!r}", rel))
        for p, k, v in _walk(rec, where):
            if ("backend" in k and isinstance(v, str) and (v.startswith(RLK_BACKEND_PREFIX) or v in allowed)) or (
                k == "implementation" and v == RLK
            ):
                out.append(_f("P_REPORTS_RLK", f"{rel}: {p} = {v!r} on a P side: rlk executed there", rel, field=p))
    return out


def _readback_names(root: Root) -> list[tuple[str | None, str]]:
    """``(host, file name)`` of every readback: ``readbacks/*.json`` (host None) and, for runs on several
    nodes, ``readbacks/<hostname>/*.json`` (one level; names starting with ``.`` are ignored)."""
    out: list[tuple[str | None, str]] = []
    for n in root.listdir(DIR):
        if n.startswith("."):
            continue
        if n.endswith(".json"):
            out.append((None, n))
        elif root.is_dir(f"{DIR}/{n}"):
            out.extend((n, m) for m in root.listdir(f"{DIR}/{n}") if m.endswith(".json") and not m.startswith("."))
    return out


def _list_readbacks(root: Root) -> list[tuple[str | None, str]] | None:
    """The ``(host, name)`` of every readback, or None when ``readbacks/`` is absent (raises InputError)."""
    if not root.is_dir(DIR):
        return None
    return _readback_names(root)


def _load_readback(root: Root, rel: str) -> tuple[dict[str, Any] | None, list[Finding]]:
    """Read one readback and check its schema and fields; the document is None when it is unusable."""
    try:
        doc = root.read_json(rel)
    except InputError as e:
        return None, [e.finding]
    schema = doc.get("schema") if isinstance(doc, dict) else None
    if schema != SCHEMA:
        return None, [
            finding(
                "SCHEMA_UNSUPPORTED",
                f"{rel}: schema is {schema!r}, expected {SCHEMA!r}",
                check=CHECK,
                path=rel,
            )
        ]
    problem = _validate_doc(doc, rel)
    if problem:
        return None, [_f("READBACK_FIELD_INVALID", f"{rel}: {problem}", rel)]
    return doc, []


def _filing_findings(doc: dict[str, Any], rel: str, name: str, host: str | None) -> list[Finding]:
    """A readback's file name and host directory must be the ones its content implies."""
    out: list[Finding] = []
    expect = readback_name(doc["framework"], doc["target"], doc["pid"])
    if name != expect:
        out.append(_f("READBACK_NAME_MISMATCH", f"{rel}: its content says it should be named {expect}", rel))
    if host is not None and doc.get("hostname") != host:
        out.append(_f("READBACK_NAME_MISMATCH", f"{rel}: written on host {doc.get('hostname')!r}, filed "
                      f"under {host!r} (readbacks/<hostname>/ holds one node's readbacks)", rel))
    return out


def _read_docs(
    root: Root, names: list[tuple[str | None, str]]
) -> tuple[list[tuple[str, dict[str, Any]]], list[Finding]]:
    """Load every readback, keeping the valid ones and one per (host, framework, target, pid)."""
    findings: list[Finding] = []
    docs: list[tuple[str, dict[str, Any]]] = []
    keys: dict[tuple[str | None, str, str, int], str] = {}
    for host, name in names:
        rel = f"{DIR}/{name}" if host is None else f"{DIR}/{host}/{name}"
        doc, problems = _load_readback(root, rel)
        findings.extend(problems)
        if doc is None:
            continue
        findings.extend(_filing_findings(doc, rel, name, host))
        # pids are per host: two nodes' processes may share one (readbacks/<hostname>/ keeps them apart)
        key = (host, doc["framework"], doc["target"], doc["pid"])
        if key in keys:
            findings.append(
                _f(
                    "READBACK_DUPLICATE",
                    f"{rel} and {keys[key]} are both the readback of {key[1]} {key[2]} pid {key[3]}",
                    rel,
                )
            )
            continue
        keys[key] = rel
        docs.append((rel, doc))
    return docs, findings


def _check_seen_plans(
    docs: list[tuple[str, dict[str, Any]]], plan: dict[str, str] | None, run_id: str | None
) -> tuple[dict[str, str] | None, list[Finding]]:
    """Each readback saw the requested plan (without one, the others' plan) and is of this run; returns the plan."""
    findings: list[Finding] = []
    ref_plan = plan
    for rel, doc in docs:
        p = doc.get("plan")
        problem = plan_problem(p)
        if problem:
            findings.append(_f("PLAN_INVALID", f"{rel}: plan: {problem}", rel))
        elif plan is not None and p != plan:
            findings.append(
                _f(
                    "READBACK_PLAN_MISMATCH",
                    f"{rel}: saw plan {p}, the run requested {plan}",
                    rel,
                    seen=p,
                    requested=plan,
                )
            )
        elif plan is None and ref_plan is not None and p != ref_plan:
            findings.append(_f("READBACK_PLAN_CONFLICT", f"{rel}: saw plan {p}, another readback saw {ref_plan}", rel))
        elif ref_plan is None:
            ref_plan = p
        if run_id is not None and doc.get("run_id") is not None and doc["run_id"] != run_id:
            findings.append(
                _f(
                    "READBACK_RUN_ID_MISMATCH",
                    f"{rel}: run_id {doc['run_id']!r} is not this run's ({run_id!r}); "
                    "readbacks of another run are mixed in",
                    rel,
                )
            )
    return ref_plan, findings


def _add_record(agg: dict[str, Any], rec: dict[str, Any]) -> None:
    """Fold one process's record of a module into its side's aggregate."""
    agg["records"] += 1
    agg["call_count"] += rec["call_count"]
    for key in ("implementation", "backend_id", "contract_id"):
        vals = agg.setdefault(key + "s", [])
        if rec.get(key) not in vals:
            vals.append(rec.get(key))


def _aggregate_sides(
    docs: list[tuple[str, dict[str, Any]]], ref_plan: dict[str, str], allowed: frozenset[str]
) -> tuple[dict[str, dict[str, Any]], list[Finding]]:
    """Check every module record against its planned letter and aggregate the records per side."""
    findings: list[Finding] = []
    sides: dict[str, dict[str, Any]] = {
        s: {"processes": [], "modules": {m: {"records": 0, "call_count": 0} for m in ref_plan}} for s in SIDES
    }
    for rel, doc in docs:
        side = doc["side"]
        sides[side]["processes"].append(
            {"file": rel, "framework": doc["framework"], "rank": doc["rank"], "pid": doc["pid"]}
        )
        for module, rec in doc["modules"].items():
            if module not in ref_plan:
                findings.append(_f("MODULE_UNPLANNED", f"{rel}: records module {module!r}, which the plan lacks", rel))
                findings.extend(_fallbacks(rec, f"modules.{module}", rel))  # a fallback is never out of scope
                continue
            findings.extend(_check_record(rec, module, letter(ref_plan, module, side), rel, allowed))
            _add_record(sides[side]["modules"][module], rec)
    return sides, findings


def _coverage_findings(sides: dict[str, dict[str, Any]], ref_plan: dict[str, str]) -> list[Finding]:
    """Each side has a readback, and on each side every planned module was recorded and executed."""
    findings: list[Finding] = []
    for side in SIDES:
        if not sides[side]["processes"]:
            findings.append(
                _f(
                    "READBACKS_MISSING",
                    f"no readback from the {side} side: nothing shows what ran there",
                    DIR,
                )
            )
            continue
        for module, agg in sides[side]["modules"].items():
            if agg["records"] == 0:
                findings.append(
                    _f(
                        "MODULE_RECORD_MISSING",
                        f"no {side}-side readback records module {module!r} ({ref_plan[module]}): "
                        "its route was never installed",
                        DIR,
                    )
                )
            elif agg["call_count"] == 0:
                findings.append(
                    _f(
                        "MODULE_NOT_EXECUTED",
                        f"module {module!r} has call_count 0 on every {side}-side process",
                        DIR,
                    )
                )
    return findings


def check_readbacks(
    root: Root,
    plan: dict[str, str] | None,
    run_id: str | None = None,
    allowed_backends: frozenset[str] = frozenset(),
) -> tuple[list[Finding], dict[str, Any]]:
    """Check ``readbacks/`` against the requested ``plan`` (None: no manifest, compare among themselves)."""
    summary: dict[str, Any] = {"files": 0, "sides": {}}
    try:
        names = _list_readbacks(root)
    except InputError as e:
        return [e.finding], summary
    if names is None:
        return [_f("READBACKS_MISSING", "readbacks/ is absent: no evidence of what executed", DIR)], summary

    docs, findings = _read_docs(root, names)
    summary["files"] = len(docs)
    ref_plan, plan_findings = _check_seen_plans(docs, plan, run_id)
    findings.extend(plan_findings)
    if ref_plan is None or plan_problem(ref_plan):
        if not docs and not findings:
            findings.append(_f("READBACKS_MISSING", "readbacks/ holds no readback", DIR))
        return findings, summary

    sides, record_findings = _aggregate_sides(docs, ref_plan, allowed_backends)
    findings.extend(record_findings)
    findings.extend(_check_same_backends(docs, ref_plan))
    findings.extend(_coverage_findings(sides, ref_plan))
    summary["sides"] = sides
    return findings, summary


def _op_backends(docs: list[tuple[str, dict[str, Any]]], module: str, side: str) -> dict[str, set[str]]:
    """``{op: {backend, ...}}`` over every process of ``side`` for ``module`` (module-level backend
    under the key ``""`` when a record lists no ops), each backend as the one whose bits it gives
    (:func:`~rlk_validate.evidence.bits_of`: ``rlk.cuda`` counts as ``rlk.triton``)."""
    out: dict[str, set[str]] = {}
    for _, doc in docs:
        rec = doc["modules"].get(module) if doc["side"] == side else None
        if not isinstance(rec, dict):
            continue
        ops = rec.get("ops")
        items = ops.items() if isinstance(ops, dict) and ops else [("", rec)]
        for name, op in items:
            if isinstance(op, dict) and isinstance(op.get("backend_id"), str):
                out.setdefault(name, set()).add(bits_of(op["backend_id"]))
    return out


def _check_same_backends(docs: list[tuple[str, dict[str, Any]]], plan: dict[str, str]) -> list[Finding]:
    """For each R/R module, both sides ran the same rlk backends (per op and over the module)."""
    out: list[Finding] = []
    for module, case in plan.items():
        if case != "R/R":
            continue
        train, roll = _op_backends(docs, module, "train"), _op_backends(docs, module, "rollout")
        if not train or not roll:
            continue  # a missing side is reported elsewhere
        for op in sorted(set(train) & set(roll)):
            if train[op] != roll[op]:
                out.append(_f("BACKEND_DIVERGES",
                              f"module {module!r} (R/R): op {op!r} ran {sorted(train[op])} on the train side but "
                              f"{sorted(roll[op])} on the rollout side; their bits can differ", DIR,
                              module=module, op=op, train=sorted(train[op]), rollout=sorted(roll[op])))
        t_all, r_all = set().union(*train.values()), set().union(*roll.values())
        if t_all != r_all:
            out.append(_f("BACKEND_DIVERGES",
                          f"module {module!r} (R/R): the train side ran backends {sorted(t_all)}, the rollout side "
                          f"{sorted(r_all)}; one contract's bits are one backend's kernels", DIR,
                          module=module, train=sorted(t_all), rollout=sorted(r_all)))
    return out
