"""benchmarks/profile_rollout.py: the local engine's rollout step under cProfile, split by callee and layer."""

from __future__ import annotations

import pstats
import re

import pytest


@pytest.fixture()
def profile(benchmark_script):
    return benchmark_script("profile_rollout")


def _shares(md: str, section: str) -> dict[str, float]:
    block = md.split(f"## {section}")[1].split("\n## ")[0]
    return {row.split("|")[1].strip(): float(row.split("|")[-2].strip().rstrip("%"))
            for row in block.splitlines() if row.startswith("| ") and row.endswith("% |")}


def test_a_tiny_run_profiles_only_the_steps_after_round_0(profile, tmp_path):
    """R/R on the tiny model, 2 rounds: the profile holds round 1's steps alone (so every layer's share is at most the
    step), the rlk route and op dispatch are inside the op table, and the engine restores its methods."""
    from rlk_repro.engine.rollout import RolloutEngine

    before = RolloutEngine._step, RolloutEngine.generate
    assert profile.main(["--out", str(tmp_path), "--rounds", "2", "--prompts", "2", "--samples", "2",
                         "--max-new-tokens", "4", "--max-num-seqs", "4"]) == 0
    assert (RolloutEngine._step, RolloutEngine.generate) == before
    md = (tmp_path / "profile.md").read_text()
    steps = int(re.search(r"\): (\d+) calls", md).group(1))
    stats = pstats.Stats(str(tmp_path / "rollout.prof"))
    step_keys = [k for k in stats.stats if k[2] == "_step" and k[0].endswith("engine/rollout.py")]
    assert [stats.stats[k][1] for k in step_keys] == [steps] and steps > 0
    direct = _shares(md, "The step by direct callee")
    assert any(name.startswith("`model/ops.py") for name in direct)
    assert 50 < sum(direct.values()) <= 100.5  # the step's callees, each counted once, its own lines aside
    layers = _shares(md, "Layers")
    op_table, route, dispatch = (layers[k] for k in list(layers)[:3])
    assert 0 < dispatch <= route <= op_table <= 100.0


def test_a_one_round_run_has_no_profiled_step(profile, tmp_path):
    with pytest.raises(SystemExit, match="rounds must be >= 2"):
        profile.main(["--out", str(tmp_path), "--rounds", "1", "--prompts", "1", "--samples", "1",
                      "--max-new-tokens", "2"])
