"""A phase's native / consistency pairs (``run --phase P --pair``) and the paired report (issue 37), with tiny
local-engine runs on the CPU. The phase is shortened here (2 rounds, seeds 1234 and 2345) so that two pairs run in
seconds; the checkout is recorded as clean (the merge rule refuses a dirty one, and the suite may run in one)."""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

import pytest

from rlk_repro import cli, phases, runs
from rlk_repro.phase_pairs import PAIR_FILE, cell_argv

TINY = ["--prompts-per-round", "2", "--samples-per-prompt", "2", "--max-new-tokens", "4", "--lr", "3e-3",
        "--top-p", "1"]


@pytest.fixture(scope="module")
def pair_root(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setitem(phases.PHASES, "short", {"steps": 2, "seeds": (1234, 2345)})
    mp.setattr(runs, "repo_state", lambda path: {"name": "rlk", "path": str(path), "sha": "a" * 40, "dirty": False})
    out = tmp_path_factory.mktemp("pairs")
    try:
        assert cli.main(["run", "--phase", "short", "--pair", "--output", str(out), *TINY]) == 0
    finally:
        mp.undo()
    (root,) = out.iterdir()
    return root


def _manifest(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def test_pairs_run_seed_by_seed_native_first(pair_root):
    doc = json.loads((pair_root / PAIR_FILE).read_text())
    assert doc["phase"] == "short" and doc["seeds"] == [1234, 2345]
    order = [(c["seed"], c["mode"]) for c in doc["cells"]]
    assert order == [(1234, "native"), (1234, "consistency"), (2345, "native"), (2345, "consistency")]
    for c in doc["cells"]:
        m = _manifest(pair_root / c["dir"])
        assert (m["mode"], m["seeds"]["train"], m["rounds"], m["config"]["phase"]) == (c["mode"], c["seed"], 2, "short")
        assert m["plan"] == dict.fromkeys(("attention", "ffn", "logp"), "P/P" if c["mode"] == "native" else "R/R")
        assert "--pair" not in m["command"] and m["command"][-4:] == ["--mode", c["mode"], "--seed", str(c["seed"])]
        bitwise = json.loads((pair_root / c["dir"] / "bitwise-validation.json").read_text())
        if c["mode"] == "consistency":
            assert bitwise["mismatch_count"] == 0
        else:  # the negative control: P/P differs
            assert bitwise["mismatch_count"] > 0


def _report(paths, out: Path, capsys) -> tuple[int, dict | None, str]:
    code = cli.main(["report", *map(str, paths), "--output", str(out)])
    err = capsys.readouterr().err
    path = out / "metrics-summary.json"
    return code, json.loads(path.read_text()) if path.is_file() else None, err


def test_report_gives_paired_estimates_and_the_seeds_table(pair_root, tmp_path, capsys):
    code, doc, _ = _report([pair_root], tmp_path / "rep", capsys)
    assert code == 0
    paired = doc["paired"]
    assert paired["phase"] == "short" and paired["seeds"] == [1234, 2345] and paired["unpaired"] == []
    by = {(r["name"]): r for r in doc["runs"]}
    for key in ("reward_mean", "rollout_tokens_per_s", "round_seconds"):
        diffs = [by[f"seed{s}-consistency"][key] - by[f"seed{s}-native"][key] for s in (1234, 2345)]
        est = paired["estimates"][key]["difference"]
        assert est["n"] == 2 and est["mean"] == pytest.approx(statistics.fmean(diffs))
        half = 12.706 * statistics.stdev(diffs) / 2 ** 0.5  # t(1) at 95%
        assert est["ci95"] == pytest.approx([est["mean"] - half, est["mean"] + half])
        natives = [by[f"seed{s}-native"][key] for s in (1234, 2345)]
        assert paired["estimates"][key]["native"]["mean"] == pytest.approx(statistics.fmean(natives))
    ratios = [by[f"seed{s}-consistency"]["round_seconds"] / by[f"seed{s}-native"]["round_seconds"] - 1
              for s in (1234, 2345)]
    assert paired["overhead"]["round time"]["mean"] == pytest.approx(statistics.fmean(ratios))
    table = paired["table"]
    assert [(r["seed"], r["mode"]) for r in table] == [(1234, "native"), (1234, "consistency"), (2345, "native"),
                                                        (2345, "consistency")]
    for r in table:
        assert r["compared_tokens"] == by[r["run"]]["compared_tokens"] > 0
        assert (r["mismatch_count"] == 0) == (r["mode"] == "consistency")
    text = (tmp_path / "rep" / "metrics-summary.md").read_text()
    # the fixture shortened the phase (2 of its 8 rounds): the heading says so (--phase-rounds' runs are named alike)
    assert "## Phase short, shortened to 2 of its 8 rounds: 2 paired seed(s)" in text
    assert "active-token exposure" in text


def test_run_dirs_that_record_a_phase_are_paired_too(pair_root, tmp_path, capsys):
    cells = sorted(p for p in pair_root.iterdir() if p.is_dir())
    code, doc, _ = _report(cells, tmp_path / "rep", capsys)
    assert code == 0 and doc["paired"]["seeds"] == [1234, 2345]
    code, doc, _ = _report([pair_root / "seed1234-native", pair_root / "seed2345-consistency"], tmp_path / "r2", capsys)
    assert code == 0 and doc["paired"] is None  # no seed with both runs: a plain report
    (tmp_path / "half").mkdir()
    shutil.copytree(pair_root / "seed1234-native", tmp_path / "half" / "seed1234-native")
    (tmp_path / "half" / PAIR_FILE).write_text((pair_root / PAIR_FILE).read_text())
    code, doc, err = _report([tmp_path / "half"], tmp_path / "r3", capsys)
    assert code == 2 and doc is None and "no seed has both" in err  # a phase root must pair


def _tampered(pair_root: Path, tmp_path: Path, edit) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(pair_root, copy)
    path = copy / "seed2345-consistency" / "manifest.json"
    m = json.loads(path.read_text())
    edit(m)
    path.write_text(json.dumps(m))
    return copy


@pytest.mark.parametrize("edit, what", [
    (lambda m: m["repos"][0].update(sha="b" * 40), "code revision"),
    (lambda m: m["inputs"].update(prompts="sha256:" + "0" * 64), "prompt hash"),
    (lambda m: m["config"].update(enforce_eager=True), "CUDA-graph settings"),
    (lambda m: m["repos"][0].update(dirty=True), "code revision"),  # one dirty run: its revision differs
    (lambda m: m["inputs"].update(checkpoint="sha256:" + "1" * 64), "different checkpoints"),
    (lambda m: m["config"].update(phase="precision"), "phases differ"),
])
def test_runs_that_differ_are_refused_in_one_line(pair_root, tmp_path, capsys, edit, what):
    root = _tampered(pair_root, tmp_path, edit)
    code, doc, err = _report([root], tmp_path / "rep", capsys)
    assert code == 2 and doc is None
    assert what in err and len(err.strip().splitlines()) == 1


def test_pair_refuses_what_it_sets(capsys, tmp_path):
    for extra in (["--mode", "native"], ["--seed", "1234"], ["--ffn-case", "P/R"]):
        assert cli.main(["run", "--phase", "short", "--pair", "--output", str(tmp_path), *extra]) == 2
        assert "is not taken with it" in capsys.readouterr().err
    assert cli.main(["run", "--pair", "--output", str(tmp_path)]) == 2
    assert "give --phase" in capsys.readouterr().err
    assert cli.main(["plan", "--phase", "short", "--pair"]) == 2
    assert "--pair is an option of `rlk-repro run" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_case_variable_overriding_the_mode_is_refused(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("RL_KERNEL_FFN_CASE", "P/R")
    assert cli.main(["run", "--phase", "short", "--pair", "--output", str(tmp_path)]) == 2
    assert "RL_KERNEL_<MODULE>_CASE" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_frameworks_cell_arguments():
    argv = ["run", "--engine", "frameworks", "--phase", "precision", "--pair", "--output", "out", "--tp", "1"]
    assert cell_argv(argv, 2345, "native", Path("out/phase-x")) == [
        "run", "--engine", "frameworks", "--phase", "precision", "--tp", "1", "--output", "out/phase-x",
        "--mode", "native", "--seed", "2345"]
