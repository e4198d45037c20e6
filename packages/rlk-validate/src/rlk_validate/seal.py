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

from . import __version__
from .evidence import COMPLETE, COMPLETE_SCHEMA, RUN_VALIDATION, json_text, write_bytes_atomic
from .findings import finding
from .report import Report, dumps, now_iso


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
    d = report.run_dir
    report.seal = {"requested": True, "status": "pending"}
    if report.unusable:
        report.seal["status"] = "refused: the directory is unusable"
        return report
    complete = os.path.join(d, COMPLETE)
    if os.path.lexists(complete):
        report.seal["status"] = "exists: COMPLETE already present, nothing written"
        report.findings.append(
            finding("SEAL_EXISTS", "COMPLETE already exists; --seal wrote nothing", check="seal", path=COMPLETE)
        )
        return report
    passed = report.verdict == "passed"
    report.seal = {
        "requested": True,
        "status": "sealed" if passed else f"not sealed: {report.verdict}",
        "sealed_at": now_iso(),
        "complete": passed,
    }
    doc = report.to_json()
    doc["findings"].append(
        finding(
            "SEAL_WRITTEN",
            "run-validation.json written" + (" and COMPLETE created" if passed else "; no COMPLETE"),
            check="seal",
            path=RUN_VALIDATION,
        ).to_json()
    )
    data = dumps(doc).encode()
    rv_path = os.path.join(d, RUN_VALIDATION)
    created_complete = replaced = False
    try:
        if not passed:
            if os.path.lexists(complete):
                raise FileExistsError(complete)
            write_bytes_atomic(rv_path, data)
        else:
            fd = os.open(complete, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
            created_complete = True
            try:
                write_bytes_atomic(rv_path, data)
                replaced = True
                body = {
                    "schema": COMPLETE_SCHEMA,
                    "run_validation_sha256": hashlib.sha256(data).hexdigest(),
                    "sealed_at": report.seal["sealed_at"],
                    "validator": {"name": "rlk-validate", "version": __version__},
                }
                os.write(fd, json_text(body, indent=None).encode())
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(d)
        report.findings.append(
            finding(
                "SEAL_WRITTEN",
                "run-validation.json written" + (" and COMPLETE created" if passed else "; no COMPLETE"),
                check="seal",
                path=RUN_VALIDATION,
            )
        )
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
        if created_complete and not replaced:
            _unlink_quiet(complete)
        report.seal = {"requested": True, "status": f"failed: {e.strerror or e}", "complete": False}
        report.findings.append(finding("SEAL_FAILED", f"could not seal {d}: {e.strerror or e}", check="seal"))
    return report


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
