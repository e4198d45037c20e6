"""``benchmarks/results/`` holds results, not run output: per benchmark its latest JSON and a README per folder,
plus ``SUMMARY.md``, and under a fifth of the repository's tracked bytes (logs, tarballs, plots, run directories
and per-commit copies live in git history)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RESULTS = "benchmarks/results/"


def _tracked() -> list[str]:
    proc = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"not a git checkout: {proc.stderr.strip()[:200]}")
    return [p for p in proc.stdout.split("\0") if p and (REPO / p).is_file()]


def kinds_allowed(paths: list[str]) -> list[str]:
    """The files under benchmarks/results that are neither a JSON result nor a README / the SUMMARY."""
    return [p for p in paths if p.startswith(RESULTS)
            and not (p.endswith(".json") or p.endswith("/README.md") or p == RESULTS + "SUMMARY.md")]


def share(paths: list[str]) -> float:
    size = {p: (REPO / p).stat().st_size for p in paths}
    return sum(v for p, v in size.items() if p.startswith(RESULTS)) / sum(size.values())


def test_results_are_json_and_readmes():
    assert kinds_allowed(_tracked()) == []


def test_results_are_under_a_fifth_of_the_tracked_bytes():
    tracked = _tracked()
    assert share(tracked) < 0.20, f"benchmarks/results is {share(tracked):.1%} of the tracked bytes"


def test_the_checks_see_what_they_must_refuse():
    assert kinds_allowed([RESULTS + "h200/runs.tar.gz", RESULTS + "h200/linear.md", RESULTS + "h200/x.json",
                          RESULTS + "h200/README.md", RESULTS + "SUMMARY.md", "README.md"]) == [
        RESULTS + "h200/runs.tar.gz", RESULTS + "h200/linear.md"]
