"""VIME's training debug dumps (``--save-debug-train-data``, format version 2): read, compared offline, imported.

With ``--save-debug-train-data DIR/{rollout_id}_{rank}.pt`` VIME writes, per rollout, one ``torch.save`` file from
the data-parallel source rank among the ranks that are tensor-parallel rank 0 of the last pipeline stage and
context-parallel rank 0 (its global rank is the ``{rank}`` of the name). It holds a dict::

    format_version  2
    rollout_id      int
    rank            int, the writer's global rank
    samples         list, one dict per training sample of every data-parallel shard, sorted by rollout_position
                    (else sample_index): data_parallel_rank, rollout_position, sample_index, and the per-sample
                    fields of the rollout data: tokens [total_length] (prompt + response), response_lengths and
                    total_lengths (ints), loss_masks [R], rollout_log_probs [R] (the rollout engine's), log_probs
                    [R] (the trainer's forward-only recompute, VIME's "old" log-probs), advantages [R], ... —
                    every context-parallel field gathered to the whole response (R = response_lengths)
    dp_shards       list, per data-parallel shard: rank, data_parallel_rank, sample_indices, partition, and its
                    micro-batch layout
    raw_reward      (when present) the whole batch's raw rewards in rollout order

This reader never imports torch (:mod:`rlk_validate.ptfile`). :func:`compare_dumps` is the offline tensor
comparison (``rlk-validate vime-dumps DIR``): per rollout the compared tokens (loss mask 1), the bitwise mismatches
of ``log_probs`` vs ``rollout_log_probs`` (float32 bits), max |diff| and VIME's own metric recomputed
(``train_rollout_logprob_abs_diff``: the per-sample mean over the loss mask of |diff|, summed over samples).
:func:`dump_train_data` turns one dump into ``rlk.train-data.v1`` tensors for ``rlk-validate import-vime``.
"""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np

from .ptfile import PtProblem, load

DUMPS = "debug-train-data"
DUMP_RE = re.compile(r"([0-9]{1,9})_([0-9]{1,6})\.pt")
FORMAT_VERSION = 2
REQUIRED = ("rollout_log_probs", "log_probs", "response_lengths", "loss_masks", "tokens")


class DumpProblem(Exception):
    """A dump is not one VIME's format version 2 writes (one line naming the file)."""


def dump_files(directory: str) -> dict[tuple[int, int], str]:
    """``{(rollout_id, writer rank): path}`` of the ``{rollout_id}_{rank}.pt`` files in ``directory``."""
    if not os.path.isdir(directory):
        return {}
    out = {}
    for name in sorted(os.listdir(directory)):
        m = DUMP_RE.fullmatch(name)
        p = os.path.join(directory, name)
        if m and os.path.isfile(p) and not os.path.islink(p):
            out[(int(m.group(1)), int(m.group(2)))] = p
    return out


def _vector(sample: dict[str, Any], key: str, where: str) -> np.ndarray:
    v = sample[key]
    if not isinstance(v, np.ndarray) or v.ndim != 1:
        raise DumpProblem(f"{where}: {key} is not a 1-D tensor")
    return v


