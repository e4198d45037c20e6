"""Bitwise comparison of train and rollout log-probs, per round, over the active mask.

A token is a *mismatch* when the float32 bit patterns of the two log-probs differ (so ``-0.0`` vs
``0.0`` counts, and so does any NaN). ``max_abs_diff`` / ``mean_abs_diff`` are over active tokens with
finite values, in float64.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

from .drift import WorstTokens, abs_histogram, drift_of
from .evidence import INFORMATIVE_LOGP
from .findings import Finding, finding
from .safeio import InputError, Root
from .tensors import Chunk, TrainData, load_pt, load_safetensors, parse_name, torch_importable

CHECK = "bitwise"
DIR = "train-data"


def _f(code: str, msg: str, path: str | None = None, **kw: Any) -> Finding:
    return finding(code, msg, check=CHECK, path=path, **kw)




class _FileScan:
    """One file's values, chunk by chunk: its findings' counts and first positions, and what its round adds up
    (token and mismatch counts, the differences that are not zero). Merged into the round only when the whole
    file was read."""

    def __init__(self, td: TrainData) -> None:
        self.td = td
        self.width = td.shape[1]
        self.counts = {"active": 0, "nonfinite": 0, "outside_kept": 0, "positive": 0, "masked_nonzero": 0,
                       "mismatch": 0, "informative": 0, "informative_mismatch": 0}
        self.first: dict[str, list[int]] = {}
        self.zeros = 0
        self.nonzero: list[np.ndarray] = []
        self.nll = 0.0  # sum of -rollout log-prob over usable tokens (a sampled-entropy estimate)
        self.usable = 0

    def _note(self, key: str, where: np.ndarray, start: int) -> None:
        n = int(np.count_nonzero(where))
        self.counts[key] += n
        if n and key not in self.first:
            i = start + int(np.flatnonzero(where)[0])
            self.first[key] = [i // self.width, i % self.width]

    def add(self, c: Chunk, worst: WorstTokens) -> None:
        m = c.mask
        self.counts["active"] += int(np.count_nonzero(m))
        fin = np.isfinite(c.train) & np.isfinite(c.rollout)
        # the trainer gives the sampled token probability 0 while the rollout's is finite: under filters, the token
        # lies outside the trainer's own kept set (a measured disagreement of the two sides' kept sets, not corrupt
        # data); any other non-finite value (NaN, +inf, a rollout -inf) is
        outside = m & np.isneginf(c.train) & np.isfinite(c.rollout)
        self._note("outside_kept", outside, c.start)
        self._note("nonfinite", m & ~fin & ~outside, c.start)
        ok = m & fin
        self._note("positive", ok & ((c.train > 0) | (c.rollout > 0)), c.start)
        self._note("masked_nonzero", ~m & ((c.train != 0) | (c.rollout != 0)), c.start)
        differ = (c.train.view(np.uint32) != c.rollout.view(np.uint32)) & m
        self.counts["mismatch"] += int(np.count_nonzero(differ))
        informative = m & (c.rollout < INFORMATIVE_LOGP)
        self.counts["informative"] += int(np.count_nonzero(informative))
        self.counts["informative_mismatch"] += int(np.count_nonzero(differ & informative))
        d = c.train[ok].astype(np.float64) - c.rollout[ok].astype(np.float64)
        nz = d[d != 0]
        self.zeros += int(d.size - nz.size)
        if nz.size:
            self.nonzero.append(nz)
        self.nll -= float(c.rollout[ok].astype(np.float64).sum())
        self.usable += int(d.size)
        worst.add_flat(self.td.round, self.td.rank, self.width, c.start, c.token_ids, c.train, c.rollout, ok)

    def findings(self) -> list[Finding]:
        rel, k, first = self.td.rel, self.counts, self.first
        out: list[Finding] = []
        if k["active"] == 0:
            out.append(_f("MASK_EMPTY", f"{rel}: response_mask selects no token; nothing is compared", rel))
        if k["nonfinite"]:
            out.append(_f("LOGPROB_NONFINITE", f"{rel}: {k['nonfinite']} active log-prob(s) are NaN or infinite "
                          f"(first at sample/position {first['nonfinite']})", rel, count=k["nonfinite"],
                          first=first["nonfinite"]))
        if k["outside_kept"]:
            out.append(_f("TRAIN_LOGPROB_OUTSIDE_KEPT_SET", f"{rel}: {k['outside_kept']} sampled token(s) have train "
                          f"log-prob -inf and a finite rollout log-prob (first at sample/position "
                          f"{first['outside_kept']}): outside the trainer's own kept set, so the two sides' kept sets "
                          "differ there (a trainer that replays the rollout's kept set, by keep mask or threshold, "
                          "has none); they count as mismatches and are left out of |diff|", rel,
                          count=k["outside_kept"], first=first["outside_kept"]))
        if k["positive"]:
            out.append(_f("LOGPROB_POSITIVE", f"{rel}: {k['positive']} active log-prob(s) are > 0, which no "
                          f"probability gives (first at sample/position {first['positive']})", rel,
                          count=k["positive"], first=first["positive"]))
        for name in ("rewards", "advantages"):
            v = getattr(self.td, name)
            if v is not None and not np.isfinite(v).all():
                out.append(_f("REWARDS_INVALID", f"{rel}: {int(np.count_nonzero(~np.isfinite(v)))} {name} value(s) "
                              "are NaN or infinite", rel))
        if k["masked_nonzero"]:
            out.append(_f("MASKED_NONZERO", f"{rel}: {k['masked_nonzero']} masked position(s) hold a non-zero "
                          "log-prob", rel, count=k["masked_nonzero"]))
        return out


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
                    f"{rel} is not named round-<NNNN>.rank<R>.safetensors: train-data holds a file no round "
                    "accounts for (not read as a round)",
                    rel,
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
    return {"element_count": 0, "mismatch_count": 0, "informative_count": 0, "informative_mismatch_count": 0,
            "zeros": 0, "nonzero": [], "nll": 0.0, "usable": 0, "files": 0, "rewards": [], "no_rewards": 0,
            "advantages": [], "no_advantages": 0}


def _accumulate(acc: dict[str, Any], scan: _FileScan) -> None:
    """Add one fully read file to its round's accumulator."""
    td, k = scan.td, scan.counts
    acc["files"] += 1
    acc["element_count"] += k["active"]
    acc["mismatch_count"] += k["mismatch"]
    acc["informative_count"] += k["informative"]
    acc["informative_mismatch_count"] += k["informative_mismatch"]
    acc["zeros"] += scan.zeros
    acc["nonzero"] += scan.nonzero
    acc["nll"] += scan.nll
    acc["usable"] += scan.usable
    for name in ("rewards", "advantages"):
        v = getattr(td, name)
        if v is None:
            acc[f"no_{name}"] += 1
        else:
            acc[name].append(v.astype(np.float64))


