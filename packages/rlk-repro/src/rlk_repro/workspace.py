"""The workspace of ``rlk-repro prepare`` (``--workspace W``): a recorded layout that ``doctor --workspace W`` checks.

::

    W/
      workspace.json                       rlk.workspace.v1: the layout below and what prepare put into it
      data/dapo-math-17k.parquet           the official Parquet file (--download-data puts it here)
      data/dapo-math-17k.vime.jsonl        VIME prompt/label JSONL (prepare's output)
      data/dapo-math-17k.vime.manifest.json  its sibling manifest (rlk.prepare-data.v1: source and output
                                           sha256, row counts, dedup, purpose: experiment / developer-fixture)
      models/<name>/                       a checkpoint prepared by --convert-checkpoint (rlk.checkpoint.v1)
      runs/                                run directories of ``run --workspace W``

``workspace.json`` is rewritten (atomically) by every ``prepare``; the files it names carry their own sha256 in
their manifests, which ``doctor`` re-hashes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from rlk_core.errors import RlkConfigError

WORKSPACE_SCHEMA = "rlk.workspace.v1"
DATA_SCHEMA = "rlk.prepare-data.v1"  # the sibling manifest of prepared data (written by rlk_repro.prepare)
PURPOSES = ("experiment", "developer-fixture")
WORKSPACE_DOC = "workspace.json"
LAYOUT = {"data": "data", "models": "models", "runs": "runs"}
SOURCE_NAME = "dapo-math-17k.parquet"
OUTPUT_NAME = "dapo-math-17k.vime.jsonl"


def manifest_path(jsonl: str | os.PathLike[str]) -> Path:
    """The sibling manifest of a prepared JSONL file: ``x.vime.jsonl`` -> ``x.vime.manifest.json``."""
    p = Path(jsonl)
    return p.with_name(p.name.removesuffix(".jsonl") + ".manifest.json")


def paths(workspace: str | os.PathLike[str]) -> dict[str, Path]:
    w = Path(workspace)
    out = {k: w / v for k, v in LAYOUT.items()}
    out.update({"doc": w / WORKSPACE_DOC, "source": w / LAYOUT["data"] / SOURCE_NAME,
                "output": w / LAYOUT["data"] / OUTPUT_NAME})
    out["data_manifest"] = manifest_path(out["output"])
    return out


def read(workspace: str | os.PathLike[str]) -> dict[str, Any]:
    """The recorded workspace document; one-line errors for a workspace ``prepare`` has not made."""
    doc_path = paths(workspace)["doc"]
    if not doc_path.is_file():
        raise RlkConfigError(f"{workspace} is not a prepared workspace (no {WORKSPACE_DOC}): run "
                             f"`rlk-repro prepare --workspace {workspace} --source FILE.parquet` (or --download-data)")
    try:
        doc = json.loads(doc_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise RlkConfigError(f"{doc_path} cannot be read: {exc}") from None
    if not isinstance(doc, dict) or doc.get("schema") != WORKSPACE_SCHEMA:
        raise RlkConfigError(f"{doc_path} is not a {WORKSPACE_SCHEMA} document")
    return doc


def data_path(workspace: str | os.PathLike[str]) -> Path:
    """The prepared prompt data a ``run --workspace W`` reads."""
    doc = read(workspace)
    rel = (doc.get("data") or {}).get("output")
    if not rel:
        raise RlkConfigError(f"{workspace}: prepare recorded no prompt data (run prepare with --source or "
                             "--download-data)")
    return Path(workspace) / rel


def model_path(workspace: str | os.PathLike[str]) -> Path | None:
    """The checkpoint ``prepare --model-path --convert-checkpoint`` recorded, or None."""
    rel = (read(workspace).get("model") or {}).get("path")
    return Path(workspace) / rel if rel else None


def read_data_manifest(jsonl: str | os.PathLike[str], verify: bool = True) -> dict[str, Any] | None:
    """The sibling manifest of a prepared JSONL file (None when there is none); with ``verify`` the JSONL's sha256
    must still be the recorded one (a file edited after prepare is refused, one line)."""
    from rlk_repro import runs

    path = manifest_path(jsonl)
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise RlkConfigError(f"{path} cannot be read: {exc}") from None
    if not isinstance(doc, dict) or doc.get("schema") != DATA_SCHEMA or doc.get("purpose") not in PURPOSES:
        raise RlkConfigError(f"{path} is not a {DATA_SCHEMA} manifest with a purpose of {' / '.join(PURPOSES)}")
    if verify:
        actual = runs.file_sha256(Path(jsonl))
        if actual != doc["output"]["sha256"]:
            raise RlkConfigError(f"{jsonl} changed after prepare: sha256 {actual}, its manifest {path.name} records "
                                 f"{doc['output']['sha256']}; run prepare again")
    return doc


def checks(workspace: str | os.PathLike[str]) -> list:
    """``doctor --workspace W``: the recorded layout and every file prepare recorded, re-hashed (FAIL: missing or
    changed; warn: a developer fixture, a source Parquet no longer where prepare read it)."""
    from rlk_repro import runs
    from rlk_repro.doctor import FAIL, OK, WARN, Check

    name = "workspace"
    try:
        doc = read(workspace)
    except RlkConfigError as exc:
        return [Check(name, FAIL, str(exc))]
    w = Path(workspace)
    layout = doc.get("layout") or {}
    missing = [d for d in LAYOUT.values() if d not in layout.values() or not (w / d).is_dir()]
    out = [Check(name, FAIL if missing else OK, f"{w}: missing {', '.join(missing)}" if missing
                 else f"{w}: layout {', '.join(f'{k}/' for k in layout)} as recorded in {WORKSPACE_DOC}")]
    data = doc.get("data")
    if data is None:
        out.append(Check("workspace data", WARN, "no prompt data prepared (prepare --source FILE or --download-data)"))
    else:
        out += _data_checks(w, data, runs, (OK, WARN, FAIL), Check)
    model = doc.get("model")
    if model is not None:
        mdir = w / model["path"]
        rec_path = mdir / "rlk-checkpoint.json"
        if not rec_path.is_file():
            out.append(Check("workspace model", FAIL, f"{mdir}: no rlk-checkpoint.json (prepare it again)"))
        else:
            rec = json.loads(rec_path.read_text(encoding="utf-8"))
            st = mdir / "model.safetensors"
            actual = runs.file_sha256(st) if st.is_file() else None
            ok = actual == rec.get("model_safetensors_sha256")
            tok = (mdir / "tokenizer.json").is_file()
            out.append(Check("workspace model", FAIL if not ok else (OK if tok else WARN),
                             f"{mdir}: model.safetensors {'matches' if ok else 'DIFFERS from'} its record "
                             f"({rec.get('tensors')} tensors, round trip {rec.get('round_trip')})"
                             + ("" if tok else "; no tokenizer.json: runs use the byte tokenizer")))
    return out


def _data_checks(w: Path, data: dict[str, Any], runs, statuses, Check) -> list:
    OK, WARN, FAIL = statuses
    out = []
    jsonl = w / data["output"]
    if not jsonl.is_file():
        return [Check("workspace data", FAIL, f"{jsonl} is missing")]
    try:
        man = read_data_manifest(jsonl)
    except RlkConfigError as exc:
        return [Check("workspace data", FAIL, str(exc))]
    if man is None:
        return [Check("workspace data", FAIL, f"{jsonl} has no sibling manifest {manifest_path(jsonl).name}")]
    fixture = man["purpose"] != "experiment"
    out.append(Check("workspace data", WARN if fixture else OK,
                     f"{jsonl.name}: {man['output']['rows']} problems, sha256 matches its manifest; purpose "
                     f"{man['purpose']} ({man['purpose_reason']})"
                     + ("; a developer fixture never backs an experiment or reward claim" if fixture else "")))
    src = Path(man["source"]["path"])
    if not src.is_file():
        out.append(Check("workspace source", WARN, f"{src} (the Parquet file prepare read) is no longer there"))
    else:
        same = runs.file_sha256(src) == man["source"]["sha256"]
        out.append(Check("workspace source", OK if same else FAIL,
                         f"{src.name}: {man['source']['rows']} rows, sha256 "
                         f"{'matches' if same else 'DIFFERS from'} the manifest"))
    return out
