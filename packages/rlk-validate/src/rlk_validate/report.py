"""Aggregating findings into a verdict; the JSON document and the human summary."""

from __future__ import annotations

import datetime as _dt
import math
from dataclasses import dataclass, field
from typing import Any

from . import __version__
from .evidence import INFORMATIVE_LOGP, RUN_VALIDATION_SCHEMA, json_text
from .findings import ERROR, INCOMPLETE, INFO, SEVERITIES, WARNING, Finding, verdict_of

RUN_SCHEMA = RUN_VALIDATION_SCHEMA
EXIT_CODES = {"passed": 0, "failed": 1, "incomplete": 2, "unusable": 3}
EXIT_INTERNAL = 4


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def clean(s: Any, limit: int = 400) -> str:
    """Printable text: control characters of untrusted names/messages are escaped, length capped."""
    text = str(s)
    out = "".join(ch if ch.isprintable() or ch == " " else repr(ch)[1:-1] for ch in text)
    return out if len(out) <= limit else out[: limit - 3] + "..."


def finite(obj: Any) -> Any:
    """``obj`` with every non-finite float (e.g. an overflowed ratio) replaced by None."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


#: the findings of one code a summary shows before it counts the rest
SHOWN_PER_CODE = 5


def summarised(findings: list[Finding]) -> list[str]:
    """One line per finding, at most :data:`SHOWN_PER_CODE` per code, then one line counting the rest of that code
    (the JSON report keeps every one)."""
    lines, seen = [], {}
    for f in findings:
        seen[f.code] = seen.get(f.code, 0) + 1
        if seen[f.code] <= SHOWN_PER_CODE:
            lines.append(f"  {f.severity.upper():<10} {f.code:<24} {clean(f.message)}")
    for code, n in seen.items():
        if n > SHOWN_PER_CODE:
            lines.append(f"  ... and {n - SHOWN_PER_CODE} more {code} finding(s) like these (--json lists every one)")
    return lines


def dumps(doc: Any) -> str:
    """Strict JSON of a report (non-finite floats become null), newline-terminated."""
    return json_text(finite(doc))


class Verdict:
    """The verdict and exit code of a report with ``findings`` and ``unusable`` (a run's, a matrix's, a ladder's)."""

    findings: list[Finding]
    unusable: bool

    @property
    def verdict(self) -> str:
        return "unusable" if self.unusable else verdict_of(self.findings)

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.verdict]


@dataclass
class Report(Verdict):
    """The outcome of checking one run directory."""

    run_dir: str
    findings: list[Finding] = field(default_factory=list)
    unusable: bool = False
    plan: dict[str, str] | None = None
    run_id: str | None = None
    require_exact: bool = False
    options: dict[str, Any] = field(default_factory=dict)
    readbacks: dict[str, Any] = field(default_factory=dict)
    bitwise: dict[str, Any] | None = None
    drift: dict[str, Any] | None = None
    seal: dict[str, Any] = field(default_factory=lambda: {"requested": False, "status": "not-requested"})
    #: rel path -> sha256 of every file the checks read in full (a seal records it; a sealed run re-checks it)
    inputs: dict[str, str] = field(default_factory=dict)
    checked_at: str = field(default_factory=now_iso)

    def counts(self) -> dict[str, int]:
        return {s: sum(1 for f in self.findings if f.severity == s) for s in SEVERITIES}

    def codes(self, severity: str | None = None) -> list[str]:
        return [f.code for f in self.findings if severity is None or f.severity == severity]

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": RUN_SCHEMA,
            "validator": {"name": "rlk-validate", "version": __version__},
            "kind": "run",
            "run_dir": self.run_dir,
            "checked_at": self.checked_at,
            "verdict": self.verdict,
            "exit_code": self.exit_code,
            "options": self.options,
            "run_id": self.run_id,
            "plan": self.plan,
            "require_exact": self.require_exact,
            "counts": self.counts(),
            "findings": [f.to_json() for f in self.findings],
            "readbacks": self.readbacks,
            "bitwise": self.bitwise,
            "drift": self.drift,
            "seal": self.seal,
            "inputs": self.inputs,
        }

    def summary(self, verbose: bool = False) -> str:
        if self.unusable:  # one line: what is wrong with the argument, and what to run instead
            why = self.findings[0].message if self.findings else "unusable"
            return f"rlk-validate: UNUSABLE (exit {self.exit_code}): {clean(why, 1000)}"
        lines = [f"rlk-validate {__version__}: {clean(self.run_dir)}"]
        if self.plan:
            plan = ", ".join(f"{k} {v}" for k, v in self.plan.items())
            lines.append(f"plan: {plan}   (bitwise equality required: {'yes' if self.require_exact else 'no'})")
        b = self.bitwise
        if b:
            lines.append(
                f"bitwise: {b['mismatch_count']} of {b['element_count']} active tokens differ over "
                f"{len(b['rounds'])} round(s), {b['files']} file(s); max |diff| {b['max_abs_diff']:.6g}, "
                f"mean |diff| {b['mean_abs_diff']:.6g}"
            )
            per_round = " ".join(f"{100 * r['informative_fraction']:.0f}%" for r in b["rounds"][:12])
            lines.append(
                f"  over informative tokens (rollout log-prob < {INFORMATIVE_LOGP:g}): "
                f"{b['informative_mismatch_count']} of {b['informative_count']} differ "
                f"({100 * b['informative_fraction']:.1f}% of the compared; per round {per_round}"
                + (" ..." if len(b["rounds"]) > 12 else "") + ")"
            )
        o = (self.drift or {}).get("overall") or {}
        if o.get("active_tokens"):
            lines.append(
                f"drift: |d| p50 {o['abs_p50']:.3g} p90 {o['abs_p90']:.3g} p99 {o['abs_p99']:.3g} "
                f"max {o['abs_max']:.3g}; clip fraction @{o['clip_eps']:g} {o['clip_fraction']:.4g}; "
                f"approx_kl0 {o['approx_kl0']:.3g}"
            )
        shown = [f for f in self.findings if verbose or f.severity in (ERROR, INCOMPLETE, WARNING)]
        hidden = len(self.findings) - len(shown)
        if shown:
            lines.append("findings:")
            lines += summarised(shown)
        if hidden:
            lines.append(f"  ({hidden} info finding(s); --verbose shows them)")
        if self.seal.get("requested"):
            lines.append(f"seal: {self.seal.get('status')}")
        c = self.counts()
        lines.append(
            f"verdict: {self.verdict.upper()} (exit {self.exit_code}); "
            f"{c[ERROR]} error(s), {c[INCOMPLETE]} incomplete, {c[WARNING]} warning(s), {c[INFO]} info"
        )
        return "\n".join(lines)