def _read_rounds(
    root: Root, files: dict[tuple[int, int], str], skip_legacy: bool, worst_k: int
) -> tuple[dict[int, dict[str, Any]], WorstTokens, list[Finding]]:
    """Stream every indexed file in (round, rank) order, check its values and accumulate it per round."""
    findings: list[Finding] = []
    per_round: dict[int, dict[str, Any]] = defaultdict(_new_round_acc)
    worst = WorstTokens(worst_k)
    for (rnd, rank), rel in sorted(files.items()):
        kind = "pt" if rel.endswith(".pt") else "safetensors"
        if kind == "pt" and skip_legacy:
            continue
        file_worst = WorstTokens(worst_k)
        try:
            td = (load_pt if kind == "pt" else load_safetensors)(root, rel, rnd, rank)
            try:
                scan = _FileScan(td)
                for chunk in td.chunks():
                    scan.add(chunk, file_worst)
            finally:
                td.close()
        except InputError as e:
            findings.append(e.finding)
            continue
        findings.extend(scan.findings())
        _accumulate(per_round[rnd], scan)
        worst.merge(file_worst)
    return per_round, worst, findings


def _round_results(
    per_round: dict[int, dict[str, Any]], n_ranks: int, clip_eps: float
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], tuple[np.ndarray, int]]:
    """Per-round bitwise and drift results, in round order, and every round's non-zero differences (concatenated)
    with the count of exact zeros."""
    rounds_out, drift_rounds, all_nz, all_zeros = [], [], [], 0
    for rnd in sorted(per_round):
        acc = per_round[rnd]
        nz = np.concatenate(acc["nonzero"]) if acc["nonzero"] else np.zeros(0)
        acc["nonzero"] = [nz]
        all_nz.append(nz)
        all_zeros += acc["zeros"]
        a = np.abs(nz)
        n = acc["zeros"] + nz.size
        rw = np.concatenate(acc["rewards"]) if acc["rewards"] and not acc["no_rewards"] else None
        adv = np.concatenate(acc["advantages"]) if acc["advantages"] and not acc["no_advantages"] else None
        rounds_out.append(
            {
                "round": rnd,
                "complete": acc["files"] == n_ranks,
                "reward_mean": float(rw.mean()) if rw is not None and rw.size and np.isfinite(rw).all() else None,
                "advantages_all_zero": bool(adv.size and not np.any(adv)) if adv is not None else None,
                "files": acc["files"],
                "element_count": acc["element_count"],
                "mismatch_count": acc["mismatch_count"],
                "informative_count": acc["informative_count"],
                "informative_mismatch_count": acc["informative_mismatch_count"],
                "informative_fraction": acc["informative_count"] / acc["element_count"] if acc["element_count"]
                else 0.0,
                "sampled_nll_mean": acc["nll"] / acc["usable"] if acc["usable"] else 0.0,
                "max_abs_diff": float(a.max()) if a.size else 0.0,
                "mean_abs_diff": float(a.sum()) / n if n else 0.0,
            }
        )
        drift_rounds.append({"round": rnd, **drift_of(nz, acc["zeros"], clip_eps)})
    return rounds_out, drift_rounds, (np.concatenate(all_nz) if all_nz else np.zeros(0), all_zeros)


