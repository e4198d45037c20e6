"""What ``rlk-repro report`` says about each run besides its metrics: where it came from, how it ended, whether
it was validated, which backend its R routes ran, and whether the compared runs ran the same experiment.

- :func:`provenance`: model, device, dtype, commit (``+dirty``), run id — printed on every figure;
- :func:`status`: the exit status (``exit-code``: ok, FAILED bitwise, failed, interrupted, terminated, or
  unfinished when the file is absent) and the validation (``COMPLETE`` = sealed, else ``run-validation.json``'s
  verdict, else not validated): a summary column each, and a mark on the run's legend entry when not ok;
- :func:`reference_note`: where an R side ran ``rlk.reference`` (the CPU reference implementation: the
  arithmetic contract by construction, not a GPU kernel), from the run's readbacks;
- :func:`config_differences`: the configuration keys (routes aside), seeds, inputs, rounds and commits in which
  the compared runs differ — a warning on the summary and the figures (a comparison of two runs is about their
  routes only when nothing else differs).

Reads only small files of the run directory; no torch.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

from rlk_validate.evidence import ROUTE_CONFIG_KEYS

EXIT_WORDS = {0: "ok", 1: "FAILED bitwise", 2: "usage error", 3: "failed", 130: "interrupted", 143: "terminated"}
#: ``config`` keys that are measurements or process details, not the experiment
VOLATILE_CONFIG = ("torch_threads", "readback_mode_source")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def provenance(manifest: dict[str, Any]) -> dict[str, str]:
    config = manifest.get("config") or {}
    hardware = manifest.get("hardware") or {}
    model = config.get("checkpoint") or config.get("model") or (config.get("vime") or {}).get("model_path") or "?"
    repo = next((r for r in manifest.get("repos") or [] if isinstance(r, dict) and r.get("name") == "rlk"), None)
    sha = (repo or {}).get("sha")
    commit = "unknown" if not sha else sha[:10] + ("+dirty" if (repo or {}).get("dirty") else "")
    device = str(hardware.get("device") or config.get("device") or "?")
    if hardware.get("name"):
        device += f" ({hardware['name']})"
    return {"model": str(model), "device": device, "dtype": str(config.get("dtype") or "?"), "commit": commit,
            "run_id": str(manifest.get("run_id") or "?")}


def status(run_dir: Path) -> dict[str, Any]:
    """``{"exit_code", "exit", "validated", "ok"}`` of the run at ``run_dir``."""
    try:
        raw = (run_dir / "exit-code").read_text(encoding="utf-8").strip()
        code: int | None = int(raw)
    except (OSError, ValueError):
        code = None
    exit_word = "unfinished (no exit-code)" if code is None else EXIT_WORDS.get(code, f"exit {code}")
    if code is not None and code not in (0,):
        exit_word = f"{exit_word} ({code})"
    report = _read_json(run_dir / "run-validation.json")
    verdict = report.get("verdict") if isinstance(report, dict) else None
    if (run_dir / "COMPLETE").is_file():
        validated = f"sealed ({verdict or 'passed'})"
    elif verdict:
        validated = str(verdict)
    else:
        validated = "not validated"
    return {"exit_code": code, "exit": exit_word, "validated": validated, "ok": code == 0}


def reference_note(run_dir: Path, plan: dict[str, str]) -> str | None:
    """Which R sides ran ``rlk.reference`` (per the readbacks), as a sentence, or None."""
    sides = set()
    for path in sorted((run_dir / "readbacks").glob("**/*.json")):
        doc = _read_json(path)
        if not isinstance(doc, dict) or not isinstance(doc.get("modules"), dict):
            continue
        for record in doc["modules"].values():
            if not isinstance(record, dict) or record.get("case") != "R":
                continue
            ops = record.get("ops") if isinstance(record.get("ops"), dict) else {}
            ids = {record.get("backend_id")} | {o.get("backend_id") for o in ops.values() if isinstance(o, dict)}
            if "rlk.reference" in ids:
                sides.add(str(doc.get("side") or doc.get("target") or "?"))
    if not sides:
        return None
    return (f"R ran rlk.reference on the {' and '.join(sorted(sides))} side: the CPU reference implementation "
            "(the arithmetic contract by construction, slow), not a GPU kernel")


def _experiment(manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest's experiment settings as flat ``key: value`` pairs (nested mappings one level deep)."""
    config = {k: v for k, v in (manifest.get("config") or {}).items()
              if k not in ROUTE_CONFIG_KEYS and k not in VOLATILE_CONFIG}
    out: dict[str, Any] = {"engine": manifest.get("engine"), "rounds": manifest.get("rounds")}
    for r in manifest.get("repos") or []:
        if isinstance(r, dict):
            out[f"commit.{r.get('name')}"] = (r.get("sha") or "?")[:10] + ("+dirty" if r.get("dirty") else "")
    for name, group in (("seeds", manifest.get("seeds")), ("inputs", manifest.get("inputs")), ("config", config)):
        for k, v in (group or {}).items():
            out[f"{name}.{k}"] = v
    return out


