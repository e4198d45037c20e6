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
    assert doc["env"]["RL_KERNEL_LOGP_CASE"] == "R/P" and doc["require_exact"] is False
    assert doc["config"]["rounds"] == 3 and doc["mode"] == "mixed"
    assert not any(tmp_path.iterdir())
    assert cli.main(["plan", "--top-p", "2"]) == cli.EXIT_USAGE


@pytest.mark.parametrize(("args", "exact"), [([], True), (["--mode", "native"], False), (["--ffn-case", "P/R"], False)])
def test_plan_names_the_exact_claim_once_as_the_manifest_does(capsys, args, exact):
    """issue 41: `plan` printed both exact_required (resolved) and config.require_exact (null): one name now,
    the manifest's and the bitwise file's, with the resolved value."""
    import json

    def keys(doc):
        if isinstance(doc, dict):
            for k, v in doc.items():
                yield k
                yield from keys(v)

    assert cli.main(["plan", *args]) == cli.EXIT_OK
    doc = json.loads(capsys.readouterr().out)
    names = list(keys(doc))
    assert "exact_required" not in names and names.count("require_exact") == 1
    assert doc["require_exact"] is exact


# -- route selection: flag > RL_KERNEL_<MODULE>_CASE > --mode > consistency ------------------------------------
CASE_VARS = {"attention": "RL_KERNEL_ATTENTION_CASE", "ffn": "RL_KERNEL_FFN_CASE", "logp": "RL_KERNEL_LOGP_CASE"}


def _plan_doc(capsys, *args):
    import json

    assert cli.main(["plan", *args]) == cli.EXIT_OK
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("module", sorted(CASE_VARS))
def test_each_case_variable_selects_its_module_and_is_recorded_as_the_source(module, monkeypatch, capsys):
    monkeypatch.setenv(CASE_VARS[module], "p/r")
    doc = _plan_doc(capsys)
    assert doc["plan"][module] == "P/R"
    assert doc["routes"][module] == {"case": "P/R", "source": CASE_VARS[module]}
    others = [m for m in CASE_VARS if m != module]
    assert all(doc["routes"][m] == {"case": "R/R", "source": "default (consistency)"} for m in others)


def test_precedence_flag_over_variable_over_mode(monkeypatch, capsys):
    monkeypatch.setenv("RL_KERNEL_FFN_CASE", "P/R")
    monkeypatch.setenv("RL_KERNEL_LOGP_CASE", "R/P")
    doc = _plan_doc(capsys, "--mode", "native", "--logp-case", "R/R")
    assert doc["routes"] == {"attention": {"case": "P/P", "source": "--mode native"},
                             "ffn": {"case": "P/R", "source": "RL_KERNEL_FFN_CASE"},
                             "logp": {"case": "R/R", "source": "flag --logp-case"}}
    assert doc["env"] == {"RL_KERNEL_ATTENTION_CASE": "P/P", "RL_KERNEL_FFN_CASE": "P/R", "RL_KERNEL_LOGP_CASE": "R/R"}


def test_mode_variable_and_audit_flag(monkeypatch, capsys):
    assert _plan_doc(capsys)["readback_mode"] == {"mode": "strict", "source": "default"}
    monkeypatch.setenv("RL_KERNEL_MODE", "audit")
    assert _plan_doc(capsys)["readback_mode"] == {"mode": "audit", "source": "RL_KERNEL_MODE"}
    monkeypatch.setenv("RL_KERNEL_MODE", "strict")
    assert _plan_doc(capsys, "--audit")["readback_mode"] == {"mode": "audit", "source": "flag --audit"}


BAD_CASES = ["X/Y", "RR", "R-R", "R/R/R", "R /R", "Q", "R/P,", "1/0"]


@pytest.mark.parametrize("value", BAD_CASES)
@pytest.mark.parametrize("command", ["run", "plan", "doctor"])
def test_one_spelling_rule_rejects_the_same_forms_as_flag_and_as_variable(value, command, tmp_path, monkeypatch,
                                                                          capsys):
    monkeypatch.chdir(tmp_path)
    out = ["--output", str(tmp_path / "runs")] if command == "run" else []
    assert cli.main([command, "--ffn-case", value, *out]) == cli.EXIT_USAGE
    flag_err = capsys.readouterr().err
    monkeypatch.setenv("RL_KERNEL_FFN_CASE", value)
    assert cli.main([command, *out]) == cli.EXIT_USAGE
    var_err = capsys.readouterr().err
    for err in (flag_err, var_err):
        assert len(err.strip().splitlines()) <= 2 and "Traceback" not in err and repr(value) in err
        assert "P/P, P/R, R/P, R/R" in err
    assert "RL_KERNEL_FFN_CASE" in var_err
    assert not any(tmp_path.iterdir()), "nothing may be created before the routes are valid"


