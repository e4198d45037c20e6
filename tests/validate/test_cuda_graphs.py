"""CUDA-graph evidence against the manifest (rlk_validate.cuda_graphs): the vLLM readbacks' ``cuda_graphs`` field
as rlk_vllm_plugin.cudagraphs writes it, checked against the profile the run asked for. Torch-free."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from validate_builders import RR, build_run, mutate_json

from rlk_validate.cuda_graphs import requested

N = 8  # prompts x samples of the seeds' profile here: exact capture sizes 1..8
VLLM = "readbacks/vllm-rollout-3000.json"


def _section(sizes=range(1, N + 1), captured=range(1, N + 1), mode="FULL_DECODE_ONLY", decode=None, mixed=None):
    """What the plugin records for a run whose decode batches shrink from N to 1 (8 steps each) after prefill."""
    decode = decode if decode is not None else [("FULL", b, b, b, 8) for b in range(1, N + 1)]
    mixed = mixed if mixed is not None else [("NONE", 40, 40, N, 1), ("NONE", 23, 23, 5, 2)]
    return {"recorded": True, "runner": "v2", "target": "vllm.v1.worker.gpu.cudagraph_utils:CudaGraphManager.dispatch",
            "settings": {"compilation_mode": "VLLM_COMPILE", "cudagraph_mode": mode, "capture_sizes": list(sizes),
                         "decode_query_len": 1, "max_num_reqs": N},
            "captured": [{"mode": "FULL", "num_tokens": t, "num_reqs": t, "uniform_token_count": 1} for t in captured],
            "dispatch": [{"mode": m, "graph_tokens": g, "batch_tokens": b, "num_reqs": r, "decode": True, "count": c}
                         for m, g, b, r, c in decode]
            + [{"mode": m, "graph_tokens": g, "batch_tokens": b, "num_reqs": r, "decode": False, "count": c}
               for m, g, b, r, c in mixed]}


def _run(tmp_path: Path, section: dict | None, ask: dict | None = None, how: str = "config") -> Path:
    run = build_run(tmp_path / "run", RR, engine="frameworks")
    if section is not None:
        mutate_json(run / VLLM, lambda d: d.update(cuda_graphs=section))
    ask = {"cudagraph_mode": "FULL_DECODE_ONLY", "capture_sizes": list(range(1, N + 1))} if ask is None else ask
    if how == "config" and ask:
        mutate_json(run / "manifest.json", lambda m: m.setdefault("config", {}).update(cuda_graphs=ask))
    elif how == "command":
        flag = json.dumps({"cudagraph_mode": ask["cudagraph_mode"], "cudagraph_capture_sizes": ask["capture_sizes"]})
        mutate_json(run / "manifest.json", lambda m: m["command"].extend(["--vllm-compilation-config", flag]))
    return run


def _gating(r) -> list[str]:
    return [c for c in r.codes if c != "CUDA_GRAPH_SUMMARY"]


@pytest.mark.parametrize("how", ["config", "command"])
def test_decode_replaying_its_own_graph_passes(tmp_path: Path, cli, how: str) -> None:
    r = cli(_run(tmp_path, _section(), how=how))
    assert r.code == 0, r.codes
    (s,) = r.findings("CUDA_GRAPH_SUMMARY")
    assert s["details"]["replays"] == {str(b): 8 for b in range(1, N + 1)} and s["details"]["eager_steps"] == 3


def test_the_vime_launch_asks_for_sizes_1_to_prompts_times_samples() -> None:
    m = {"config": {"vime": {"cuda_graph_decode": True, "prompts_per_round": 2, "samples_per_prompt": 4}}}
    assert requested(m)["capture_sizes"] == list(range(1, 9))
    assert requested({"config": {"vime": {"cuda_graph_decode": False}}}) is None


def test_eager_decode_fails(tmp_path: Path, cli) -> None:
    decode = [("FULL", b, b, b, 8) for b in range(2, N + 1)] + [("NONE", 1, 1, 1, 3)]
    r = cli(_run(tmp_path, _section(decode=decode)))
    assert r.code == 1 and r.codes.count("CUDA_GRAPH_DECODE_EAGER") == 1, r.codes
    assert r.findings("CUDA_GRAPH_DECODE_EAGER")[0]["details"] == {"steps": 3, "sizes": [1]}


def test_decode_outside_the_captured_sizes_fails(tmp_path: Path, cli) -> None:
    decode = [("FULL", b, b, b, 8) for b in range(1, N + 1)] + [("NONE", 12, 12, 12, 2)]
    r = cli(_run(tmp_path, _section(decode=decode)))
    assert r.code == 1 and "CUDA_GRAPH_DECODE_EAGER" in r.codes
    assert "outside the captured sizes (largest 8)" in r.findings("CUDA_GRAPH_DECODE_EAGER")[0]["message"]


def test_decode_padded_to_a_larger_graph_fails(tmp_path: Path, cli) -> None:
    decode = [("FULL", b, b, b, 8) for b in range(1, N + 1) if b != 3] + [("FULL", 4, 3, 3, 8)]
    r = cli(_run(tmp_path, _section(decode=decode)))
    assert r.code == 1 and r.codes.count("CUDA_GRAPH_DECODE_PADDED") == 1, r.codes
    assert r.findings("CUDA_GRAPH_DECODE_PADDED")[0]["details"]["pairs"] == [[3, 4]]


def test_other_settings_than_asked_fail(tmp_path: Path, cli) -> None:
    r = cli(_run(tmp_path, _section(sizes=[1, 2, 4, 8], captured=[1, 2, 4, 8],
                                    decode=[("FULL", b, b, b, 8) for b in (1, 2, 4, 8)])))
    assert r.code == 1 and "CUDA_GRAPH_SETTINGS_MISMATCH" in r.codes and "CUDA_GRAPH_NOT_CAPTURED" in r.codes
    r = cli(_run(tmp_path / "p", _section(mode="PIECEWISE")))
    assert r.code == 1 and "CUDA_GRAPH_SETTINGS_MISMATCH" in r.codes


def test_a_size_never_captured_fails(tmp_path: Path, cli) -> None:
    r = cli(_run(tmp_path, _section(captured=[b for b in range(1, N + 1) if b != 5],
                                    decode=[("FULL", b, b, b, 8) for b in range(1, N + 1) if b != 5])))
    assert r.code == 1 and _gating(r) == ["CUDA_GRAPH_NOT_CAPTURED"], r.codes
    assert r.findings("CUDA_GRAPH_NOT_CAPTURED")[0]["details"]["sizes"] == [5]


def test_no_evidence_is_incomplete(tmp_path: Path, cli) -> None:
    r = cli(_run(tmp_path, None))
    assert r.code == 2 and _gating(r) == ["CUDA_GRAPH_EVIDENCE_MISSING"], r.codes
    unrecorded = {"recorded": False, "reason": "vllm.v1.worker.gpu.cudagraph_utils:CudaGraphManager.dispatch is "
                  "not in this vLLM"}
    r = cli(_run(tmp_path / "u", unrecorded))
    assert r.code == 2 and "not in this vLLM" in r.findings("CUDA_GRAPH_EVIDENCE_MISSING")[0]["message"]
    r = cli(_run(tmp_path / "d", _section(decode=[])))  # graphs captured, no decode step ever dispatched
    assert r.code == 2 and _gating(r) == ["CUDA_GRAPH_EVIDENCE_MISSING"], r.codes


def test_a_run_that_asked_for_nothing_is_only_summarised(tmp_path: Path, cli) -> None:
    decode = [("NONE", b, b, b, 8) for b in range(1, N + 1)]  # eager: fine where nothing was asked
    r = cli(_run(tmp_path, _section(decode=decode), ask={}, how="none"))
    assert r.code == 0 and "CUDA_GRAPH_SUMMARY" in r.codes and "CUDA_GRAPH_DECODE_EAGER" not in r.codes


def test_an_eager_engine_with_no_capture_sizes_is_valid_evidence(tmp_path: Path, cli) -> None:
    """vLLM under enforce_eager records capture_sizes [] (found on the H200: every ladder rung, which runs eager,
    failed CUDA_GRAPH_EVIDENCE_INVALID)."""
    decode = [("NONE", b, b, b, 8) for b in range(1, N + 1)]
    s = _section(sizes=[], captured=[], mode="NONE", decode=decode)
    r = cli(_run(tmp_path, s, ask={}, how="none"))
    assert r.code == 0 and "CUDA_GRAPH_EVIDENCE_INVALID" not in r.codes, r.codes


@pytest.mark.parametrize("edit", [
    lambda s: s.update(recorded="yes"),
    lambda s: s["dispatch"][0].update(count=0),
    lambda s: s["dispatch"][0].pop("decode"),
    lambda s: s.update(settings=None),
    lambda s: s["captured"].append({"mode": "FULL", "num_tokens": 0}),
    lambda s: s["settings"].update(capture_sizes=[0]),
    lambda s: s["settings"].update(capture_sizes="1-8"),
], ids=["recorded-str", "count-0", "no-decode-flag", "dispatch-without-settings", "size-0", "capture-size-0",
        "capture-sizes-str"])
def test_invalid_evidence_fails(tmp_path: Path, cli, edit) -> None:
    s = _section()
    edit(s)
    r = cli(_run(tmp_path, s))
    assert r.code == 1 and "CUDA_GRAPH_EVIDENCE_INVALID" in r.codes, r.codes
