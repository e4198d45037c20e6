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
from typing import Any

import numpy as np

DEFAULT_CLIP_EPS = 0.2


def drift_stats(d: np.ndarray, clip_eps: float = DEFAULT_CLIP_EPS) -> dict[str, Any]:
    """Statistics of a 1-D float64 array of finite differences ``train - rollout``."""
    n = int(d.size)
    if n == 0:
        return {"active_tokens": 0}
    a = np.abs(d)
    with np.errstate(over="ignore"):
        r = np.exp(d)
    p50, p90, p99 = (float(x) for x in np.percentile(a, [50, 90, 99]))
    with np.errstate(over="ignore", invalid="ignore"):
        kl = float(np.mean(r - 1.0 - d))
    return {
        "active_tokens": n,
        "abs_mean": float(a.mean()),
        "abs_max": float(a.max()),
        "abs_p50": p50,
        "abs_p90": p90,
        "abs_p99": p99,
        "ratio0_min": float(r.min()),
        "ratio0_mean": float(r.mean()),
        "ratio0_max": float(r.max()),
        "clip_eps": clip_eps,
        "clip_fraction": float(np.count_nonzero(np.abs(r - 1.0) > clip_eps)) / n,
        "approx_kl0": kl,
    }


HIST_LO, HIST_HI, HIST_PER_DECADE = -12, 2, 4


def abs_histogram(d: np.ndarray) -> dict[str, Any]:
    """Histogram of ``|d|``: exact zeros apart, the rest in log10 bins of fixed edges (for plots)."""
    a = np.abs(d)
    nz = a[a > 0]
    edges = np.linspace(HIST_LO, HIST_HI, (HIST_HI - HIST_LO) * HIST_PER_DECADE + 1)
    counts, _ = (
        np.histogram(np.clip(np.log10(nz), HIST_LO, HIST_HI), bins=edges)
        if nz.size
        else (np.zeros(edges.size - 1, dtype=np.int64), None)
    )
    return {
        "zero": int(a.size - nz.size),
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
        if self.k == 0:
            return
        s_idx, t_idx = np.nonzero(ok)
        if s_idx.size == 0:
            return
        tr = train[s_idx, t_idx].astype(np.float64)
        ro = rollout[s_idx, t_idx].astype(np.float64)
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
                "token_id": int(token_ids[s_idx[i], t_idx[i]]),
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

    def result(self) -> list[dict[str, Any]]:
        return [e[2] for e in sorted(self._heap, key=lambda e: (-e[0], -e[1]))]
