"""The sampling semantics of a run (manifest ``sampling``) and its kept-set statistics (metrics ``kept_set``,
``kept_set_mismatches``): a comparison of different semantics under filters is a finding (an error where exact
equality is required, a warning otherwise); kept-set sizes that differ between the sides likewise; the size
distribution is reported; malformed statistics are not summarised and crash nothing."""

from __future__ import annotations

import json
from pathlib import Path

from validate_builders import PP, build_run, mutate_json

from rlk_validate import Options, validate_run


def _sampling(rollout: str, train: str, filtered: bool = True) -> dict:
    return {"temperature": 0.7, "top_k": 40, "top_p": 0.95, "min_p": 0.0, "filtered": filtered,
            "rollout": {"logprobs": rollout}, "train": {"logprobs": train}}


def _set_manifest(run: Path, sampling: dict) -> None:
    mutate_json(run / "manifest.json", lambda m: m.update(sampling=sampling))


def _set_metrics(run: Path, **fields) -> None:
    path = run / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps({**r, **fields}) + "\n" for r in rows))


def _codes(run: Path, **kw) -> dict[str, str]:
    return {f.code: f.severity for f in validate_run(run, Options(**kw)).findings}


def test_same_semantics_pass_and_report_kept_sets(tmp_path: Path) -> None:
    run = build_run(tmp_path / "run")
    _set_manifest(run, _sampling("processed", "processed"))
    _set_metrics(run, kept_set={"tokens": 48, "mean": 6.5, "median": 5.0, "p99": 31, "singletons": 0.125},
                 kept_set_mismatches=0)
    report = validate_run(run, Options(require_bitwise=True))
    assert report.verdict == "passed"
    info = [f for f in report.findings if f.code == "KEPT_SET_SIZES"]
    assert len(info) == 1 and info[0].details["tokens"] == 48 * 3 and info[0].details["singletons"] == 0.125


def test_different_semantics_under_filters_are_an_error_where_exact(tmp_path: Path) -> None:
    run = build_run(tmp_path / "rr")
    _set_manifest(run, _sampling("processed", "unfiltered"))
    assert _codes(run).get("SAMPLING_SEMANTICS_DIFFER") == "error"
    pp = build_run(tmp_path / "pp", PP)
    _set_manifest(pp, _sampling("processed", "unfiltered"))
    assert _codes(pp).get("SAMPLING_SEMANTICS_DIFFER") == "warning"  # P/P: it quantifies the semantic drift
    same = build_run(tmp_path / "nofilter")
    _set_manifest(same, _sampling("processed", "unfiltered", filtered=False))  # without filters: one distribution
    assert "SAMPLING_SEMANTICS_DIFFER" not in _codes(same)


def test_kept_set_mismatches_and_malformed_statistics(tmp_path: Path) -> None:
    run = build_run(tmp_path / "run")
    _set_metrics(run, kept_set_mismatches=3)
    assert _codes(run).get("KEPT_SET_MISMATCH") == "error"
    bad = build_run(tmp_path / "bad")
    _set_metrics(bad, kept_set={"tokens": "many", "mean": None})
    codes = _codes(bad)
    assert "KEPT_SET_SIZES" not in codes and "INTERNAL_ERROR" not in codes
