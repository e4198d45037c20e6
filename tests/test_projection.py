"""The 8-GPU paper projection (benchmarks/projection.py) is computed from the committed measurements."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture()
def projection(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("rlk_projection", REPO / "benchmarks" / "projection.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for rel in (
        "h200/linear.json",
        "h200/attention_prefill.json",
        "h200/attention_backward.json",
        "h200x2/collectives/collectives.json",
    ):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / "benchmarks" / "results" / rel, tmp_path / rel)
    monkeypatch.setattr(mod, "ROOT", tmp_path)
    return mod


def test_gemm_time_follows_the_measured_rate(projection, tmp_path):
    before = projection.project(256 * 2048, 8192)
    path = tmp_path / "h200/linear.json"
    data = json.loads(path.read_text())
    for row in data["rows"]:
        row["rlk_tflops"] /= 2
    path.write_text(json.dumps(data))
    after = projection.project(256 * 2048, 8192)
    gemm = [p["steps"]["rlk"]["per_micro_batch_ms"]["gemm_ms"] for p in (before, after)]
    assert gemm[1] == pytest.approx(2 * gemm[0])
    # the native path did not change, so the ratio moved
    assert after["steps"]["native"]["step_s"] == before["steps"]["native"]["step_s"]
    assert after["rlk_vs_native"] < before["rlk_vs_native"]


def test_memory_and_parameters(projection):
    p = projection.project(256 * 2048, 8192)
    assert 8.0e9 < p["params"]["total"] < 8.4e9  # Qwen3-8B with untied head
    mem = p["memory_per_gpu"]
    parts = sum(v for k, v in mem.items() if k not in ("training_total_gib", "logp_native_logits_gib"))
    assert mem["training_total_gib"] == pytest.approx(parts)
    assert mem["logp_rlk_gib"] < mem["logp_native_logits_gib"] / 100  # O(T x 256) vs T x V/TP logits
    assert p["micro_batches"] == 32


def test_cli_writes_json_and_markdown(projection, tmp_path, capsys):
    out = tmp_path / "out"
    assert projection.main(["--out", str(out)]) == 0
    data = json.loads((out / "projection_qwen3-8b_tp4_cp2.json").read_text())
    assert data["parallel"] == {"tp": 4, "cp": 2, "gpus": 8, "dp": 1}
    assert "Projected rlk / native" in (out / "projection_qwen3-8b_tp4_cp2.md").read_text()


def test_tp_invariant_partials_double_the_row_parallel_bytes(projection):
    """Issue 39: the fp32 partials' extra bytes at TP 4 / 8 — the forward's row-parallel reductions in fp32 instead of
    bf16, twice the bytes; more of them per rank at TP 8 ((W-1)/W); time at the measured bus bandwidths."""
    p = projection.project(256 * 2048, 8192)
    tp4, tp8 = p["tp_invariant_partials"]["tp4"], p["tp_invariant_partials"]["tp8"]
    per = tp4["train_bytes_per_rank_per_micro_batch"]
    assert per["fp32"] == 2 * per["bf16"] == 2 * 36 * 2 * 0.75 * 8192 * 4096 * 2
    assert tp4["train_extra_bytes_per_rank_per_step"] == (per["fp32"] - per["bf16"]) * p["micro_batches"]
    assert tp8["train_extra_bytes_per_rank_per_step"] / tp4["train_extra_bytes_per_rank_per_step"] == pytest.approx(
        (7 / 8) / (3 / 4))
    bw = p["inputs"]["collective_busbw_gbps"]["reduce_scatter"]
    assert tp4["train_extra_ms_per_step_at_native_busbw"] == pytest.approx(
        tp4["train_extra_bytes_per_rank_per_step"] / (bw["native"] * 1e9) * 1e3)
    assert tp4["rollout_decode_extra_bytes_per_token_per_rank"] == 36 * 2 * 2 * 0.75 * 4096 * 2
