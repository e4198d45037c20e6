"""``rlk-validate import-vime SRC DST``: a VIME run's artifact directory -> an rlk run directory.

A VIME run launched as ``rlk-repro plan --engine vime`` prints leaves (docs/vime.md)::

    SRC/
      rlk-launch.json        rlk.vime-launch.v1: the launch (plan, run id, seeds, topology, flags, env)
      environment.json       rlk.vime-environment.v1: repos, packages, hardware, input hashes (head node)
      run.log  exit-code     the `ray job submit` output (slime/VIME's "step N: {...}" lines) and status
      readbacks/             rlk.readback.v1 of every process: flat, or readbacks/<hostname>/ per node
      logprob-records/       rlk.vime-logprobs.v1 from the record hook, flat or per node:
                             rollout-<NNNNNN>.rank<R>.call<K>.safetensors

The import writes DST once (it must not exist) and never touches SRC: ``manifest.json`` from the launch
and the environment, ``readbacks/`` and ``run.log`` / ``exit-code`` copied byte for byte (host
directories kept: pids are per node), ``train-data/round-NNNN.rank<R>.safetensors`` re-packed from the
records (one file per round and writer rank, samples padded to ``[S, T]``), ``metrics.jsonl`` holding
VIME's own logged ``train/train_rollout_logprob_abs_diff`` per round (``rlk-validate`` checks its
zero-ness against the recomputed mismatches) and ``bitwise-validation.json`` recomputed from the
records (VIME writes no such report; its ``source`` says so). Every claim is then checked by
``rlk-validate DST`` unchanged: this module decides nothing. Torch is never imported.

A record file holds, for one call of the hook on one training rank (the log-probs VIME compares: the
forward-only pass before the update, CP-local response tokens): ``train_logprobs`` and
``rollout_logprobs`` float32 ``[N]``, ``loss_mask`` uint8/bool ``[N]``, ``response_lengths`` int64 ``[S]``
(summing to N), optional ``token_ids`` int64 ``[N]``; metadata ``schema``, ``rollout_id``, ``rank``, ``call``.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
from typing import Any

import numpy as np

from .evidence import (
    BITWISE_SCHEMA,
    EXIT_CODE,
    MANIFEST_SCHEMA,
    METRICS_SCHEMA,
    READBACKS_DIR,
    RUN_LOG,
    TRAIN_DATA_DIR,
    TRAIN_DATA_SCHEMA,
    VIME_LAUNCH_SCHEMA,
    VIME_LOGPROBS_SCHEMA,
    json_text,
    train_data_name,
    write_bytes_atomic,
    write_json_atomic,
)

LAUNCH = "rlk-launch.json"
ENVIRONMENT = "environment.json"
RECORDS = "logprob-records"
LAUNCH_SCHEMA = VIME_LAUNCH_SCHEMA
RECORD_SCHEMA = VIME_LOGPROBS_SCHEMA
RECORD_RE = re.compile(r"rollout-([0-9]{1,9})\.rank([0-9]{1,6})\.call([0-9]{1,9})\.safetensors")
#: slime/VIME's per-step log line: ``... step 3: {'train/loss': ..., 'train/train_rollout_logprob_abs_diff': 0.0}``
STEP_RE = re.compile(r"\bstep ([0-9]{1,12}): (\{.*\})\s*$")
VIME_KEY = "train/train_rollout_logprob_abs_diff"
MAX_LOG_BYTES = 8 << 30
MAX_JSON_BYTES = 64 << 20


class ImportProblem(Exception):
    """SRC is not a VIME artifact directory this importer can read (one line)."""


def _read_json(path: str) -> Any:
    import json

    if not os.path.isfile(path):
        raise ImportProblem(f"{path} is missing")
    if os.path.getsize(path) > MAX_JSON_BYTES:
        raise ImportProblem(f"{path} is larger than {MAX_JSON_BYTES >> 20} MiB")
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (ValueError, OSError) as e:
        raise ImportProblem(f"{path}: {e}") from None


def vime_steps(log_path: str) -> dict[int, float]:
    """``{step: train/train_rollout_logprob_abs_diff}`` from slime/VIME's per-step log lines."""
    out: dict[int, float] = {}
    if not os.path.isfile(log_path) or os.path.getsize(log_path) > MAX_LOG_BYTES:
        return out
    with open(log_path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            if VIME_KEY not in line:
                continue
            m = STEP_RE.search(line)
            if not m:
                continue
            try:
                d = ast.literal_eval(m.group(2))
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                continue
            v = d.get(VIME_KEY) if isinstance(d, dict) else None
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[int(m.group(1))] = float(v)
    return out


def _record_files(src: str) -> dict[tuple[int, int], list[tuple[int, str]]]:
    """``{(rollout, rank): [(call, path), ...]}`` over logprob-records/ (flat or per host)."""
    base = os.path.join(src, RECORDS)
    found: dict[tuple[int, int], list[tuple[int, str]]] = {}
    if not os.path.isdir(base):
        return found
    dirs = [base] + [os.path.join(base, d) for d in sorted(os.listdir(base)) if os.path.isdir(os.path.join(base, d))]
    for d in dirs:
        for name in sorted(os.listdir(d)):
            m = RECORD_RE.fullmatch(name)
            if m:
                key = (int(m.group(1)), int(m.group(2)))
                found.setdefault(key, []).append((int(m.group(3)), os.path.join(d, name)))
    return found


def _load_record(path: str) -> dict[str, np.ndarray]:
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    try:
        t = load_file(path)
    except (SafetensorError, OSError, ValueError) as e:
        raise ImportProblem(f"{path}: not a readable safetensors file ({e})") from None
    for key in ("train_logprobs", "rollout_logprobs", "loss_mask", "response_lengths"):
        if key not in t:
            raise ImportProblem(f"{path}: lacks tensor {key!r} ({RECORD_SCHEMA})")
    n = t["train_logprobs"].shape
    lengths = t["response_lengths"]
    if (len(n) != 1 or t["rollout_logprobs"].shape != n or t["loss_mask"].shape != n or lengths.ndim != 1
            or (lengths < 0).any() or int(lengths.sum()) != n[0]
            or ("token_ids" in t and t["token_ids"].shape != n)):
        raise ImportProblem(f"{path}: shapes disagree (train/rollout/mask/token_ids [N], response_lengths "
                            "summing to N)")
    return t


def _pack(calls: list[tuple[int, str]], rnd: int, rank: int) -> dict[str, np.ndarray]:
    """One round's calls on one rank -> rlk.train-data.v1 tensors ``[S, T]``."""
    rows: list[tuple[np.ndarray, ...]] = []
    for _, path in sorted(calls):
        t = _load_record(path)
        tok = t.get("token_ids", np.zeros_like(t["train_logprobs"], dtype=np.int64))
        start = 0
        for n in t["response_lengths"].tolist():
            sl = slice(start, start + n)
            rows.append((tok[sl], t["loss_mask"][sl], t["rollout_logprobs"][sl], t["train_logprobs"][sl]))
            start += n
    s, width = len(rows), max([len(r[0]) for r in rows] + [1])
    out = {"token_ids": np.zeros((s, width), np.int64), "response_mask": np.zeros((s, width), np.uint8),
           "rollout_logprobs": np.zeros((s, width), np.float32), "train_logprobs": np.zeros((s, width), np.float32)}
    for i, (tok, mask, roll, train) in enumerate(rows):
        n = len(tok)
        out["token_ids"][i, :n] = tok.astype(np.int64)
        out["response_mask"][i, :n] = mask.astype(np.uint8) != 0
        active = out["response_mask"][i, :n] != 0
        out["rollout_logprobs"][i, :n] = np.where(active, roll.astype(np.float32), np.float32(0))
        out["train_logprobs"][i, :n] = np.where(active, train.astype(np.float32), np.float32(0))
    return out


def _stats(t: dict[str, np.ndarray]) -> tuple[int, int, float, float]:
    active = t["response_mask"] != 0
    a, b = t["train_logprobs"][active], t["rollout_logprobs"][active]
    if a.size == 0:
        return 0, 0, 0.0, 0.0
    diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
    return int(a.size), int((a.view(np.uint32) != b.view(np.uint32)).sum()), float(diff.max()), float(diff.mean())


def _copy_tree(src: str, dst: str) -> None:
    """Copy regular files (no symlinks followed) of src into dst, one directory level deep."""
    os.makedirs(dst)
    for name in sorted(os.listdir(src)):
        p = os.path.join(src, name)
        if os.path.islink(p):
            continue
        if os.path.isfile(p):
            shutil.copyfile(p, os.path.join(dst, name))
        elif os.path.isdir(p):
            os.makedirs(os.path.join(dst, name))
            for inner in sorted(os.listdir(p)):
                q = os.path.join(p, inner)
                if os.path.isfile(q) and not os.path.islink(q):
                    shutil.copyfile(q, os.path.join(dst, name, inner))


def _packs(src: str, source: str | None) -> tuple[dict[tuple[int, int], Any], str, int]:
    """``{(round, writer rank): loader of its rlk.train-data.v1 tensors}`` and what they come from: the record hook's
    files (``logprob-records/``) or VIME's own debug dumps (``debug-train-data/``, :mod:`rlk_validate.vime_dump`), and
    how many files that is."""
    from .vime_dump import DUMPS, DumpProblem, dump_train_data, read_dump
    from .vime_dump import dump_files as _dump_files

    records, dumps = _record_files(src), _dump_files(os.path.join(src, DUMPS))
    if source is None and records and dumps:
        raise ImportProblem(f"{src} holds both {RECORDS}/ and {DUMPS}/: choose one with --from records|dumps")
    if source == "dumps" or (source is None and dumps and not records):
        def dump(path: str) -> Any:
            try:
                return dump_train_data(read_dump(path))
            except DumpProblem as e:
                raise ImportProblem(str(e)) from None
        return {key: (lambda p=path: dump(p)) for key, path in dumps.items()}, DUMPS, len(dumps)
    return ({key: (lambda c=calls, k=key: _pack(c, *k)) for key, calls in records.items()}, RECORDS,
            sum(map(len, records.values())))


def import_vime(src: str, dst: str, source: str | None = None) -> dict[str, Any]:
    """Write the rlk run directory ``dst`` from the VIME artifact directory ``src``; returns a summary. ``source``:
    ``records`` (the record hook's ``logprob-records/``), ``dumps`` (VIME's ``debug-train-data/``) or None (the one
    ``src`` holds)."""
    src, dst = os.path.abspath(src), os.path.abspath(dst)
    if not os.path.isdir(src):
        raise ImportProblem(f"{src} is not a directory")
    if os.path.lexists(dst):
        raise ImportProblem(f"{dst} exists: an import writes a new directory")
    launch = _read_json(os.path.join(src, LAUNCH))
    if not isinstance(launch, dict) or launch.get("schema") != LAUNCH_SCHEMA:
        raise ImportProblem(f"{os.path.join(src, LAUNCH)}: schema is not {LAUNCH_SCHEMA!r}")
    env_path = os.path.join(src, ENVIRONMENT)
    environment = _read_json(env_path) if os.path.exists(env_path) else {}
    records, origin, files = _packs(src, source)
    writers = sorted({rank for _, rank in records})
    rank_index = {rank: i for i, rank in enumerate(writers)}
    rounds = int(launch.get("rounds") or 0)
    steps_per_round = max(int(launch.get("steps_per_round") or 1), 1)

    os.makedirs(dst)
    for name in (RUN_LOG, EXIT_CODE):
        if os.path.isfile(os.path.join(src, name)) and not os.path.islink(os.path.join(src, name)):
            shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
    if os.path.isdir(os.path.join(src, READBACKS_DIR)):
        _copy_tree(os.path.join(src, READBACKS_DIR), os.path.join(dst, READBACKS_DIR))

    from safetensors.numpy import save_file

    os.makedirs(os.path.join(dst, TRAIN_DATA_DIR))
    per_round: dict[int, list[tuple[int, int, float, float]]] = {}
    for (rnd, rank), pack in sorted(records.items()):
        t = pack()
        meta = {"schema": TRAIN_DATA_SCHEMA, "round": str(rnd), "rank": str(rank_index[rank]),
                "vime_global_rank": str(rank)}
        path = os.path.join(dst, TRAIN_DATA_DIR, train_data_name(rnd, rank_index[rank]))
        save_file(t, path, metadata=meta)
        per_round.setdefault(rnd, []).append(_stats(t))

    steps = vime_steps(os.path.join(src, RUN_LOG))
    lines = []
    for rnd in range(rounds):
        vals = [steps[s] for s in range(rnd * steps_per_round, (rnd + 1) * steps_per_round) if s in steps]
        row: dict[str, Any] = {"schema": METRICS_SCHEMA, "round": rnd}
        if vals:
            row["vime_train_rollout_logprob_abs_diff"] = vals
        lines.append(json_text(row, indent=None))
    write_bytes_atomic(os.path.join(dst, "metrics.jsonl"), "".join(lines).encode())

    rows = []
    for rnd, st in sorted(per_round.items()):
        rows.append({"round": rnd, "element_count": sum(x[0] for x in st), "mismatch_count": sum(x[1] for x in st),
                     "max_abs_diff": max(x[2] for x in st)})
    total = sum(r["element_count"] for r in rows)
    mism = sum(r["mismatch_count"] for r in rows)
    write_json_atomic(os.path.join(dst, "bitwise-validation.json"), {
        "schema": BITWISE_SCHEMA, "require_exact": bool(launch.get("require_exact", launch.get("exact_required"))),
        "torch_equal": mism == 0, "element_count": total, "mismatch_count": mism,
        "max_abs_diff": max([r["max_abs_diff"] for r in rows] + [0.0]), "rounds": rows, "fallback_failures": 0,
        "source": f"rlk-validate import-vime: recomputed from {origin}/ (VIME writes no bitwise report)"})

    topo = launch.get("topology") or {}
    write_json_atomic(os.path.join(dst, "manifest.json"), {
        "schema": MANIFEST_SCHEMA, "run_id": launch.get("run_id"), "created_at": launch.get("created_at")
        or _mtime(os.path.join(src, LAUNCH)), "engine": "vime", "mode": launch.get("mode"),
        "command": launch.get("submit") or launch.get("command") or [], "plan": launch.get("plan"),
        "rounds": rounds, "ranks": max(len(writers), 1),
        "repos": environment.get("repos") or [{"name": "vime", "sha": None, "dirty": None,
                                               "error": f"{ENVIRONMENT} is absent"}],
        "packages": environment.get("packages") or {}, "hardware": environment.get("hardware") or {},
        "inputs": {k: v for k, v in (environment.get("inputs") or {}).items() if v},
        "seeds": launch.get("seeds") or {},
        "config": {"vime": launch.get("config") or {}, "topology": topo, "sampling": launch.get("sampling") or {},
                   "env": launch.get("env") or {}, "record_writer_ranks": writers,
                   "imported_from": src, "train_data_from": origin,
                   "token_ids": "as recorded; zeros where the hook recorded none"},
    })
    return {"dst": dst, "rounds": rounds, "writer_ranks": writers, "source": origin, "record_files": files,
            "vime_steps": len(steps), "mismatch_count": mism, "element_count": total}


def _mtime(path: str) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(os.path.getmtime(path), datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
