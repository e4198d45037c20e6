"""``rlk-repro run --resume RUN_DIR`` for ``--engine frameworks`` on the GPU (issue 41), zero tolerance: real vLLM +
real megatron-core, an R/R run interrupted in round 3 of 4 (round state saved after round 2: ``--state-every 2``) and
resumed in a new attempt gives the uninterrupted run's train-data bit for bit (rounds 0-1 inherited, 2-3 computed
again from the state: the Megatron masters and AdamW state, the RNG streams, the weights synced into a fresh vLLM) and
its final weights (every bf16 parameter and fp32 master, by sha256); the attempt passes ``rlk-validate
--require-bitwise`` across the chain. Negative control: the parent's state with one master nudged (its document
rewritten to match, so the resume takes it) gives the inherited rounds unchanged and every later round and the final
weights different, and the first attempt's chain then fails (``RESUME_STATE_MISMATCH``). The CPU side (the trainer
state round trip, the CLI): tests/repro/test_frameworks_resume.py. Sitting: ``sitting.sh run exact-resume:480``."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from _frameworks import HERE, child_env
from vllm_stages import _write_plugin_site

RUN = ["--model", "qwen3-0.6b", "--rounds", "4", "--prompts-per-round", "8", "--samples-per-prompt", "4",
       "--max-new-tokens", "32", "--seed", "29", "--gpu-memory-utilization", "0.3", "--enforce-eager",
       "--state-every", "2"]


def _tensors(run: Path) -> dict[str, dict[str, str]]:
    """Each train-data file's tensors, by sha256 of their bytes (safetensors orders its header keys at random)."""
    from safetensors import safe_open

    out = {}
    for p in sorted((run / "train-data").iterdir()):
        with safe_open(str(p), "pt") as f:
            out[p.name] = {k: hashlib.sha256(f.get_tensor(k).contiguous().reshape(-1).view(torch.uint8).numpy()
                                             .tobytes()).hexdigest() for k in sorted(f.keys())}
    return out


def _nudge(obj) -> bool:
    """Move the first large fp32 tensor of the state's masters by 1e-2 (in place)."""
    for t in obj["master"].values():
        if t.is_floating_point() and t.numel() >= 1024:
            t.add_(1e-2)
            return True
    return False


@pytest.mark.gpu
@pytest.mark.vllm
@pytest.mark.megatron
def test_a_resumed_frameworks_run_is_the_uninterrupted_run_bit_for_bit_gpu(worker, tmp_path):
    site = tmp_path / "plugin-site"
    _write_plugin_site(site)
    env = child_env(PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
                    VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_DISABLE_COMPILE_CACHE="1")

    def rlk(name: str, *args: str, code: int = 0) -> None:
        proc = worker([sys.executable, str(HERE / "resume_worker.py"), *args], timeout=300, name=name, env=env)
        assert proc.returncode == code, proc.log[-6000:]

    def new_dir(root: Path, before: set[Path]) -> Path:
        (d,) = {p for p in root.iterdir() if p.is_dir()} - before
        return d

    def validate(run: Path, name: str) -> dict:
        report = tmp_path / f"{name}.json"
        worker([sys.executable, "-m", "rlk_validate", str(run), "--require-bitwise", "--json", str(report)],
               timeout=180, name=name, env=env)
        return json.loads(report.read_text())

    whole_root, root = tmp_path / "whole", tmp_path / "runs"
    rlk("whole", "--weights", str(tmp_path / "whole-weights.json"), "run", "--engine", "frameworks", *RUN,
        "--output", str(whole_root))
    whole = new_dir(whole_root, set())
    (whole / "round-state" / "state.pt").unlink()  # 12 bytes a parameter; only the parent's is needed
    rlk("interrupted", "--interrupt-at", "3", "run", "--engine", "frameworks", *RUN, "--output", str(root), code=130)
    parent = new_dir(root, set())
    assert json.loads((parent / "round-state" / "state.json").read_text())["next_round"] == 2
    assert len(list((parent / "train-data").iterdir())) == 3  # rounds 0..2 ran, the state is after round 1's sync
    parent_files = {p: p.stat().st_mtime_ns for p in parent.rglob("*") if p.is_file()}

    before = {parent}
    rlk("resumed", "--weights", str(tmp_path / "resumed-weights.json"), "run", "--resume", str(parent))
    child = new_dir(root, before)
    assert {p: p.stat().st_mtime_ns for p in parent.rglob("*") if p.is_file()} == parent_files  # append-only
    assert _tensors(child) == _tensors(whole)
    mine, theirs = (json.loads((tmp_path / f"{n}-weights.json").read_text()) for n in ("resumed", "whole"))
    assert mine == theirs and len(mine["master"]) > 0
    doc = validate(child, "validate-resumed")
    assert doc["verdict"] == "passed", json.dumps(doc["findings"])[:3000]
    assert doc["bitwise"]["mismatch_count"] == 0 and len(doc["bitwise"]["rounds"]) == 4
    assert json.loads((child / "manifest.json").read_text())["resume"]["from_round"] == 2

    # negative control: the parent's state with one master moved (its document rewritten to match)
    state = parent / "round-state" / "state.pt"
    saved = torch.load(state, map_location="cpu", weights_only=True)
    assert _nudge(saved), "no fp32 master of 1024+ elements in the round state"
    torch.save(saved, state)
    del saved
    doc_path = parent / "round-state" / "state.json"
    sdoc = json.loads(doc_path.read_text())
    h = hashlib.sha256()
    with open(state, "rb") as fh:
        while chunk := fh.read(1 << 24):
            h.update(chunk)
    sdoc.update(sha256="sha256:" + h.hexdigest(), bytes=state.stat().st_size)
    doc_path.write_text(json.dumps(sdoc))
    codes = {f["code"] for f in validate(child, "validate-after-nudge")["findings"]}
    assert "RESUME_STATE_MISMATCH" in codes, codes  # the first attempt's parent no longer holds its state
    before = {p for p in root.iterdir() if p.is_dir()}
    rlk("nudged", "--weights", str(tmp_path / "nudged-weights.json"), "run", "--resume", str(parent))
    nudged = new_dir(root, before)
    got, want = _tensors(nudged), _tensors(whole)
    assert [got[f"round-000{r}.rank0.safetensors"] == want[f"round-000{r}.rank0.safetensors"] for r in range(4)] == [
        True, True, False, False]
    off = json.loads((tmp_path / "nudged-weights.json").read_text())
    assert off["master"] != theirs["master"] and off["params"] != theirs["params"]
