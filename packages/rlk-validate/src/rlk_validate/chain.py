"""The resume chain of a run directory (``rlk-repro run --resume``): a new attempt that continued an interrupted
run from its round state holds the parent's earlier rounds as copies. Checked here, reading only:

- ``RESUME_FIELD_INVALID``: the manifest's ``resume`` block is malformed;
- ``RESUME_PARENT_MISSING``: the parent directory (a sibling, ``resume.parent.dir``) is not there, so the
  inherited rounds cannot be traced to it;
- ``RESUME_PARENT_MISMATCH``: the directory there is another run (its manifest's run id), or the chain loops;
- ``RESUME_CONFIG_DIFFERS``: plan, seeds, inputs, engine, rounds or configuration differ between the attempt
  and its parent (a continuation runs the same experiment);
- ``RESUME_STATE_MISMATCH``: the parent's round state is not the one the attempt recorded starting from (its
  file's sha256, or the round it names);
- ``RESUME_INHERITED_DIFFERS``: an inherited round (train-data file, or ``metrics.jsonl`` line) is not the
  parent's, or the inherited set is not exactly the parent's rounds before ``from_round``.

A parent that is itself a resumed attempt is checked the same way, up the chain. With the inherited rounds
traced to their parents, the attempt's own train-data (all rounds) carries the bitwise claim across the chain:
the ordinary checks of :func:`rlk_validate.validate.validate_run` read every round of it. Files are hashed in
chunks (never read whole).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Any

from .evidence import MANIFEST, METRICS, TRAIN_DATA_DIR, train_data_name
from .findings import Finding, finding
from .safeio import InputError, Root

CHECK = "chain"
STATE_DIR, STATE_DOC = "round-state", "state.json"
#: manifest keys a continuation must share with its parent (``command``, ``created_at``, ``repos``,
#: ``packages``, ``hardware`` may differ: another process, perhaps after an upgrade, on another host)
SAME_KEYS = ("engine", "mode", "plan", "plan_sources", "rounds", "ranks", "seeds", "inputs", "config",
             "readback_mode")
MAX_DEPTH = 64
_HASH_RE = re.compile(r"sha256:[0-9a-f]{64}")


def _f(code: str, msg: str, path: str | None = None) -> Finding:
    return finding(code, msg, check=CHECK, path=path)


def _sha256(root: Root, rel: str) -> str:
    fd, _ = root.open_fd(rel, root.caps.stream_bytes)
    h = hashlib.sha256()
    try:
        while True:
            b = os.read(fd, 1 << 22)
            if not b:
                break
            h.update(b)
    finally:
        os.close(fd)
    return "sha256:" + h.hexdigest()


def _block_problem(r: Any) -> str | None:
    if not isinstance(r, dict):
        return "'resume' must be an object"
    parent = r.get("parent")
    if not isinstance(parent, dict) or not isinstance(parent.get("dir"), str) or not isinstance(parent.get("run_id"),
                                                                                                  str):
        return "resume.parent needs 'dir' and 'run_id' strings"
    name = parent["dir"]
    if not name or name in (".", "..") or "/" in name or os.sep in name:
        return f"resume.parent.dir {name!r} is not a sibling directory name"
    if type(r.get("from_round")) is not int or r["from_round"] < 1:
        return "resume.from_round must be an integer >= 1"
    state = r.get("state")
    if not isinstance(state, dict) or not _HASH_RE.fullmatch(str(state.get("sha256"))) or \
            not isinstance(state.get("file"), str):
        return "resume.state needs 'file' and a 'sha256:<64 hex>' sha256"
    inherited = r.get("inherited")
    if not isinstance(inherited, dict) or not all(isinstance(k, str) and _HASH_RE.fullmatch(str(v))
                                                  for k, v in inherited.items()):
        return "resume.inherited must map file names to 'sha256:<64 hex>'"
    if not _HASH_RE.fullmatch(str(r.get("inherited_metrics_sha256"))):
        return "resume.inherited_metrics_sha256 must be 'sha256:<64 hex>'"
    return None


def _metrics_head(root: Root, k: int) -> bytes:
    """The lines of rounds < ``k`` of ``metrics.jsonl`` (each with its newline), in file order."""
    text = root.read_text(METRICS, root.caps.log_bytes) if root.lexists(METRICS) else ""
    out = []
    for line in text.splitlines():
        try:
            rnd = json.loads(line).get("round") if line.strip() else None
        except ValueError:
            rnd = None
        if isinstance(rnd, int) and rnd < k:
            out.append(line + "\n")
    return "".join(out).encode()


def check_chain(root: Root, manifest: dict[str, Any] | None) -> list[Finding]:
    """Findings for the resume chain of the run at ``root`` whose manifest is ``manifest`` (none without one)."""
    if not isinstance(manifest, dict) or "resume" not in manifest:
        return []
    return _check(root, manifest, [os.path.realpath(root.path)])


def _check(root: Root, manifest: dict[str, Any], seen: list[str]) -> list[Finding]:
    r = manifest["resume"]
    problem = _block_problem(r)
    if problem:
        return [_f("RESUME_FIELD_INVALID", f"manifest.json {problem}", MANIFEST)]
    k, name = r["from_round"], r["parent"]["dir"]
    where = os.path.join(os.path.dirname(root.path), name)
    if not os.path.isdir(where):
        return [_f("RESUME_PARENT_MISSING", f"this attempt resumed {name} (run {r['parent']['run_id']}) at round {k}, "
                   f"which is not beside it ({where}): its inherited rounds cannot be traced", MANIFEST)]
    if os.path.realpath(where) in seen or len(seen) > MAX_DEPTH:
        return [_f("RESUME_PARENT_MISMATCH", f"the resume chain loops or is deeper than {MAX_DEPTH} at {name}")]
    parent = Root(where, root.caps, check=CHECK)
    out: list[Finding] = []
    try:
        pm = parent.read_json(MANIFEST)
    except InputError as e:
        return [_f("RESUME_PARENT_MISMATCH", f"the parent {name} has no readable manifest.json ({e.finding.message})")]
    if not isinstance(pm, dict) or pm.get("run_id") != r["parent"]["run_id"]:
        got = pm.get("run_id") if isinstance(pm, dict) else None
        return [_f("RESUME_PARENT_MISMATCH", f"{name} is run {got!r}, not the parent {r['parent']['run_id']!r} this "
                   "attempt resumed")]
    differ = [key for key in SAME_KEYS if manifest.get(key) != pm.get(key)]
    if differ:
        out.append(_f("RESUME_CONFIG_DIFFERS", f"this attempt and its parent {name} differ in {', '.join(differ)}: a "
                      "continuation runs the same experiment", MANIFEST))
    out += _state_findings(parent, name, r)
    out += _inherited_findings(root, parent, name, r, pm)
    if "resume" in pm:  # up the chain
        out += [_f(f.code, f"(parent {name}) {f.message}", f.path) for f in _check(parent, pm, [*seen, parent.real])]
    return out


def _state_findings(parent: Root, name: str, r: dict[str, Any]) -> list[Finding]:
    k, rel = r["from_round"], r["state"]["file"]
    try:
        doc = parent.read_json(f"{STATE_DIR}/{STATE_DOC}")
        digest = _sha256(parent, rel)
    except InputError as e:
        return [_f("RESUME_STATE_MISMATCH", f"the parent {name}'s round state cannot be read ({e.finding.message})")]
    if not isinstance(doc, dict) or doc.get("next_round") != k:
        got = doc.get("next_round") if isinstance(doc, dict) else None
        return [_f("RESUME_STATE_MISMATCH", f"the parent {name}'s round state is for round {got!r}, the attempt "
                   f"resumed at round {k}")]
    if digest != r["state"]["sha256"] or doc.get("sha256") != digest:
        return [_f("RESUME_STATE_MISMATCH", f"the parent {name}'s {rel} is not the state this attempt started from "
                   f"(sha256 {digest}, recorded {r['state']['sha256']})")]
    return []


def _inherited_findings(root: Root, parent: Root, name: str, r: dict[str, Any], pm: dict[str, Any]) -> list[Finding]:
    k, out = r["from_round"], []
    ranks = pm.get("ranks") if type(pm.get("ranks")) is int and 0 < pm["ranks"] <= 4096 else 1
    expected = {f"{TRAIN_DATA_DIR}/{train_data_name(rnd, rank)}" for rnd in range(k) for rank in range(ranks)}
    listed = set(r["inherited"])
    if listed != expected:
        extra, missing = sorted(listed - expected), sorted(expected - listed)
        out.append(_f("RESUME_INHERITED_DIFFERS", f"the inherited files are not the parent's rounds 0..{k - 1}"
                      + (f"; missing {missing[:3]}" if missing else "") + (f"; extra {extra[:3]}" if extra else ""),
                      MANIFEST))
    for rel in sorted(listed & expected):
        try:
            mine, theirs = _sha256(root, rel), _sha256(parent, rel)
        except InputError as e:
            out.append(_f("RESUME_INHERITED_DIFFERS", f"{rel}: {e.finding.message}", rel))
            continue
        if not mine == theirs == r["inherited"][rel]:
            out.append(_f("RESUME_INHERITED_DIFFERS", f"{rel} is not the parent {name}'s (sha256 here {mine}, there "
                          f"{theirs}, recorded {r['inherited'][rel]})", rel))
    try:
        mine, theirs = _metrics_head(root, k), _metrics_head(parent, k)
    except InputError as e:
        return [*out, _f("RESUME_INHERITED_DIFFERS", f"metrics.jsonl: {e.finding.message}", METRICS)]
    digest = "sha256:" + hashlib.sha256(mine).hexdigest()
    if mine != theirs or digest != r["inherited_metrics_sha256"]:
        out.append(_f("RESUME_INHERITED_DIFFERS", f"the metrics.jsonl lines of rounds 0..{k - 1} are not the parent "
                      f"{name}'s", METRICS))
    return out
