"""ReadbackRecorder.count's repeat path (a report that passed the policy before only counts): counts stay
exact, and every policy check still runs for any report that differs (backend, contract, mode, fallback)."""

from __future__ import annotations

import logging

import pytest

from rlk_core.errors import RlkPolicyError
from rlk_core.plan import RoutePlan
from rlk_core.readback import ReadbackRecorder

PLAN = RoutePlan("R/R", "P/P", "R/R")  # ffn P on the train side


def _rec(mode: str) -> ReadbackRecorder:
    return ReadbackRecorder("megatron", "train", PLAN, mode=mode)


def test_repeats_count_exactly():
    rec = _rec("strict")
    for _ in range(7):
        rec.count("attention", "rope", "rlk.reference", "rlk.rope.v1")
    for _ in range(3):
        rec.count("attention", "rope", "rlk.reference", "rlk.rope.v1", execution_mode="graph")
    rec.count("attention", "linear", "rlk.reference", "rlk.gemm.bi.v1", provenance={"world_size": 2})
    rec.count("attention", "linear", "rlk.reference", "rlk.gemm.bi.v1", provenance={"world_size": 2})
    doc = rec.to_dict()["modules"]["attention"]
    assert doc["ops"]["rope"]["call_count"] == 10 and doc["ops"]["rope"]["execution_mode"] == "mixed"
    assert doc["ops"]["linear"]["call_count"] == 2 and doc["ops"]["linear"]["provenance"] == {"world_size": 2}
    assert doc["call_count"] == 12


def test_policy_runs_after_repeats():
    rec = _rec("strict")
    for _ in range(5):
        rec.count("attention", "rope", "rlk.reference", "rlk.rope.v1")
        rec.production("ffn", "linear", "production.megatron.ColumnParallelLinear")
    with pytest.raises(RlkPolicyError, match="production implementation"):
        rec.count("attention", "rope", "production.megatron.rope", None)
    with pytest.raises(RlkPolicyError, match="fell back"):
        rec.count("attention", "rope", "rlk.reference", "rlk.rope.v1", fallback_reason="no triton")
    with pytest.raises(RlkPolicyError, match="is P"):
        rec.count("ffn", "linear", "rlk.reference", "rlk.gemm.bi.v1")


def test_audit_violations_are_reported_every_time(caplog):
    rec = _rec("audit")
    with caplog.at_level(logging.WARNING, logger="rlk"):
        for _ in range(3):
            rec.count("ffn", "linear", "rlk.reference", "rlk.gemm.bi.v1")
    assert sum("rlk audit" in r.getMessage() for r in caplog.records) == 3
    assert rec.to_dict()["modules"]["ffn"]["call_count"] == 3
