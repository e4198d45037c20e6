"""Issue 41, the validator's side: the seal covers every file, sealing is atomic and re-done after a kill, a live
run is never sealed, signed seals tell a re-sealed edit from the original, vacuous and saturated claims are
findings, and the small ones (severity, names, summaries, broken pipes). Each case fails on the previous code."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from validate_builders import build_run, load_round, mutate_json, train_data_path, tree_state, write_round

PR = {"attention": "P/R", "ffn": "R/R", "logp": "R/R"}


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONWARNINGS", None)
    return env


# -- defect 4: the seal covers every file under the run -------------------------------------------
@pytest.mark.parametrize("added", ["report/summary.png", ".hidden", "extra/deep/blob.bin", "readbacks/.x.json"])
def test_a_file_added_anywhere_after_sealing_is_named(good_run, cli, added):
    assert cli(good_run, "--seal").code == 0
    p = good_run / added
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(os.urandom(1 << 20))
    res = cli(good_run)
    assert res.code == 1, res.out
    assert any(added in f["message"] for f in res.findings("SEAL_INVALID")), res.out


def test_an_edited_unread_file_and_a_removed_folder_are_named(good_run, cli):
    (good_run / "report").mkdir(exist_ok=True)
    (good_run / "report" / "summary.md").write_text("the run's own summary\n")
    assert cli(good_run, "--seal").code == 0
    (good_run / "report" / "summary.md").write_text("edited\n")
    res = cli(good_run)
    assert res.code == 1 and any("report/summary.md" in f["message"] for f in res.findings("SEAL_INVALID"))


# -- defect 10: atomic seal, an interrupted one re-done --------------------------------------------
KILLED_SEALER = """
import os, signal, sys
from rlk_validate import sealing as seal
real = seal.write_bytes_atomic
def write(path, data):
    name = os.path.basename(path)
    if name == {"report": "run-validation.json", "complete": "COMPLETE"}[os.environ["AT"]]:
        # killed mid-write: half the bytes in the writer's temp file, the target not renamed yet
        with open(os.path.join(os.path.dirname(path), f".{name}.tmp-{os.getpid()}-abcdefabcdef"), "wb") as fh:
            fh.write(data[: len(data) // 2])
        os.kill(os.getpid(), signal.SIGKILL)
    return real(path, data)
seal.write_bytes_atomic = write
from rlk_validate.cli import main
sys.exit(main([sys.argv[1], "--seal"]))
"""


@pytest.mark.parametrize("at", ["report", "complete"])
def test_a_sealer_killed_mid_seal_leaves_no_false_seal_and_the_next_seal_redoes_it(good_run, cli, at):
    proc = subprocess.run([sys.executable, "-c", KILLED_SEALER, str(good_run)], env={**_env(), "AT": at},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    assert not (good_run / "COMPLETE").exists()  # never an empty or half-written seal
    res = cli(good_run)
    assert res.code == 0 and not res.findings("SEALED")  # a passing, unsealed run
    res = cli(good_run, "--seal")
    assert res.code == 0 and res.doc["seal"]["status"] == "sealed", res.out
    assert cli(good_run).findings("SEALED")


def test_an_empty_complete_of_an_older_sealer_says_so_and_is_re_done(good_run, cli):
    (good_run / "COMPLETE").write_text("")
    res = cli(good_run)
    assert res.code == 1 and any("re-does it" in f["message"] for f in res.findings("SEAL_INVALID"))
    res = cli(good_run, "--seal")
    assert res.code == 0 and res.findings("SEAL_REDONE") and res.doc["seal"]["status"] == "sealed", res.out


LIVE_WRITER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(120)
"""


def test_a_run_still_being_written_is_not_sealed(good_run, cli):
    (good_run / "exit-code").unlink()  # as rlk-repro's run process: it holds the lock until exit-code is written
    holder = subprocess.Popen([sys.executable, "-c", LIVE_WRITER, str(good_run)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = tree_state(good_run)
        res = cli(good_run, "--seal")
        assert tree_state(good_run) == before
        assert res.findings("SEAL_FAILED") and "still being written" in res.findings("SEAL_FAILED")[0]["message"]
        assert res.findings("RUN_DIR_BUSY")
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()


# -- defect 15: signed seals ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    from rlk_validate.cli import main

    a, b = tmp_path_factory.mktemp("key-a"), tmp_path_factory.mktemp("key-b")
    assert main(["keygen", str(a)]) == 0 and main(["keygen", str(b)]) == 0
    assert oct((a / "rlk-seal.key").stat().st_mode & 0o777) == "0o600"
    return {"a": (a / "rlk-seal.key", a / "rlk-seal.pub"), "b": (b / "rlk-seal.key", b / "rlk-seal.pub")}


def test_a_signed_seal_verifies_against_its_key_only(good_run, cli, keys):
    (ka, pa), (_, pb) = keys["a"], keys["b"]
    res = cli(good_run, "--seal", "--sign-key", ka)
    assert res.code == 0 and res.doc["seal"]["status"] == "sealed", res.out
    complete = json.loads((good_run / "COMPLETE").read_text())
    assert complete["signature"]["scheme"] == "ed25519"
    res = cli(good_run, "--verify-key", pa)
    assert res.code == 0 and "trusted key" in res.findings("SEAL_SIGNED")[0]["message"]
    res = cli(good_run, "--verify-key", pb)
    assert res.code == 1 and "not by the trusted key" in res.findings("SIGNATURE_INVALID")[0]["message"]
    assert cli(good_run).findings("SEAL_SIGNED")  # without a trusted key: self-consistent, said so


def test_a_re_sealed_edit_passes_a_checksum_but_not_the_signature(good_run, cli, keys):
    (ka, pa), (kb, _) = keys["a"], keys["b"]
    assert cli(good_run, "--seal", "--sign-key", ka).code == 0
    # the edit a writer of the directory can make: change the evidence, drop the seal, seal again
    rows = [json.loads(x) for x in (good_run / "metrics.jsonl").read_text().splitlines()]
    rows[0]["loss"] = 0.001
    (good_run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name in ("COMPLETE", "run-validation.json"):
        (good_run / name).unlink()
    assert cli(good_run, "--seal").code == 0  # re-sealed, unsigned
    assert cli(good_run).code == 0  # a checksum seal cannot tell (docs/evidence.md, threat model)
    res = cli(good_run, "--verify-key", pa)
    assert res.code == 1 and res.findings("SIGNATURE_MISSING")
    (good_run / "COMPLETE").unlink()
    assert cli(good_run, "--seal", "--sign-key", kb).code == 0  # re-sealed with another key
    res = cli(good_run, "--verify-key", pa)
    assert res.code == 1 and res.findings("SIGNATURE_INVALID")


def test_a_signed_complete_edited_by_hand_fails(good_run, cli, keys):
    (ka, pa) = keys["a"]
    assert cli(good_run, "--seal", "--sign-key", ka).code == 0
    doc = json.loads((good_run / "COMPLETE").read_text())
    doc["sealed_at"] = "2020-01-01T00:00:00Z"
    (good_run / "COMPLETE").write_text(json.dumps(doc))
    res = cli(good_run, "--verify-key", pa)
    assert res.code == 1 and "changed after signing" in res.findings("SIGNATURE_INVALID")[0]["message"]


def test_signing_key_problems_are_usage_errors_and_write_nothing(good_run, cli, tmp_path, keys):
    bad = tmp_path / "bad.key"
    bad.write_text("not a key\n")
    before = tree_state(good_run)
    for args in (["--seal", "--sign-key", str(bad)], ["--sign-key", str(keys["a"][0])],
                 ["--verify-key", str(bad)], ["--seal", "--sign-key", str(tmp_path / "absent.key")]):
        res = cli(good_run, *args, json_out=False)
        assert res.code == 3 and res.err.strip() and "Traceback" not in res.err, (args, res.err)
    assert tree_state(good_run) == before
    from rlk_validate.cli import main

    assert main(["keygen", str(keys["a"][0].parent)]) == 3  # never overwrites a key


# -- defects 12 and 13: vacuous and saturated claims ----------------------------------------------
def _weights_never_changed(run: Path) -> None:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        r["weights_changed"] = False
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_static_weights_fail_a_bitwise_claim_unless_asked_for(tmp_path, cli):
    rr = build_run(tmp_path / "rr")
    _weights_never_changed(rr)
    res = cli(rr)
    assert res.code == 1 and res.findings("WEIGHTS_STATIC")[0]["severity"] == "error"
    pr = build_run(tmp_path / "pr", PR)
    _weights_never_changed(pr)
    res = cli(pr)
    assert res.code == 0 and res.findings("WEIGHTS_STATIC")[0]["severity"] == "warning"
    assert cli(pr, "--require-bitwise").findings("WEIGHTS_STATIC")[0]["severity"] == "error"
    mutate_json(rr / "manifest.json", lambda d: d["config"].update(static_weights=True))
    res = cli(rr)
    assert res.code == 0 and res.findings("WEIGHTS_STATIC")[0]["severity"] == "info"


def test_zero_advantages_everywhere_are_static_weights(tmp_path, cli):
    run = build_run(tmp_path / "run")
    for rnd in range(3):
        p = train_data_path(run, rnd)
        t = load_round(p)
        t["advantages"] = np.zeros_like(t["advantages"])
        write_round(p, t, rnd, 0)
    res = cli(run)
    assert res.code == 1 and "every advantage" in res.findings("WEIGHTS_STATIC")[0]["message"]


def test_rounds_without_a_learning_signal_are_named(tmp_path, cli):
    run = build_run(tmp_path / "run")  # 3 rounds; from round 1 on the reward separates no group (issue 41, item 13)
    for rnd in (1, 2):
        p = train_data_path(run, rnd)
        t = load_round(p)
        t["advantages"] = np.zeros_like(t["advantages"])
        write_round(p, t, rnd, 0)
    res = cli(run, "--require-bitwise")
    (hit,) = res.findings("ADVANTAGES_ZERO")
    assert hit["severity"] == "warning" and hit["details"]["rounds"] == [1, 2] and "2 of 3 round(s)" in hit["message"]
    assert res.code == 0 and not res.findings("WEIGHTS_STATIC")
    assert not cli(build_run(tmp_path / "live")).findings("ADVANTAGES_ZERO")  # negative control


def _saturate(run: Path, rnd: int) -> None:
    """Round ``rnd``'s log-probs as a collapsed policy's: 0.0 (probability 1) at 95% of the compared tokens."""
    p = train_data_path(run, rnd)
    t = load_round(p)
    m = t["response_mask"].astype(bool)
    sat = m & (np.random.default_rng(1).random(m.shape) < 0.95)
    for k in ("rollout_logprobs", "train_logprobs"):
        t[k][sat] = 0.0
    write_round(p, t, rnd, 0)


def test_a_saturated_round_is_flagged_with_informative_counts(tmp_path, cli):
    run = build_run(tmp_path / "run", samples=16, positions=24)
    _saturate(run, 1)
    res = cli(run)
    hit = res.findings("INFORMATIVE_FRACTION_LOW")
    assert hit and hit[0]["severity"] == "error" and hit[0]["details"]["rounds"] == [1], res.out
    b = res.doc["bitwise"]
    assert b["rounds"][0]["informative_fraction"] > 0.9 and b["rounds"][1]["informative_fraction"] < 0.1
    assert "over informative tokens" in res.out
    assert cli(run, "--min-informative-fraction", "0.01").code == 0
    pr = build_run(tmp_path / "pr", PR, samples=16, positions=24)
    _saturate(pr, 1)
    assert cli(pr).findings("INFORMATIVE_FRACTION_LOW")[0]["severity"] == "warning"


# -- defect 11: the small ones ----------------------------------------------------------------------
def test_a_misnamed_train_data_file_is_the_error_the_docs_say(good_run, cli):
    (good_run / "train-data" / "notes.txt").write_text("x")
    res = cli(good_run)
    assert res.code == 1 and res.findings("TRAIN_DATA_UNEXPECTED")[0]["severity"] == "error"


def test_a_deleted_readback_of_a_sealed_run_is_named_beside_the_other_findings(good_run, cli):
    assert cli(good_run, "--seal").code == 0
    (good_run / "readbacks" / "local-rollout-1000.json").unlink()
    res = cli(good_run)
    assert res.findings("READBACKS_MISSING") and res.findings("COMPLETE_UNJUSTIFIED")
    assert any("local-rollout-1000.json" in f["message"] for f in res.findings("SEAL_INVALID")), res.out


def test_thousands_of_identical_findings_are_summarised(good_run, cli):
    for i in range(3000):
        (good_run / "train-data" / f"stray-{i}").write_bytes(b"")
    res = cli(good_run)
    assert len(res.findings("TRAIN_DATA_UNEXPECTED")) == 3000  # the JSON keeps every one
    lines = [x for x in res.out.splitlines() if "TRAIN_DATA_UNEXPECTED" in x]
    assert len(lines) == 6 and "2995 more TRAIN_DATA_UNEXPECTED" in lines[-1], lines[-2:]


def test_a_reader_that_leaves_is_not_an_internal_error(good_run):
    r, w = os.pipe()
    os.close(r)  # `rlk-validate RUN | head` whose head has already gone
    code = "import sys; from rlk_validate.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.run([sys.executable, "-c", code, str(good_run)], stdout=w, stderr=subprocess.PIPE, text=True,
                          env=_env(), timeout=120)
    os.close(w)
    assert proc.returncode == 0 and "internal error" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr

