"""The contract digest handshake in the local engine, and rlk-validate's check of it (issue 37): a run's readbacks,
manifest and metrics carry the digest both sides agreed on; a side running another route stops the run before
anything is compared; a tampered, missing or disagreeing digest is a finding."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rlk_core.digest import ContractDigestError
from rlk_core.plan import RoutePlan
from rlk_repro.engine import local
from rlk_repro.engine.local import run_local
from rlk_validate.digest import digest_of
from rlk_validate.validate import validate_run

RR = RoutePlan("R/R", "R/R", "R/R")


def _digest_findings(run_dir: Path) -> list[dict]:
    return [f.to_json() for f in validate_run(run_dir).findings if f.code.startswith("CONTRACT_DIGEST")]


def _readbacks(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "readbacks").glob("*.json"))


@pytest.mark.parametrize("fixture", ["rr_run", "pp_run"])
def test_a_run_carries_one_digest_everywhere(request, fixture):
    run_dir = request.getfixturevalue(fixture).run_dir
    manifest = json.loads((run_dir / "manifest.json").read_text())
    digest = manifest["contract_digest"]
    docs = [json.loads(p.read_text())["contract_digest"] for p in _readbacks(run_dir)]
    assert len(docs) == 2 and {d["detail"]["side"] for d in docs} == {"train", "rollout"}
    for d in docs:
        assert d["digest"] == digest == digest_of(d["document"])
        assert [c["at"] for c in d["checks"]] == ["start"] + [f"sync {i}" for i in range(1, manifest["rounds"] + 1)]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["contract_digest"] for r in rows] == [digest] * manifest["rounds"]
    assert _digest_findings(run_dir) == []


def test_native_and_consistency_digests_differ(rr_run, pp_run):
    a, b = (json.loads((r.run_dir / "manifest.json").read_text())["contract_digest"] for r in (rr_run, pp_run))
    assert a != b


def _copy(run, tmp_path: Path) -> Path:
    dst = tmp_path / run.run_dir.name
    shutil.copytree(run.run_dir, dst)
    return dst


def _edit(path: Path, fn) -> None:
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(doc))


def _rollout(run_dir: Path) -> Path:
    return next(p for p in _readbacks(run_dir) if "rollout" in p.name)


def test_a_tampered_digest_is_a_finding(rr_run, tmp_path):
    run_dir = _copy(rr_run, tmp_path)
    _edit(_rollout(run_dir), lambda d: d["contract_digest"]["document"]["sampling"].update(temperature=0.5))
    codes = [f["code"] for f in _digest_findings(run_dir)]
    assert codes == ["CONTRACT_DIGEST_MISMATCH"]


def test_a_consistently_rewritten_digest_disagrees_with_the_other_side(rr_run, tmp_path):
    run_dir = _copy(rr_run, tmp_path)

    def rewrite(d):
        rec = d["contract_digest"]
        rec["document"]["modules"]["ffn"]["backends"] = ["rlk.triton"]
        rec["digest"] = digest_of(rec["document"])
        for c in rec["checks"]:
            c["digest"] = rec["digest"]
    _edit(_rollout(run_dir), rewrite)
    found = _digest_findings(run_dir)
    # the train side (and the manifest) carry another digest; the rollout's ffn ops ran rlk.reference
    assert {f["code"] for f in found} == {"CONTRACT_DIGEST_SIDES_DIFFER", "CONTRACT_DIGEST_DISAGREES"}
    disagree = [f["message"] for f in found if f["code"] == "CONTRACT_DIGEST_DISAGREES"]
    assert disagree and all("ffn op" in m and "'rlk.reference', not one of the digest's ['rlk.triton']" in m
                            for m in disagree)


def test_a_readback_of_a_process_that_ran_nothing_needs_no_digest(rr_run, tmp_path):
    """Seen on the H200: one of vLLM's Inductor compile workers loaded the plugin, executed no op and wrote a readback
    with no modules and no digest; that is not a missing digest. The same readback with modules is."""
    run_dir = _copy(rr_run, tmp_path)
    rollout = _rollout(run_dir)
    idle = json.loads(rollout.read_text())
    idle.pop("contract_digest")
    idle.update(pid=idle["pid"] + 1, modules={})
    (rollout.parent / f"vllm-rollout-{idle['pid']}.json").write_text(json.dumps(idle))
    assert "CONTRACT_DIGEST_MISSING" not in [f["code"] for f in _digest_findings(run_dir)]
    _edit(rollout, lambda d: d.pop("contract_digest"))
    assert "CONTRACT_DIGEST_MISSING" in [f["code"] for f in _digest_findings(run_dir)]


@pytest.mark.parametrize("edit, code", [
    (lambda d: d.pop("contract_digest"), "CONTRACT_DIGEST_MISSING"),
    (lambda d: d["contract_digest"]["checks"][2].update(digest="sha256:" + "0" * 64), "CONTRACT_DIGEST_CHANGED"),
    (lambda d: d["contract_digest"].update(checks=[]), "CONTRACT_DIGEST_INVALID"),
    (lambda d: d.update(plan={**d["plan"], "ffn": "R/P"}), "CONTRACT_DIGEST_DISAGREES"),
])
def test_a_readback_whose_digest_is_missing_or_inconsistent_is_a_finding(rr_run, tmp_path, edit, code):
    run_dir = _copy(rr_run, tmp_path)
    _edit(_rollout(run_dir), edit)
    assert code in [f["code"] for f in _digest_findings(run_dir)]


def test_a_metrics_line_with_another_digest_is_a_finding(rr_run, tmp_path):
    run_dir = _copy(rr_run, tmp_path)
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[1]["contract_digest"] = "sha256:" + "1" * 64
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    found = _digest_findings(run_dir)
    assert [f["code"] for f in found] == ["CONTRACT_DIGEST_DISAGREES"] and "round 1" in found[0]["message"]


def _other_route_for(side: str, monkeypatch, when: str = "start") -> None:
    """The ``side`` engine runs ffn P from the start, or (``when`` "sync") from its first weight sync on."""
    real, recorder = local.Ops, local.ReadbackRecorder
    other = RoutePlan("R/R", "P/P", "R/R")
    if when == "start":  # as a framework process that read other RL_KERNEL_*_CASE variables: its plan throughout
        monkeypatch.setattr(local, "ReadbackRecorder", lambda fw, s, plan, **kw: recorder(
            fw, s, other if s == side else plan, **kw))
        monkeypatch.setattr(local, "Ops", lambda plan, s, rec: real(other if s == side else plan, s, rec))
        return
    load, handshake, started = local.RolloutEngine.load_weights, local._handshake, []

    def noted(cfg, ses, at):
        started.append(at)
        return handshake(cfg, ses, at)

    def load_and_switch(self, weights):
        out = load(self, weights)
        if started:  # a weight sync of a round (the engine's own first load comes before the start)
            self.ops = real(other, "rollout", recorder("local", "rollout", other, mode="strict"))
        return out
    monkeypatch.setattr(local, "_handshake", noted)
    monkeypatch.setattr(local.RolloutEngine, "load_weights", load_and_switch)


@pytest.mark.parametrize("side", ["train", "rollout"])
def test_a_side_with_another_route_stops_the_run_before_anything_is_compared(small_config, tmp_path, monkeypatch,
                                                                             side):
    _other_route_for(side, monkeypatch)
    with pytest.raises(ContractDigestError, match=r"at start: the rollout and train sides run different contracts"
                       r".*modules\.ffn"):
        run_local(small_config(RR, rounds=2), tmp_path)
    (run_dir,) = tmp_path.iterdir()
    assert (run_dir / "exit-code").read_text().strip() == "3"
    assert not (run_dir / "metrics.jsonl").exists() and list((run_dir / "train-data").iterdir()) == []
    assert "ContractDigestError" in (run_dir / "run.log").read_text()


def test_a_route_that_changes_at_a_weight_sync_stops_the_run(small_config, tmp_path, monkeypatch):
    _other_route_for("rollout", monkeypatch, when="sync")
    with pytest.raises(ContractDigestError, match="at sync 1: the rollout and train sides run different"):
        run_local(small_config(RR, rounds=3), tmp_path)
    (run_dir,) = tmp_path.iterdir()
    assert not (run_dir / "metrics.jsonl").exists()  # round 0's line waits for its sync's handshake
    assert len(list((run_dir / "train-data").iterdir())) == 1  # round 1 never ran


# -- the frameworks engine's handshake (its run needs a GPU, vLLM and Megatron; the shared function runs here) --------
def _framework_sides(train_plan: RoutePlan, roll_plan: RoutePlan, roll_leaves: int = 0):
    from rlk_core.readback import ReadbackRecorder

    train = ReadbackRecorder("megatron", "train", train_plan, mode="strict")
    roll = ReadbackRecorder("vllm", "rollout", roll_plan, mode="strict")
    return (train_plan, train, None), (roll_plan, roll, roll_leaves)


def test_the_frameworks_handshake_records_into_both_adapters_recorders():
    from rlk_repro.engine.frameworks import FrameworksRunConfig, contract_handshake
    from rlk_repro.engine.local import sampling_params

    cfg = FrameworksRunConfig(plan=RR, top_p=1.0)
    train, roll = _framework_sides(RR, RR)
    digest = contract_handshake(cfg, "cpu", train, roll, cfg.temperature, sampling_params(cfg), "start")
    again = contract_handshake(cfg, "cpu", train, roll, cfg.temperature, sampling_params(cfg), "sync 1", digest)
    assert again == digest
    for _, rec, _ in (train, roll):
        doc = rec.to_dict()["contract_digest"]
        assert doc["digest"] == digest and [c["at"] for c in doc["checks"]] == ["start", "sync 1"]


@pytest.mark.parametrize("roll_plan, leaves, temperature, where", [
    (RoutePlan("R/R", "R/R", "R/P"), 0, 1.0, "modules.logp"),  # vLLM's process read another RL_KERNEL_LOGP_CASE
    (RR, 8, 1.0, "tp_invariant_leaves"),  # the plugin read RL_KERNEL_TP_INVARIANT=8, the provider's is off
    (RR, 0, 0.5, "sampling.temperature"),  # the trainer recomputes at another temperature than vLLM samples at
])
def test_the_frameworks_handshake_stops_on_a_difference(roll_plan, leaves, temperature, where, monkeypatch):
    from rlk_repro.engine.frameworks import FrameworksRunConfig, contract_handshake
    from rlk_repro.engine.local import sampling_params

    monkeypatch.delenv("RL_KERNEL_TP_INVARIANT", raising=False)
    cfg = FrameworksRunConfig(plan=RR, top_p=1.0)
    train, roll = _framework_sides(RR, roll_plan, leaves)
    with pytest.raises(ContractDigestError, match=where):
        contract_handshake(cfg, "cpu", train, roll, temperature, sampling_params(cfg), "start")
