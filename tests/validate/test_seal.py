"""--seal: run-validation.json always, COMPLETE only when passed, never overwritten, one winner."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from validate_builders import build_run, run_subprocess, tree_state


def _without(state: dict, *names: str) -> dict:
    return {k: v for k, v in state.items() if k not in names and k != "."}


def test_plain_run_writes_nothing(good_run: Path, cli) -> None:
    before = tree_state(good_run)
    st = os.stat(good_run).st_mtime_ns
    assert cli(good_run, json_out=False).code == 0
    assert tree_state(good_run) == before and os.stat(good_run).st_mtime_ns == st


def test_seal_passing_run(good_run: Path, cli) -> None:
    before = tree_state(good_run)
    res = cli(good_run, "--seal")
    assert res.code == 0, res.out
    after = tree_state(good_run)
    assert set(after) - set(before) == {"COMPLETE", "run-validation.json"}
    assert {k: after[k] for k in before} == before  # nothing else touched
    rv = (good_run / "run-validation.json").read_bytes()
    doc = json.loads(rv)
    assert doc["verdict"] == "passed" and doc["seal"]["status"] == "sealed"
    complete = json.loads((good_run / "COMPLETE").read_text())
    assert complete["run_validation_sha256"] == hashlib.sha256(rv).hexdigest()
    assert not [p for p in os.listdir(good_run) if p.startswith(".")]
    # validating a sealed run again: passes, says it is sealed, writes nothing
    again = tree_state(good_run)
    res = cli(good_run)
    assert res.code == 0 and res.findings("SEALED") and tree_state(good_run) == again


def test_seal_failed_run_writes_only_the_report(good_run: Path, cli) -> None:
    (good_run / "exit-code").write_text("1\n")
    before = tree_state(good_run)
    res = cli(good_run, "--seal")
    assert res.code == 1
    after = tree_state(good_run)
    assert set(after) - set(before) == {"run-validation.json"}
    assert not (good_run / "COMPLETE").exists()
    doc = json.loads((good_run / "run-validation.json").read_text())
    assert doc["verdict"] == "failed" and doc["seal"]["complete"] is False


def test_seal_never_overwrites_complete(good_run: Path, cli) -> None:
    (good_run / "COMPLETE").write_text("sealed by someone else\n")
    before = tree_state(good_run)
    res = cli(good_run, "--seal")
    assert tree_state(good_run) == before
    # a hand-written seal is not a seal: reported, and still never overwritten
    assert res.code == 1 and res.findings("SEAL_EXISTS") and res.findings("SEAL_INVALID")
    assert "Traceback" not in res.out + res.err
    # also when the run fails: COMPLETE stays, the problem is reported
    (good_run / "run.log").write_text("Traceback (most recent call last):\n")
    before = tree_state(good_run)
    res = cli(good_run, "--seal")
    assert tree_state(good_run) == before
    assert res.code == 1 and res.findings("COMPLETE_UNJUSTIFIED") and res.findings("SEAL_EXISTS")


def test_seal_with_dangling_complete_link(good_run: Path, cli, tmp_path: Path) -> None:
    (good_run / "COMPLETE").symlink_to(tmp_path / "nowhere")
    before = tree_state(good_run)
    res = cli(good_run, "--seal")
    assert tree_state(good_run) == before and res.findings("SEAL_EXISTS")
    assert not (tmp_path / "nowhere").exists()


def test_incomplete_run_is_not_sealed(good_run: Path, cli) -> None:
    (good_run / "exit-code").unlink()
    res = cli(good_run, "--seal")
    assert res.code == 2 and not (good_run / "COMPLETE").exists()
    assert (good_run / "run-validation.json").exists()


def test_concurrent_seal_has_exactly_one_winner(good_run: Path) -> None:
    n = 8
    code = "import sys; from rlk_validate.cli import main; sys.exit(main(sys.argv[1:]))"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(good_run), "--seal"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(n)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert all("Traceback" not in o + e for o, e in outs)
    sealed = [o for o, _ in outs if "seal: sealed" in o]
    assert len(sealed) == 1, [o.splitlines()[-2:] for o, _ in outs]
    assert sum("SEAL_EXISTS" in o for o, _ in outs) == n - 1
    rv = (good_run / "run-validation.json").read_bytes()
    assert json.loads((good_run / "COMPLETE").read_text())["run_validation_sha256"] == hashlib.sha256(rv).hexdigest()
    assert not [p for p in os.listdir(good_run) if p.startswith(".")]


def test_json_and_report_inside_run_dir_are_refused(good_run: Path, cli) -> None:
    before = tree_state(good_run)
    for flag, val in (("--json", good_run / "x.json"), ("--report", good_run / "report")):
        res = cli(good_run, flag, val, json_out=False)
        assert res.code == 3 and "inside RUN_DIR" in res.err
    assert tree_state(good_run) == before


def test_seal_subprocess(tmp_path: Path) -> None:
    run = build_run(tmp_path / "run")
    proc = run_subprocess(str(run), "--seal", "--quiet")
    assert proc.returncode == 0 and (run / "COMPLETE").exists()
    assert proc.stdout.strip().startswith("verdict: PASSED")


def test_seal_failure_is_reported_and_leaves_nothing(good_run: Path, cli, monkeypatch) -> None:
    from rlk_validate import sealing as seal

    def deny(path: str, data: bytes) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(seal, "write_bytes_atomic", deny)
    before = tree_state(good_run)
    res = cli(good_run, "--seal")
    assert res.code == 1 and res.findings("SEAL_FAILED")
    assert "Permission denied" in res.findings("SEAL_FAILED")[0]["message"]
    assert tree_state(good_run) == before


def test_report_json_is_strict_even_with_overflowing_ratio(tmp_path: Path, cli) -> None:
    import numpy as np
    from validate_builders import load_round, train_data_path, write_round

    run = build_run(tmp_path / "run", {"attention": "P/R", "ffn": "R/R", "logp": "R/R"})
    p = train_data_path(run, 0)
    t = load_round(p)
    s, q = np.nonzero(t["response_mask"])
    t["rollout_logprobs"][s[0], q[0]] = np.float32(-1e30)
    write_round(p, t, 0, 0)
    res = cli(run)  # the cli fixture parses with json.loads; check strictness explicitly too
    text = next(tmp_path.glob("report-*.json")).read_text()
    assert "Infinity" not in text and "NaN" not in text
    assert res.doc["drift"]["overall"]["ratio0_max"] is None