@pytest.mark.parametrize("value", ["r/p", " R/P ", "R/p"])
def test_one_spelling_rule_accepts_the_same_forms_as_flag_and_as_variable(value, monkeypatch, capsys):
    assert _plan_doc(capsys, "--ffn-case", value)["plan"]["ffn"] == "R/P"
    monkeypatch.setenv("RL_KERNEL_FFN_CASE", value)
    assert _plan_doc(capsys)["plan"]["ffn"] == "R/P"


@pytest.mark.parametrize("var,value", [("RL_KERNEL_MODE", "foo"), ("RLK_BACKENDS", "linear"),
                                       ("RL_KERNEL_RUN_ID", "a/b"), ("RLK_VALUE_CHECKS", "sometimes")])
def test_bad_variable_exits_2_before_a_run_directory_exists(var, value, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(var, value)
    assert cli.main(["run", "--output", str(tmp_path), *SMALL]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert var in err and len(err.strip().splitlines()) <= 2
    assert not any(tmp_path.iterdir())


def test_run_honours_the_variables_and_records_their_sources(tmp_path, monkeypatch):
    import json

    monkeypatch.setenv("RL_KERNEL_FFN_CASE", "P/R")
    monkeypatch.setenv("RL_KERNEL_MODE", "audit")
    assert cli.main(["run", "--rounds", "1", "--output", str(tmp_path), *SMALL]) == cli.EXIT_OK
    run_dir = next(tmp_path.iterdir())
    m = json.loads((run_dir / "manifest.json").read_text())
    assert m["plan"] == {"attention": "R/R", "ffn": "P/R", "logp": "R/R"} and m["mode"] == "mixed"
    assert m["plan_sources"]["ffn"] == "RL_KERNEL_FFN_CASE"
    assert m["plan_sources"]["attention"] == "default (consistency)"
    assert m["readback_mode"] == {"mode": "audit", "source": "RL_KERNEL_MODE"}
    for rb in (run_dir / "readbacks").iterdir():
        doc = json.loads(rb.read_text())
        assert doc["plan"]["ffn"] == "P/R" and doc["mode"] == "audit"
        ffn = doc["modules"]["ffn"]
        assert ffn["implementation"] == ("production" if doc["side"] == "train" else "rlk")


@pytest.mark.parametrize("exc,code", [(KeyboardInterrupt(), cli.EXIT_INTERRUPTED),
                                      (RuntimeError("boom"), cli.EXIT_FAILED)])
def test_exit_code_file_equals_the_exit_status(exc, code, tmp_path, monkeypatch, capsys):
    def broken(self, samples):
        raise exc

    monkeypatch.setattr(Trainer, "step", broken)
    assert cli.main(["run", "--rounds", "1", "--output", str(tmp_path), *SMALL]) == code
    run_dir = next(tmp_path.iterdir())
    assert (run_dir / "exit-code").read_text() == f"{code}\n"
    assert "Traceback" not in capsys.readouterr().err


def test_doctor_reports_each_case_and_its_source(monkeypatch, capsys):
    monkeypatch.setenv("RL_KERNEL_LOGP_CASE", "R/P")
    cli.main(["doctor", "--device", "cpu", "--mode", "native"])
    first = capsys.readouterr().out.splitlines()[0]
    assert "logp R/P (RL_KERNEL_LOGP_CASE)" in first and "ffn P/P (--mode native)" in first


# -- the CLI as a new user meets it ------------------------------------------------------------------------------
def test_every_option_of_every_command_has_help_text():
    import argparse

    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in sub.choices.items():
        for action in p._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help and action.help.strip(), f"rlk-repro {name} {action.option_strings or action.dest}"


def test_plan_into_a_closed_pipe_prints_no_broken_pipe_error():
    proc = subprocess.Popen([sys.executable, "-m", "rlk_repro", "plan"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # what `| head` does before the command has written anything
    with proc.stderr:
        err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0
    assert "BrokenPipe" not in err and "Traceback" not in err and "Exception ignored" not in err, err


@pytest.mark.parametrize("args,prefix", [
    (["matrix", "--cells", "bogus"], "rlk-repro matrix: error:"),
    (["report", "/nonexistent/run"], "rlk-repro report: error:"),
    (["plan", "--rounds", "1", "--checkpoint", "/nonexistent/model"], "rlk-repro plan: error:"),
])
def test_errors_name_the_command_that_failed(args, prefix, capsys):
    assert cli.main(args) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith(prefix) and "run failed" not in err, err
