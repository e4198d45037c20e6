"""``rlk-validate ladder LADDER_ROOT``: the mismatch-knob ladder of ``rlk-repro ladder`` (``docs/ladder.md``).

A ladder root holds ``ladder-options.json`` (``rlk.ladder-options.v1``: the rungs, each a name, its knobs and
the rung it is compared with), one run directory per rung that ran and ``<rung>.skipped.json``
(``rlk.ladder-skip.v1``) per rung the machine or engine could not run. Every rung directory is checked as a run
(an all-R/R rung must be bitwise zero); its manifest must show the rung's knobs; every rung must share commit,
inputs, seeds and configuration (knobs and routes aside); a skip must name what was missing. Then each rung's
drift metrics (:func:`rung_metrics`), its delta against its reference rung and its drift class
(:func:`classify`, the rules of ``docs/ladder.md``) form the ladder report; a ``ladder-report.json`` already at
the root must be what its rungs' data give now. Writes ``ladder-report.json/.md`` only when asked.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from . import __version__
from .evidence import (
    LADDER_OPTIONS,
    LADDER_OPTIONS_SCHEMA,
    LADDER_REPORT_JSON,
    LADDER_REPORT_MD,
    LADDER_REPORT_SCHEMA,
    LADDER_SKIP_SCHEMA,
    LADDER_SKIP_SUFFIX,
    MANIFEST,
    MATRIX_SHARED_FIELDS,
    REPORT_DIR,
    ROUTE_CONFIG_KEYS,
    write_bytes_atomic,
)
from .findings import ERROR, INCOMPLETE, Finding, finding
from .ladder_metrics import (
    JUMP_FACTOR,
    MODULES,
    NUMERICAL_ABS_MAX,
    NUMERICAL_CLIP_FRACTION,
    SAMPLING_KNOBS,
    classify,
    delta,
    drift_class,
    rung_metrics,
)
from .report import Report, Verdict, clean, dumps, finite, now_iso, summarised
from .safeio import InputError, Root
from .validate import Options, unusable_reason, validate_run

CHECK = "ladder"
SKIP_SUFFIX, SKIP_SCHEMA = LADDER_SKIP_SUFFIX, LADDER_SKIP_SCHEMA
#: ``config`` keys that follow from a rung's knobs and so differ between rungs (besides the route keys)
KNOB_CONFIG_KEYS = (*SAMPLING_KNOBS, "rollout_quantization")

# -- the ladder root --------------------------------------------------------------------------------------------------
@dataclass
class LadderReport(Verdict):
    ladder_root: str
    rungs: list[dict[str, Any]] = field(default_factory=list)  # one entry per rung of ladder-options.json, in order
    findings: list[Finding] = field(default_factory=list)
    unusable: bool = False
    checked_at: str = field(default_factory=now_iso)
    written: list[str] = field(default_factory=list)
    engine: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": LADDER_REPORT_SCHEMA,
            "validator": {"name": "rlk-validate", "version": __version__},
            "ladder_root": self.ladder_root,
            "engine": self.engine,
            "checked_at": self.checked_at,
            "verdict": self.verdict,
            "passed": self.verdict == "passed",
            "exit_code": self.exit_code,
            "thresholds": {"numerical_abs_max": NUMERICAL_ABS_MAX, "numerical_clip_fraction": NUMERICAL_CLIP_FRACTION,
                           "jump_factor": JUMP_FACTOR},
            "findings": [f.to_json() for f in self.findings],
            "rungs": self.rungs,
        }

    def to_markdown(self) -> str:
        def num(v: Any, fmt: str = ".3g") -> str:
            return "-" if v is None else format(v, fmt)

        rows = [f"# Ladder report: {self.verdict}", "",
                f"`{self.ladder_root}`, engine {self.engine}, checked {self.checked_at} by rlk-validate {__version__}. "
                "d = train - rollout log-prob of each sampled token (nats); delta: against the rung named in `vs`. "
                "Classes and their rules: docs/ladder.md.", "",
                "| rung | routes | knobs | status | tokens | mismatches | mean abs d | mean d | max abs d | p50 | p90 "
                "| p99 | k3 KL | clip fraction | vs | delta mean abs d | class |",
                "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- "
                "| ---: | --- |"]
        for g in self.rungs:
            m = g.get("metrics") or {}
            d = m.get("dlogp") or {}
            dl = (g.get("delta") or {}).get("abs_mean")
            knobs = ", ".join(f"{k}={v}" for k, v in g["knobs"].items() if k not in ("case", *MODULES))
            status = g["status"] if g["status"] != "skipped" else f"skipped: {g.get('skip_reason')}"
            rows.append(
                f"| {g['name']} | {_routes(g['plan'])} | {knobs} | {clean(status, 160).replace('|', '/')} "
                f"| {num(m.get('tokens'), 'd')} | {num(m.get('mismatch_count'), 'd')} | {num(d.get('abs_mean'))} "
                f"| {num(d.get('mean'))} | {num(d.get('abs_max'))} | {num(d.get('abs_p50'))} | {num(d.get('abs_p90'))} "
                f"| {num(d.get('abs_p99'))} | {num(m.get('k3_kl'))} | {num(m.get('clip_fraction'))} "
                f"| {g.get('vs') or '-'} | {num(dl, '+.3g')} | {(g.get('classification') or {}).get('class', '-')} |")
        rows += ["", "## Classification", ""]
        for g in self.rungs:
            c = g.get("classification")
            if c:
                rows.append(f"- **{g['name']}**: {c['class']} (rule {c['rule']}): {clean(c['why'], 300)}"
                            + (f". Next: {c['next']}" if c.get("next") else ""))
        rows += ["", "## Worst tokens", "",
                 "| rung | round | sample | position (context length) | response index | token | vocab shard (tp) "
                 "| filtered rung | train | rollout | d |",
                 "| --- | ---: | ---: | ---: | ---: | ---: | --- | --- | ---: | ---: | ---: |"]
        for g in self.rungs:
            for w in (g.get("metrics") or {}).get("worst_tokens", []):
                rows.append(f"| {g['name']} | {w['round']} | {w['sample']} | {w['context_length']} "
                            f"| {num(w['response_index'], 'd')} | {w['token_id']} | {num(w['vocab_shard'], 'd')} "
                            f"({w['tp']}) | {'yes' if w['filtered'] else 'no'} | {w['train_logprob']:.7g} "
                            f"| {w['rollout_logprob']:.7g} | {w['diff']:+.3g} |")
        rows += ["", "## Backends and batch layout", ""]
        for g in self.rungs:
            m = g.get("metrics")
            if not m:
                continue
            used = "; ".join(f"{side} {mod}: {'/'.join(map(str, e['backend_ids']))}"
                             + (f" (fallbacks: {len(e['fallbacks'])})" if e["fallbacks"] else "")
                             for side, mods in sorted(m["backends"].items()) for mod, e in sorted(mods.items()))
            lay = {**m["batch_layout"].get("config", {}), **m["batch_layout"].get("scheduler", {})}
            rows.append(f"- **{g['name']}**: {used or 'no readbacks'}. Layout: "
                        + ", ".join(f"{k} {v}" for k, v in lay.items()))
        bad = [f for f in self.findings if f.severity in (ERROR, INCOMPLETE)]
        if bad:
            rows += ["", "## Problems", ""] + [f"- **{f.code}** {clean(f.message).replace('|', '/')}" for f in bad]
        return "\n".join(rows) + "\n"

    def summary(self) -> str:
        if self.unusable:
            why = self.findings[0].message if self.findings else "unusable"
            return f"rlk-validate: UNUSABLE (exit {self.exit_code}): {clean(why, 1000)}"
        lines = [f"rlk-validate {__version__} ladder: {clean(self.ladder_root)}"]
        for g in self.rungs:
            m = g.get("metrics") or {}
            if g["status"] == "skipped":
                lines.append(f"  {g['name']:<16} skipped: {clean(g.get('skip_reason'), 200)}")
                continue
            am = (m.get("dlogp") or {}).get("abs_mean")
            lines.append(f"  {g['name']:<16} {g['status']:<11} mismatches {m.get('mismatch_count', '-')}/"
                         f"{m.get('tokens', '-')}  mean |d| {'-' if am is None else format(am, '.3g')}  "
                         f"{(g.get('classification') or {}).get('class', '')}")
        lines += summarised([f for f in self.findings if f.severity != "info"])
        lines += [f"wrote {clean(w)}" for w in self.written]
        lines.append(f"verdict: {self.verdict.upper()} (exit {self.exit_code})")
        return "\n".join(lines)


def _routes(plan: dict[str, str] | None) -> str:
    if not plan:
        return "-"
    cases = set(plan.values())
    return cases.pop() if len(cases) == 1 else ", ".join(f"{m} {plan[m]}" for m in MODULES if m in plan)


def _read_options(root: Root) -> tuple[dict[str, Any] | None, Finding | None]:
    try:
        doc = root.read_json(LADDER_OPTIONS)
    except InputError as e:
        return None, e.finding
    rungs = doc.get("rungs") if isinstance(doc, dict) else None
    if not isinstance(doc, dict) or doc.get("schema") != LADDER_OPTIONS_SCHEMA or not isinstance(rungs, list) \
            or not rungs or not all(_rung_ok(g) for g in rungs):
        return None, finding("LADDER_OPTIONS_INVALID", f"{LADDER_OPTIONS} is not a {LADDER_OPTIONS_SCHEMA} document "
                             "with a non-empty list of rungs (name, knobs, plan, needs)", check=CHECK,
                             path=LADDER_OPTIONS)
    names = [g["name"] for g in rungs]
    if len(set(names)) != len(names):
        return None, finding("LADDER_OPTIONS_INVALID", f"{LADDER_OPTIONS} names a rung twice", check=CHECK,
                             path=LADDER_OPTIONS)
    return doc, None


def _rung_ok(g: Any) -> bool:
    return (isinstance(g, dict) and isinstance(g.get("name"), str) and g["name"]
            and "/" not in g["name"] and not g["name"].startswith(".") and isinstance(g.get("knobs"), dict)
            and isinstance(g.get("plan"), dict) and isinstance(g.get("needs"), list)
            and all(type(g["knobs"].get(k)) in (int, float) for k in SAMPLING_KNOBS))


def _knob_findings(name: str, g: dict[str, Any], manifest: Any) -> list[Finding]:
    """A rung's manifest must show its plan and its knobs (sampling filters, temperature, quantization)."""
    if not isinstance(manifest, dict):
        return []  # the rung's own validation reports an unreadable manifest
    sampling = manifest.get("sampling") if isinstance(manifest.get("sampling"), dict) else {}
    config = manifest.get("config") if isinstance(manifest.get("config"), dict) else {}
    differ = []
    if manifest.get("plan") != g["plan"]:
        differ.append(f"plan {manifest.get('plan')} (the rung: {g['plan']})")
    for k in SAMPLING_KNOBS:
        if sampling.get(k) != g["knobs"][k]:
            differ.append(f"{k} {sampling.get(k)!r} (the rung: {g['knobs'][k]!r})")
    quant = config.get("rollout_quantization") or "none"
    if quant != g["knobs"].get("quantization", "none"):
        differ.append(f"rollout quantization {quant!r} (the rung: {g['knobs'].get('quantization')!r})")
    if not differ:
        return []
    return [finding("LADDER_RUNG_KNOBS_MISMATCH", f"{name}: the manifest shows {'; '.join(differ)}", check=CHECK,
                    path=f"{name}/{MANIFEST}")]


