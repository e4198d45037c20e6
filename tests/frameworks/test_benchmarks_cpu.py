"""The framework benchmarks run end to end on the CPU on tiny models (the figures mean nothing there; that the
scripts, their stages and their reports work does): Megatron's step timing, vLLM's throughput stages on the local
stand-in engine."""

from __future__ import annotations

import json
import sys

import pytest
from _frameworks import REPO, child_env

BENCH = REPO / "benchmarks" / "frameworks"


@pytest.mark.megatron
@pytest.mark.slow
def test_megatron_step_timing_cpu(worker, tmp_path):
    proc = worker([sys.executable, str(BENCH / "megatron_gpu.py"), "--device", "cpu", "--tiny", "--out",
                   str(tmp_path)], timeout=300)
    assert proc.returncode == 0, proc.log[-4000:]
    doc = json.loads((tmp_path / "megatron_gpu.json").read_text())
    timing = doc["timing"]["tiny"]
    assert timing["rlk"]["median_ms"] > 0 and timing["stock"]["median_ms"] > 0 and timing["speed_ratio"] > 0
    assert doc["checks"] == [] and doc["logp_memory"]["tokens"] == 64


@pytest.mark.slow
def test_vllm_throughput_stages_cpu(worker, tmp_path):
    proc = worker([sys.executable, str(BENCH / "vllm_gpu.py"), "--tiny", "--device", "cpu", "--prompts", "4",
                   "--samples", "2", "--max-tokens", "4", "--decode-batch", "2", "--decode-steps", "2", "--ttft-runs",
                   "1", "--gen-repeats", "2", "--out", str(tmp_path)], timeout=300,
                  env=child_env(CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 0, proc.log[-4000:]
    doc = json.loads((tmp_path / "vllm_gpu.json").read_text())
    assert set(doc["throughput"]["ratios"]) == {"rr_vs_native", "rr_vs_batch_invariant"}
    assert len(doc["stages"]["rr"]["result"]["generate"]["seconds_each"]) == 2
