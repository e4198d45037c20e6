"""``--seal``: write ``run-validation.json`` and, only for a passing run, ``COMPLETE``.

Protocol (safe against concurrent sealers and never overwriting a seal):

1. If ``COMPLETE`` exists, nothing is written (``SEAL_EXISTS``).
2. Failing run: the report is written atomically (:func:`rlk_validate.evidence.write_bytes_atomic`:
   private temp file, fsync, rename) onto ``run-validation.json``; no ``COMPLETE``.
3. Passing run: ``COMPLETE`` is created with ``O_CREAT | O_EXCL``. Exactly one sealer wins; a loser
   writes nothing and reports ``SEAL_EXISTS``. The winner writes its report atomically onto
   ``run-validation.json`` and then writes into ``COMPLETE`` the sha256 of that report's bytes
   (``rlk.complete.v1``), which validation recomputes. An empty ``COMPLETE`` therefore means sealing
   is in progress (or was interrupted); validation reports it as a broken seal.

No other file of the run directory is created, modified or removed.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from typing import Any

from . import __version__
from .evidence import (
    COMPLETE,
    COMPLETE_SCHEMA,
    RUN_VALIDATION,
    RUN_VALIDATION_SCHEMA,
    is_member,
    json_text,
    write_bytes_atomic,
)
from .findings import Finding, finding
from .report import Report, dumps, now_iso
from .safeio import InputError, Root, parse_json_text

_HEX64 = re.compile(r"[0-9a-f]{64}")
#: how long validation waits for an empty COMPLETE (a sealer between its two writes) to be filled
SEAL_WAIT_S = 3.0


def _seal_problem(root: Root, report: Report) -> str | None:
    """Why the ``COMPLETE`` of ``root`` is not a seal this validator wrote for the run as it is now."""
    deadline = time.monotonic() + SEAL_WAIT_S
    while True:
        raw = root.read_bytes(COMPLETE, root.caps.small_bytes)
        if raw.strip() or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if not raw.strip():
        return "COMPLETE is empty: sealing was interrupted (or is still running)"
    try:
        seal: Any = parse_json_text(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        return "COMPLETE is not the JSON rlk-validate --seal writes (hand-written?)"
    if not isinstance(seal, dict) or not is_member(seal.get("schema"), (COMPLETE_SCHEMA,)):
        return f"COMPLETE is not a {COMPLETE_SCHEMA} document (hand-written?)"
    want = seal.get("run_validation_sha256")
    if type(want) is not str or not _HEX64.fullmatch(want):
        return "COMPLETE records no sha256 of run-validation.json"
    if not root.lexists(RUN_VALIDATION):
        return "COMPLETE exists without its run-validation.json"
    data = root.read_bytes(RUN_VALIDATION, root.caps.json_bytes)
    if hashlib.sha256(data).hexdigest() != want:
        return "run-validation.json is not the report COMPLETE was sealed with (its sha256 differs)"
    try:
        rv: Any = parse_json_text(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        return "run-validation.json is not valid JSON"
    if not isinstance(rv, dict) or not is_member(rv.get("schema"), (RUN_VALIDATION_SCHEMA,)):
        return f"run-validation.json is not a {RUN_VALIDATION_SCHEMA} document"
    if rv.get("verdict") != "passed":
        return f"the sealed run-validation.json says {str(rv.get('verdict'))[:40]!r}, not passed"
    sealed = rv.get("inputs")
    if not isinstance(sealed, dict) or not sealed:
        return "run-validation.json records no input digests (not written by this rlk-validate)"
    now = report.inputs
    changed = sorted(k for k in set(sealed) | set(now) if sealed.get(k) != now.get(k))
    if changed:
        shown = ", ".join(str(k)[:120] for k in changed[:5]) + (" ..." if len(changed) > 5 else "")
        return f"{len(changed)} file(s) changed, appeared or vanished since the run was sealed: {shown}"
    return None


def check_complete(root: Root, report: Report) -> None:
    """A ``COMPLETE`` must be justified (the run passes now) and verifiable (:func:`_seal_problem`)."""
    try:
        if not root.lexists(COMPLETE):
            return
        root.resolve(COMPLETE)
    except InputError as e:
        report.findings.append(e.finding)
        return
    if report.verdict != "passed":
        report.findings.append(finding("COMPLETE_UNJUSTIFIED", f"COMPLETE exists, but the run is {report.verdict} "
                                       "on this check: the seal is not supported by the evidence", check="seal",
                                       path=COMPLETE))
        return
    try:
        problem = _seal_problem(root, report)
    except InputError as e:
        problem = e.finding.message
    if problem:
        report.findings.append(finding("SEAL_INVALID", problem, check="seal", path=COMPLETE))
    else:
        report.findings.append(finding("SEALED", "COMPLETE is a valid seal and the run passes", check="seal",
                                       path=COMPLETE))


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def seal_run(report: Report) -> Report:
    """Seal ``report.run_dir`` according to ``report``'s verdict; updates ``report.seal``/findings."""
    report.seal = {"requested": True, "status": "pending"}
    if report.unusable:
        report.seal["status"] = "refused: the directory is unusable"
        return report
    if os.path.lexists(os.path.join(report.run_dir, COMPLETE)):
        _record_existing_seal(report)
        return report
    passed = report.verdict == "passed"
    report.seal = _seal_intent(report, passed)
    data = _sealed_report_bytes(report, passed)
    _write_seal(report, data, passed)
    return report


