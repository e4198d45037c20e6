"""``--seal``: write ``run-validation.json`` and, only for a passing run, ``COMPLETE``.

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

import contextlib
import errno
import fcntl
import hashlib
import os
import re
import time
from collections.abc import Iterator
from typing import Any

from . import __version__, signing
from .evidence import (
    COMPLETE,
    COMPLETE_SCHEMA,
    EXIT_CODE,
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
#: how long validation waits for a sealer or a run holding the directory's lock before it reads anyway
SEAL_WAIT_S = 3.0
#: how long --seal waits for another sealer to finish (a run still being written is refused at once)
SEAL_LOCK_WAIT_S = 120.0
#: the temp files of write_bytes_atomic for the two files a sealer writes
_SEAL_TEMP = re.compile(r"\.(COMPLETE|run-validation\.json)\.tmp-[0-9]+-[0-9a-f]{12}")


def _read_seal(root: Root) -> tuple[dict[str, Any] | None, bytes | None, str | None]:
    """``(COMPLETE, the bytes of run-validation.json, problem)``: the seal as written, or why it is not one."""
    raw = root.read_bytes(COMPLETE, root.caps.small_bytes)
    if not raw.strip():
        return None, None, ("COMPLETE is empty: a seal was interrupted (rlk-validate --seal re-does it, once no "
                            "other sealer runs)")
    try:
        seal: Any = parse_json_text(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        return None, None, "COMPLETE is not the JSON rlk-validate --seal writes (hand-written?)"
    if not isinstance(seal, dict) or not is_member(seal.get("schema"), (COMPLETE_SCHEMA,)):
        return None, None, f"COMPLETE is not a {COMPLETE_SCHEMA} document (hand-written?)"
    want = seal.get("run_validation_sha256")
    if type(want) is not str or not _HEX64.fullmatch(want):
        return seal, None, "COMPLETE records no sha256 of run-validation.json"
    if not root.lexists(RUN_VALIDATION):
        return seal, None, "COMPLETE exists without its run-validation.json"
    data = root.read_bytes(RUN_VALIDATION, root.caps.json_bytes)
    if hashlib.sha256(data).hexdigest() != want:
        return seal, data, "run-validation.json is not the report COMPLETE was sealed with (its sha256 differs)"
    return seal, data, None


def _changed(sealed: dict[str, Any], now: dict[str, str]) -> str | None:
    changed = sorted(k for k in set(sealed) | set(now) if sealed.get(k) != now.get(k))
    if not changed:
        return None
    shown = ", ".join(str(k)[:120] for k in changed[:8]) + (" ..." if len(changed) > 8 else "")
    return f"{len(changed)} file(s) changed, appeared or vanished since the run was sealed: {shown}"


def _seal_problems(root: Root, report: Report) -> tuple[list[str], dict[str, Any] | None, bytes | None]:
    """Why the ``COMPLETE`` of ``root`` is not a seal this validator wrote for the run as it is now (every reason
    found, the changed files named), with the seal and its report's bytes."""
    seal, data, problem = _read_seal(root)
    if problem:
        return [problem], seal, data
    problems = []
    try:
        rv: Any = parse_json_text(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        return ["run-validation.json is not valid JSON"], seal, data
    if not isinstance(rv, dict) or not is_member(rv.get("schema"), (RUN_VALIDATION_SCHEMA,)):
        return [f"run-validation.json is not a {RUN_VALIDATION_SCHEMA} document"], seal, data
    if rv.get("verdict") != "passed":
        problems.append(f"the sealed run-validation.json says {str(rv.get('verdict'))[:40]!r}, not passed")
    sealed = rv.get("inputs")
    if not isinstance(sealed, dict) or not sealed:
        problems.append("run-validation.json records no input digests (not written by this rlk-validate)")
    else:
        changed = _changed(sealed, report.inputs)
        if changed:
            problems.append(changed)
    return problems, seal, data


def check_complete(root: Root, report: Report, verify_key: str | None = None) -> None:
    """A ``COMPLETE`` must be verifiable (:func:`_seal_problems`: every problem is named, whatever else is wrong
    with the run), justified (the run passes now) and, with ``verify_key``, signed by that key."""
    verdict = report.verdict  # of the evidence, before what is said about the seal
    try:
        if not root.lexists(COMPLETE):
            if verify_key is not None:
                report.findings.append(finding("SIGNATURE_MISSING", "--verify-key given, but the run is not sealed "
                                               "(no COMPLETE)", check="seal", path=COMPLETE))
            return
        root.resolve(COMPLETE)
        problems, seal, data = _seal_problems(root, report)
    except InputError as e:
        report.findings.append(e.finding)
        return
    for problem in problems:
        report.findings.append(finding("SEAL_INVALID", problem, check="seal", path=COMPLETE))
    if seal is not None and data is not None:
        report.findings.extend(signing.check(seal, verify_key))
    elif verify_key is not None:
        report.findings.append(finding("SIGNATURE_MISSING", "--verify-key given, but COMPLETE is no seal that a "
                                       "signature could be checked on", check="seal", path=COMPLETE))
    if verdict != "passed":
        report.findings.append(finding("COMPLETE_UNJUSTIFIED", f"COMPLETE exists, but the run is {verdict} on this "
                                       "check: the seal is not supported by the evidence", check="seal",
                                       path=COMPLETE))
        return
    if report.verdict != "passed":  # the evidence passes, the seal does not (said above)
        return
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


@contextlib.contextmanager
def run_dir_lock(path: str, wait_s: float, shared: bool = False) -> Iterator[str | None]:
    """Hold an exclusive (``shared``: a shared) ``flock`` on the run directory ``path`` (yields None), or yield
    why not: the run is still being written (the lock is held and there is no ``exit-code`` yet), or the lock
    stayed busy for ``wait_s`` seconds (another sealer)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not os.path.lexists(os.path.join(path, EXIT_CODE)):
                    yield "the run is still being written (its process holds the run directory's lock and has " \
                          "written no exit-code): seal it when it has ended"
                    return
                if time.monotonic() > deadline:
                    yield f"another process (a sealer?) held the run directory's lock for {wait_s:.0f} s"
                    return
                time.sleep(0.05)
            except OSError as e:  # a file system without flock: sealers are not serialised there
                yield None if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP) else f"lock: {e}"
                return
        yield None
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
    from .validate import validate_run

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
