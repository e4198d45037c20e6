"""Bitwise comparison of train and rollout log-probs, per round, over the active mask.

A token is a *mismatch* when the float32 bit patterns of the two log-probs differ (so ``-0.0`` vs
``0.0`` counts, and so does any NaN). ``max_abs_diff`` / ``mean_abs_diff`` are over active tokens with
finite values, in float64.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

from .drift import WorstTokens, abs_histogram, drift_stats
from .findings import Finding, finding
from .safeio import InputError, Root
from .tensors import TrainData, load_pt, load_safetensors, parse_name, torch_importable

CHECK = "bitwise"
DIR = "train-data"


def _f(code: str, msg: str, path: str | None = None, **kw: Any) -> Finding:
    return finding(code, msg, check=CHECK, path=path, **kw)


def _first(mask: np.ndarray) -> list[int]:
    s, t = np.nonzero(mask)
    return [int(s[0]), int(t[0])]


def _content_findings(td: TrainData) -> tuple[list[Finding], np.ndarray]:
    """Findings about one file's values; returns the mask of usable (active, finite) positions."""
    out: list[Finding] = []
    m = td.mask
    n = int(np.count_nonzero(m))
    if n == 0:
        out.append(_f("MASK_EMPTY", f"{td.rel}: response_mask selects no token; nothing is compared", td.rel))
    fin = np.isfinite(td.train) & np.isfinite(td.rollout)
    bad = m & ~fin
    if bad.any():
        out.append(
            _f(
                "LOGPROB_NONFINITE",
                f"{td.rel}: {int(np.count_nonzero(bad))} active log-prob(s) are NaN or infinite "
                f"(first at sample/position {_first(bad)})",
                td.rel,
                count=int(np.count_nonzero(bad)),
                first=_first(bad),
            )
        )
    ok = m & fin
    pos = ok & ((td.train > 0) | (td.rollout > 0))
    if pos.any():
        out.append(
            _f(
                "LOGPROB_POSITIVE",
                f"{td.rel}: {int(np.count_nonzero(pos))} active log-prob(s) are > 0, "
                f"which no probability gives "
                f"(first at sample/position {_first(pos)})",
                td.rel,
                count=int(np.count_nonzero(pos)),
                first=_first(pos),
            )
        )
    for name in ("rewards", "advantages"):
        v = getattr(td, name)
        if v is not None and not np.isfinite(v).all():
            out.append(_f("REWARDS_INVALID", f"{td.rel}: {int(np.count_nonzero(~np.isfinite(v)))} {name} value(s) "
                          "are NaN or infinite", td.rel))
    masked_nz = ~m & ((td.train != 0) | (td.rollout != 0))
    if masked_nz.any():
        out.append(
            _f(
                "MASKED_NONZERO",
                f"{td.rel}: {int(np.count_nonzero(masked_nz))} masked position(s) hold a non-zero log-prob",
                td.rel,
                count=int(np.count_nonzero(masked_nz)),
            )
        )
    return out, ok


def _missing(files: dict[tuple[int, int], str], n_rounds: int, n_ranks: int) -> tuple[int, list[tuple[int, int]]]:
    """How many of the ``n_rounds x n_ranks`` expected files are absent, and the first five: counted from
    the files present, never by enumerating the expected ones (a manifest may claim 10^9 rounds)."""
    present = sum(1 for r, k in files if r < n_rounds and k < n_ranks)
    n = n_rounds * n_ranks - present
    first: list[tuple[int, int]] = []
    r = k = 0
    while len(first) < min(n, 5):  # at most len(files) + 5 steps
        if (r, k) not in files:
            first.append((r, k))
        k += 1
        if k == n_ranks:
            r, k = r + 1, 0
    return n, first


def _list_train_data(root: Root) -> list[str] | None:
    """The entry names of ``train-data/``, or None when it is absent (raises InputError)."""
    if not root.is_dir(DIR):
        return None
    return root.listdir(DIR)


def _range_findings(
    rel: str, rnd: int, rank: int, expected_rounds: int | None, expected_ranks: int | None
) -> list[Finding]:
    """A file's round and rank must lie within the manifest's ranges (when it states them)."""
    out: list[Finding] = []
    if expected_rounds is not None and rnd >= expected_rounds:
        out.append(
            _f(
                "TRAIN_DATA_UNEXPECTED",
                f"{rel} is round {rnd}, but the manifest expects rounds 0..{expected_rounds - 1}",
                rel,
            )
        )
    if expected_ranks is not None and rank >= expected_ranks:
        out.append(
            _f(
                "TRAIN_DATA_UNEXPECTED",
                f"{rel} is rank {rank}, but the manifest expects ranks 0..{expected_ranks - 1}",
                rel,
            )
        )
    return out


