"""``--cuda-graph-decode`` (frameworks engine): the seeds' CUDA-graph profile, FULL_DECODE_ONLY with exact capture
sizes 1..prompts x samples, as the run configuration and manifest record it for rlk-validate's CUDA-graph gate."""

from __future__ import annotations

import json

from rlk_repro import cli
from rlk_repro.engine.frameworks import FrameworksRunConfig
from rlk_validate.cuda_graphs import requested


def test_plan_records_the_profile(capsys):
    argv = ["plan", "--engine", "frameworks", "--cuda-graph-decode", "--prompts-per-round", "2",
            "--samples-per-prompt", "4"]
    assert cli.main(argv) == 0
    c = json.loads(capsys.readouterr().out)["config"]
    assert c["cuda_graph_decode"] is True and c["enforce_eager"] is False


def test_the_profile_the_manifest_asks_for():
    cfg = FrameworksRunConfig(device="cuda", top_p=1.0, prompts_per_round=2, samples_per_prompt=4,
                              cuda_graph_decode=True)
    assert cfg.cuda_graphs == {"cudagraph_mode": "FULL_DECODE_ONLY", "capture_sizes": list(range(1, 9))}
    got = requested({"config": {"cuda_graphs": cfg.cuda_graphs}})  # the frameworks manifest's config.cuda_graphs
    assert got["cudagraph_mode"] == "FULL_DECODE_ONLY" and got["capture_sizes"] == list(range(1, 9))
    assert FrameworksRunConfig(device="cuda", top_p=1.0).cuda_graphs is None


def test_eager_and_graphs_together_and_the_local_engine_are_refused(capsys):
    assert cli.main(["plan", "--engine", "frameworks", "--cuda-graph-decode", "--enforce-eager"]) == cli.EXIT_USAGE
    assert "--enforce-eager" in capsys.readouterr().err
    assert cli.main(["plan", "--cuda-graph-decode"]) == cli.EXIT_USAGE
    assert "--cuda-graph-decode is an option of --engine frameworks" in capsys.readouterr().err