def _totals(
    rounds_out: list[dict[str, Any]], diffs: tuple[np.ndarray, int], require_exact: bool, missing_n: int,
    n_rounds: int
) -> dict[str, Any]:
    """The run-wide bitwise result: sums over the rounds, |diff| over every compared token."""
    nz, zeros = diffs
    a_all = np.abs(nz)
    n = zeros + nz.size
    elements = sum(r["element_count"] for r in rounds_out)
    informative = sum(r["informative_count"] for r in rounds_out)
    return {
        "require_exact": require_exact,
        "complete": not missing_n and len(rounds_out) == n_rounds and all(r["complete"] for r in rounds_out),
        "files": sum(r["files"] for r in rounds_out),
        "element_count": elements,
        "mismatch_count": sum(r["mismatch_count"] for r in rounds_out),
        "informative_count": informative,
        "informative_mismatch_count": sum(r["informative_mismatch_count"] for r in rounds_out),
        "informative_fraction": informative / elements if elements else 0.0,
        "max_abs_diff": float(a_all.max()) if a_all.size else 0.0,
        "mean_abs_diff": float(a_all.sum()) / n if n else 0.0,
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
    diffs: tuple[np.ndarray, int], drift_rounds: list[dict[str, Any]], worst: WorstTokens, clip_eps: float
) -> dict[str, Any]:
    """The drift result: overall and per-round statistics, the worst tokens, the |diff| histogram."""
    nz, zeros = diffs
    return {
        "clip_eps": clip_eps,
        "overall": drift_of(nz, zeros, clip_eps),
        "rounds": drift_rounds,
        "worst_tokens": worst.result(),
        "abs_histogram": abs_histogram(nz, zeros),
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

    rounds_out, drift_rounds, diffs = _round_results(per_round, n_ranks, clip_eps)
    total = _totals(rounds_out, diffs, require_exact, missing_n, n_rounds)
    total["rewards"], rewards = _rewards_presence(per_round)
    findings.extend(rewards)
    if total["element_count"] == 0:
        findings.append(_f("NOTHING_COMPARED", "the train-data that was read selects no token: nothing was "
                           "compared, which is no evidence of equality", DIR))
    drift = _drift_result(diffs, drift_rounds, worst, clip_eps)
    findings.extend(_mismatch_findings(total, require_exact))
    return findings, total, drift
