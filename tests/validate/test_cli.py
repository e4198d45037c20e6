"""Command line: exit codes, usage errors, the codes table and its documentation."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from validate_builders import run_subprocess

from rlk_validate import CODES
from rlk_validate.cli import main

DOCS = Path(__file__).resolve().parents[2] / "docs"


@pytest.mark.parametrize(
    "argv",
    [
        ["--bogus"],
        [],
        ["a", "b"],
        ["--clip-eps", "0", "x"],
        ["matrix"],
        ["--worst", "-1", "x"],
        ["--max-json-mib", "0", "x"],
    ],
)
def test_usage_errors_exit_3(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 3
    err = capsys.readouterr().err
    assert "usage error" in err and "Traceback" not in err


def test_not_a_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    assert main([str(f)]) == 3
    assert "is not a directory" in capsys.readouterr().out


def test_json_write_failure_is_calm(tmp_path: Path, good_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(good_run), "--json", str(tmp_path / "no" / "such" / "dir.json")]) == 3
    assert "cannot write" in capsys.readouterr().err


def test_internal_error_is_calm(good_run: Path, monkeypatch, capsys: pytest.CaptureFixture[str]) -> None:
    import rlk_validate.validate as v

    def boom(*a, **k):
        raise RuntimeError("simulated bug")

    monkeypatch.setattr(v, "check_readbacks", boom)
    assert main([str(good_run)]) == 4
    err = capsys.readouterr().err
    assert "internal error" in err and "simulated bug" in err and "Traceback" not in err


def test_codes_and_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["codes"]) == 0
    out = capsys.readouterr().out
    assert all(code in out for code in CODES)
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0


def test_run_subcommand_alias(good_run: Path) -> None:
    proc = run_subprocess("run", str(good_run), "-q")
    assert proc.returncode == 0 and "PASSED" in proc.stdout


def test_every_code_is_documented() -> None:
    text = (DOCS / "validate.md").read_text() + (DOCS / "evidence.md").read_text()
    documented = set(re.findall(r"`([A-Z][A-Z0-9_]+)`", text))
    assert set(CODES) <= documented, sorted(set(CODES) - documented)


def test_control_characters_are_escaped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from validate_builders import build_run

    run = build_run(tmp_path / "run")
    (run / "train-data" / "evil\x1b[31m.bin").write_text("x")
    assert main([str(run)]) == 1  # a file no round accounts for (an error, issue 41)
    out = capsys.readouterr().out
    assert "\x1b" not in out and "TRAIN_DATA_UNEXPECTED" in out
