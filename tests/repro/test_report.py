"""``rlk-repro report``: the summary agrees with the runs' own bitwise documents; plots are written for
several runs; a single run reports into its own report/ folder; bad inputs are one-line errors."""

from __future__ import annotations

import json
import shutil

import pytest

from rlk_repro import cli
from rlk_repro.report import load_run, summarize


def test_summary_and_plots_for_two_runs(rr_run, pp_run, tmp_path, capsys):
    out = tmp_path / "report"
    assert cli.main(["report", str(rr_run.run_dir), str(pp_run.run_dir), "--output", str(out)]) == cli.EXIT_OK
    doc = json.loads((out / "metrics-summary.json").read_text())
    assert doc["schema"] == "rlk.repro-report.v1"
    by_mode = {r["mode"]: r for r in doc["runs"]}
    for mode, run in (("consistency", rr_run), ("native", pp_run)):
        summary = by_mode[mode]
        assert summary["compared_tokens"] == run.bitwise["element_count"]
        assert summary["mismatch_count"] == run.bitwise["mismatch_count"]
        assert summary["max_abs_diff"] == pytest.approx(run.bitwise["max_abs_diff"])
    assert by_mode["consistency"]["mismatch_count"] == 0 and by_mode["native"]["mismatch_count"] > 0
    for name in ("consistency.png", "learning.png", "optimization.png", "performance.png"):
        png = (out / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000, name
    table = (out / "metrics-summary.md").read_text()
    assert table.count("\n| ") == 3  # header + two runs
    assert "wrote" in capsys.readouterr().out


def test_token_weighted_mean_and_truncation(pp_run):
    s = summarize(load_run(pp_run.run_dir))
    rows = pp_run.rounds
    weighted = sum(r["mean_abs_diff"] * r["compared_tokens"] for r in rows) / sum(r["compared_tokens"] for r in rows)
    assert s["mean_abs_diff"] == pytest.approx(weighted)
    assert 0.0 <= s["truncation"] <= 1.0 and s["rounds"] == len(rows)


def test_single_run_reports_into_its_report_folder(rr_run, tmp_path):
    run = tmp_path / "copy"
    shutil.copytree(rr_run.run_dir, run)
    assert cli.main(["report", str(run)]) == cli.EXIT_OK
    assert (run / "report" / "metrics-summary.md").is_file()
    assert (run / "report" / "summary.md").read_text() == (rr_run.run_dir / "report" / "summary.md").read_text()


@pytest.mark.parametrize("case", ["missing", "not_a_run", "two_runs_no_output", "bad_schema"])
def test_bad_inputs_are_one_line_errors(case, rr_run, tmp_path, capsys):
    if case == "missing":
        args = [str(tmp_path / "nope")]
    elif case == "not_a_run":
        args = [str(tmp_path)]
    elif case == "two_runs_no_output":
        args = [str(rr_run.run_dir), str(rr_run.run_dir)]
    else:
        run = tmp_path / "run"
        shutil.copytree(rr_run.run_dir, run)
        (run / "metrics.jsonl").write_text('{"schema": "other"}\n')
        args = [str(run)]
    assert cli.main(["report", *args]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.strip() and "Traceback" not in err and len(err.strip().splitlines()) == 1
