"""The one committed frameworks R/R run (``tests/validate/data/frameworks-rr/``) passes ``rlk-validate
--require-bitwise`` in a fresh interpreter without torch, and the same check fails on a copy whose train side
moved one token's log-prob by one ulp. It runs in the full suite and in the torch-free validator suite."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file
from validate_builders import load_round, run_subprocess, tree_state

DATA = Path(__file__).resolve().parent / "data" / "frameworks-rr"
MAX_BYTES = 2 * 1024 * 1024


def _run_dir() -> Path:
    runs = sorted(p for p in DATA.iterdir() if p.is_dir())
    assert len(runs) == 1, f"exactly one committed run is kept in {DATA}, found {[p.name for p in runs]}"
    return runs[0]


def test_one_small_whole_frameworks_run_is_committed():
    run = _run_dir()
    size = sum(p.stat().st_size for p in run.rglob("*") if p.is_file())
    assert size <= MAX_BYTES, f"{run.name}: {size} bytes, more than 2 MiB"
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["engine"] == "frameworks" and manifest["run_id"]
    assert manifest["plan"] == {"attention": "R/R", "ffn": "R/R", "logp": "R/R"}
    assert manifest["packages"]["vllm"] != "not installed" and manifest["packages"]["megatron-core"] != "not installed"
    rounds = [json.loads(line)["round"] for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert rounds == list(range(manifest["rounds"])) and len(rounds) >= 2  # at least one weight update between rounds
    tensors = sorted(p.name for p in (run / "train-data").glob("*.safetensors"))
    assert tensors == [f"round-{r:04d}.rank0.safetensors" for r in rounds]


def test_committed_run_passes_require_bitwise_without_torch(tmp_path):
    run = _run_dir()
    before = tree_state(run)
    report = tmp_path / "report.json"
    proc = run_subprocess(str(run), "--require-bitwise", "--json", str(report))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(report.read_text())
    assert doc["verdict"] == "passed" and doc["bitwise"]["complete"]
    assert doc["bitwise"]["mismatch_count"] == 0 and doc["bitwise"]["element_count"] > 20_000
    assert {p["framework"] for side in doc["readbacks"]["sides"].values() for p in side["processes"]} == {
        "vllm", "megatron"}
    assert tree_state(run) == before, "validating must not write into the committed run"


def test_one_ulp_on_the_train_side_fails(tmp_path):
    run = shutil.copytree(_run_dir(), tmp_path / "run")
    path = run / "train-data" / "round-0001.rank0.safetensors"
    with safe_open(str(path), "np") as fh:
        metadata = fh.metadata()
    tensors = load_round(path)
    rows, cols = np.nonzero(tensors["response_mask"])
    i, j = rows[len(rows) // 2], cols[len(cols) // 2]
    lp = tensors["train_logprobs"].copy()
    lp[i, j] = np.nextafter(lp[i, j], np.float32(0.0))
    tensors["train_logprobs"] = lp
    save_file(tensors, str(path), metadata=metadata)
    report = tmp_path / "report.json"
    proc = run_subprocess(str(run), "--require-bitwise", "--json", str(report))
    doc = json.loads(report.read_text())
    assert proc.returncode == 1 and doc["verdict"] == "failed", proc.stdout + proc.stderr
    assert doc["bitwise"]["mismatch_count"] == 1
    assert "BITWISE_MISMATCH" in {f["code"] for f in doc["findings"]}
