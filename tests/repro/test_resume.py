"""`rlk-repro run --resume RUN_DIR` (issue 41): an interrupted local run continues in a new attempt directory
beside it from its last round state, with the parent's options, bit-identical to the uninterrupted run; the
parent is never written; rlk-validate checks the chain (rlk_validate.chain) and the bitwise claim across it."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from rlk_repro import cli
from rlk_repro.engine import local
from rlk_repro.resume import STATE_DIR
from rlk_validate.validate import Options, validate_run

SMALL = ["--prompts-per-round", "2", "--samples-per-prompt", "3", "--max-new-tokens", "6", "--chunk-size", "8",
         "--page-size", "4", "--max-num-seqs", "4", "--seed", "11"]
TIMINGS = ("rollout_seconds", "train_seconds", "rollout_tokens_per_s", "rollout_generated_tokens_per_s",
           "train_tokens_per_s", "peak_memory_bytes", "triton_jit", "python_gc", "rollout_step_ms")


def _dirs(root: Path) -> set[Path]:
    return {p for p in root.iterdir() if p.is_dir()}


def _run(root: Path, *args: str) -> tuple[int, Path]:
    before = _dirs(root) if root.exists() else set()
    code = cli.main(["run", "--output", str(root), *SMALL, *args])
    (new,) = _dirs(root) - before
    return code, new


def _interrupted(root: Path, monkeypatch, at: int, *args: str) -> Path:
    """A run whose round ``at`` is interrupted (Ctrl-C): exit 130, the rounds before it written."""
    real = local._round

    def round_(cfg, ses, run_dir, rnd, *rest):
        if rnd == at:
            raise KeyboardInterrupt
        return real(cfg, ses, run_dir, rnd, *rest)

    monkeypatch.setattr(local, "_round", round_)
    code, parent = _run(root, *args)
    monkeypatch.setattr(local, "_round", real)
    assert code == cli.EXIT_INTERRUPTED and (parent / "exit-code").read_text() == "130\n"
    return parent


def _metrics(run: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMINGS} for r in rows]


def _tree(run: Path, sub: str) -> dict[str, tuple]:
    """Each train-data file's metadata and tensors, as bytes (safetensors orders its header keys at random)."""
    from safetensors import safe_open

    out = {}
    for p in sorted((run / sub).iterdir()):
        with safe_open(str(p), "pt") as f:
            tensors = {k: (str(f.get_tensor(k).dtype), tuple(f.get_tensor(k).shape),
                           f.get_tensor(k).contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes())
                       for k in sorted(f.keys())}
            out[p.name] = (f.metadata(), tensors)
    return out


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> dict[str, Path]:
    """The uninterrupted 4-round runs the continuations are compared with."""
    out = {}
    for mode in ("consistency", "native"):
        root = tmp_path_factory.mktemp(f"whole-{mode}")
        code, run = _run(root, "--rounds", "4", "--mode", mode)
        assert code == 0
        out[mode] = run
    return out


@pytest.mark.parametrize("mode", ["consistency", "native"])
def test_a_resumed_run_is_the_uninterrupted_run_bit_for_bit(tmp_path, monkeypatch, capsys, whole, mode) -> None:
    root = tmp_path / "runs"
    parent = _interrupted(root, monkeypatch, 2, "--rounds", "4", "--mode", mode)
    parent_files = {p: p.read_bytes() for p in parent.rglob("*") if p.is_file()}
    assert json.loads((parent / STATE_DIR / "state.json").read_text())["next_round"] == 2
    assert f"continue this run with: rlk-repro run --resume {parent}" in capsys.readouterr().err
    before = _dirs(root)
    assert cli.main(["run", "--resume", str(parent)]) == 0
    (child,) = _dirs(root) - before  # a new attempt beside the parent
    err = capsys.readouterr().err
    assert f"resuming {parent}" in err and "at round 3 of 4" in err
    # the parent is untouched (append-only)
    assert {p: p.read_bytes() for p in parent.rglob("*") if p.is_file()} == parent_files
    # every round's train-data and metrics (timings aside) are the uninterrupted run's
    assert _tree(child, "train-data") == _tree(whole[mode], "train-data")
    assert _metrics(child) == _metrics(whole[mode])
    mine, theirs = (json.loads((r / "bitwise-validation.json").read_text()) for r in (child, whole[mode]))
    assert mine == theirs
    m = json.loads((child / "manifest.json").read_text())
    assert m["resume"]["parent"] == {"run_id": json.loads((parent / "manifest.json").read_text())["run_id"],
                                     "dir": parent.name}
    assert m["resume"]["from_round"] == 2 and sorted(m["resume"]["inherited"]) == [
        "train-data/round-0000.rank0.safetensors", "train-data/round-0001.rank0.safetensors"]
    # the validator follows the chain and checks every round of the attempt
    rep = validate_run(child, Options(require_bitwise=mode == "consistency"))
    assert rep.verdict == "passed", [f.to_json() for f in rep.findings if f.severity in ("error", "incomplete")]
    assert rep.bitwise["rounds"][-1]["round"] == 3 and len(rep.bitwise["rounds"]) == 4


