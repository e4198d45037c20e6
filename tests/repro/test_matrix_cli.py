"""``rlk-repro matrix``: every cell of the ablation matrix in one root, checked by rlk-validate matrix;
``--resume`` finishes an interrupted matrix without rerunning finished cells or losing files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlk_repro import cli
from rlk_repro.engine.trainer import Trainer

SMALL = ["--rounds", "1", "--prompts-per-round", "1", "--samples-per-prompt", "2", "--max-new-tokens", "4",
         "--chunk-size", "8"]
CELLS = {"control-RR", "native-PP", *(f"{m}-{xy}" for m in ("attention", "ffn", "logp") for xy in ("PR", "RP", "PP"))}


def _root(out: str) -> Path:
    return Path(out.strip().splitlines()[-1].split(": ", 1)[1])


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    out = tmp_path_factory.mktemp("matrix")
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = cli.main(["matrix", "--output", str(out), *SMALL])
    return code, _root(buf.getvalue())


def test_every_cell_runs_and_the_matrix_validates(matrix):
    code, root = matrix
    assert code == cli.EXIT_OK
    assert {p.name for p in root.iterdir() if p.is_dir()} == CELLS
    report = json.loads((root / "matrix-report.json").read_text())
    assert report["verdict"] == "passed"
    control = json.loads((root / "control-RR" / "bitwise-validation.json").read_text())
    native = json.loads((root / "native-PP" / "bitwise-validation.json").read_text())
    assert control["mismatch_count"] == 0 and control["element_count"] > 0
    assert native["mismatch_count"] > 0
    manifest = json.loads((root / "attention-PR" / "manifest.json").read_text())
    assert manifest["plan"] == {"attention": "P/R", "ffn": "R/R", "logp": "R/R"}


def test_resume_runs_only_unfinished_cells_and_keeps_the_interrupted_files(matrix, capsys):
    _, root = matrix
    (root / "ffn-PR" / "exit-code").unlink()  # as if the process died inside the cell
    before = (root / "logp-RP" / "manifest.json").stat().st_mtime_ns
    assert cli.main(["matrix", "--resume", str(root), *SMALL]) == cli.EXIT_OK
    err = capsys.readouterr().err
    assert "ffn-PR           was interrupted" in err and "logp-RP          finished earlier" in err
    assert (root / "logp-RP" / "manifest.json").stat().st_mtime_ns == before
    assert (root / "ffn-PR" / "exit-code").read_text() == "0\n"
    assert len(list(root.glob("ffn-PR.interrupted-*"))) == 1


def test_a_control_cell_that_mismatches_fails_the_matrix(tmp_path, monkeypatch, capsys):
    real_step = Trainer.step

    def perturbed(self, samples):
        res = real_step(self, samples)
        res.train_logprobs = [torch.nextafter(t, torch.full_like(t, -1.0)) for t in res.train_logprobs]
        return res

    monkeypatch.setattr(Trainer, "step", perturbed)
    code = cli.main(["matrix", "--output", str(tmp_path), "--cells", "control-RR", *SMALL])
    assert code == cli.EXIT_MISMATCH
    assert "control-RR" in capsys.readouterr().out


@pytest.mark.parametrize("args", [["--cells", "ffn-XX"], ["--resume", "/nonexistent/matrix"], ["--rounds", "0"]])
def test_bad_matrix_arguments_exit_2(args, tmp_path, capsys):
    assert cli.main(["matrix", "--output", str(tmp_path), *args]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.strip() and "Traceback" not in err
    assert not any(tmp_path.iterdir())
