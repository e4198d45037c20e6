"""The claim of the local engine: R/R is bitwise equal round after round; P/P is not (negative control);
every mixed cell runs and reports its own mismatch."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlk_core.plan import RoutePlan
from rlk_repro.engine.local import run_local

ROUNDS = 5  # tests/repro/conftest.py runs the shared R/R and P/P runs for this many rounds


def test_rr_is_bitwise_equal_over_rounds_with_updates(rr_run):
    rounds = rr_run.rounds
    assert len(rounds) == ROUNDS >= 5
    assert all(r["element_count"] > 0 for r in rounds)
    assert [r["mismatch_count"] for r in rounds] == [0] * ROUNDS, rounds
    assert all(r["max_abs_diff"] == 0.0 for r in rounds)
    assert rr_run.bitwise["torch_equal"] and rr_run.bitwise["require_exact"]
    assert rr_run.exit_code == 0
    # the weights really changed every round, so every round compares a new policy
    assert all(r["weights_changed"] for r in rounds) and rr_run.weights_changed_every_round
    assert all(r["reward_std"] > 0 for r in rounds), "rewards must vary within the batch for GRPO to update"


def test_rr_run_exercises_chunking_batching_and_mixed_lengths(rr_run):
    import safetensors.torch as st

    rounds = rr_run.rounds
    assert sum(r["chunked_prompts"] for r in rounds) > 0, "no prompt was prefilled in chunks"
    assert all(r["decode_steps"] > 0 and r["prefill_steps"] > 0 for r in rounds)
    # continuous batching: requests arrive and finish at different steps, so the scheduled set changes often
    assert all(r["batch_composition_changes"] >= max(5, r["rollout_steps"] // 4) for r in rounds), rounds
    assert all(r["max_batch"] >= 3 for r in rounds)
    # where each round's rollout time went: one wall time per step, the slowest named; the GC record per phase
    for r in rounds:
        steps = r["rollout_step_ms"]
        assert steps["steps"] == r["rollout_steps"] and 0 < steps["median"] <= steps["p90"] <= steps["max"]
        assert steps["total_s"] <= r["rollout_seconds"] and len(steps["slowest"]) == min(5, r["rollout_steps"])
        # the host's part of a step before its first wait, and the rest: both there, both within the step
        assert 0 < steps["launch_median"] <= steps["max"] and 0 <= steps["rest_median"] <= steps["max"]
        assert isinstance(r["python_gc"], dict)
    lengths = set()
    for path in sorted((rr_run.run_dir / "train-data").glob("*.safetensors")):
        t = st.load_file(str(path))
        mask = t["response_mask"]
        first = mask.int().argmax(dim=1)  # prompt length = position of the first response token
        lengths |= set(first.tolist())
    assert len(lengths) >= 3, f"prompt lengths {sorted(lengths)}"


def test_pp_is_the_negative_control(pp_run, rr_run):
    assert pp_run.bitwise["mismatch_count"] > 0
    assert not pp_run.bitwise["require_exact"]
    assert pp_run.exit_code == 0  # mismatches are expected and not an error for P/P
    assert pp_run.bitwise["element_count"] > 0
    print(f"\nR/R: {rr_run.bitwise['mismatch_count']} of {rr_run.bitwise['element_count']} differ; "
          f"P/P: {pp_run.bitwise['mismatch_count']} of {pp_run.bitwise['element_count']} differ "
          f"(max |diff| {pp_run.bitwise['max_abs_diff']:.3g})")


MIXED = [(m, c) for m in ("attention", "ffn", "logp") for c in ("P/R", "R/P")]


@pytest.mark.parametrize(("module", "case"), MIXED, ids=[f"{m}-{c.replace('/', '')}" for m, c in MIXED])
def test_mixed_cell_runs_and_reports_its_mismatch(module, case, tmp_path, small_config):
    cases = {"attention": "R/R", "ffn": "R/R", "logp": "R/R", module: case}
    res = run_local(small_config(RoutePlan(**cases), rounds=1), tmp_path)
    assert res.exit_code == 0
    assert not res.bitwise["require_exact"]
    assert res.bitwise["element_count"] > 0
    print(f"\n{module} {case} (rest R/R): {res.bitwise['mismatch_count']} of {res.bitwise['element_count']} "
          f"tokens differ, max |diff| {res.bitwise['max_abs_diff']:.3g}")
    import json

    manifest = json.loads((res.run_dir / "manifest.json").read_text())
    assert manifest["plan"][module] == case and manifest["mode"] == "mixed"
    for path in (res.run_dir / "readbacks").glob("*.json"):
        doc = json.loads(path.read_text())
        letter = case.split("/")[0 if doc["side"] == "train" else 1]
        rec = doc["modules"][module]
        assert rec["case"] == letter
        assert rec["implementation"] == ("rlk" if letter == "R" else "production")
        assert rec["backend_id"].startswith("rlk." if letter == "R" else "production.")


@pytest.mark.parametrize("cases, reserved", [(dict(attention="R/R", ffn="P/P", logp="P/P"), True),
                                              (dict(attention="P/R", ffn="R/R", logp="R/R"), True),
                                              (dict(attention="P/P", ffn="R/R", logp="R/R"), False)])
def test_the_rope_table_is_reserved_where_rlk_runs_attention(cases, reserved, tmp_path, small_config, monkeypatch):
    """Where either side runs rlk attention, the engine reserves rope's cos/sin table for every position the model
    can see, once, before any step (else each rope call sizes it from positions.max(): a host sync per call on a
    GPU); where neither does, nothing is reserved."""
    from rlk_repro.engine import local
    from rlk_repro.model import config

    calls = []
    monkeypatch.setattr(local, "reserve_tables", lambda *a: calls.append(a))
    run_local(small_config(RoutePlan(**cases), rounds=1), tmp_path)
    cfg = config.PRESETS["tiny"]
    expected = [(torch.device("cpu"), cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings)]
    assert calls == (expected if reserved else [])
    if reserved:  # a run longer than the model's positions reserves its own length (no position past the table)
        calls.clear()
        longer = dataclasses.replace(cfg, max_position_embeddings=8)
        monkeypatch.setitem(config.PRESETS, "tiny", longer)
        run_local(small_config(RoutePlan(**cases), rounds=1), tmp_path / "longer")
        assert len(calls) == 1 and calls[0][3] > 8