def _skip_findings(root: Root, name: str, g: dict[str, Any], has_dir: bool) -> tuple[str | None, list[Finding]]:
    """A rung's skip record: well formed, naming a need the rung has, and alone (no run directory beside it)."""
    rel = name + SKIP_SUFFIX
    try:
        doc = root.read_json(rel)
    except InputError as e:
        return None, [e.finding]
    bad = None
    if not isinstance(doc, dict) or doc.get("schema") != SKIP_SCHEMA or doc.get("rung") != name \
            or not isinstance(doc.get("reason"), str) or not doc["reason"].strip():
        bad = f"{rel} is not a {SKIP_SCHEMA} record of rung {name} with a reason"
    elif not g["needs"] or doc.get("needs") != g["needs"]:
        bad = (f"{rel}: rung {name} needs {g['needs'] or 'nothing this machine could lack'}, the record says "
               f"{doc.get('needs')}: a rung that can run is never skipped")
    elif has_dir:
        bad = f"{name} has both a run directory and {rel}"
    if bad:
        return None, [finding("LADDER_SKIP_INVALID", bad, check=CHECK, path=rel)]
    return doc["reason"], [finding("LADDER_RUNG_SKIPPED", f"{name} skipped: {doc['reason']}", check=CHECK, path=rel)]


