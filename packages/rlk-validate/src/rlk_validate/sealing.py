"""``--seal`` (the reading half: :mod:`.seal`): write ``run-validation.json`` and, only for a passing run, ``COMPLETE``.

Protocol (atomic, safe against concurrent sealers and against sealing a run that is still written):

1. The sealer takes an exclusive ``flock`` on the run directory, the lock the run's own process holds until
   its ``exit-code`` is written (:mod:`rlk_repro.lifecycle`): a live run is never sealed, and sealers take
   turns. Under the lock it removes what an interrupted sealer left (its temp files; an empty ``COMPLETE``
   from the two-step protocol of earlier versions), validates the run, and then:
2. ``COMPLETE`` exists: nothing is written (``SEAL_EXISTS``).
3. Failing run: the report is written atomically (:func:`rlk_validate.evidence.write_bytes_atomic`: private
   temp file, fsync, rename) onto ``run-validation.json``; no ``COMPLETE``.
4. Passing run: the report as above, then ``COMPLETE`` — the sha256 of the report's bytes (``rlk.complete.v1``),
   optionally an Ed25519 signature (:mod:`rlk_validate.signing`) — written to a temp file and renamed into
   place: ``COMPLETE`` appears whole or not at all. A sealer killed at any point leaves no ``COMPLETE`` (or a
   whole one), and the next ``--seal`` re-does the seal.

What the seal covers: ``run-validation.json`` records the sha256 of every file under the run directory (and
every folder and link), so any file changed, added or removed after sealing is ``SEAL_INVALID``. What it
proves, and what only a signature adds: ``docs/evidence.md``, "Guarantees and threat model".
No other file of the run directory is created, modified or removed.
"""

from __future__ import annotations

import hashlib
import os
import re
from typing import Any

from . import __version__, signing
from .evidence import COMPLETE, COMPLETE_SCHEMA, RUN_VALIDATION, json_text, write_bytes_atomic
from .findings import Finding, finding
from .report import Report, dumps, now_iso
from .seal import run_dir_lock
from .validate import validate_run

#: how long --seal waits for another sealer to finish (a run still being written is refused at once)
SEAL_LOCK_WAIT_S = 120.0
#: the temp files of write_bytes_atomic for the two files a sealer writes
_SEAL_TEMP = re.compile(r"\.(COMPLETE|run-validation\.json)\.tmp-[0-9]+-[0-9a-f]{12}")


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


def _clear_interrupted(path: str) -> list[str]:
    """Remove what an interrupted sealer left (under the lock, so no sealer is running): its temp files and an
    empty ``COMPLETE`` (the two-step protocol of earlier versions). Returns what was removed."""
    removed = []
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        stale = _SEAL_TEMP.fullmatch(name) is not None
        if name == COMPLETE and not os.path.islink(full):
            try:
                stale = os.path.isfile(full) and os.path.getsize(full) == 0
            except OSError:
                stale = False
        if stale:
            _unlink_quiet(full)
            removed.append(name)
    return removed


def seal_run(path: str | os.PathLike[str] | Report, options: Any = None, *,
             sign_key: str | None = None) -> Report:
    """Validate the run directory ``path`` under its lock and seal it according to the verdict (see the module
    docstring); ``sign_key``: a PEM Ed25519 private key that signs ``COMPLETE``. Returns the report, whose
    ``seal`` and findings say what was written. (A :class:`Report` stands for its run directory.)"""
    run_dir = os.path.abspath(path.run_dir if isinstance(path, Report) else os.fspath(path))
    signer = signing.load_private_key(sign_key) if sign_key else None  # a bad key stops before any write
    if not os.path.isdir(run_dir):
        return validate_run(run_dir, options)
    with run_dir_lock(run_dir, SEAL_LOCK_WAIT_S) as busy:
        if busy:
            report = validate_run(run_dir, options)
            report.seal = {"requested": True, "status": f"refused: {busy}", "complete": False}
            report.findings.append(finding("SEAL_FAILED", f"not sealed: {busy}", check="seal"))
            return report
        removed = _clear_interrupted(run_dir)
        report = validate_run(run_dir, options, locked=True)
        report.seal = {"requested": True, "status": "pending"}
        if removed:
            report.findings.append(finding("SEAL_REDONE", f"an interrupted seal left {', '.join(removed)}; removed, "
                                           "and the run sealed afresh", check="seal", path=COMPLETE))
        if report.unusable:
            report.seal["status"] = "refused: the directory is unusable"
            return report
        if os.path.lexists(os.path.join(run_dir, COMPLETE)):
            _record_existing_seal(report)
            return report
        passed = report.verdict == "passed"
        report.seal = _seal_intent(report, passed, signer)
        data = _sealed_report_bytes(report, passed)
        _write_seal(report, data, passed, signer)
        return report


def _record_existing_seal(report: Report) -> None:
    """A run that already has a ``COMPLETE`` is left as it is (``SEAL_EXISTS``)."""
    report.seal["status"] = "exists: COMPLETE already present, nothing written"
    report.findings.append(
        finding("SEAL_EXISTS", "COMPLETE already exists; --seal wrote nothing", check="seal", path=COMPLETE)
    )


def _seal_intent(report: Report, passed: bool, signer: Any) -> dict[str, Any]:
    """The ``seal`` section the written report carries: sealed (passing run) or not, when, and by which key."""
    out = {
        "requested": True,
        "status": "sealed" if passed else f"not sealed: {report.verdict}",
        "sealed_at": now_iso(),
        "complete": passed,
    }
    if signer is not None and passed:
        out["signed_by"] = signing.key_id(signer.public_key())
    return out


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


def _complete_bytes(data: bytes, sealed_at: str, signer: Any) -> bytes:
    """The bytes of ``COMPLETE`` for the report ``data``, signed by ``signer`` where given."""
    body: dict[str, Any] = {
        "schema": COMPLETE_SCHEMA,
        "run_validation_sha256": hashlib.sha256(data).hexdigest(),
        "sealed_at": sealed_at,
        "validator": {"name": "rlk-validate", "version": __version__},
    }
    if signer is not None:
        body["signature"] = signing.sign(signer, body)
    return json_text(body, indent=None).encode()


def _write_seal(report: Report, data: bytes, passed: bool, signer: Any) -> None:
    """Write the seal's files (under the run directory's lock) and record the outcome: written or failed."""
    d = report.run_dir
    complete = os.path.join(d, COMPLETE)
    try:
        write_bytes_atomic(os.path.join(d, RUN_VALIDATION), data)
        if passed:
            write_bytes_atomic(complete, _complete_bytes(data, report.seal["sealed_at"], signer))
        _fsync_dir(d)
        report.findings.append(_seal_written(passed))
    except OSError as e:
        report.seal = {"requested": True, "status": f"failed: {e.strerror or e}", "complete": False}
        report.findings.append(finding("SEAL_FAILED", f"could not seal {d}: {e.strerror or e}", check="seal"))


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
