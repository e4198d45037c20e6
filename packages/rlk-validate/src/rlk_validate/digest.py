"""The contract digest (issue 37): its definition, and the check of the digests a run records.

Before its first round and after every weight sync, each side of a run describes what it runs in one JSON document
(``rlk.contract-digest.v1``, built by :func:`rlk_core.digest.side_document`): the plan, per ``R/R`` module its
contract ids, backend families and the hash of the backends' sources, the sampling parameters both sides apply and
the TP-invariance setting. The digest is the SHA-256 of that document's canonical JSON (:func:`digest_of`). The two
sides' digests must be equal, and equal to the first one, or the run stops before anything is compared
(:func:`rlk_core.digest.handshake`). Readbacks carry the digest (``contract_digest``: the digest, its document, this
side's detail and every check), the manifest and every metrics line carry it too.

:func:`check_digests` (``rlk-validate``, check ``digest``): a readback's digest must be that of its document
(``CONTRACT_DIGEST_MISMATCH``), every check of the run must have found the same digest (``CONTRACT_DIGEST_CHANGED``),
all readbacks must carry one digest (``CONTRACT_DIGEST_SIDES_DIFFER``), its document must agree with the readback's
plan and with what the readback says executed (contract ids and backends of the R/R modules), the manifest's and the
metrics lines' digests must be that digest (``CONTRACT_DIGEST_DISAGREES``), and where the manifest records a digest
every readback of a process that executed an op must carry it (``CONTRACT_DIGEST_MISSING``). A run that records no
digest anywhere (an older run, a VIME run) is not checked here.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from .evidence import CONTRACT_DIGEST_SCHEMA as DIGEST_SCHEMA
from .evidence import MANIFEST, SAME_BITS_AS
from .findings import Finding, finding
from .safeio import InputError, Root

FIELD = "contract_digest"  # the key in readbacks, the manifest and metrics lines
CHECK = "digest"


def canonical(document: Any) -> bytes:
    """The canonical JSON of ``document``: sorted keys, no spaces, ASCII."""
    return json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode("ascii")


def digest_of(document: Any) -> str:
    """``sha256:<64 hex>`` of the canonical JSON of ``document``."""
    return "sha256:" + hashlib.sha256(canonical(document)).hexdigest()


def differences(a: Any, b: Any, where: str = "") -> list[str]:
    """Where two documents differ, as ``path: a vs b`` lines (dotted paths into nested objects)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            path = f"{where}.{k}" if where else str(k)
            if k not in a or k not in b:
                out.append(f"{path}: {a.get(k, '(absent)')!r} vs {b.get(k, '(absent)')!r}")
            else:
                out += differences(a[k], b[k], path)
        return out
    return [] if a == b else [f"{where or '(document)'}: {a!r} vs {b!r}"]


def family(backend_id: str) -> str:
    """The backend whose bits a backend gives (``rlk.cuda`` launches ``rlk.triton``'s binaries)."""
    return SAME_BITS_AS.get(backend_id, backend_id)


def _f(code: str, msg: str, path: str | None = None, **kw: Any) -> Finding:
    return finding(code, msg, check=CHECK, path=path, **kw)


def _record_problem(rec: Any) -> str | None:
    if not isinstance(rec, dict):
        return f"{FIELD} is not an object"
    if not isinstance(rec.get("digest"), str) or not rec["digest"].startswith("sha256:"):
        return f"{FIELD}.digest is not a sha256:<hex> string"
    doc = rec.get("document")
    if not isinstance(doc, dict) or doc.get("schema") != DIGEST_SCHEMA or not isinstance(doc.get("modules"), dict):
        return f"{FIELD}.document is not a {DIGEST_SCHEMA} document"
    checks = rec.get("checks")
    if not isinstance(checks, list) or not checks or not all(
            isinstance(c, dict) and isinstance(c.get("at"), str) and isinstance(c.get("digest"), str) for c in checks):
        return f"{FIELD}.checks is not a non-empty list of {{at, digest}}"
    return None


