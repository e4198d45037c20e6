"""benchmarks/round_spread.py: the local engine's per-round throughput across runs of one workload."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

ROUNDS = 8
# per run: the round that is slowest after round 0, and by how much
SLOW = {"run-a": (3, 0.80), "run-b": (2, 0.85), "run-c": (6, 0.75), "run-d": (7, 0.90)}


def _rows(slow_round: int, factor: float, mode: str) -> list[dict]:
    rows = []
    for r in range(ROUNDS):
        rate = 5000.0 * (factor if r == slow_round else 1.0 + 0.01 * r) * (0.7 if r == 0 else 1.0)
        work = {"rollout_tokens": 11_000 + 17 * r, "rollout_steps": 180 + r, "prefill_steps": 40,
                "train_tokens": 11_500, "reward_mean": 0.25 + r / 1000}
        if mode == "native":  # P/P runs are not bitwise reproducible: their sampled tokens differ between runs
            work["rollout_tokens"] += slow_round
        rows.append({"round": r, **work, "rollout_tokens_per_s": rate, "train_tokens_per_s": 9 * rate})
    return rows


def _write(root: Path, mode: str = "consistency") -> list[Path]:
    runs = []
    for name, (slow_round, factor) in SLOW.items():
        path = root / name / mode / "metrics.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(row) + "\n" for row in _rows(slow_round, factor, mode)))
        runs.append(root / name)
    return runs


@pytest.fixture()
def spread(benchmark_script):
    return benchmark_script("round_spread")


def test_runs_of_the_same_work_side_by_side(spread, tmp_path):
    """The table names each run's slowest round after round 0 and each round's share of the run's median."""
    runs = _write(tmp_path / "runs")
    assert spread.main([str(r) for r in runs] + ["--out", str(tmp_path / "out")]) == 0
    md = (tmp_path / "out" / "round_spread.md").read_text()
    slowest = next(line for line in md.splitlines() if line.startswith("| slowest after 0"))
    want = []
    for slow_round, factor in SLOW.values():
        rates = [row["rollout_tokens_per_s"] for row in _rows(slow_round, factor, "consistency")]
        want.append(f"{rates[slow_round] / statistics.median(rates[1:]):.2f}x (round {slow_round})")
    assert [cell.strip() for cell in slowest.split("|")[2:-1]] == want
    assert "| 3 | 4000 (0.77x) |" in md  # run-a's round 3 against the median of its rounds 1-7 (5,200 tok/s)


def test_runs_of_different_work_are_refused(spread, tmp_path):
    """A run whose round 3 generated other tokens is not compared (exit 2, nothing written); P/P runs, whose
    work differs run to run, are refused too."""
    runs = _write(tmp_path / "runs")
    path = runs[1] / "consistency" / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    rows[3]["rollout_tokens"] += 1
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    assert spread.main([str(r) for r in runs[:2]] + ["--out", str(out)]) == 2
    assert not out.exists()
    native = _write(tmp_path / "native", mode="native")
    assert spread.main([str(r) for r in native] + ["--mode", "native", "--out", str(out)]) == 2
    with pytest.raises(SystemExit, match="no consistency/metrics.jsonl"):
        spread.main([str(tmp_path / "missing"), "--out", str(out)])
