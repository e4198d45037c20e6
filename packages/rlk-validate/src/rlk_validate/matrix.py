"""``rlk-validate matrix MATRIX_ROOT``: every cell checked as a run, plus what the matrix itself needs.

Cells are directories named ``<module>-<XY>`` (the operator-isolation cells: one module at ``X/Y``,
the others at ``R/R``), ``control-RR`` (all R/R) and optionally ``native-PP`` (all P/P). A cell passes
when its routes executed as requested and its evidence is complete; only all-R/R cells must be
bitwise zero, the mismatch of the others is reported as a diagnostic. The only files written are
``matrix-report.json`` and ``matrix-report.md`` at the matrix root.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from . import __version__, evidence
from .evidence import (
    MANIFEST,
    MATRIX_REPORT_JSON,
    MATRIX_REPORT_MD,
    MATRIX_REPORT_SCHEMA,
    MATRIX_SHARED_FIELDS,
    REQUIRED_CELLS,
    ROUTE_CONFIG_KEYS,
    RUN_MARKERS,
    expected_plan,
    write_bytes_atomic,
)
from .findings import ERROR, INCOMPLETE, Finding, finding
from .report import Report, Verdict, clean, dumps, now_iso, summarised
from .safeio import InputError, Root
from .validate import Options, unusable_reason, validate_run

CHECK = "matrix"
SCHEMA = MATRIX_REPORT_SCHEMA
JSON_NAME = MATRIX_REPORT_JSON
MD_NAME = MATRIX_REPORT_MD


@dataclass
class MatrixReport(Verdict):
    matrix_root: str
    cells: list[tuple[str, str, dict[str, str], Report]] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    unusable: bool = False
    checked_at: str = field(default_factory=now_iso)
    written: list[str] = field(default_factory=list)

    def cell_json(self, name: str, role: str, plan: dict[str, str], r: Report) -> dict[str, Any]:
        b = r.bitwise or {}
        o = (r.drift or {}).get("overall") or {}
        return {
            "name": name,
            "role": role,
            "dir": r.run_dir,
            "expected_plan": plan,
            "plan": r.plan,
            "verdict": r.verdict,
            "require_exact": r.require_exact,
            "element_count": b.get("element_count"),
            "mismatch_count": b.get("mismatch_count"),
            "max_abs_diff": b.get("max_abs_diff"),
            "mean_abs_diff": b.get("mean_abs_diff"),
            "rounds": len(b.get("rounds", [])),
            "drift": {k: o.get(k) for k in ("abs_p50", "abs_p99", "abs_max", "clip_fraction", "approx_kl0")},
            "counts": r.counts(),
            "findings": [f.to_json() for f in r.findings if f.severity in (ERROR, INCOMPLETE)],
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "validator": {"name": "rlk-validate", "version": __version__},
            "matrix_root": self.matrix_root,
            "checked_at": self.checked_at,
            "verdict": self.verdict,
            "passed": self.verdict == "passed",
            "exit_code": self.exit_code,
            "findings": [f.to_json() for f in self.findings],
            "cells": [self.cell_json(*c) for c in self.cells],
        }

    def to_markdown(self) -> str:
        rows = [
            f"# Matrix report: {self.verdict}",
            "",
            f"`{self.matrix_root}`, checked {self.checked_at} by rlk-validate {__version__}. "
            "Only all-R/R cells "
            "must be bitwise zero; the mismatch of the others is a diagnostic.",
            "",
            "| cell | attention | ffn | logp | verdict | tokens | mismatches | max abs diff | mean abs diff "
            "| p99 abs diff | clip fraction | approx_kl0 |",
            "| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]

        def num(v: Any, fmt: str = ".3g") -> str:
            return "-" if v is None else format(v, fmt)

        for name, _role, plan, r in self.cells:
            b = r.bitwise or {}
            o = (r.drift or {}).get("overall") or {}
            rows.append(
                f"| {name} | {plan['attention']} | {plan['ffn']} | {plan['logp']} | {r.verdict} "
                f"| {num(b.get('element_count'), 'd')} | {num(b.get('mismatch_count'), 'd')} "
                f"| {num(b.get('max_abs_diff'))} | {num(b.get('mean_abs_diff'))} | {num(o.get('abs_p99'))} "
                f"| {num(o.get('clip_fraction'))} | {num(o.get('approx_kl0'))} |"
            )
        bad = [f for f in self.findings if f.severity in (ERROR, INCOMPLETE)]
        if bad:
            rows += ["", "## Problems", ""]
            rows += [f"- **{f.code}** {clean(f.message).replace('|', '/')}" for f in bad]
        return "\n".join(rows) + "\n"

    def summary(self) -> str:
        if self.unusable:
            why = self.findings[0].message if self.findings else "unusable"
            return f"rlk-validate: UNUSABLE (exit {self.exit_code}): {clean(why, 1000)}"
        lines = [f"rlk-validate {__version__} matrix: {clean(self.matrix_root)}"]
        for name, _role, _plan, r in self.cells:
            b = r.bitwise or {}
            mm = "-" if not b else f"{b['mismatch_count']}/{b['element_count']}"
            lines.append(
                f"  {name:<14} {r.verdict:<11} mismatches {mm:<14} max |diff| {b.get('max_abs_diff', float('nan')):.3g}"
            )
        lines += summarised([f for f in self.findings if f.severity != "info"])
        for w in self.written:
            lines.append(f"wrote {clean(w)}")
        lines.append(f"verdict: {self.verdict.upper()} (exit {self.exit_code})")
        return "\n".join(lines)


def validate_matrix(
    path: str | os.PathLike[str],
    options: Options | None = None,
    allow_partial: bool = False,
    write: bool = False,
) -> MatrixReport:
    """Check the matrix root at ``path``. Writes ``matrix-report.json/.md`` into it only when ``write``
    is true and ``path`` is a matrix root (holds at least one cell directory)."""
    opts = options or Options()
    root_dir = os.path.abspath(os.fspath(path))
    rep = MatrixReport(matrix_root=root_dir)
    why = unusable_reason(root_dir)
    if why:
        return _unusable(rep, finding("INPUT_UNUSABLE", why, check=CHECK))
    root = Root(root_dir, opts.caps, check=CHECK)
    try:
        names = root.listdir("")
    except InputError as e:
        return _unusable(rep, e.finding)
    if not any(expected_plan(n) is not None for n in names):
        return _unusable(rep, _not_a_matrix_root(root_dir, names))

    seen = _check_cells(rep, root, names, opts)
    rep.findings.extend(_missing_cells(seen, allow_partial))
    rep.findings.extend(_check_provenance(rep, opts))
    if write:
        _write_reports(rep)
    return rep


def _unusable(rep: MatrixReport, why: Finding) -> MatrixReport:
    """Mark ``rep`` unusable for the reason ``why``: nothing is checked or written."""
    rep.unusable = True
    rep.findings.append(why)
    return rep


def _not_a_matrix_root(root_dir: str, names: list[str]) -> Finding:
    """Why a directory holding no cell directory is not checked, with a hint at what it may be."""
    hint = (
        "it is a run directory: check it with `rlk-validate DIR`"
        if any(n in RUN_MARKERS for n in names)
        else "a matrix root holds cell directories named control-RR, <module>-<XY>, native-PP"
    )
    return finding("INPUT_UNUSABLE", f"{root_dir} is not a matrix root ({hint}); nothing was "
                   "checked or written", check=CHECK)


def _check_cells(rep: MatrixReport, root: Root, names: list[str], opts: Options) -> set[str]:
    """Validate every cell directory as a run and flag other directories; returns the cells seen."""
    seen = set()
    for name in names:
        if name in (JSON_NAME, MD_NAME, evidence.REPORT_DIR) or name.startswith("."):
            continue  # the matrix's own reports (rlk-validate matrix --write, rlk-repro report ROOT)
        try:
            is_dir = root.is_dir(name)
        except InputError as e:
            rep.findings.append(e.finding)
            continue
        if not is_dir:
            continue
        exp = expected_plan(name)
        if exp is None:
            rep.findings.append(
                finding("MATRIX_UNKNOWN_ENTRY", f"{name}/ is not a cell name; skipped", check=CHECK, path=name)
            )
            continue
        role, plan = exp
        seen.add(name)
        r = _validate_cell(rep.matrix_root, name, role, opts)
        rep.cells.append((name, role, plan, r))
        rep.findings.extend(_cell_findings(name, plan, r))
    return seen


def _validate_cell(root_dir: str, name: str, role: str, opts: Options) -> Report:
    """Validate one cell as a run; a control cell must be bitwise zero whatever its manifest says."""
    cell_opts = dataclasses.replace(opts, require_bitwise=opts.require_bitwise or role == "control")
    return validate_run(os.path.join(root_dir, name), cell_opts)


def _cell_findings(name: str, plan: dict[str, str], r: Report) -> list[Finding]:
    """What the matrix reports about one cell: a plan unlike its name, its verdict, its mismatch diagnostic."""
    out: list[Finding] = []
    if r.plan is not None and r.plan != plan:
        out.append(
            finding(
                "MATRIX_CELL_PLAN_MISMATCH",
                f"{name}: the manifest plan is {r.plan}, the cell name means {plan}",
                check=CHECK,
                path=name,
            )
        )
    v = r.verdict
    failed = v in ("failed", "unusable")
    if failed or v == "incomplete":
        severity, code, what = (ERROR, "MATRIX_CELL_FAILED", "failed") if failed else (
            INCOMPLETE, "MATRIX_CELL_INCOMPLETE", "is incomplete")
        codes = sorted({f.code for f in r.findings if f.severity == severity})
        out.append(finding(code, f"{name} {what}: {', '.join(codes)}", check=CHECK, path=name, codes=codes))
    b = r.bitwise
    if b and not r.require_exact and b["mismatch_count"]:
        out.append(
            finding(
                "MISMATCH_DIAGNOSTIC",
                f"{name}: {b['mismatch_count']} of {b['element_count']} tokens differ (max |diff| "
                f"{b['max_abs_diff']:.3g}); diagnostic only",
                check=CHECK,
                path=name,
            )
        )
    return out


def _missing_cells(seen: set[str], allow_partial: bool) -> list[Finding]:
    """Every required cell must be present (a warning only when a partial matrix is allowed)."""
    return [
        finding(
            "MATRIX_CELL_MISSING",
            f"cell {name}/ is absent",
            check=CHECK,
            path=name,
            severity="warning" if allow_partial else None,
        )
        for name in REQUIRED_CELLS
        if name not in seen
    ]


def _provenance(cell_dir: str, opts: Options) -> dict[str, Any] | None:
    """The manifest fields a cell shares with the other cells of its root (routes aside), or None."""
    try:
        m = Root(cell_dir, opts.caps, check=CHECK).read_json(MANIFEST)
    except InputError:
        return None  # reported by the cell's own validation
    if not isinstance(m, dict):
        return None
    out = {k: m.get(k) for k in MATRIX_SHARED_FIELDS}
    if isinstance(out["config"], dict):
        out["config"] = {k: v for k, v in out["config"].items() if k not in ROUTE_CONFIG_KEYS}
    if isinstance(out["repos"], list):  # the revision, not where the checkout lived
        out["repos"] = [{k: r.get(k) for k in ("name", "sha", "dirty")} if isinstance(r, dict) else r
                        for r in out["repos"]]
    return out


def _check_provenance(rep: MatrixReport, opts: Options) -> list[Finding]:
    """Every cell of one root ran the same commit, inputs, seeds and configuration; only routes differ."""
    prov = {name: _provenance(r.run_dir, opts) for name, _role, _plan, r in rep.cells}
    known = {n: p for n, p in prov.items() if p is not None}
    if len(known) < 2:
        return []
    ref_name = "control-RR" if "control-RR" in known else next(iter(known))
    ref = known[ref_name]
    out = []
    for name, p in known.items():
        if name == ref_name:
            continue
        differ = [k for k in MATRIX_SHARED_FIELDS if p[k] != ref[k]]
        if isinstance(p["config"], dict) and isinstance(ref["config"], dict) and "config" in differ:
            a, b = p["config"], ref["config"]
            keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
            differ[differ.index("config")] = "config." + "/".join(str(k)[:40] for k in keys[:5])
        if differ:
            out.append(finding("MATRIX_PROVENANCE_MISMATCH",
                               f"{name}: its manifest differs from {ref_name}'s in {', '.join(differ)}; a matrix "
                               "compares routes only, so every cell must share commit, inputs, seeds and "
                               "configuration", check=CHECK, path=name, fields=differ))
    return out


def _write_reports(rep: MatrixReport) -> None:
    """Write ``matrix-report.md`` and ``matrix-report.json`` into the matrix root; a failure is a finding."""
    try:
        for name in (JSON_NAME, MD_NAME):
            target = os.path.join(rep.matrix_root, name)
            if os.path.isdir(target) and not os.path.islink(target):
                raise IsADirectoryError(21, "is a directory", target)
        md = rep.to_markdown().encode()
        rep.written.append(write_bytes_atomic(os.path.join(rep.matrix_root, MD_NAME), md))
        rep.written.append(write_bytes_atomic(os.path.join(rep.matrix_root, JSON_NAME), dumps(rep.to_json()).encode()))
    except OSError as e:
        rep.findings.append(
            finding("MATRIX_WRITE_FAILED", f"could not write the matrix report: {e.strerror or e}", check=CHECK)
        )
