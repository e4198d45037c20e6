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


@pytest.mark.megatron
@pytest.mark.slow
def test_megatron_tp_cost_cpu(worker, tmp_path):
    """--tp-cost G: the rlk model built without and with RL_KERNEL_TP_INVARIANT=G in one process, each timed; every
    row-parallel linear built as asked (the stage checks it), the ratio against the 10% target in the JSON."""
    proc = worker([sys.executable, str(BENCH / "megatron_gpu.py"), "--device", "cpu", "--tiny", "--tp-cost", "8",
                   "--out", str(tmp_path)], timeout=300)
    assert proc.returncode == 0, proc.log[-4000:]
    doc = json.loads((tmp_path / "megatron_gpu.json").read_text())
    cost = doc["tp_cost"]["tiny"]
    assert cost["off"]["model"] == {"row_parallel_by_leaves": {"0": 4}}
    assert cost["invariant"]["model"] == {"row_parallel_by_leaves": {"8": 4}}
    assert cost["time_ratio"] > 0 and cost["target"] == "time_ratio <= 1.1" and "within_target" in cost
    assert set(doc["stages"]) == {"init", "tp_cost_tiny"}


@pytest.mark.slow
def test_vllm_tp_cost_stages_cpu(worker, tmp_path):
    """--tp-invariant G adds stage rr_tp (R/R with the variable) after rr (without it) and the tp_cost section; on the
    CPU stand-in engine the mode is not wired, so it reads "did not run" and no pass is claimed."""
    proc = worker([sys.executable, str(BENCH / "vllm_gpu.py"), "--tiny", "--device", "cpu", "--prompts", "4",
                   "--samples", "2", "--max-tokens", "4", "--decode-batch", "2", "--decode-steps", "2", "--ttft-runs",
                   "1", "--gen-repeats", "1", "--tp-invariant", "8", "--skip", "pp,bi", "--out", str(tmp_path)],
                  timeout=300, env=child_env(CUDA_VISIBLE_DEVICES="", RL_KERNEL_TP_INVARIANT="4"))
    assert proc.returncode == 0, proc.log[-4000:]
    doc = json.loads((tmp_path / "vllm_gpu.json").read_text())
    st = doc["stages"]
    assert [n for n, v in st.items() if v["status"] == "ok"] == ["ckpt", "rr", "rr_tp"]
    env = {n: st[n]["result"]["env"]["RL_KERNEL_TP_INVARIANT"] for n in ("rr", "rr_tp")}
    assert env == {"rr": None, "rr_tp": "8"}  # the outer variable cleared for every stage; rr_tp's own
    cost = doc["tp_cost"]
    assert cost["time_ratio"] > 0 and cost["invariant_mode_ran"] is False and cost["within_target"] is False


