"""The contract digest handshake (rlk_core.digest, issue 37): both sides' documents agree when they run the same
arithmetic, and any difference of route, sampling, TP-invariance or backend stops the handshake, naming it."""

from __future__ import annotations

import pytest

from rlk_core.digest import ContractDigestError, handshake, side_document
from rlk_core.plan import RoutePlan
from rlk_core.readback import ReadbackRecorder
from rlk_validate.digest import DIGEST_SCHEMA, digest_of

SAMPLING = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
PLANS = [RoutePlan("R/R", "R/R", "R/R"), RoutePlan("P/P", "P/P", "P/P"), RoutePlan("P/R", "R/R", "R/P")]


def _sides(plan_train: RoutePlan, plan_roll: RoutePlan | None = None, roll_sampling: dict | None = None,
           roll_leaves: int = 0):
    plan_roll = plan_roll or plan_train
    recs = {s: ReadbackRecorder("local", s, p, mode="strict") for s, p in (("train", plan_train),
                                                                          ("rollout", plan_roll))}
    train = side_document(plan_train, "train", "cpu", logprobs="processed", tp_leaves=0, **SAMPLING)
    roll = side_document(plan_roll, "rollout", "cpu", logprobs="processed", tp_leaves=roll_leaves,
                         **(roll_sampling or SAMPLING))
    return recs, {"train": (recs["train"], *train), "rollout": (recs["rollout"], *roll)}


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.name)
def test_the_sides_agree_and_record_the_digest(plan):
    recs, sides = _sides(plan)
    digest = handshake(sides, "start")
    assert digest == digest_of(sides["train"][1]) == digest_of(sides["rollout"][1])
    assert handshake(sides, "sync 1", expected=digest) == digest
    for rec in recs.values():
        doc = rec.to_dict()["contract_digest"]
        assert doc["digest"] == digest and doc["document"]["schema"] == DIGEST_SCHEMA
        assert doc["checks"] == [{"at": "start", "digest": digest}, {"at": "sync 1", "digest": digest}]
        assert doc["detail"]["side"] == rec.side
    document = sides["train"][1]
    for module, case in plan.as_dict().items():
        entry = document["modules"][module]
        assert entry["case"] == case
        assert ("contracts" in entry) == (case == "R/R")  # only an R/R module has arithmetic both sides share
    if plan.case("ffn") == "R/R":
        ffn = document["modules"]["ffn"]
        assert {"rlk.gemm.bi.v1", "rlk.rms_norm.v1", "rlk.swiglu.v1"} <= set(ffn["contracts"])
        assert ffn["backends"] == ["rlk.reference"] and set(ffn["builds"]) == set(ffn["contracts"])


def test_the_sides_own_detail_stays_out_of_the_digest():
    plan = PLANS[0]
    train = side_document(plan, "train", "cpu", logprobs="unfiltered", tp_leaves=0, **SAMPLING)
    roll = side_document(plan, "rollout", "cpu", logprobs="processed", tp_leaves=0, **SAMPLING)
    assert train[1]["ops"] != roll[1]["ops"]  # attention_varlen vs the paged ops: the same contracts
    assert digest_of(train[0]) == digest_of(roll[0])


@pytest.mark.parametrize("change, where", [
    (dict(plan_roll=RoutePlan("R/R", "R/P", "R/R")), "modules.ffn"),
    (dict(roll_sampling={**SAMPLING, "temperature": 0.7}), "sampling.temperature"),
    (dict(roll_sampling={**SAMPLING, "top_p": 0.9}), "sampling.top_p"),
    (dict(roll_leaves=8), "tp_invariant_leaves"),
])
def test_a_difference_stops_the_handshake_naming_it(change, where):
    recs, sides = _sides(PLANS[0], **change)
    with pytest.raises(ContractDigestError, match=f"at start: the rollout and train sides run different.*{where}"):
        handshake(sides, "start")
    assert all("contract_digest" not in r.to_dict() for r in recs.values())  # nothing recorded as agreed


def test_a_backend_the_other_side_does_not_prefer_stops_it(monkeypatch):
    from rlk_core import digest

    real = digest._preferred
    monkeypatch.setattr(digest, "_preferred",
                        lambda op, dev: "rlk.other" if op == "attention_decode" else real(op, dev))
    _, sides = _sides(PLANS[0])
    with pytest.raises(ContractDigestError, match="modules.attention.backends"):
        handshake(sides, "start")


def test_a_digest_that_changes_during_the_run_stops_it():
    _, sides = _sides(PLANS[0])
    start = handshake(sides, "start")
    _, other = _sides(PLANS[1])
    with pytest.raises(ContractDigestError, match="at sync 3: both sides now run .* not the run's"):
        handshake(other, "sync 3", expected=start)


def test_a_backend_without_python_source_is_hashed_by_its_name(monkeypatch):
    """A compiled op's handle (rlk.cuda launches torch.ops) has no source file: the build hash names it instead."""
    import functools

    import rlk_core.ops  # noqa: F401
    from rlk_core import digest
    from rlk_core.backends import REGISTRY, Backend

    b = Backend(id="rlk.nosource", op="swiglu", fn=functools.partial(max), devices=("cpu",), priority=-100)
    REGISTRY.register(b)
    try:
        digest._build_hash.cache_clear()
        one = digest._build_hash("rlk.swiglu.v1", ("rlk.nosource", "rlk.reference"), "cpu")
        assert one != digest._build_hash("rlk.swiglu.v1", ("rlk.reference",), "cpu")
    finally:
        REGISTRY.unregister("swiglu", "rlk.nosource")
        digest._build_hash.cache_clear()
