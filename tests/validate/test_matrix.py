"""rlk-validate matrix: per-cell checks, R/R strictly zero, mixed cells as diagnostics, one report."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from validate_builders import (
    MATRIX_CELLS,
    build_matrix,
    build_run,
    load_round,
    mutate_json,
    run_subprocess,
    train_data_path,
    tree_state,
    write_round,
)

from rlk_validate.matrix import REQUIRED_CELLS, expected_plan

REPORTS = {"matrix-report.json", "matrix-report.md"}


@pytest.fixture
def matrix(tmp_path: Path) -> Path:
    return build_matrix(tmp_path / "matrix", (*MATRIX_CELLS, "native-PP"))


def _only_reports_written(before: dict, after: dict) -> None:
    assert set(after) - set(before) <= REPORTS
    assert {k: v for k, v in after.items() if k != "."} == {
        **{k: v for k, v in before.items() if k != "."},
        **{k: after[k] for k in REPORTS if k in after},
    }


def test_full_matrix_passes(matrix: Path, cli) -> None:
    (matrix / "report").mkdir()  # what `rlk-repro report ROOT` writes: the matrix's own, not an unknown entry
    before = tree_state(matrix)
    res = cli("matrix", matrix, "--write")
    _only_reports_written(before, tree_state(matrix))
    assert res.code == 0, res.out
    assert not res.findings("MATRIX_UNKNOWN_ENTRY")
    doc = json.loads((matrix / "matrix-report.json").read_text())
    assert doc["schema"] == "rlk.matrix-report.v1" and doc["passed"] is True
    cells = {c["name"]: c for c in doc["cells"]}
    assert set(cells) == {*MATRIX_CELLS, "native-PP"}
    assert cells["control-RR"]["mismatch_count"] == 0 and cells["control-RR"]["require_exact"] is True
    for name in ("attention-PR", "ffn-RP", "logp-PP", "native-PP"):
        assert cells[name]["verdict"] == "passed" and cells[name]["mismatch_count"] > 0
    diags = [f for f in doc["findings"] if f["code"] == "MISMATCH_DIAGNOSTIC"]
    assert len(diags) == 10 and all(f["severity"] == "info" for f in diags)
    md = (matrix / "matrix-report.md").read_text()
    assert "| control-RR | R/R | R/R | R/R | passed |" in md
    assert md.count("\n| ") == 2 + 11


def test_control_with_mismatch_fails(matrix: Path, cli) -> None:
    p = train_data_path(matrix / "control-RR", 1)
    t = load_round(p)
    s, q = np.nonzero(t["response_mask"])
    t["train_logprobs"][s[0], q[0]] = np.nextafter(t["train_logprobs"][s[0], q[0]], np.float32(0), dtype=np.float32)
    write_round(p, t, 1, 0)
    res = cli("matrix", matrix, "--write")
    assert res.code == 1
    [f] = res.findings("MATRIX_CELL_FAILED")
    assert f["path"] == "control-RR" and "BITWISE_MISMATCH" in f["details"]["codes"]
    assert json.loads((matrix / "matrix-report.json").read_text())["passed"] is False


def test_control_is_strict_even_if_its_manifest_is_not(matrix: Path, cli) -> None:
    shutil.rmtree(matrix / "control-RR")
    build_run(matrix / "control-RR", {"attention": "P/R", "ffn": "R/R", "logp": "R/R"})
    res = cli("matrix", matrix)
    assert res.code == 1
    assert res.findings("MATRIX_CELL_PLAN_MISMATCH")
    assert "BITWISE_MISMATCH" in res.findings("MATRIX_CELL_FAILED")[0]["details"]["codes"]


def test_mixed_cell_with_fallback_fails(matrix: Path, cli) -> None:
    mutate_json(
        matrix / "attention-PR" / "readbacks" / "local-rollout-1000.json",
        lambda d: d["modules"]["attention"].update(fallback=True),
    )
    res = cli("matrix", matrix)
    assert res.code == 1
    [f] = res.findings("MATRIX_CELL_FAILED")
    assert f["path"] == "attention-PR" and f["details"]["codes"] == ["FALLBACK"]


def test_cell_plan_mismatch(matrix: Path, cli) -> None:
    mutate_json(matrix / "ffn-PR" / "manifest.json", lambda d: d["plan"].update(ffn="R/P"))
    res = cli("matrix", matrix)
    assert res.code == 1 and res.findings("MATRIX_CELL_PLAN_MISMATCH")[0]["path"] == "ffn-PR"


def test_missing_and_incomplete_cells(tmp_path: Path, cli) -> None:
    root = build_matrix(tmp_path / "m", ("control-RR", "attention-PR"))
    (root / "attention-PR" / "exit-code").unlink()
    (root / "notes").mkdir()
    res = cli("matrix", root)
    assert res.code == 2
    missing = {f["path"] for f in res.findings("MATRIX_CELL_MISSING")}
    assert missing == set(REQUIRED_CELLS) - {"control-RR", "attention-PR"}
    assert res.findings("MATRIX_CELL_INCOMPLETE")[0]["path"] == "attention-PR"
    assert res.findings("MATRIX_UNKNOWN_ENTRY")[0]["severity"] == "warning"
    (root / "attention-PR" / "exit-code").write_text("0\n")
    assert cli("matrix", root, "--allow-partial").code == 0


def test_matrix_unusable_and_escaping_cell(tmp_path: Path, cli) -> None:
    res = cli("matrix", tmp_path / "absent")
    assert res.code == 3 and "does not exist" in res.out
    root = build_matrix(tmp_path / "m", ("control-RR",))
    build_run(tmp_path / "outside", {"attention": "P/R", "ffn": "R/R", "logp": "R/R"})
    (root / "attention-PR").symlink_to(tmp_path / "outside", target_is_directory=True)
    res = cli("matrix", root, "--allow-partial")
    assert res.code == 1 and res.findings("PATH_ESCAPES")


def test_matrix_no_write_and_subprocess(matrix: Path) -> None:
    before = tree_state(matrix)
    proc = run_subprocess("matrix", str(matrix), "--no-write", "--quiet")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert tree_state(matrix) == before
    assert proc.stdout.strip() == "verdict: PASSED (exit 0)"


def test_expected_plan_names() -> None:
    assert expected_plan("logp-RP") == ("isolation", {"attention": "R/R", "ffn": "R/R", "logp": "R/P"})
    assert expected_plan("control-RR")[0] == "control" and expected_plan("native-PP")[0] == "native"
    assert expected_plan("logp-XY") is None and expected_plan("report") is None
    assert len(REQUIRED_CELLS) == 10
