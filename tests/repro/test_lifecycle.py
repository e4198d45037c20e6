"""Fault cases of a run's and a matrix's life (issue 41): locks, exit codes under signals, handlers closed on
every path, resume with the recorded options, nothing written into a run directory, ``RLK_BACKENDS`` checked
before anything is created. Each runs the tiny model for one round (seconds)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rlk_repro import cli, runs

SMALL = ["--rounds", "1", "--prompts-per-round", "1", "--samples-per-prompt", "2", "--max-new-tokens", "4",
         "--chunk-size", "8"]


def _matrix_root(tmp_path: Path, capsys, cells: str = "control-RR,ffn-PR") -> Path:
    assert cli.main(["matrix", "--output", str(tmp_path / "m"), "--cells", cells, *SMALL]) == cli.EXIT_OK
    out = capsys.readouterr().out
    return Path(out.strip().splitlines()[-1].split(": ", 1)[1])


def _py(body: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RL_KERNEL_", "RLK_"))}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(body), *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


# -- defect 1: one writer per matrix root ---------------------------------------------------------
HOLDER = """
import sys, time
from pathlib import Path
from rlk_repro import lifecycle
lock = lifecycle.lock_matrix_root(Path(sys.argv[1]), ["rlk-repro", "matrix", "--resume", "HOLDER-CMD"])
print("locked", flush=True)
time.sleep(120)
"""


def test_a_second_matrix_writer_exits_2_naming_the_holder_and_the_lock_dies_with_it(tmp_path, capsys):
    root = _matrix_root(tmp_path, capsys)
    (root / "ffn-PR" / "exit-code").unlink()  # an unfinished cell a resume would run
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(root)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = sorted(p.name for p in root.iterdir())
        assert cli.main(["matrix", "--resume", str(root)]) == cli.EXIT_USAGE
        err = capsys.readouterr().err
        assert f"pid {holder.pid}" in err and "HOLDER-CMD" in err and "Traceback" not in err
        assert sorted(p.name for p in root.iterdir()) == before  # nothing moved aside, nothing written
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    assert cli.main(["matrix", "--resume", str(root)]) == cli.EXIT_OK  # released by the OS on death
    assert (root / "ffn-PR" / "exit-code").read_text() == "0\n"


# -- defect 2: every handler closed on every path -------------------------------------------------
def test_a_failed_exit_code_write_closes_the_cells_log(tmp_path, capsys, monkeypatch):
    real, calls = runs.write_exit_code, []

    def first_fails(run_dir, code):
        calls.append(run_dir)
        if len(calls) == 1:
            raise OSError(28, "No space left on device")
        real(run_dir, code)

    monkeypatch.setattr(runs, "write_exit_code", first_fails)
    before = list(logging.getLogger("rlk_repro").handlers)
    cli.main(["matrix", "--output", str(tmp_path), "--cells", "control-RR,ffn-PR", *SMALL])
    root = next(tmp_path.glob("matrix-*"))
    first = (root / "control-RR" / "run.log").read_text()
    second_id = json.loads((root / "ffn-PR" / "manifest.json").read_text())["run_id"]
    assert second_id not in first and "ffn-PR" not in first.split("\n", 1)[1]
    assert logging.getLogger("rlk_repro").handlers == before
    assert "Logging error" not in capsys.readouterr().err


def test_a_full_disk_is_said_once_not_as_a_traceback_per_log_line(tmp_path, capsys):
    handler = runs.open_run_log(tmp_path)
    try:
        handler.stream.close()
        handler.stream = open("/dev/full", "w", encoding="utf-8")  # every write: ENOSPC
        for i in range(50):
            logging.getLogger("rlk_repro").info("line %d", i)
    finally:
        runs.close_run_log(handler)
    err = capsys.readouterr().err
    assert "Logging error" not in err and "Traceback" not in err
    assert err.count("cannot write") == 1 and "later lines of this run's log are lost" in err


def test_a_full_disk_shows_the_runs_own_error_not_the_exit_code_writes(tmp_path, capsys, monkeypatch):
    def no_space(*a, **k):
        raise OSError(28, "No space left on device", "train-data/round-0000.rank0.safetensors")

    def no_space_either(run_dir, code):
        raise OSError(28, "No space left on device", "exit-code")

    monkeypatch.setattr(runs, "write_train_data", no_space)
    monkeypatch.setattr(runs, "write_exit_code", no_space_either)
    assert cli.main(["run", "--output", str(tmp_path), *SMALL]) == cli.EXIT_FAILED
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert "round-0000" in last and "failed" in last, err
    assert "also cannot write" in err  # the second failure is said, not hidden


# -- defects 3 and 9: exit-code is the process's exit status, SIGTERM like SIGINT ------------------
SIGNALLED = """
import os, signal, sys
from rlk_repro import cli, runs
from rlk_repro.engine.trainer import Trainer
when, sig = os.environ["WHEN"], getattr(signal, os.environ["SIG"])
if when == "exit-code":  # the signal arrives while exit-code is written
    real = runs.write_exit_code
    def write(run_dir, code):
        real(run_dir, code)
        os.kill(os.getpid(), sig)
    runs.write_exit_code = write