def test_state_every_n_rounds_resumes_from_the_last_state(tmp_path, monkeypatch, capsys, whole) -> None:
    root = tmp_path / "runs"
    parent = _interrupted(root, monkeypatch, 3, "--rounds", "4", "--state-every", "2")
    assert len(list((parent / "train-data").iterdir())) == 3  # rounds 0..2 ran ...
    assert json.loads((parent / STATE_DIR / "state.json").read_text())["next_round"] == 2  # ... the state is at 2
    before = _dirs(root)
    assert cli.main(["run", "--resume", str(parent)]) == 0
    (child,) = _dirs(root) - before
    assert "at round 3 of 4" in capsys.readouterr().err  # round 2 (the third) runs again
    assert _tree(child, "train-data") == _tree(whole["consistency"], "train-data")


def _resumed(tmp_path, monkeypatch) -> tuple[Path, Path]:
    root = tmp_path / "runs"
    parent = _interrupted(root, monkeypatch, 1, "--rounds", "3")
    before = _dirs(root)
    assert cli.main(["run", "--resume", str(parent)]) == 0
    (child,) = _dirs(root) - before
    return parent, child


def _codes(run: Path) -> set[str]:
    return {f.code for f in validate_run(run, Options(require_bitwise=True)).findings}


def test_the_validator_finds_a_broken_chain(tmp_path, monkeypatch) -> None:
    parent, child = _resumed(tmp_path, monkeypatch)
    assert not {c for c in _codes(child) if c.startswith("RESUME_")}
    # the parent's state changed after the attempt started from it
    state = parent / STATE_DIR / "state.pt"
    saved = state.read_bytes()
    state.write_bytes(saved[:-1] + bytes([saved[-1] ^ 1]))
    assert "RESUME_STATE_MISMATCH" in _codes(child)
    state.write_bytes(saved)
    # an inherited round that is not the parent's
    rel = parent / "train-data" / "round-0000.rank0.safetensors"
    good = rel.read_bytes()
    rel.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    assert "RESUME_INHERITED_DIFFERS" in _codes(child)
    rel.write_bytes(good)
    # the parent gone: the inherited rounds cannot be traced
    moved = tmp_path / "elsewhere"
    shutil.move(parent, moved)
    assert "RESUME_PARENT_MISSING" in _codes(child)
    shutil.move(moved, parent)
    # another run in the parent's place
    m = json.loads((parent / "manifest.json").read_text())
    (parent / "manifest.json").write_text(json.dumps({**m, "run_id": "20990101T000000Z-000000"}))
    assert "RESUME_PARENT_MISMATCH" in _codes(child)
    (parent / "manifest.json").write_text(json.dumps(m))
    # a continuation that ran another experiment
    cm = json.loads((child / "manifest.json").read_text())
    (child / "manifest.json").write_text(json.dumps({**cm, "seeds": {"train": 99, "rollout": 99}}))
    assert "RESUME_CONFIG_DIFFERS" in _codes(child)
    (child / "manifest.json").write_text(json.dumps({**cm, "resume": {**cm["resume"], "from_round": "1"}}))
    assert "RESUME_FIELD_INVALID" in _codes(child)


def test_resume_takes_the_recorded_options_and_refuses_others(tmp_path, monkeypatch, capsys) -> None:
    root = tmp_path / "runs"
    parent = _interrupted(root, monkeypatch, 1, "--rounds", "3")
    before = _dirs(root)
    for args, words in ((["--rounds", "9"], "--rounds 9 differs from the recorded 3"),
                        (["--seed", "5"], "--seed 5 differs from the recorded 11"),
                        (["--mode", "native"], "--mode gives plan"),
                        (["--tp", "2"], "--tp is not an option of a local run")):
        capsys.readouterr()
        assert cli.main(["run", "--resume", str(parent), *args]) == cli.EXIT_USAGE
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1, err
    assert cli.main(["run", "--resume", str(parent), "--output", str(tmp_path / "elsewhere")]) == cli.EXIT_USAGE
    assert "beside RUN_DIR" in capsys.readouterr().err and not (tmp_path / "elsewhere").exists()
    assert _dirs(root) == before  # nothing created
    assert cli.main(["run", "--resume", str(parent), "--rounds", "3", "--seed", "11"]) == 0  # the same: fine


def test_what_cannot_be_resumed_exits_2(tmp_path, monkeypatch, capsys) -> None:
    root = tmp_path / "runs"
    code, finished = _run(root, "--rounds", "2")
    assert code == 0
    assert cli.main(["run", "--resume", str(finished)]) == cli.EXIT_USAGE
    assert "nothing to resume" in capsys.readouterr().err
    parent = _interrupted(root, monkeypatch, 1, "--rounds", "3", "--state-every", "0")
    assert cli.main(["run", "--resume", str(parent)]) == cli.EXIT_USAGE
    assert "saved no round state" in capsys.readouterr().err
    assert cli.main(["run", "--resume", str(tmp_path / "nope")]) == cli.EXIT_USAGE
    assert not os.path.exists(tmp_path / "nope")