def _short(v: Any) -> str:
    text = v if isinstance(v, str) else json.dumps(v, sort_keys=True, default=str)
    return text[:19] + "..." if len(text) > 22 else text


def config_differences(manifests: list[dict[str, Any]], names: list[str]) -> list[str]:
    """``key: a (run1) vs b (run2)`` for every experiment setting the runs do not share (routes aside)."""
    if len(manifests) < 2:
        return []
    views = [_experiment(m) for m in manifests]
    keys = sorted(set().union(*views))
    out = []
    for key in keys:
        values = [v.get(key) for v in views]
        if any(v != values[0] for v in values[1:]):
            shown: dict[str, list[str]] = {}
            for name, v in zip(names, values, strict=True):
                shown.setdefault(_short(v), []).append(name)
            out.append(f"{key}: " + " vs ".join(f"{v} ({', '.join(n[:24] for n in ns[:2])}"
                                                 f"{' ...' if len(ns) > 2 else ''})" for v, ns in shown.items()))
    return out


def footer(provs: list[dict[str, str]], notes: list[str]) -> str:
    """The provenance line(s) under a figure: shared values once, then the run ids; the notes after."""
    shared = {k: provs[0][k] for k in ("model", "device", "dtype", "commit") if all(p[k] == provs[0][k] for p in provs)}
    lines = []
    if shared:
        lines.append("  ".join(f"{k} {v}" for k, v in shared.items()))
    per_run = [", ".join(f"{k} {p[k]}" for k in ("model", "device", "dtype", "commit") if k not in shared)
               for p in provs]
    ids = [p["run_id"] + (f" ({extra})" if extra else "") for p, extra in zip(provs, per_run, strict=True)]
    lines.append("run " + "; ".join(ids[:4]) + (f"; ... ({len(ids)} runs)" if len(ids) > 4 else ""))
    return "\n".join(lines + notes)


def figure_footer(runs: list[Any]) -> str:
    """The text under every figure of ``runs`` (:class:`rlk_repro.report.RunMetrics`): provenance (model, device,
    dtype, commit, run ids), where R ran the CPU reference, and a warning when the runs differ in anything but
    their routes."""
    notes = sorted({n for r in runs if (n := reference_note(r.path, r.plan))})
    diffs = config_differences([r.manifest for r in runs], [r.label for r in runs])
    if diffs:
        notes.append("WARNING: the runs differ in more than their routes: " + "; ".join(diffs)[:300])
    return footer([provenance(r.manifest) for r in runs], ["\n".join(textwrap.wrap(n, 150)) for n in notes])


def claims_text(manifest: dict[str, Any]) -> str:
    """What a run may back (issue 37): ``experiment`` or ``no experiment or reward claim: <reasons>``; a run from
    before the manifest recorded its claims is labelled so."""
    claims = manifest.get("claims")
    if not isinstance(claims, dict):
        return "no experiment or reward claim: the manifest records no claims (a run from before issue 37)"
    if claims.get("experiment"):
        return "experiment"
    return "no experiment or reward claim: " + "; ".join(str(r) for r in claims.get("reasons") or ["unknown"])