def read_dump(path: str) -> dict[str, Any]:
    """The dump at ``path``, checked: format version 2, one entry per sample with the fields VIME's CP gather
    restores to the whole response (``REQUIRED``), float32 log-probs, lengths that agree."""
    try:
        doc = load(path)
    except PtProblem as e:
        raise DumpProblem(f"{path}: {e}") from None
    if not isinstance(doc, dict) or doc.get("format_version") != FORMAT_VERSION:
        got = doc.get("format_version") if isinstance(doc, dict) else type(doc).__name__
        raise DumpProblem(f"{path}: format_version is {got!r}, not {FORMAT_VERSION} (VIME's debug dump with the "
                          "training log-probs)")
    samples = doc.get("samples")
    if type(doc.get("rollout_id")) is not int or type(doc.get("rank")) is not int or not isinstance(samples, list) \
            or not samples or not isinstance(doc.get("dp_shards"), list):
        raise DumpProblem(f"{path}: needs rollout_id and rank (ints), samples (a non-empty list) and dp_shards")
    positions = []
    for i, s in enumerate(samples):
        where = f"{path}: samples[{i}]"
        if not isinstance(s, dict) or any(k not in s for k in REQUIRED):
            lacking = [k for k in REQUIRED if not isinstance(s, dict) or k not in s]
            raise DumpProblem(f"{where} lacks {', '.join(lacking)}")
        n = s["response_lengths"]
        if type(n) is not int or n < 0:
            raise DumpProblem(f"{where}: response_lengths is not a non-negative int")
        for key in ("rollout_log_probs", "log_probs", "loss_masks"):
            v = _vector(s, key, where)
            if v.shape[0] != n:
                raise DumpProblem(f"{where}: {key} has {v.shape[0]} entries, response_lengths is {n} (a dump whose "
                                  "context-parallel fields were not gathered to the whole response?)")
        for key in ("rollout_log_probs", "log_probs"):
            if s[key].dtype != np.float32:
                raise DumpProblem(f"{where}: {key} is {s[key].dtype}, not float32")
        tokens = _vector(s, "tokens", where)
        total = s.get("total_lengths", tokens.shape[0])
        if tokens.shape[0] != total or tokens.shape[0] < n or tokens.dtype.kind not in "iu":
            raise DumpProblem(f"{where}: tokens ({tokens.shape[0]} {tokens.dtype}) do not hold total_lengths "
                              f"{total} >= response_lengths {n} integer ids")
        if not np.isin(s["loss_masks"], (0, 1)).all():
            raise DumpProblem(f"{where}: loss_masks holds values other than 0 and 1")
        positions.append(s.get("rollout_position", s.get("sample_index")))
    known = all(type(p) is int for p in positions)
    if known and (positions != sorted(positions) or len(set(positions)) != len(positions)):
        raise DumpProblem(f"{path}: samples are not sorted by distinct rollout_position (VIME sorts them so)")
    return doc


