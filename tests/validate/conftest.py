"""Fixtures of the rlk-validate tests. The builders live in validate_builders.py next to this file."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from validate_builders import build_run

from rlk_validate.cli import main


@pytest.fixture
def good_run(tmp_path: Path) -> Path:
    return build_run(tmp_path / "run")


class CliResult:
    def __init__(self, code: int, out: str, err: str, doc: dict | None):
        self.code, self.out, self.err, self.doc = code, out, err, doc

    @property
    def codes(self) -> list[str]:
        return [f["code"] for f in (self.doc or {}).get("findings", [])]

    def findings(self, code: str) -> list[dict]:
        return [f for f in (self.doc or {}).get("findings", []) if f["code"] == code]


@pytest.fixture
def cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """Run the CLI in-process with --json into a file outside the checked tree."""
    counter = [0]

    def run(*args: str, json_out: bool = True) -> CliResult:
        counter[0] += 1
        out_path = tmp_path / f"report-{counter[0]}.json"
        argv = [str(a) for a in args] + (["--json", str(out_path)] if json_out else [])
        code = main(argv)
        cap = capsys.readouterr()
        doc = json.loads(out_path.read_text()) if out_path.exists() else None
        return CliResult(code, cap.out, cap.err, doc)

    return run