def _record_existing_seal(report: Report) -> None:
    """A run that already has a ``COMPLETE`` is left as it is (``SEAL_EXISTS``)."""
    report.seal["status"] = "exists: COMPLETE already present, nothing written"
    report.findings.append(
        finding("SEAL_EXISTS", "COMPLETE already exists; --seal wrote nothing", check="seal", path=COMPLETE)
    )


def _seal_intent(report: Report, passed: bool) -> dict[str, Any]:
    """The ``seal`` section the written report carries: sealed (passing run) or not, and when."""
    return {
        "requested": True,
        "status": "sealed" if passed else f"not sealed: {report.verdict}",
        "sealed_at": now_iso(),
        "complete": passed,
    }


def _seal_written(passed: bool) -> Finding:
    """The finding that records what this sealer wrote."""
    return finding(
        "SEAL_WRITTEN",
        "run-validation.json written" + (" and COMPLETE created" if passed else "; no COMPLETE"),
        check="seal",
        path=RUN_VALIDATION,
    )


def _sealed_report_bytes(report: Report, passed: bool) -> bytes:
    """The bytes of ``run-validation.json``: the report as it will be once the seal is written."""
    doc = report.to_json()
    doc["findings"].append(_seal_written(passed).to_json())
    return dumps(doc).encode()


def _write_report_only(complete: str, rv_path: str, data: bytes) -> None:
    """Failing run: write ``run-validation.json`` atomically, unless another sealer made ``COMPLETE``."""
    if os.path.lexists(complete):
        raise FileExistsError(complete)
    write_bytes_atomic(rv_path, data)


def _write_report_and_complete(complete: str, rv_path: str, data: bytes, sealed_at: str, undo: list[str]) -> None:
    """Passing run: create ``COMPLETE`` exclusively, write the report, then record its sha256 in ``COMPLETE``.

    ``COMPLETE`` is in ``undo`` (to remove on failure) from its creation until the report is written."""
    fd = os.open(complete, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    undo.append(complete)
    try:
        write_bytes_atomic(rv_path, data)
        undo.remove(complete)
        body = {
            "schema": COMPLETE_SCHEMA,
            "run_validation_sha256": hashlib.sha256(data).hexdigest(),
            "sealed_at": sealed_at,
            "validator": {"name": "rlk-validate", "version": __version__},
        }
        os.write(fd, json_text(body, indent=None).encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_seal(report: Report, data: bytes, passed: bool) -> None:
    """Write the seal's files and record the outcome: written, lost to another sealer, or failed."""
    d = report.run_dir
    complete = os.path.join(d, COMPLETE)
    rv_path = os.path.join(d, RUN_VALIDATION)
    undo: list[str] = []
    try:
        if not passed:
            _write_report_only(complete, rv_path, data)
        else:
            _write_report_and_complete(complete, rv_path, data, report.seal["sealed_at"], undo)
        _fsync_dir(d)
        report.findings.append(_seal_written(passed))
    except FileExistsError:
        report.seal = {
            "requested": True,
            "status": "exists: another sealer created COMPLETE first",
            "complete": False,
        }
        report.findings.append(
            finding(
                "SEAL_EXISTS",
                "COMPLETE was created by another sealer; this one wrote nothing",
                check="seal",
                path=COMPLETE,
            )
        )
    except OSError as e:
        for path in undo:
            _unlink_quiet(path)
        report.seal = {"requested": True, "status": f"failed: {e.strerror or e}", "complete": False}
        report.findings.append(finding("SEAL_FAILED", f"could not seal {d}: {e.strerror or e}", check="seal"))


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
