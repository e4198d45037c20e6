"""A run's seal, read and checked (``COMPLETE``, ``run-validation.json``: :func:`check_complete`), and the run
directory's lock (:func:`run_dir_lock`) that runs, sealers and validation share. Writing a seal: :mod:`.sealing`.
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

from . import signing
from .evidence import (
    COMPLETE,
    COMPLETE_SCHEMA,
    EXIT_CODE,
    RUN_VALIDATION,
    RUN_VALIDATION_SCHEMA,
    is_member,
)
from .findings import finding
from .report import Report
from .safeio import InputError, Root, parse_json_text

_HEX64 = re.compile(r"[0-9a-f]{64}")
#: how long validation waits for a sealer or a run holding the directory's lock before it reads anyway
SEAL_WAIT_S = 3.0


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