def test_moe_loop_summaries_read_a_run_directory(tmp_path):
    """moe_loop_gpu.py's K3 KL and routing summaries on a run directory written by rlk-repro's own writers: K3 is 0
    where the two sides agree and ``mean(r - 1 - log r)`` where they do not; the routing counts are the rounds' sums."""
    import math

    import torch

    sys.path.insert(0, str(BENCH))
    from moe_loop_gpu import k3_kl, routing

    from rlk_repro import runs

    roll = [torch.tensor([-1.0, -2.0]), torch.tensor([-0.5])]
    (tmp_path / "train-data").mkdir()
    runs.write_train_data(tmp_path, 0, 0, [[1, 2], [3]], [[4, 5], [6]], roll, roll, [0.0, 1.0], [0.0, 0.0])
    assert k3_kl(tmp_path) == {"k3_kl_mean": 0.0, "k3_tokens": 3}
    train = [torch.tensor([-1.5, -2.0]), torch.tensor([-0.25])]
    runs.write_train_data(tmp_path, 1, 0, [[1, 2], [3]], [[4, 5], [6]], roll, train, [0.0, 1.0], [0.0, 0.0])
    want = sum(math.expm1(d) - d for d in (-0.5, 0.0, 0.25)) / 6  # both rounds: 6 tokens
    assert abs(k3_kl(tmp_path)["k3_kl_mean"] - want) < 1e-12
    rows = [{"routing_compared_tokens": 10, "routing_mismatch_tokens": 0},
            {"routing_compared_tokens": 30, "routing_mismatch_tokens": 3}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert routing(tmp_path) == {"routing_compared_tokens": 40, "routing_mismatch_tokens": 3,
                                 "routing_mismatch_fraction": 0.075, "routing_rounds": 2}


def test_the_loop_summary_keeps_each_rounds_evidence_and_names_rounds_without_a_learning_signal(tmp_path):
    """loop_gpu.py's summary (loop, filtered stages) keeps every round's informative share, entropy estimate and
    distinct responses, and names the rounds whose advantages are all 0 (issue 41, item 13: the 10-round R/R run
    whose reward saturated by round 3 was summarised by its counts alone)."""
    import torch

    sys.path.insert(0, str(BENCH))
    from loop_gpu import EVIDENCE_KEYS, _summary

    from rlk_repro import runs

    (tmp_path / "train-data").mkdir()
    lp = [torch.tensor([-1.0, -2.0]), torch.tensor([-0.5])]
    runs.write_train_data(tmp_path, 0, 0, [[1, 2], [3]], [[4, 5], [6]], lp, lp, [0.2, 0.7], [-1.0, 1.0])
    runs.write_train_data(tmp_path, 1, 0, [[1, 2], [3]], [[4, 5], [6]], lp, lp, [0.5, 0.5], [0.0, 0.0])
    rows = [{"round": r, "compared_tokens": 3, "mismatch_count": 0, "max_abs_diff": 0.0, "weights_changed": True,
             "rollout_tokens_per_s": 1.0, "train_tokens_per_s": 1.0, "weight_sync_seconds": 0.1,
             "informative_fraction": 1.0 - r / 2,
             "informative_mismatch_count": 0, "sampled_nll_mean": (1.25, 0.25)[r], "max_entropy": 11.9,
             "distinct_responses": 2, "samples": 2, "reward_std": 0.25 * (1 - r)} for r in (0, 1)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = _summary(tmp_path)
    assert s["zero_advantage_rounds"] == [1]
    assert [r["informative_fraction"] for r in s["per_round"]] == [1.0, 0.5]
    assert [r["sampled_nll_mean"] for r in s["per_round"]] == [1.25, 0.25]
    assert all(set(EVIDENCE_KEYS) <= set(r) for r in s["per_round"])


def test_tp_emu_loop_stage_commands_parse_and_plan_the_emulation(capsys):
    """tp_emu_loop_gpu.py (sitting.sh stage tp-emu-loop, issue 35): its two ``rlk-repro run`` command lines, planned on
    the CPU: R/R at emulated train TP 4 with SP in invariant mode, then the bi-control, both runnable by the engine."""
    import json
    import shlex

    from rlk_repro import cli

    sys.path.insert(0, str(BENCH))
    import tp_emu_loop_gpu

    assert tp_emu_loop_gpu.main(["--out", "/tmp/unused", "--dry-run"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2
    for line, control in zip(lines, (False, True)):
        argv = shlex.split(line.split(" -m rlk_repro ", 1)[1])
        assert argv[0] == "run"
        i = argv.index("--output")
        argv = ["plan", *argv[1:i], *argv[i + 2:]]
        argv.remove("--debug")
        assert cli.main(argv) == cli.EXIT_OK
        doc = json.loads(capsys.readouterr().out)
        emu = doc["parallel"]["train_tp_emulated"]
        assert emu["tp"] == 4 and emu["sequence_parallel"] and emu["negative_control"] is control
        assert doc["parallel"]["engine_problem"] is None and doc["env"]["RL_KERNEL_TP_INVARIANT"] == "8"
    rounds = int(lines[0].split("--rounds ")[1].split()[0])
    per_round = 64 * 8 * 40  # prompts x samples x the shortest response limit (max-new-tokens / 2)
    assert rounds * per_round >= 100_000  # >= 100,000 compared tokens unless rollouts stop early


def test_sitting_stage_tp_emu_loop_is_wired():
    text = (BENCH / "sitting.sh").read_text()
    assert "[tp-emu-loop]=" in text and "tp-emu-loop)" in text and "tp_emu_loop_gpu.py" in text
