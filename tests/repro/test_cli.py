"""``rlk-repro`` command line: exit codes, one-line errors, the run directory it prints."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlk_repro import cli
from rlk_repro.engine.trainer import Trainer

SMALL = ["--prompts-per-round", "1", "--samples-per-prompt", "2", "--max-new-tokens", "4", "--chunk-size", "8"]


@pytest.mark.parametrize("args", [
    ["run", "--attention-case", "X/Q"],
    ["run", "--rounds", "0"],
    ["run", "--temperature", "0"],
    ["run", "--top-p", "1.5"],
    ["run", "--device", "tpu9"],
    ["run", "--model", "huge"],
    ["run", "--engine", "vime"],
    ["run", "--checkpoint", "/nonexistent/model"],
    ["frobnicate"],
], ids=lambda a: " ".join(a))
def test_bad_arguments_exit_2_with_one_line_and_no_traceback(args, tmp_path, capsys):
    code = cli.main([*args, "--output", str(tmp_path)] if args[0] == "run" else args)
    err = capsys.readouterr().err
    assert code == cli.EXIT_USAGE
    assert "Traceback" not in err and err.strip()
    assert not any(tmp_path.iterdir()), "a rejected command must not create a run directory"


def test_console_run_prints_its_run_directory(tmp_path):
    cmd = [sys.executable, "-m", "rlk_repro", "run", "--rounds", "1", "--output", str(tmp_path), *SMALL]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("run directory: ")][-1]
    run_dir = Path(line.split(": ", 1)[1])
    assert run_dir.parent == tmp_path and (run_dir / "exit-code").read_text() == "0\n"
    assert "PASS: bitwise equal" in proc.stdout and "mismatch" in proc.stdout.splitlines()[0]


def test_native_mode_with_mismatches_exits_0(tmp_path, capsys):
    assert cli.main(["run", "--mode", "native", "--rounds", "1", "--output", str(tmp_path), *SMALL]) == 0
    assert "exact equality not required" in capsys.readouterr().out


def test_strict_rr_mismatch_exits_1(tmp_path, monkeypatch, capsys):
    real_step = Trainer.step

    def perturbed(self, samples):  # a trainer whose log-probs are one ulp off: what a broken route would do
        res = real_step(self, samples)
        res.train_logprobs = [torch.nextafter(t, torch.full_like(t, -1.0)) for t in res.train_logprobs]
        return res

    monkeypatch.setattr(Trainer, "step", perturbed)
    code = cli.main(["run", "--rounds", "1", "--output", str(tmp_path), *SMALL])
    out = capsys.readouterr().out
    assert code == cli.EXIT_MISMATCH and "FAIL" in out
    run_dir = next(tmp_path.iterdir())
    assert (run_dir / "exit-code").read_text() == "1\n"


def test_plan_prints_the_resolved_run_and_writes_nothing(tmp_path, capsys, monkeypatch):
    import json

    monkeypatch.chdir(tmp_path)
    assert cli.main(["plan", "--logp-case", "R/P", "--rounds", "3"]) == cli.EXIT_OK
    doc = json.loads(capsys.readouterr().out)
    assert doc["plan"] == {"attention": "R/R", "ffn": "R/R", "logp": "R/P"}
    assert doc["env"]["RL_KERNEL_LOGP_CASE"] == "R/P" and doc["exact_required"] is False
    assert doc["config"]["rounds"] == 3 and doc["mode"] == "mixed"
    assert not any(tmp_path.iterdir())
    assert cli.main(["plan", "--top-p", "2"]) == cli.EXIT_USAGE
