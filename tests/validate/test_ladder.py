"""rlk-validate ladder: a ladder root written by ``rlk-repro ladder`` (a tiny local-engine ladder on the CPU) passes;
a tampered, incomplete, missing, mislabelled or unjustifiably skipped rung, a rung of another configuration and a
stale report each fail; the drift classes follow the documented rules."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from validate_builders import load_round, mutate_json, train_data_path, tree_state, write_round

from rlk_validate.ladder_metrics import JUMP_FACTOR, NUMERICAL_ABS_MAX, classify

SMALL = ["--rounds", "1", "--prompts-per-round", "1", "--samples-per-prompt", "2", "--max-new-tokens", "4",
         "--chunk-size", "8"]
RUNGS = "0-aligned,1-fp8,2-top-p,rr-2-top-p"


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    pytest.importorskip("torch", reason="the ladder fixture runs the local engine")
    from rlk_repro import cli as repro_cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = repro_cli.main(["ladder", "--output", str(tmp_path_factory.mktemp("ladder")), "--rungs", RUNGS, *SMALL])
    assert code == 0, out.getvalue()
    return Path(out.getvalue().strip().splitlines()[-1].split(": ", 1)[1])


@pytest.fixture
def ladder(built: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(built, tmp_path / "ladder"))


def test_a_ladder_root_passes_and_writes_nothing_unless_asked(ladder: Path, cli) -> None:
    before = tree_state(ladder)
    res = cli("ladder", ladder)
    assert res.code == 0, res.out
    assert tree_state(ladder) == before
    assert res.doc["schema"] == "rlk.ladder-report.v1" and res.doc["passed"] is True
    rungs = {g["name"]: g for g in res.doc["rungs"]}
    assert rungs["1-fp8"]["status"] == "skipped" and res.findings("LADDER_RUNG_SKIPPED")
    assert rungs["rr-2-top-p"]["metrics"]["mismatch_count"] == 0
    assert rungs["2-top-p"]["metrics"]["mismatch_count"] > 0  # the local engine's P/P drifts on the CPU
    assert "rr-2-top-p" in res.out and "verdict: PASSED" in res.out


def test_tampered_rr_rung_fails(ladder: Path, cli) -> None:
    path = train_data_path(ladder / "rr-2-top-p", 0)
    t = load_round(path)
    i = np.flatnonzero(t["response_mask"].reshape(-1))[0]
    flat = t["train_logprobs"].reshape(-1)
    flat[i] = np.nextafter(flat[i], np.float32(-np.inf))
    write_round(path, t, 0, 0)
    res = cli("ladder", ladder)
    assert res.code == 1
    assert [f["path"] for f in res.findings("LADDER_RUNG_FAILED")] == ["rr-2-top-p"]
    assert "REPORT" in " ".join(res.codes)  # the written report no longer holds what the data give


def test_an_incomplete_rung_is_incomplete(ladder: Path, cli) -> None:
    (ladder / "2-top-p" / "exit-code").unlink()
    (ladder / "ladder-report.json").unlink()
    res = cli("ladder", ladder)
    assert res.code == 2 and [f["path"] for f in res.findings("LADDER_RUNG_INCOMPLETE")] == ["2-top-p"]


def test_a_missing_rung_is_incomplete(ladder: Path, cli) -> None:
    shutil.rmtree(ladder / "0-aligned")
    res = cli("ladder", ladder)
    assert res.code in (1, 2) and res.findings("LADDER_RUNG_MISSING")


def test_a_rung_that_could_run_is_never_skipped(ladder: Path, cli) -> None:
    shutil.rmtree(ladder / "rr-2-top-p")
    (ladder / "rr-2-top-p.skipped.json").write_text(json.dumps({
        "schema": "rlk.ladder-skip.v1", "rung": "rr-2-top-p", "reason": "no time", "needs": []}))
    res = cli("ladder", ladder)
    assert res.code == 1 and res.findings("LADDER_SKIP_INVALID")


@pytest.mark.parametrize("change", ["empty reason", "beside its run"])
def test_malformed_skip_records_fail(ladder: Path, cli, change: str) -> None:
    if change == "empty reason":
        mutate_json(ladder / "1-fp8.skipped.json", lambda d: d.update(reason=" "))
    else:
        shutil.copytree(ladder / "0-aligned", ladder / "1-fp8")
    res = cli("ladder", ladder)
    assert res.code == 1 and res.findings("LADDER_SKIP_INVALID")


def test_a_rung_whose_manifest_shows_other_knobs_fails(ladder: Path, cli) -> None:
    mutate_json(ladder / "2-top-p" / "manifest.json", lambda d: d["sampling"].update(top_p=1.0))
    res = cli("ladder", ladder)
    assert res.code == 1
    assert [f["path"] for f in res.findings("LADDER_RUNG_KNOBS_MISMATCH")] == ["2-top-p/manifest.json"]
    rungs = {g["name"]: g for g in res.doc["rungs"]}
    assert rungs["2-top-p"]["classification"]["class"] == "framework"


def test_a_rung_of_another_configuration_fails(ladder: Path, cli) -> None:
    mutate_json(ladder / "2-top-p" / "manifest.json", lambda d: d["seeds"].update(train=99))
    res = cli("ladder", ladder)
    assert res.code == 1 and res.findings("LADDER_PROVENANCE_MISMATCH")


def test_a_stale_report_fails_and_write_renews_it(ladder: Path, cli) -> None:
    def edit(doc):
        doc["rungs"][0]["metrics"]["dlogp"]["abs_mean"] = 0.0
    mutate_json(ladder / "ladder-report.json", edit)
    res = cli("ladder", ladder)
    assert res.code == 1 and res.findings("LADDER_REPORT_STALE")
    assert cli("ladder", ladder, "--write").code == 0
    assert cli("ladder", ladder).code == 0


def test_a_directory_that_is_not_a_ladder_root_is_unusable(tmp_path: Path, cli) -> None:
    root = tmp_path / "not-a-ladder"
    root.mkdir()
    assert cli("ladder", root).code == 3
    (root / "ladder-options.json").write_text('{"schema": "rlk.ladder-options.v1", "rungs": []}')
    res = cli("ladder", root)
    assert res.code == 3 and res.findings("LADDER_OPTIONS_INVALID")


def _rung(name="r", case="P/P", **knobs):
    k = {"top_p": 1.0, "top_k": 0, "min_p": 0.0, "temperature": 1.0, "quantization": "none", **knobs}
    return {"name": name, "knobs": k, "plan": {m: case for m in ("attention", "ffn", "logp")}}


def _metrics(mismatches=5, abs_mean=1e-6, abs_max=1e-5, clip=0.0, nonfinite=0, fallbacks=()):
    backends = {"rollout": {"logp": {"fallbacks": [{"op": "logp", "reason": r} for r in fallbacks]}}}
    return {"tokens": 100, "mismatch_count": mismatches, "nonfinite_diff_count": nonfinite, "clip_fraction": clip,
            "dlogp": {"abs_mean": abs_mean, "abs_max": abs_max}, "backends": backends}


@pytest.mark.parametrize(("rung", "m", "ref", "codes", "expected"), [
    (_rung(), _metrics(), None, [], "expected numerical"),
    (_rung(case="R/R"), _metrics(mismatches=0, abs_mean=0.0, abs_max=0.0), None, [], "none"),
    (_rung(case="R/R"), _metrics(mismatches=1), None, [], "candidate operator"),
    (_rung(), _metrics(abs_max=NUMERICAL_ABS_MAX * 2), None, [], "candidate operator"),
    (_rung(quantization="fp8"), _metrics(abs_max=NUMERICAL_ABS_MAX * 2), None, [], "expected numerical"),
    (_rung(top_p=0.9), _metrics(abs_mean=1e-6 * JUMP_FACTOR * 2), (_rung("ref"), _metrics()), [], "semantic"),
    (_rung(top_p=0.9), _metrics(abs_mean=1e-6 * JUMP_FACTOR / 2), (_rung("ref"), _metrics()), [],
     "expected numerical"),
    (_rung(), _metrics(nonfinite=2), None, [], "semantic"),
    (_rung(), _metrics(), None, ["SAMPLING_SEMANTICS_DIFFER"], "semantic"),
    (_rung(case="R/R"), _metrics(mismatches=1), None, ["GREEDY_NOT_COMPARABLE"], "semantic"),  # argmax rollout
    (_rung(case="R/R"), _metrics(fallbacks=("no kernel",)), None, [], "framework"),
    (_rung(case="R/R"), _metrics(mismatches=1), None, ["CASE_MISMATCH"], "framework"),
])
def test_classification_rules(rung, m, ref, codes, expected) -> None:
    ref_rung, ref_m = ref if ref else (None, None)
    assert classify(rung, m, ref_m, ref_rung, codes)["class"] == expected