def _provenance(manifest: Any) -> dict[str, Any] | None:
    if not isinstance(manifest, dict):
        return None
    out = {k: manifest.get(k) for k in MATRIX_SHARED_FIELDS}
    if isinstance(out["config"], dict):
        out["config"] = {k: v for k, v in out["config"].items() if k not in (*ROUTE_CONFIG_KEYS, *KNOB_CONFIG_KEYS)}
    if isinstance(out["repos"], list):
        out["repos"] = [{k: r.get(k) for k in ("name", "sha", "dirty")} if isinstance(r, dict) else r
                        for r in out["repos"]]
    return out


def validate_ladder(path: str | os.PathLike[str], options: Options | None = None, write: bool = False) -> LadderReport:
    """Check the ladder root at ``path`` and build its report; writes ``ladder-report.json/.md`` only when ``write``."""
    opts = options or Options()
    root_dir = os.path.abspath(os.fspath(path))
    rep = LadderReport(ladder_root=root_dir)
    why = unusable_reason(root_dir)
    if why is None and not os.path.exists(os.path.join(root_dir, LADDER_OPTIONS)):
        why = f"{root_dir} is not a ladder root (no {LADDER_OPTIONS}: `rlk-repro ladder` writes one)"
    if why:
        rep.unusable = True
        rep.findings.append(finding("INPUT_UNUSABLE", why, check=CHECK))
        return rep
    root = Root(root_dir, opts.caps, check=CHECK)
    doc, bad = _read_options(root)
    if doc is None:
        rep.unusable = True
        rep.findings.append(bad)
        return rep
    rep.engine = doc.get("engine")
    names = root.listdir("")
    known = {g["name"] for g in doc["rungs"]}
    for n in names:
        base = n[: -len(SKIP_SUFFIX)] if n.endswith(SKIP_SUFFIX) else n.split(".interrupted-")[0]
        if n in (LADDER_OPTIONS, LADDER_REPORT_JSON, LADDER_REPORT_MD, REPORT_DIR) or n.startswith(".") \
                or base in known:
            continue
        rep.findings.append(finding("LADDER_UNKNOWN_ENTRY", f"{n} is not a rung of {LADDER_OPTIONS}; skipped",
                                    check=CHECK, path=n))
    metrics: dict[str, dict[str, Any]] = {}
    prov: dict[str, Any] = {}
    for g in doc["rungs"]:
        name = g["name"]
        entry: dict[str, Any] = {"name": name, "knobs": g["knobs"], "plan": g["plan"], "vs": g.get("vs"),
                                 "needs": g["needs"], "dir": None, "status": "missing"}
        rep.rungs.append(entry)
        has_dir = name in names and root.is_dir(name)
        if name + SKIP_SUFFIX in names:
            reason, found = _skip_findings(root, name, g, has_dir)
            rep.findings.extend(found)
            if reason is not None:
                entry.update(status="skipped", skip_reason=reason,
                             classification=drift_class("not run", "0", reason, None))
                continue
        if not has_dir:
            if name + SKIP_SUFFIX not in names:
                rep.findings.append(finding("LADDER_RUNG_MISSING", f"rung {name} has neither a run directory nor a "
                                            "skip record", check=CHECK, path=name))
            continue
        r = validate_run(os.path.join(root_dir, name), opts)
        try:
            manifest = Root(r.run_dir, opts.caps, check=CHECK).read_json(MANIFEST)
        except InputError:
            manifest = None
        kf = _knob_findings(name, g, manifest)
        rep.findings.extend(kf)
        rep.findings.extend(_run_findings(name, r))
        prov[name] = _provenance(manifest)
        m = rung_metrics(r, g["knobs"])
        metrics[name] = m
        entry.update(dir=name, status=r.verdict, metrics=m)
        entry["_codes"] = [f.code for f in (*r.findings, *kf) if f.severity != "info"]
    by_name = {g["name"]: g for g in doc["rungs"]}
    for entry in rep.rungs:
        codes = entry.pop("_codes", None)
        if entry["name"] not in metrics:
            continue
        vs = entry.get("vs")
        ref = metrics.get(vs) if vs else None
        entry["delta"] = delta(metrics[entry["name"]], ref) if ref is not None else None
        if vs and ref is None:
            entry["delta_note"] = f"{vs} did not run"
        entry["classification"] = classify(entry, metrics[entry["name"]], ref, by_name.get(vs), codes or [])
    rep.findings.extend(_provenance_findings(prov))
    rep.findings.extend(_stale(root, rep))
    if write:
        _write(rep)
    return rep