def _index_files(
    names: list[str], expected_rounds: int | None, expected_ranks: int | None
) -> tuple[dict[tuple[int, int], str], int, list[Finding]]:
    """Index the round files by ``(round, rank)``: returns the index, the legacy .pt files unreadable here, findings."""
    findings: list[Finding] = []
    files: dict[tuple[int, int], str] = {}
    legacy_skipped = 0
    for name in names:
        rel = f"{DIR}/{name}"
        parsed = parse_name(name)
        if parsed is None:
            findings.append(
                _f(
                    "TRAIN_DATA_UNEXPECTED",
                    f"{rel} is not named round-<NNNN>.rank<R>.safetensors; ignored",
                    rel,
                    severity="warning",
                )
            )
            continue
        rnd, rank, kind = parsed
        if (rnd, rank) in files:
            findings.append(
                _f(
                    "TRAIN_DATA_UNEXPECTED",
                    f"{rel} and {files[(rnd, rank)]} both claim round {rnd} rank {rank}",
                    rel,
                )
            )
            continue
        findings.extend(_range_findings(rel, rnd, rank, expected_rounds, expected_ranks))
        if kind == "pt" and not torch_importable():
            legacy_skipped += 1
        files[(rnd, rank)] = rel
    if legacy_skipped:
        findings.append(
            _f(
                "LEGACY_PT_UNAVAILABLE",
                f"{legacy_skipped} legacy .pt train-data file(s) cannot be read: torch is not importable here",
                DIR,
            )
        )
    return files, legacy_skipped, findings


def _missing_findings(files: dict[tuple[int, int], str], n_rounds: int, n_ranks: int) -> tuple[int, list[Finding]]:
    """Count the expected round/rank files that are absent and report the first few."""
    missing_n, first_missing = _missing(files, n_rounds, n_ranks)
    if not missing_n:
        return missing_n, []
    shown = ", ".join(f"round {r} rank {k}" for r, k in first_missing) + (" ..." if missing_n > 5 else "")
    return missing_n, [
        _f(
            "ROUNDS_MISSING",
            f"train-data lacks {missing_n} of {n_rounds * n_ranks} expected round/rank file(s): {shown}",
            DIR,
            missing_count=missing_n,
            missing=[list(x) for x in first_missing],
        )
    ]


def _new_round_acc() -> dict[str, Any]:
    """An empty per-round accumulator."""
    return {"element_count": 0, "mismatch_count": 0, "diffs": [], "files": 0, "rewards": [], "no_rewards": 0}


def _accumulate(acc: dict[str, Any], td: TrainData, ok: np.ndarray) -> None:
    """Add one file's token counts, bit mismatches, diffs and rewards to its round's accumulator."""
    m = td.mask
    bits_differ = td.train.view(np.uint32) != td.rollout.view(np.uint32)
    acc["files"] += 1
    acc["element_count"] += int(np.count_nonzero(m))
    acc["mismatch_count"] += int(np.count_nonzero(bits_differ & m))
    acc["diffs"].append(td.train[ok].astype(np.float64) - td.rollout[ok].astype(np.float64))
    if td.rewards is None:
        acc["no_rewards"] += 1
    else:
        acc["rewards"].append(td.rewards.astype(np.float64))


def _read_rounds(
    root: Root, files: dict[tuple[int, int], str], skip_legacy: bool, worst_k: int
) -> tuple[dict[int, dict[str, Any]], WorstTokens, list[Finding]]:
    """Load every indexed file in (round, rank) order, check its values and accumulate it per round."""
    findings: list[Finding] = []
    per_round: dict[int, dict[str, Any]] = defaultdict(_new_round_acc)
    worst = WorstTokens(worst_k)
    for (rnd, rank), rel in sorted(files.items()):
        kind = "pt" if rel.endswith(".pt") else "safetensors"
        if kind == "pt" and skip_legacy:
            continue
        try:
            td = (load_pt if kind == "pt" else load_safetensors)(root, rel, rnd, rank)
        except InputError as e:
            findings.append(e.finding)
            continue
        content, ok = _content_findings(td)
        findings.extend(content)
        _accumulate(per_round[rnd], td, ok)
        worst.add(rnd, rank, td.token_ids, td.train, td.rollout, ok)
    return per_round, worst, findings


def _round_results(
    per_round: dict[int, dict[str, Any]], n_ranks: int, clip_eps: float
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], np.ndarray]:
    """Per-round bitwise and drift results, in round order, and every round's diffs concatenated."""
    rounds_out, drift_rounds, all_d = [], [], []
    for rnd in sorted(per_round):
        acc = per_round[rnd]
        d = np.concatenate(acc["diffs"]) if acc["diffs"] else np.zeros(0)
        all_d.append(d)
        a = np.abs(d)
        rw = np.concatenate(acc["rewards"]) if acc["rewards"] and not acc["no_rewards"] else None
        rounds_out.append(
            {
                "round": rnd,
                "complete": acc["files"] == n_ranks,
                "reward_mean": float(rw.mean()) if rw is not None and rw.size and np.isfinite(rw).all() else None,
                "files": acc["files"],
                "element_count": acc["element_count"],
                "mismatch_count": acc["mismatch_count"],
                "max_abs_diff": float(a.max()) if a.size else 0.0,
                "mean_abs_diff": float(a.mean()) if a.size else 0.0,
            }
        )
        drift_rounds.append({"round": rnd, **drift_stats(d, clip_eps)})
    return rounds_out, drift_rounds, np.concatenate(all_d)