def _executed(rel: str, readback: dict[str, Any], document: dict[str, Any]) -> list[Finding]:
    """The document against the readback: its plan, and the contracts and backends its R/R modules executed."""
    out = []
    if document.get("plan") != readback.get("plan"):
        out.append(_f("CONTRACT_DIGEST_DISAGREES", f"{rel}: the digest's plan {document.get('plan')} is not the "
                      f"readback's {readback.get('plan')}", rel))
    for module, rec in (readback.get("modules") or {}).items():
        declared = (document.get("modules") or {}).get(module)
        if not isinstance(declared, dict) or declared.get("case") != "R/R" or not isinstance(rec, dict):
            continue
        contracts, backends = set(declared.get("contracts") or ()), set(declared.get("backends") or ())
        for op, r in (rec.get("ops") or {}).items():
            if not isinstance(r, dict) or not str(r.get("backend_id", "")).startswith("rlk."):
                continue  # production records (an install note, say) are the readback check's concern
            if r.get("contract_id") not in contracts:
                out.append(_f("CONTRACT_DIGEST_DISAGREES", f"{rel}: {module} op {op} executed contract "
                              f"{r.get('contract_id')!r}, not one of the digest's {sorted(contracts)}", rel))
            if family(str(r.get("backend_id"))) not in backends:
                out.append(_f("CONTRACT_DIGEST_DISAGREES", f"{rel}: {module} op {op} executed backend "
                              f"{r.get('backend_id')!r}, not one of the digest's {sorted(backends)}", rel))
    return out


def _readbacks(root: Root) -> list[tuple[str, dict[str, Any]]]:
    from .readbacks import _list_readbacks, _read_docs  # their reading findings are the readback check's

    try:
        names = _list_readbacks(root)
    except InputError:
        return []
    return _read_docs(root, names or [])[0]


def check_digests(root: Root, manifest: Any, rows: dict[int, dict[str, Any]]) -> list[Finding]:
    """Findings about the contract digests of the run at ``root`` (``manifest`` as parsed, None where unreadable;
    ``rows``: the well-formed metrics lines by round)."""
    out: list[Finding] = []
    declared = manifest.get(FIELD) if isinstance(manifest, dict) else None
    if declared is not None and not (isinstance(declared, str) and declared.startswith("sha256:")):
        out.append(_f("CONTRACT_DIGEST_INVALID", f"manifest {FIELD} {declared!r} is not a sha256:<hex> string",
                      MANIFEST))
        declared = None
    seen: dict[str, str] = {}  # digest -> the first readback carrying it
    for rel, doc in _readbacks(root):
        rec = doc.get(FIELD)
        if rec is None:
            # a process that loaded the plugin and executed no op (an Inductor compile worker of vLLM's, say) writes a
            # readback with no modules: it computed nothing the digest guards
            if declared is not None and doc.get("modules"):
                out.append(_f("CONTRACT_DIGEST_MISSING", f"{rel} carries no {FIELD}; the manifest records "
                              f"{declared}", rel))
            continue
        problem = _record_problem(rec)
        if problem:
            out.append(_f("CONTRACT_DIGEST_INVALID", f"{rel}: {problem}", rel))
            continue
        ours = digest_of(rec["document"])
        if ours != rec["digest"]:
            out.append(_f("CONTRACT_DIGEST_MISMATCH", f"{rel}: the recorded digest {rec['digest']} is not the digest "
                          f"of its document ({ours}): the document or the digest was altered", rel))
            continue
        changed = [c for c in rec["checks"] if c["digest"] != rec["digest"]]
        if changed:
            out.append(_f("CONTRACT_DIGEST_CHANGED", f"{rel}: the check at {changed[0]['at']} found "
                          f"{changed[0]['digest']}, not the run's {rec['digest']}", rel))
        out += _executed(rel, doc, rec["document"])
        seen.setdefault(rec["digest"], rel)
    if len(seen) > 1:
        out.append(_f("CONTRACT_DIGEST_SIDES_DIFFER", "the readbacks carry different contract digests: "
                      + "; ".join(f"{d} ({rel})" for d, rel in seen.items())))
    if declared is not None and seen and declared not in seen:
        out.append(_f("CONTRACT_DIGEST_DISAGREES", f"the manifest's {FIELD} {declared} is not the readbacks' "
                      f"({', '.join(seen)})", MANIFEST))
    want = declared or (next(iter(seen)) if len(seen) == 1 else None)
    if want is not None:
        bad = sorted(r for r, row in rows.items() if FIELD in row and row[FIELD] != want)
        if bad:
            out.append(_f("CONTRACT_DIGEST_DISAGREES", f"metrics.jsonl round {bad[0]} carries {FIELD} "
                          f"{rows[bad[0]][FIELD]!r}, not the run's {want}", "metrics.jsonl"))
    return out
