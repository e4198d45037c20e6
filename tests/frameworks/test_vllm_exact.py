"""rlk-vllm-plugin inside real vLLM, zero tolerance: the rollout's sampled-token log-probs equal rlk-repro's
training-side recompute bit for bit (and so do a prompt alone and in the batch, a batch and its repeat, the eager
engine and the CUDA-graph one); with the plugin off, vLLM's own kernels differ (negative control); the readbacks
name rlk for every module, and at TP 2 the rlk all-reduce on every worker. ``vllm_worker.py`` runs each stage in its
own process; on the CPU rlk-repro's local rollout engine stands in for vLLM (vLLM's GPU engine does not run there)."""

from __future__ import annotations

import sys

import pytest
from _frameworks import HERE, checks, child_env, failed

WORKER = str(HERE / "vllm_worker.py")
REQUIRED = ("rr.logp_equal_trainer", "rr.alone_equal_batch", "rr.repeat_equal_first", "eager.equal_cuda_graphs",
            "pp.differs_from_trainer", "rr.readback_rlk", "eager.readback_rlk")


def _passed(proc, out, required=REQUIRED) -> dict:
    assert proc.returncode == 0, failed(proc, out)
    got = checks(out)
    assert [name for name in required if not got.get(name, {}).get("passed")] == [], failed(proc, out)
    return got


@pytest.mark.gpu
@pytest.mark.vllm
def test_rollout_logprobs_equal_training_recompute_gpu(worker, tmp_path):
    """Qwen3-0.6B shape, 256 prompts x 8 samples x 64 tokens, CUDA graphs on: 131,072 compared tokens."""
    proc = worker([sys.executable, WORKER, "--out", str(tmp_path), "--budget-s", "420"], timeout=470, name="vllm")
    got = _passed(proc, tmp_path / "vllm_exact.json")
    assert got["rr.logp_equal_trainer"]["tokens"] >= 100_000


@pytest.mark.gpu
@pytest.mark.multi_gpu
@pytest.mark.vllm
def test_tp2_every_worker_runs_the_rlk_all_reduce_gpu(worker, tmp_path):
    proc = worker([sys.executable, WORKER, "--tp", "2", "--out", str(tmp_path), "--budget-s", "540"], timeout=580,
                  name="vllm-tp2")
    # at TP 2 the trainer's TP 1 recompute differs by contract (row-parallel partial sums): reported, not required
    required = [r for r in REQUIRED if r != "rr.logp_equal_trainer"]
    _passed(proc, tmp_path / "vllm_exact.json", [*required, "rr.tp2_rlk_all_reduce_every_worker",
                                                  "eager.tp2_rlk_all_reduce_every_worker"])


@pytest.mark.slow
def test_worker_on_the_local_stand_in_cpu(worker, tmp_path):
    proc = worker([sys.executable, WORKER, "--tiny", "--device", "cpu", "--prompts", "8", "--samples", "2",
                   "--max-tokens", "8", "--decode-batch", "4", "--ttft-runs", "2", "--eager-prompts", "4",
                   "--control-seqs", "8", "--out", str(tmp_path)], timeout=300, env=child_env(CUDA_VISIBLE_DEVICES=""))
    got = _passed(proc, tmp_path / "vllm_exact.json")
    assert got["pp.differs_from_trainer"]["mismatched_tokens"] > 0 and got["rr.logp_equal_trainer"]["tokens"] > 0


def test_vllm_engine_on_the_cpu_is_refused_in_one_line(worker, tmp_path):
    proc = worker([sys.executable, WORKER, "--device", "cpu", "--engine", "vllm", "--out", str(tmp_path)], timeout=120)
    assert proc.returncode == 2 and "--engine vllm needs --device cuda" in proc.log.strip().splitlines()[-1]