def _totals(
    rounds_out: list[dict[str, Any]], d_all: np.ndarray, require_exact: bool, missing_n: int, n_rounds: int
) -> dict[str, Any]:
    """The run-wide bitwise result: sums over the rounds, |diff| over every compared token."""
    a_all = np.abs(d_all)
    return {
        "require_exact": require_exact,
        "complete": not missing_n and len(rounds_out) == n_rounds and all(r["complete"] for r in rounds_out),
        "files": sum(r["files"] for r in rounds_out),
        "element_count": sum(r["element_count"] for r in rounds_out),
        "mismatch_count": sum(r["mismatch_count"] for r in rounds_out),
        "max_abs_diff": float(a_all.max()) if a_all.size else 0.0,
        "mean_abs_diff": float(a_all.mean()) if a_all.size else 0.0,
        "rounds": rounds_out,
    }


def _rewards_presence(per_round: dict[int, dict[str, Any]]) -> tuple[str, list[Finding]]:
    """Whether the files hold rewards (absent, partial or present); partial is reported."""
    with_rewards = sum(len(a["rewards"]) for a in per_round.values())
    without = sum(a["no_rewards"] for a in per_round.values())
    status = "absent" if not with_rewards else ("partial" if without else "present")
    if not (with_rewards and without):
        return status, []
    return status, [_f("TENSOR_MISSING", f"{without} train-data file(s) lack the rewards tensor that "
                       f"{with_rewards} other(s) hold: the reward claims of those rounds cannot be checked",
                       DIR, missing=["rewards"])]


def _drift_result(
    d_all: np.ndarray, drift_rounds: list[dict[str, Any]], worst: WorstTokens, clip_eps: float
) -> dict[str, Any]:
    """The drift result: overall and per-round statistics, the worst tokens, the |diff| histogram."""
    return {
        "clip_eps": clip_eps,
        "overall": drift_stats(d_all, clip_eps),
        "rounds": drift_rounds,
        "worst_tokens": worst.result(),
        "abs_histogram": abs_histogram(d_all),
    }


def _mismatch_findings(total: dict[str, Any], require_exact: bool) -> list[Finding]:
    """A mismatch is an error when bitwise equality is required, a diagnostic otherwise."""
    if not (total["element_count"] and total["mismatch_count"]):
        return []
    bad_rounds = [r["round"] for r in total["rounds"] if r["mismatch_count"]]
    msg = (
        f"{total['mismatch_count']} of {total['element_count']} active tokens differ between train and "
        f"rollout (max |diff| {total['max_abs_diff']:.6g}) in round(s) {bad_rounds[:10]}"
    )
    if require_exact:
        code, msg = "BITWISE_MISMATCH", msg + "; bitwise equality is required"
    else:
        code, msg = "MISMATCH_DIAGNOSTIC", msg + " (not required to be zero for this plan)"
    return [_f(code, msg, DIR, mismatch_count=total["mismatch_count"], element_count=total["element_count"])]


def check_train_data(
    root: Root,
    *,
    require_exact: bool,
    expected_rounds: int | None = None,
    expected_ranks: int | None = None,
    clip_eps: float = 0.2,
    worst_k: int = 10,
) -> tuple[list[Finding], dict[str, Any] | None, dict[str, Any] | None]:
    """Returns ``(findings, bitwise_result, drift_result)``; results are None when nothing was read."""
    try:
        names = _list_train_data(root)
    except InputError as e:
        return [e.finding], None, None
    if names is None:
        return [_f("TRAIN_DATA_MISSING", "train-data/ is absent: no log-probs to compare", DIR)], None, None

    files, legacy_skipped, findings = _index_files(names, expected_rounds, expected_ranks)
    if not files:
        findings.append(_f("TRAIN_DATA_MISSING", "train-data/ holds no round files", DIR))
        return findings, None, None
    n_rounds = expected_rounds if expected_rounds is not None else max(r for r, _ in files) + 1
    n_ranks = expected_ranks if expected_ranks is not None else max(k for _, k in files) + 1
    missing_n, missing = _missing_findings(files, n_rounds, n_ranks)
    findings.extend(missing)

    per_round, worst, content = _read_rounds(root, files, bool(legacy_skipped), worst_k)
    findings.extend(content)
    if not per_round:
        return findings, None, None

    rounds_out, drift_rounds, d_all = _round_results(per_round, n_ranks, clip_eps)
    total = _totals(rounds_out, d_all, require_exact, missing_n, n_rounds)
    total["rewards"], rewards = _rewards_presence(per_round)
    findings.extend(rewards)
    if total["element_count"] == 0:
        findings.append(_f("NOTHING_COMPARED", "the train-data that was read selects no token: nothing was "
                           "compared, which is no evidence of equality", DIR))
    drift = _drift_result(d_all, drift_rounds, worst, clip_eps)
    findings.extend(_mismatch_findings(total, require_exact))
    return findings, total, drift
