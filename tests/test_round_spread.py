"""benchmarks/round_spread.py: the local engine's per-round throughput across runs of one workload."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
COMMITTED = REPO / "benchmarks" / "results" / "h200" / "local-engine"
RUNS = ("qwen3-0.6b-f6aead2", "qwen3-0.6b-30a4e8d", "qwen3-0.6b-df9eb7b", "qwen3-0.6b-ec98a15")


@pytest.fixture()
def spread(benchmark_script):
    return benchmark_script("round_spread")


def test_the_committed_rr_runs_did_the_same_work_and_their_slowest_rounds_differ(spread, tmp_path):
    """The four committed R/R runs: the same work every round, and the table computed from their metrics (the
    slowest rollout round after round 0 is another round in each run)."""
    assert spread.main([str(COMMITTED / r) for r in RUNS] + ["--out", str(tmp_path)]) == 0
    md = (tmp_path / "round_spread.md").read_text()
    slowest = next(line for line in md.splitlines() if line.startswith("| slowest after 0"))
    rounds = [cell.split("(round ")[1].rstrip(")") for cell in slowest.split("|")[2:-1]]
    assert len(set(rounds)) == len(RUNS), slowest
    rows = [json.loads(x) for x in (COMMITTED / RUNS[2] / "consistency" / "metrics.jsonl").read_text().splitlines()]
    med = sorted(r["rollout_tokens_per_s"] for r in rows[1:])[len(rows[1:]) // 2]
    assert "| 6 | " in md and f"{rows[6]['rollout_tokens_per_s'] / med:.2f}x" in md


def test_runs_of_different_work_are_refused(spread, tmp_path):
    """A run whose round 3 generated other tokens is not compared (exit 2, nothing written); the P/P runs, not
    bitwise reproducible, are refused too."""
    for r in RUNS[:2]:
        shutil.copytree(COMMITTED / r / "consistency", tmp_path / r / "consistency")
    path = tmp_path / RUNS[1] / "consistency" / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    rows[3]["rollout_tokens"] += 1
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    assert spread.main([str(tmp_path / r) for r in RUNS[:2]] + ["--out", str(out)]) == 2
    assert not out.exists()
    assert spread.main([str(COMMITTED / r) for r in RUNS] + ["--mode", "native", "--out", str(out)]) == 2
    with pytest.raises(SystemExit, match="no consistency/metrics.jsonl"):
        spread.main([str(tmp_path / "missing"), "--out", str(out)])
