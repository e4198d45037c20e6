"""`rlk-repro run --resume` on CUDA (issue 41): a local-engine run interrupted in round 2 and continued from its round
state gives the uninterrupted run's train-data bit for bit on the GPU too (the round state carries the CUDA RNG and
the optimizer moments as the CPU suite's `tests/repro/test_resume.py` checks them on the CPU), and the continuation
validates with `--require-bitwise` across the chain. A negative control: a continuation from a state whose weights
were nudged differs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlk_repro import cli
from rlk_repro.engine import local
from rlk_repro.resume import STATE_DIR
from rlk_repro.runs import file_sha256
from rlk_validate.validate import Options, validate_run

pytestmark = pytest.mark.gpu

ARGS = ["--device", "cuda", "--prompts-per-round", "4", "--samples-per-prompt", "4", "--max-new-tokens", "12",
        "--seed", "23", "--rounds", "4"]


def _dirs(root: Path) -> set[Path]:
    return {p for p in root.iterdir() if p.is_dir()} if root.exists() else set()


def _run(root: Path, *args: str) -> tuple[int, Path]:
    before = _dirs(root)
    code = cli.main(["run", "--output", str(root), *ARGS, *args])
    (new,) = _dirs(root) - before
    return code, new


def _bytes(run: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((run / "train-data").iterdir())}


def _tensors(run: Path) -> dict[str, dict[str, bytes]]:
    from safetensors import safe_open
    out = {}
    for p in sorted((run / "train-data").iterdir()):
        with safe_open(str(p), "pt") as f:
            out[p.name] = {k: f.get_tensor(k).contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                           for k in sorted(f.keys())}
    return out


def _interrupted(root: Path, monkeypatch, at: int) -> Path:
    real = local._round

    def round_(cfg, ses, run_dir, rnd, *rest):
        if rnd == at:
            raise KeyboardInterrupt
        return real(cfg, ses, run_dir, rnd, *rest)

    monkeypatch.setattr(local, "_round", round_)
    code, parent = _run(root)
    monkeypatch.setattr(local, "_round", real)
    assert code == cli.EXIT_INTERRUPTED
    return parent


def _resume(root: Path, parent: Path) -> Path:
    before = _dirs(root)
    assert cli.main(["run", "--resume", str(parent)]) == 0
    (child,) = _dirs(root) - before
    return child


def test_a_resumed_cuda_run_is_the_uninterrupted_run_bit_for_bit(tmp_path, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    code, whole = _run(tmp_path / "whole")
    assert code == 0
    root = tmp_path / "runs"
    parent = _interrupted(root, monkeypatch, 2)
    assert json.loads((parent / STATE_DIR / "state.json").read_text())["next_round"] == 2
    child = _resume(root, parent)
    assert _tensors(child) == _tensors(whole)
    rep = validate_run(child, Options(require_bitwise=True))
    assert rep.verdict == "passed", [f.to_json() for f in rep.findings if f.severity in ("error", "incomplete")]
    assert len(rep.bitwise["rounds"]) == 4

    # negative control: the same continuation from a state whose weights moved (and whose record was rewritten to
    # match) differs after the inherited rounds
    root2 = tmp_path / "nudged"
    parent2 = _interrupted(root2, monkeypatch, 2)
    state = parent2 / STATE_DIR / "state.pt"
    saved = torch.load(state, map_location="cpu", weights_only=False)
    nudged = _nudge(saved)
    assert nudged, "no floating-point weight found in the round state"
    torch.save(saved, state)
    doc_path = parent2 / STATE_DIR / "state.json"
    doc = json.loads(doc_path.read_text())
    doc.update(sha256=file_sha256(state), bytes=state.stat().st_size)  # a consistent edit: the resume takes it
    doc_path.write_text(json.dumps(doc))
    child2 = _resume(root2, parent2)
    assert _tensors(child2)["round-0000.rank0.safetensors"] == _tensors(whole)["round-0000.rank0.safetensors"]
    assert _tensors(child2) != _tensors(whole)


def _nudge(obj) -> bool:
    """Move the first large floating-point tensor in ``obj`` (a weight, not the optimizer's step count) by 1e-2."""
    if isinstance(obj, torch.Tensor) and obj.is_floating_point() and obj.numel() >= 1024:
        obj.add_(1e-2)
        return True
    if isinstance(obj, dict):
        return any(_nudge(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_nudge(v) for v in obj)
    return False
