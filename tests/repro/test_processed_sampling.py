"""Filtered sampling in the local engine (contract ``rlk.logp.processed.v1``): with top-k, top-p and min-p the
rollout's processed log-probs equal the trainer's bit for bit under R/R (the trainer finds its own kept sets,
whose sizes match the rollout's), P/P differs (negative control), and a run whose trainer recomputes the
unfiltered log-prob is a semantic mismatch rlk-validate reports."""

from __future__ import annotations

import json

import pytest

from rlk_core.plan import RoutePlan
from rlk_repro.engine.local import run_local
from rlk_validate.validate import Options, validate_run

FILTERS = dict(top_k=12, top_p=0.9, min_p=0.02, temperature=0.8)


def _rows(res):
    return [json.loads(line) for line in (res.run_dir / "metrics.jsonl").read_text().splitlines()]


def _codes(report):
    return {f.code: f.severity for f in report.findings}


@pytest.fixture(scope="module")
def rr_filtered(tmp_path_factory, small_config):
    return run_local(small_config(RoutePlan("R/R", "R/R", "R/R"), rounds=2, **FILTERS),
                     tmp_path_factory.mktemp("rr_filtered"))


def test_rr_processed_logprobs_are_bitwise_with_filters(rr_filtered):
    res = rr_filtered
    assert res.exit_code == 0 and [r["mismatch_count"] for r in res.rounds] == [0, 0]
    rows = _rows(res)
    for row in rows:
        kept = row["kept_set"]
        assert kept["tokens"] > 0
        assert 1 <= kept["mean"] <= 12 and kept["p99"] <= 12  # top-k 12 bounds every kept set
        assert row["kept_set_mismatches"] == 0  # the trainer's own kept sets have the rollout's sizes
    manifest = json.loads((res.run_dir / "manifest.json").read_text())
    assert manifest["sampling"] == {"temperature": 0.8, "top_k": 12, "top_p": 0.9, "min_p": 0.02, "filtered": True,
                                    "rollout": {"logprobs": "processed"}, "train": {"logprobs": "processed"}}
    report = validate_run(res.run_dir, Options(require_bitwise=True))
    assert report.verdict == "passed", [f.message for f in report.findings if f.severity == "error"]
    assert "KEPT_SET_SIZES" in _codes(report) and "SAMPLING_SEMANTICS_DIFFER" not in _codes(report)
    # the processed ops ran on both sides (their own names in the readbacks)
    for side in ("train", "rollout"):
        doc = json.loads(next((res.run_dir / "readbacks").glob(f"*{side}*.json")).read_text())
        ops = json.dumps(doc["modules"]["logp"])
        assert "kept_set" in ops and "processed_" in ops, side


def test_pp_with_filters_differs(tmp_path, small_config):
    res = run_local(small_config(RoutePlan("P/P", "P/P", "P/P"), rounds=1, **FILTERS), tmp_path)
    assert res.rounds[0]["mismatch_count"] > 0


def test_unfiltered_trainer_is_a_semantic_mismatch(tmp_path, small_config):
    res = run_local(small_config(RoutePlan("R/R", "R/R", "R/R"), rounds=1, train_logprobs="unfiltered",
                                 **FILTERS), tmp_path)
    assert res.rounds[0]["mismatch_count"] > 0  # log-probs over the kept set vs over the whole vocabulary
    report = validate_run(res.run_dir, Options(require_bitwise=True))
    assert _codes(report).get("SAMPLING_SEMANTICS_DIFFER") == "error" and report.verdict == "failed"
