"""The seeds' phases and the paired-seed estimate (issue 37)."""

from __future__ import annotations

import pytest

from rlk_core.errors import RlkConfigError
from rlk_repro import cli
from rlk_repro.phases import merge_problem, paired_estimate, phase_settings


def test_phase_table():
    assert phase_settings("short", None) == (8, 1234)
    assert phase_settings("precision", 3456) == (30, 3456)
    assert phase_settings("convergence", None) == (200, 1234)
    with pytest.raises(RlkConfigError, match="runs seeds 1234, 2345, 3456"):
        phase_settings("precision", 7)
    with pytest.raises(RlkConfigError, match="not one of"):
        phase_settings("long", None)


def test_paired_estimate_mean_and_ci():
    est = paired_estimate([(1.0, 2.0), (1.0, 3.0), (1.0, 4.0)])  # differences 1, 2, 3: sd 1, t(2) 4.303
    assert est["n"] == 3 and est["mean"] == 2.0
    assert est["ci95"] == pytest.approx([2.0 - 4.303 / 3**0.5, 2.0 + 4.303 / 3**0.5])
    assert paired_estimate([(1.0, 1.5)]) == {"n": 1, "mean": 0.5, "ci95": None}


def _manifest(sha="a" * 40, ckpt="sha256:c", prompts="sha256:p", eager=False, dirty=False):
    return {"repos": [{"sha": sha, "dirty": dirty}], "inputs": {"checkpoint": ckpt, "prompts": prompts},
            "config": {"enforce_eager": eager}}


@pytest.mark.parametrize("other, what", [
    (_manifest(sha="b" * 40), "code revision"), (_manifest(ckpt="sha256:d"), "checkpoint"),
    (_manifest(prompts="sha256:q"), "prompt hash"), (_manifest(eager=True), "CUDA-graph settings"),
])
def test_runs_that_differ_are_not_merged(other, what):
    assert merge_problem([_manifest(), _manifest()]) is None
    assert what in merge_problem([_manifest(), other])


def test_dirty_checkout_is_not_merged():
    assert "dirty" in merge_problem([_manifest(dirty=True), _manifest(dirty=True)])


def test_run_phase_sets_rounds_and_seed(capsys):
    assert cli.main(["plan", "--phase", "short"]) == 0
    out = capsys.readouterr().out
    assert '"rounds": 8' in out and '"seed": 1234' in out
    assert cli.main(["plan", "--phase", "short", "--rounds", "3"]) == 2
    assert "--phase short runs 8 rounds" in capsys.readouterr().err


def test_phase_rounds_shortens_convergence_only_down_to_its_minimum(capsys):
    assert phase_settings("convergence", None, 120) == (120, 1234)
    assert phase_settings("convergence", None, 100) == (100, 1234)
    for phase, rounds, what in (("convergence", 99, "no fewer than 100"), ("convergence", 201, "no fewer than 100"),
                                ("short", 4, "not shortened")):
        with pytest.raises(RlkConfigError, match=what):
            phase_settings(phase, None, rounds)
    assert cli.main(["plan", "--phase", "convergence", "--phase-rounds", "100"]) == 0
    assert '"rounds": 100' in capsys.readouterr().out
    assert cli.main(["plan", "--phase-rounds", "100"]) == 2
    assert "--phase-rounds shortens a phase" in capsys.readouterr().err
    assert cli.main(["plan", "--phase", "convergence", "--phase-rounds", "100", "--rounds", "200"]) == 2
    assert "contradicts" in capsys.readouterr().err


def test_report_names_a_shortened_phase():
    from rlk_repro.report_pairs import markdown

    doc = {"phase": "convergence", "rounds": 100, "phase_steps": 200, "seeds": [1234], "estimates": {},
           "overhead": {}, "table": [], "unpaired": []}
    assert "## Phase convergence, shortened to 100 of its 200 rounds: 1 paired seed(s)" in markdown(doc)
    assert "## Phase convergence: 1 paired" in markdown({**doc, "rounds": 200})
