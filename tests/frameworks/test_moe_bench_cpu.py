"""The MoE benchmarks' CPU side (issue 36's performance part): megatron_moe_gpu.py runs end to end on the tiny
Qwen3-MoE model (the figures mean nothing here; that both sides build what they say and report does), its argument
parsing, and the sitting stage ``moe-bench`` wired in sitting.sh."""

from __future__ import annotations

import json
import sys

import pytest
from _frameworks import REPO

BENCH = REPO / "benchmarks" / "frameworks"


@pytest.mark.megatron
@pytest.mark.slow
def test_megatron_moe_step_timing_cpu(worker, tmp_path):
    pytest.importorskip("megatron.core")
    proc = worker([sys.executable, str(BENCH / "megatron_moe_gpu.py"), "--device", "cpu", "--tiny", "--out",
                   str(tmp_path)], timeout=300)
    assert proc.returncode == 0, proc.log[-4000:]
    doc = json.loads((tmp_path / "megatron_moe_gpu.json").read_text())
    t = doc["timing"]
    assert t["rlk"]["classes"] == ["RlkMoELayer", "RlkTopKRouter", "RlkGroupedExperts"]
    assert t["rlk"]["experts_layout"] == "grouped" and t["rlk"]["plan"]["RL_KERNEL_FFN_CASE"] == "R/R"
    assert t["stock"]["classes"] == ["MoELayer", "TopKRouter", "SequentialMLP"]
    assert t["stock"]["experts_layout"] == "sequential" and t["stock"]["plan"]["RL_KERNEL_FFN_CASE"] == "P/P"
    assert t["stock"]["plan"]["RL_KERNEL_ATTENTION_CASE"] == "R/R"  # only the MoE layer differs
    assert t["rlk"]["median_ms"] > 0 and t["stock"]["speed_ratio"] > 0
    assert doc["speed_ratios"] == {"stock": t["stock"]["speed_ratio"]}
    # the same model and weights: only the MoE arithmetic differs (not bitwise, but close)
    assert 0 < t["stock"]["logp_max_abs_diff_vs_rlk"] < 1e-3
    grouped = t["stock-grouped"]
    assert "median_ms" in grouped or "GroupedMLP" in grouped["skipped"]
    assert (tmp_path / "megatron_moe_gpu.md").read_text().count("| rlk |") == 1


def test_megatron_moe_arguments(tmp_path):
    sys.path.insert(0, str(BENCH))
    import megatron_moe_gpu as M

    assert M.side_env("rlk")["RL_KERNEL_FFN_CASE"] == "R/R"
    assert M.side_env("stock-grouped") == {**M.side_env("rlk"), "RL_KERNEL_FFN_CASE": "P/P"}
    with pytest.raises(ValueError):
        M.side_env("native")
    for bad in ("stock", "rlk,other", ""):
        with pytest.raises(SystemExit) as e:
            M.main(["--out", str(tmp_path), "--sides", bad])
        assert e.value.code == 2
    cfg = M.model_cfg("qwen3-moe-30b-a3b-L2", tiny=False)
    assert (cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
            cfg.num_hidden_layers) == (2048, 128, 8, 768, 2)


def test_sitting_stage_moe_bench_is_wired():
    text = (BENCH / "sitting.sh").read_text()
    assert "[moe-bench]=" in text and "moe-bench)" in text
    arm = text.split("moe-bench)", 1)[1].split(";;", 1)[0]
    assert "bench_moe.py" in arm and "megatron_moe_gpu.py" in arm and "_moe_C" in arm
    header = text.split("set -u", 1)[0]
    assert "moe-bench" in header
    assert "moe-bench" in (BENCH / "README.md").read_text()
