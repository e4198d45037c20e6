"""Drift statistics of ``d = train_logp - rollout_logp`` over active tokens.

- ``abs_mean`` / ``abs_max`` / ``abs_p50`` / ``abs_p90`` / ``abs_p99``: of ``|d|``;
- ``ratio0 = exp(d)``: the importance ratio ``pi_train / pi_rollout`` before the first update
  (``ratio0_min`` / ``ratio0_mean`` / ``ratio0_max``);
- ``clip_fraction``: the fraction of tokens with ``|ratio0 - 1| > clip_eps``;
- ``approx_kl0 = mean(exp(d) - 1 - d)``: the k3 estimate of KL(rollout || train);
- ``active_tokens``: tokens with a finite value on both sides (non-finite ones are reported as errors
  by the bitwise check and left out here).

Everything is computed in float64 from the float32 values.
"""

from __future__ import annotations

import heapq
import math
from typing import Any

import numpy as np

DEFAULT_CLIP_EPS = 0.2


def drift_stats(d: np.ndarray, clip_eps: float = DEFAULT_CLIP_EPS) -> dict[str, Any]:
    """Statistics of a 1-D float64 array of finite differences ``train - rollout``."""
    return drift_of(d[d != 0], int(np.count_nonzero(d == 0)), clip_eps)


def _percentiles(nonzero_abs: np.ndarray, zeros: int, qs: tuple[float, ...]) -> list[float]:
    """``np.percentile`` (linear) of the array of ``zeros`` zeros and ``nonzero_abs`` (all > 0), without making it."""
    n = zeros + nonzero_abs.size
    idx = sorted({math.floor(q / 100 * (n - 1)) for q in qs} | {math.ceil(q / 100 * (n - 1)) for q in qs})
    want = [i - zeros for i in idx if i >= zeros]
    part = np.partition(nonzero_abs, want) if want else nonzero_abs
    value = {i: 0.0 if i < zeros else float(part[i - zeros]) for i in idx}
    out = []
    for q in qs:
        pos = q / 100 * (n - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        out.append(value[lo] + (value[hi] - value[lo]) * (pos - lo))
    return out


def drift_of(nonzero: np.ndarray, zeros: int, clip_eps: float = DEFAULT_CLIP_EPS) -> dict[str, Any]:
    """:func:`drift_stats` of ``zeros`` exact zeros and the differences ``nonzero`` (float64, none 0): what the
    streaming check keeps (8 bytes per differing token, nothing per equal one)."""
    n = zeros + int(nonzero.size)
    if n == 0:
        return {"active_tokens": 0}
    a = np.abs(nonzero)
    with np.errstate(over="ignore"):
        r = np.exp(nonzero)
    p50, p90, p99 = _percentiles(a, zeros, (50, 90, 99))
    with np.errstate(over="ignore", invalid="ignore"):
        kl = float(np.sum(r - 1.0 - nonzero)) / n
    lo, hi = (float(r.min()), float(r.max())) if r.size else (1.0, 1.0)
    if zeros:
        lo, hi = min(lo, 1.0), max(hi, 1.0)
    return {
        "active_tokens": n,
        "abs_mean": float(a.sum()) / n,
        "abs_max": float(a.max()) if a.size else 0.0,
        "abs_p50": p50,
        "abs_p90": p90,
        "abs_p99": p99,
        "ratio0_min": lo,
        "ratio0_mean": (float(r.sum()) + zeros) / n,
        "ratio0_max": hi,
        "clip_eps": clip_eps,
        "clip_fraction": float(np.count_nonzero(np.abs(r - 1.0) > clip_eps)) / n,
        "approx_kl0": kl,
    }


HIST_LO, HIST_HI, HIST_PER_DECADE = -12, 2, 4


def abs_histogram(d: np.ndarray, zeros: int = 0) -> dict[str, Any]:
    """Histogram of ``|d|`` (plus ``zeros`` exact zeros not in ``d``): exact zeros apart, the rest in log10 bins of
    fixed edges (for plots)."""
    a = np.abs(d)
    nz = a[a > 0]
    edges = np.linspace(HIST_LO, HIST_HI, (HIST_HI - HIST_LO) * HIST_PER_DECADE + 1)
    counts, _ = (
        np.histogram(np.clip(np.log10(nz), HIST_LO, HIST_HI), bins=edges)
        if nz.size
        else (np.zeros(edges.size - 1, dtype=np.int64), None)
    )
    return {
        "zero": int(a.size - nz.size) + zeros,
        "log10_edges": [float(e) for e in edges],
        "counts": [int(c) for c in counts],
    }


class WorstTokens:
    """Keeps the ``k`` tokens of largest ``|d|`` seen so far (ties: earliest first)."""

    def __init__(self, k: int):
        self.k = max(0, k)
        self._heap: list[tuple[float, int, dict[str, Any]]] = []
        self._seq = 0

    def add(
        self,
        round_: int,
        rank: int,
        token_ids: np.ndarray,
        train: np.ndarray,
        rollout: np.ndarray,
        ok: np.ndarray,
    ) -> None:
        """``ok``: bool [S, T] of active positions with finite values on both sides."""
        s_idx, t_idx = np.nonzero(ok)
        self._add(round_, rank, s_idx, t_idx, token_ids[s_idx, t_idx], train[s_idx, t_idx], rollout[s_idx, t_idx])

    def add_flat(self, round_: int, rank: int, width: int, start: int, token_ids: np.ndarray, train: np.ndarray,
                 rollout: np.ndarray, ok: np.ndarray) -> None:
        """One chunk of a file's ``[S, width]`` grid flattened from position ``start`` (1-D arrays, ``ok`` bool)."""
        (i,) = np.nonzero(ok)
        self._add(round_, rank, (start + i) // width, (start + i) % width, token_ids[i], train[i], rollout[i])

    def _add(self, round_: int, rank: int, s_idx: np.ndarray, t_idx: np.ndarray, ids: np.ndarray,
             train: np.ndarray, rollout: np.ndarray) -> None:
        if self.k == 0 or s_idx.size == 0:
            return
        tr = train.astype(np.float64)
        ro = rollout.astype(np.float64)
        a = np.abs(tr - ro)
        top = np.argsort(-a, kind="stable")[: self.k]
        for i in top:
            if a[i] == 0.0:
                break
            item = {
                "round": round_,
                "rank": rank,
                "sample": int(s_idx[i]),
                "position": int(t_idx[i]),
                "token_id": int(ids[i]),
                "train_logprob": float(tr[i]),
                "rollout_logprob": float(ro[i]),
                "diff": float(tr[i] - ro[i]),
                "abs_diff": float(a[i]),
            }
            self._seq -= 1
            entry = (float(a[i]), self._seq, item)
            if len(self._heap) < self.k:
                heapq.heappush(self._heap, entry)
            elif entry[:2] > self._heap[0][:2]:
                heapq.heapreplace(self._heap, entry)

    def merge(self, other: WorstTokens) -> None:
        """Add what ``other`` kept (a file's worst tokens, kept apart until the whole file was read)."""
        for a, _seq, item in sorted(other._heap, key=lambda e: (-e[0], -e[1])):
            self._seq -= 1
            entry = (a, self._seq, item)
            if len(self._heap) < self.k:
                heapq.heappush(self._heap, entry)
            elif entry[:2] > self._heap[0][:2]:
                heapq.heapreplace(self._heap, entry)

    def result(self) -> list[dict[str, Any]]:
        return [e[2] for e in sorted(self._heap, key=lambda e: (-e[0], -e[1]))]