def _run_findings(name: str, r: Report) -> list[Finding]:
    v = r.verdict
    if v in ("failed", "unusable"):
        codes = sorted({f.code for f in r.findings if f.severity == ERROR} or {"INPUT_UNUSABLE"})
        return [finding("LADDER_RUNG_FAILED", f"{name} failed: {', '.join(codes)}", check=CHECK, path=name,
                        codes=codes)]
    if v == "incomplete":
        codes = sorted({f.code for f in r.findings if f.severity == INCOMPLETE})
        return [finding("LADDER_RUNG_INCOMPLETE", f"{name} is incomplete: {', '.join(codes)}", check=CHECK,
                        path=name, codes=codes)]
    return []


def _provenance_findings(prov: dict[str, Any]) -> list[Finding]:
    known = {n: p for n, p in prov.items() if p is not None}
    if len(known) < 2:
        return []
    ref_name = next(iter(known))
    ref = known[ref_name]
    out = []
    for name, p in known.items():
        differ = [k for k in MATRIX_SHARED_FIELDS if p[k] != ref[k]]
        if "config" in differ and isinstance(p["config"], dict) and isinstance(ref["config"], dict):
            a, b = p["config"], ref["config"]
            keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
            differ[differ.index("config")] = "config." + "/".join(str(k)[:40] for k in keys[:5])
        if differ:
            out.append(finding("LADDER_PROVENANCE_MISMATCH", f"{name}: its manifest differs from {ref_name}'s in "
                               f"{', '.join(differ)}; the rungs of a ladder differ in their knobs only", check=CHECK,
                               path=name, fields=differ))
    return out