else:  # the signal arrives in the middle of the round
    step = Trainer.step
    def train(self, samples):
        os.kill(os.getpid(), sig)
        return step(self, samples)
    Trainer.step = train
sys.argv = ["rlk-repro", *sys.argv[1:]]
sys.exit(cli.main())
"""


@pytest.mark.parametrize("when,sig,status", [("exit-code", "SIGINT", 0), ("exit-code", "SIGTERM", 0),
                                              ("round", "SIGINT", 130), ("round", "SIGTERM", 143)])
def test_exit_code_file_equals_the_process_exit_status(tmp_path, when, sig, status):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RL_KERNEL_", "RLK_"))}
    proc = subprocess.run([sys.executable, "-c", SIGNALLED, "run", "--output", str(tmp_path), *SMALL],
                          capture_output=True, text=True, timeout=300, env={**env, "WHEN": when, "SIG": sig})
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert proc.returncode == status, proc.stderr[-3000:]
    assert (run_dir / "exit-code").read_text() == f"{status}\n"
    assert "Traceback" not in proc.stderr
    if when == "round":
        how = "interrupted (SIGINT)" if sig == "SIGINT" else "terminated (SIGTERM)"
        assert f"run {how}" in (run_dir / "run.log").read_text()
    else:
        assert f"{sig} arrived after the run had ended" in proc.stderr


# -- defects 6 and 7: resume runs the recorded options and re-runs interrupted cells ---------------
def test_resume_takes_the_recorded_options_and_refuses_a_conflicting_flag(tmp_path, capsys, monkeypatch):
    root = _matrix_root(tmp_path, capsys)
    assert cli.main(["matrix", "--resume", str(root), "--rounds", "3"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "--rounds 3" in err and "ran 1" in err
    monkeypatch.setenv("RL_KERNEL_MODE", "audit")
    assert cli.main(["matrix", "--resume", str(root)]) == cli.EXIT_USAGE
    assert "readback_mode" in capsys.readouterr().err
    monkeypatch.delenv("RL_KERNEL_MODE")
    (root / "ffn-PR" / "exit-code").unlink()
    # no experiment flag at all: the recorded ones (1 round, 2 samples), so the matrix still validates
    assert cli.main(["matrix", "--resume", str(root), "--rounds", "1"]) == cli.EXIT_OK
    m = json.loads((root / "ffn-PR" / "manifest.json").read_text())
    assert m["rounds"] == 1 and m["config"]["samples_per_prompt"] == 2
    assert json.loads((root / "matrix-report.json").read_text())["verdict"] == "passed"


def test_an_interrupted_cell_is_run_again_even_with_its_bitwise_file(tmp_path, capsys):
    root = _matrix_root(tmp_path, capsys)
    (root / "ffn-PR" / "exit-code").write_text("130\n")  # interrupted after bitwise-validation.json
    assert cli.main(["matrix", "--resume", str(root)]) == cli.EXIT_OK
    err = capsys.readouterr().err
    assert "ffn-PR           was interrupted" in err and "control-RR       finished earlier" in err
    assert (root / "ffn-PR" / "exit-code").read_text() == "0\n"
    assert len(list(root.glob("ffn-PR.interrupted-*"))) == 1


def test_an_interrupted_matrix_prints_the_exact_resume_command(tmp_path, capsys, monkeypatch):
    from rlk_repro.engine.trainer import Trainer

    def interrupted(self, samples):
        raise KeyboardInterrupt

    monkeypatch.setattr(Trainer, "step", interrupted)
    assert cli.main(["matrix", "--output", str(tmp_path), "--cells", "control-RR", *SMALL]) == 130
    root = next(tmp_path.glob("matrix-*"))
    assert f"rlk-repro matrix --resume {root}" in capsys.readouterr().err
    assert (root / "control-RR" / "exit-code").read_text() == "130\n"


# -- defect 4 (producer side): nothing is written into a run directory -----------------------------
def test_run_and_matrix_refuse_to_write_into_a_run_directory(tmp_path, capsys):
    assert cli.main(["run", "--output", str(tmp_path), *SMALL]) == cli.EXIT_OK
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    capsys.readouterr()
    before = sorted(str(p) for p in run_dir.rglob("*"))
    for argv in (["run", "--output", str(run_dir)], ["run", "--output", str(run_dir / "report" / "x")],
                 ["matrix", "--output", str(run_dir)], ["matrix", "--resume", str(run_dir)]):
        assert cli.main([*argv, *SMALL]) == cli.EXIT_USAGE, argv
        err = capsys.readouterr().err
        assert "run directory" in err and "Traceback" not in err, err
    assert sorted(str(p) for p in run_dir.rglob("*")) == before


def test_matrix_output_that_is_a_file_exits_2_like_run(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    for command in ("run", "matrix"):
        assert cli.main([command, "--output", str(f), *SMALL]) == cli.EXIT_USAGE, command
        assert "is not a directory" in capsys.readouterr().err


# -- defect 8: RLK_BACKENDS is checked before anything is created ---------------------------------
@pytest.mark.parametrize("value,named", [("rmsnorm=rlk.reference", "did you mean 'rms_norm'"),
                                         ("rms_norm=acme.missing", "acme.missing")])
def test_a_bad_rlk_backends_exits_2_before_anything_is_created(tmp_path, capsys, monkeypatch, value, named):
    from rlk_core.backends import REGISTRY

    monkeypatch.setenv("RLK_BACKENDS", value)
    REGISTRY.refresh()  # RLK_BACKENDS is read once per process
    try:
        for command in ("run", "matrix"):
            assert cli.main([command, "--output", str(tmp_path / command), *SMALL]) == cli.EXIT_USAGE
            err = capsys.readouterr().err
            assert named in err and "Traceback" not in err
            assert not (tmp_path / command).exists()
        assert cli.main(["doctor", "--device", "cpu"]) == cli.EXIT_MISMATCH
        out = capsys.readouterr().out
        assert "RLK_BACKENDS" in out and named in out and "FAILED" in out
    finally:
        monkeypatch.delenv("RLK_BACKENDS")
        REGISTRY.refresh()


# -- defect 12 (producer side): a run whose weights cannot change says so at start ----------------
def test_one_sample_per_prompt_warns_and_static_weights_is_explicit(tmp_path, capsys):
    one = [a if a != "2" else "1" for a in SMALL]
    assert cli.main(["run", "--output", str(tmp_path / "a"), *one]) == cli.EXIT_OK
    err = capsys.readouterr().err
    assert "--samples-per-prompt 1" in err and "vacuously" in err
    assert cli.main(["run", "--output", str(tmp_path / "b"), "--static-weights", *SMALL[:-4]]) == cli.EXIT_OK
    assert "vacuously" not in capsys.readouterr().err
    (run_dir,) = list((tmp_path / "b").iterdir())
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["weights_changed"] for r in rows] == [False]
    assert json.loads((run_dir / "manifest.json").read_text())["config"]["static_weights"] is True


PROBE = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    print("free")
except BlockingIOError:
    print("locked")
"""