def _bits_differ(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return a.view(np.uint32) != b.view(np.uint32)


def dump_stats(doc: dict[str, Any]) -> dict[str, Any]:
    """The comparison of one dump (see the module doc)."""
    tokens = mismatches = 0
    max_diff, vime = 0.0, 0.0
    for s in doc["samples"]:
        active = s["loss_masks"] != 0
        a, b = s["log_probs"][active], s["rollout_log_probs"][active]
        tokens += int(a.size)
        mismatches += int(_bits_differ(a, b).sum())
        if a.size:
            d = np.abs(a.astype(np.float64) - b.astype(np.float64))
            max_diff = max(max_diff, float(d.max()))
            vime += float(d.mean())
    return {"rollout_id": doc["rollout_id"], "writer_rank": doc["rank"], "samples": len(doc["samples"]),
            "dp_shards": len(doc["dp_shards"]), "compared_tokens": tokens, "mismatch_count": mismatches,
            "max_abs_diff": max_diff, "train_rollout_logprob_abs_diff": vime}


def compare_dumps(directory: str) -> list[dict[str, Any]]:
    """:func:`dump_stats` of every dump in ``directory``, by rollout and writer."""
    files = dump_files(directory)
    if not files:
        raise DumpProblem(f"{directory} holds no {{rollout_id}}_{{rank}}.pt debug dump")
    out = []
    for (rollout, rank), path in sorted(files.items()):
        doc = read_dump(path)
        if (doc["rollout_id"], doc["rank"]) != (rollout, rank):
            raise DumpProblem(f"{path}: holds rollout {doc['rollout_id']} of rank {doc['rank']}, not its name's")
        out.append({"file": os.path.basename(path), **dump_stats(doc)})
    return out


def dump_train_data(doc: dict[str, Any]) -> dict[str, np.ndarray]:
    """One dump as ``rlk.train-data.v1`` tensors ``[S, T]`` over the response tokens (T the longest response):
    token ids, the loss mask as ``response_mask``, both log-probs (0 where masked); ``rewards`` ``[S]`` from
    ``raw_reward`` at each sample's rollout_position where the dump has both."""
    samples = doc["samples"]
    width = max([s["response_lengths"] for s in samples] + [1])
    n = len(samples)
    out = {"token_ids": np.zeros((n, width), np.int64), "response_mask": np.zeros((n, width), np.uint8),
           "rollout_logprobs": np.zeros((n, width), np.float32), "train_logprobs": np.zeros((n, width), np.float32)}
    for i, s in enumerate(samples):
        r = s["response_lengths"]
        active = s["loss_masks"] != 0
        out["token_ids"][i, :r] = s["tokens"][len(s["tokens"]) - r:].astype(np.int64)
        out["response_mask"][i, :r] = active
        out["rollout_logprobs"][i, :r] = np.where(active, s["rollout_log_probs"], np.float32(0))
        out["train_logprobs"][i, :r] = np.where(active, s["log_probs"], np.float32(0))
    raw = doc.get("raw_reward")
    pos = [s.get("rollout_position") for s in samples]
    if isinstance(raw, (list, tuple)) and all(type(p) is int and 0 <= p < len(raw) for p in pos) \
            and all(isinstance(raw[p], (int, float)) and not isinstance(raw[p], bool) for p in pos):
        out["rewards"] = np.array([float(raw[p]) for p in pos], np.float32)
    return out


def main(argv: list[str]) -> int:
    """``rlk-validate vime-dumps DIR [--json OUT]``: the offline comparison of the dumps in DIR. Exit 0 when every
    compared token's two log-probs are equal in bits, 1 when any differs (or nothing was compared), 3 when DIR holds
    no readable dump."""
    import argparse
    import sys

    from .evidence import VIME_DUMPS_COMPARISON_SCHEMA, write_json_atomic
    from .report import clean

    p = argparse.ArgumentParser(prog="rlk-validate vime-dumps", allow_abbrev=False,
                                description="Compare the training and rollout log-probs of VIME's "
                                "--save-debug-train-data dumps (format version 2) in DIR, bit for bit.")
    p.add_argument("directory", metavar="DIR")
    p.add_argument("--json", metavar="OUT", help="also write the per-dump comparison as JSON to OUT")
    try:
        a = p.parse_args(argv)
    except SystemExit as e:
        return 0 if e.code == 0 else 3
    try:
        rows = compare_dumps(a.directory)
    except DumpProblem as e:
        print(f"rlk-validate vime-dumps: {clean(e)}", file=sys.stderr)
        return 3
    print(f"{'dump':<24} {'samples':>7} {'shards':>6} {'compared':>9} {'mismatch':>9} {'max|diff|':>10} "
          f"{'vime abs_diff':>13}")
    for r in rows:
        print(f"{r['file']:<24} {r['samples']:>7} {r['dp_shards']:>6} {r['compared_tokens']:>9} "
              f"{r['mismatch_count']:>9} {r['max_abs_diff']:>10.3g} {r['train_rollout_logprob_abs_diff']:>13.6g}")
    compared, mism = sum(r["compared_tokens"] for r in rows), sum(r["mismatch_count"] for r in rows)
    if a.json:
        write_json_atomic(a.json, {"schema": VIME_DUMPS_COMPARISON_SCHEMA, "dumps": rows,
                                   "compared_tokens": compared, "mismatch_count": mism})
    if compared == 0:
        print("FAIL: no token compared (every loss mask is 0)")
        return 1
    print(f"{'PASS' if mism == 0 else 'FAIL'}: {mism} of {compared} compared tokens differ in bits between log_probs "
          f"and rollout_log_probs over {len(rows)} dump(s)")
    return 0 if mism == 0 else 1