def _comparable(rungs: list[dict[str, Any]]) -> Any:
    import json

    return json.loads(dumps(finite(rungs)))


def _stale(root: Root, rep: LadderReport) -> list[Finding]:
    """A ``ladder-report.json`` at the root must hold what the rungs' data give now (a report edited by hand, or left
    from before a rung was rerun, is stale)."""
    if not root.lexists(LADDER_REPORT_JSON):
        return []
    try:
        old = root.read_json(LADDER_REPORT_JSON)
    except InputError as e:
        return [e.finding]
    if isinstance(old, dict) and old.get("schema") == LADDER_REPORT_SCHEMA and \
            _comparable(old.get("rungs")) == _comparable(rep.rungs):
        return []
    return [finding("LADDER_REPORT_STALE", f"{LADDER_REPORT_JSON} does not hold what the rungs' data give now; "
                    "rewrite it with `rlk-validate ladder ROOT --write`", check=CHECK, path=LADDER_REPORT_JSON)]


def _write(rep: LadderReport) -> None:
    try:
        # the report without its own staleness finding: it is rewritten from the data now
        rep.findings = [f for f in rep.findings if f.code != "LADDER_REPORT_STALE"]
        rep.written.append(write_bytes_atomic(os.path.join(rep.ladder_root, LADDER_REPORT_MD),
                                              rep.to_markdown().encode()))
        rep.written.append(write_bytes_atomic(os.path.join(rep.ladder_root, LADDER_REPORT_JSON),
                                              dumps(rep.to_json()).encode()))
    except OSError as e:
        rep.findings.append(finding("LADDER_WRITE_FAILED", f"could not write the ladder report: {e.strerror or e}",
                                    check=CHECK))