def test_the_run_directory_is_locked_while_its_run_writes_it(tmp_path, monkeypatch, small_config):
    from rlk_core.plan import RoutePlan
    from rlk_repro.engine.local import run_local
    from rlk_repro.engine.trainer import Trainer

    seen, step = [], Trainer.step

    def train(self, samples):
        (d,) = list(tmp_path.iterdir())
        seen.append(_py(PROBE, str(d)).stdout.strip())
        return step(self, samples)

    monkeypatch.setattr(Trainer, "step", train)
    res = run_local(small_config(RoutePlan("R/R", "R/R", "R/R"), rounds=1), tmp_path)
    assert seen == ["locked"]
    assert _py(PROBE, str(res.run_dir)).stdout.strip() == "free"


def test_report_refuses_to_write_into_a_sealed_run(tmp_path, capsys):
    from rlk_validate import seal_run

    assert cli.main(["run", "--output", str(tmp_path / "runs"), *SMALL]) == cli.EXIT_OK
    (run_dir,) = list((tmp_path / "runs").iterdir())
    rep = seal_run(run_dir)
    assert rep.seal["status"] == "sealed" or rep.verdict != "passed", rep.summary()
    (run_dir / "COMPLETE").touch()  # sealed (or, outside a git checkout, as if): report/ must stay as sealed
    before = sorted(str(p) for p in run_dir.rglob("*"))
    capsys.readouterr()
    assert cli.main(["report", str(run_dir)]) == cli.EXIT_USAGE
    assert "break the seal" in capsys.readouterr().err
    assert cli.main(["report", str(run_dir), "--output", str(run_dir / "report")]) == cli.EXIT_USAGE
    assert sorted(str(p) for p in run_dir.rglob("*")) == before
    assert cli.main(["report", str(run_dir), "--output", str(tmp_path / "elsewhere")]) == cli.EXIT_OK
