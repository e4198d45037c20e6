"""Valid run directories, written as producers write them, pass; drift statistics are right."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from validate_builders import (
    PP,
    build_run,
    load_round,
    run_subprocess,
    train_data_path,
    tree_state,
    write_round,
)

from rlk_validate import Options, validate_run
from rlk_validate.drift import WorstTokens, drift_stats

PR_FFN = {"attention": "R/R", "ffn": "P/R", "logp": "R/R"}


@pytest.mark.parametrize(
    ("engine", "ranks"),
    [("local", 1), ("vime", 1), ("vime", 2), ("local", 3)],
    ids=["local", "vime", "vime-tp2", "local-3r"],
)
def test_rr_run_passes(tmp_path: Path, cli, engine: str, ranks: int) -> None:
    run = build_run(tmp_path / "run", engine=engine, ranks=ranks, rounds=4)
    before = tree_state(run)
    res = cli(run)
    assert tree_state(run) == before
    assert res.code == 0, res.out
    doc = res.doc
    assert doc["verdict"] == "passed" and doc["require_exact"] is True
    assert doc["counts"] == {"error": 0, "incomplete": 0, "warning": 0, "info": 0}
    b = doc["bitwise"]
    assert b["mismatch_count"] == 0 and b["max_abs_diff"] == 0.0 and b["element_count"] > 0
    assert [r["round"] for r in b["rounds"]] == [0, 1, 2, 3]
    assert b["files"] == 4 * ranks
    assert doc["drift"]["overall"]["approx_kl0"] == 0.0 and doc["drift"]["worst_tokens"] == []
    assert set(doc["readbacks"]["sides"]) == {"train", "rollout"}
    assert "PASSED (exit 0)" in res.out


def test_mixed_cell_passes_with_diagnostic(tmp_path: Path, cli) -> None:
    run = build_run(tmp_path / "run", PR_FFN)
    res = cli(run)
    assert res.code == 0, res.out
    [diag] = res.findings("MISMATCH_DIAGNOSTIC")
    assert diag["severity"] == "info" and diag["details"]["mismatch_count"] > 0
    assert res.doc["drift"]["overall"]["abs_max"] > 0
    assert len(res.doc["drift"]["worst_tokens"]) == 10


def test_require_bitwise_fails_a_mixed_cell(tmp_path: Path, cli) -> None:
    run = build_run(tmp_path / "run", PR_FFN)
    res = cli(run, "--require-bitwise")
    assert res.code == 1
    assert res.findings("BITWISE_MISMATCH") and not res.findings("MISMATCH_DIAGNOSTIC")


def test_native_pp_passes(tmp_path: Path, cli) -> None:
    res = cli(build_run(tmp_path / "run", PP))
    assert res.code == 0, res.out
    assert res.doc["require_exact"] is False


def test_dirty_repo_is_a_warning_only(tmp_path: Path, cli) -> None:
    import json

    run = build_run(tmp_path / "run")
    m = json.loads((run / "manifest.json").read_text())
    m["repos"][0]["dirty"] = True
    (run / "manifest.json").write_text(json.dumps(m))
    res = cli(run)
    assert res.code == 0 and res.findings("REPO_DIRTY")[0]["severity"] == "warning"


def test_drift_stats_by_hand() -> None:
    d = np.array([0.0, 0.1, -0.1, 0.3, -0.5], dtype=np.float64)
    s = drift_stats(d, clip_eps=0.2)
    a = np.abs(d)
    assert s["active_tokens"] == 5
    assert s["abs_mean"] == pytest.approx(a.mean()) and s["abs_max"] == 0.5
    assert s["abs_p50"] == pytest.approx(0.1) and s["abs_p99"] == pytest.approx(np.percentile(a, 99))
    # ratio0 = exp(d): exp(0.3) - 1 = 0.35 and |exp(-0.5) - 1| = 0.39 exceed 0.2; exp(+-0.1) do not
    assert s["clip_fraction"] == pytest.approx(2 / 5)
    assert s["approx_kl0"] == pytest.approx(np.mean(np.exp(d) - 1 - d))
    assert s["ratio0_max"] == pytest.approx(math.exp(0.3)) and s["ratio0_min"] == pytest.approx(math.exp(-0.5))
    assert drift_stats(np.zeros(0)) == {"active_tokens": 0}


def test_worst_tokens_order_and_fields() -> None:
    w = WorstTokens(2)
    tr = np.array([[-1.0, -2.0, -3.0]], dtype=np.float32)
    ro = np.array([[-1.5, -2.0, -3.25]], dtype=np.float32)
    ids = np.array([[7, 8, 9]])
    w.add(4, 1, ids, tr, ro, np.ones_like(tr, dtype=bool))
    top = w.result()
    assert [t["position"] for t in top] == [0, 2]
    assert top[0] == {
        "round": 4,
        "rank": 1,
        "sample": 0,
        "position": 0,
        "token_id": 7,
        "train_logprob": -1.0,
        "rollout_logprob": -1.5,
        "diff": 0.5,
        "abs_diff": 0.5,
    }


def test_drift_of_a_known_run(tmp_path: Path) -> None:
    """Plant known differences in an otherwise exact run and find them all in the report."""
    run = build_run(tmp_path / "run", PR_FFN, drift=0.0, rounds=2)
    p = train_data_path(run, 1)
    t = load_round(p)
    s, q = np.nonzero(t["response_mask"])
    t["train_logprobs"][s[0], q[0]] -= np.float32(0.25)
    write_round(p, t, 1, 0)
    rep = validate_run(run, Options(clip_eps=0.2))
    r1 = rep.drift["rounds"][1]
    assert rep.drift["rounds"][0]["abs_max"] == 0.0
    assert r1["abs_max"] == pytest.approx(0.25) and r1["clip_fraction"] == pytest.approx(1 / r1["active_tokens"])
    [worst] = rep.drift["worst_tokens"]
    assert (worst["round"], worst["sample"], worst["position"]) == (1, int(s[0]), int(q[0]))
    assert worst["diff"] == pytest.approx(-0.25)
    assert rep.bitwise["rounds"][1]["mismatch_count"] == 1


def test_plots(tmp_path: Path, cli) -> None:
    pytest.importorskip("matplotlib")
    run = build_run(tmp_path / "run", PR_FFN)
    out = tmp_path / "plots"
    before = tree_state(run)
    res = cli(run, "--report", out)
    assert res.code == 0 and tree_state(run) == before
    for name in ("consistency.png", "drift.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    res = cli(build_run(tmp_path / "rr"), "--report", tmp_path / "plots-rr")
    assert (tmp_path / "plots-rr" / "drift.png").exists()


def test_cli_never_imports_torch(tmp_path: Path) -> None:
    run = build_run(tmp_path / "run", PR_FFN)
    proc = run_subprocess(str(run), "--report", str(tmp_path / "plots"), "--json", str(tmp_path / "r.json"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = run_subprocess("matrix", str(tmp_path), "--no-write", "--allow-partial")
    assert proc.returncode != 97, proc.stderr
    proc = run_subprocess(str(tmp_path / "nope"))
    assert proc.returncode == 3 and "Traceback" not in proc.stderr


def test_import_has_no_torch_and_no_side_effects() -> None:
    import subprocess
    import sys

    code = "import sys, rlk_validate, rlk_validate.cli, rlk_validate.plots; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False" and out.stderr == ""
