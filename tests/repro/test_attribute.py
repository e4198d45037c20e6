"""`rlk-repro attribute RUN_DIR` (issue 38): the probes in order, the per-layer comparison that names the first point
where the two sides' bits part, and the refusal to blame an operator while a semantic probe fails. Each verdict has
its control: an R/R run names no boundary; the same run with one ulp injected at one point names exactly that point;
a P/P run names a boundary whose every earlier point agrees; a semantic failure blocks the blame."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rlk_core.errors import RlkConfigError
from rlk_core.plan import RoutePlan
from rlk_repro import cli
from rlk_repro.attribute import BLOCKING, attribute
from rlk_repro.attribute_dumps import compare_dumps, load_dump, point_order, save_dump
from rlk_repro.attribute_local import Injection
from rlk_repro.engine.local import run_local
from rlk_validate import evidence

RR = RoutePlan("R/R", "R/R", "R/R")
PP = RoutePlan("P/P", "P/P", "P/P")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_config):
    root = tmp_path_factory.mktemp("attr")
    return {
        "rr": run_local(small_config(RR, rounds=1), root, "rr").run_dir,
        "pp": run_local(small_config(PP, rounds=2), root, "pp").run_dir,
        # semantic mismatch: the rollout's log-prob over its top-p kept set, the trainer's over the whole vocabulary
        "semantic": run_local(small_config(RR, rounds=1, top_p=0.8, train_logprobs="unfiltered", require_exact=False),
                              root, "semantic").run_dir,
        "top_p": run_local(small_config(RR, rounds=1, top_p=0.8), root, "top_p").run_dir,
    }


@pytest.fixture(scope="module")
def rr_doc(runs):
    return attribute(runs["rr"], 0, [0, 4], repeats=1)


def _status(doc) -> dict[int, str]:
    return {p["id"]: p["status"] for p in doc["probes"]}


def test_rr_run_attributes_no_boundary(rr_doc):
    doc, replay, _ = rr_doc
    assert doc["verdict"]["kind"] == "no_boundary" and doc["verdict"]["boundary"] is None
    assert _status(doc) == {0: "pass", 1: "pass", 2: "pass", 3: "pass", 4: "pass", 5: "trivial", 6: "trivial",
                            7: "pass"}
    layers = doc["layers"]
    assert layers["missing"] == []  # every point dumped by both sides: agreement is never assumed from absence
    order = [label for label, _ in point_order(replay.model_cfg.num_hidden_layers)]
    assert [p["point"] for p in layers["points"]] == order
    assert all(p["equal"] for p in layers["points"])
    assert doc["positions_compared"] == sum(len(replay.rollout_outputs[s]) for s in (0, 4))


@pytest.mark.parametrize("spec", ["train:1:ffn.swiglu", "rollout:0:attention.qkv", "train:0:attention.core",
                                  "rollout:1:attention.rope_k"])
def test_an_injected_difference_is_named_at_its_layer_and_operator(runs, spec):
    inj = Injection.parse(spec)
    doc, _, _ = attribute(runs["rr"], 0, [0, 4], injection=inj, repeats=1)
    v = doc["verdict"]
    assert v["kind"] == "boundary", v
    assert v["boundary"]["point"] == inj.label
    assert v["boundary"]["layer"] == inj.layer and v["boundary"]["operator"] == inj.point
    points = [p["point"] for p in doc["layers"]["points"]]
    before = doc["layers"]["points"][:points.index(inj.label)]
    assert before and all(p["equal"] for p in before)
    assert _status(doc)[0] == "pass" and doc["probes"][0]["evidence"].get("injected")


def test_pp_run_names_the_first_differing_point(runs):
    doc, _, _ = attribute(runs["pp"], 0, None, repeats=1)
    v = doc["verdict"]
    assert v["kind"] == "boundary" and _status(doc)[0] == "pass"
    points = doc["layers"]["points"]
    i = [p["point"] for p in points].index(v["boundary"]["point"])
    assert not points[i]["equal"] and all(p["equal"] for p in points[:i])
    growth = doc["layers"]["residual_growth"]
    assert growth[0]["equal"] and not growth[-1]["equal"]  # the embedding agrees; the last residual does not


def test_a_round_state_round_replays_faithfully(runs):
    doc, _, _ = attribute(runs["pp"], 1, [0, 1], repeats=1)
    assert _status(doc)[0] == "pass" and _status(doc)[2] == "pass"
    assert "round state" in doc["weights"]


def test_a_round_without_its_weights_is_refused(runs):
    with pytest.raises(RlkConfigError, match="no train-data for round 3"):
        attribute(runs["pp"], 3, [0], repeats=1)


def test_semantic_kept_set_failure_blocks_operator_blame(runs):
    doc, _, _ = attribute(runs["semantic"], 0, [0, 1, 2], repeats=1)
    v = doc["verdict"]
    assert _status(doc)[6] == "fail" and "semantic" in doc["probes"][6]["detail"]
    assert v["kind"] == "blocked" and v["boundary"] is None and 6 in v["blocked_by"]
    # without the block the walk would blame the log-prob op: the difference is there, it is not attributed
    assert v["first_difference_unattributed"] == "final.logprobs"


def test_matching_kept_sets_pass_under_top_p(runs):
    doc, _, _ = attribute(runs["top_p"], 0, [0, 1, 2], repeats=1)
    ev = doc["probes"][6]["evidence"]
    assert _status(doc)[6] == "pass" and ev["sets_differ"] == 0 and ev["sampled_outside_train_set"] == 0
    assert ev["sizes"]["train_mean"] < 320  # the filter kept fewer than the whole vocabulary: not a vacuous pass
    assert doc["verdict"]["kind"] == "no_boundary"


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_a_shifted_loss_mask_fails_probe_1_and_blocks(runs, tmp_path):
    run = _copy(runs["pp"], tmp_path / "shifted")
    path = run / evidence.TRAIN_DATA_DIR / evidence.train_data_name(0, 0)
    t = load_file(str(path))
    t["response_mask"] = torch.roll(t["response_mask"], 1, dims=1)  # a trainer that masks one token late
    save_file(t, str(path), metadata={"schema": evidence.TRAIN_DATA_SCHEMA, "round": "0", "rank": "0"})
    doc, _, _ = attribute(run, 0, [0, 1], repeats=1)
    assert _status(doc)[1] == "fail" and "loss mask" in doc["probes"][1]["detail"]
    assert doc["verdict"]["kind"] == "blocked" and 1 in doc["verdict"]["blocked_by"]


def test_a_wrong_weight_hash_fails_probe_2_and_blocks(runs, tmp_path):
    run = _copy(runs["rr"], tmp_path / "hash")
    m = json.loads((run / evidence.MANIFEST).read_text())
    m["inputs"]["checkpoint"] = "sha256:" + "0" * 64
    (run / evidence.MANIFEST).write_text(json.dumps(m))
    doc, _, _ = attribute(run, 0, [0], repeats=1)
    assert _status(doc)[2] == "fail" and doc["verdict"]["kind"] == "blocked" and doc["verdict"]["blocked_by"] == [2]
    assert set(doc["verdict"]["blocked_by"]) <= set(BLOCKING)


def test_dumps_round_trip_and_compare_the_same(rr_doc, tmp_path):
    _, replay, _ = rr_doc
    for side, dump in replay.dumps.items():
        save_dump(dump, tmp_path / f"{side}.safetensors")
    train, roll = load_dump(tmp_path / "train.safetensors"), load_dump(tmp_path / "rollout.safetensors")
    n = replay.model_cfg.num_hidden_layers
    assert compare_dumps(train, roll, n) == compare_dumps(replay.dumps["train"], replay.dumps["rollout"], n)
    assert train.ops["layers.0.attention.core"] == {"attention_varlen"}
    assert roll.ops["layers.0.attention.core"] <= {"attention_decode", "attention_paged_prefill"}


def test_cli_writes_the_report_beside_the_run_and_never_over_it(runs, tmp_path, capsys):
    out = tmp_path / "report"
    assert cli.main(["attribute", str(runs["rr"]), "--sequences", "0", "--repeats", "1", "--output", str(out)]) == 0
    doc = json.loads((out / "attribution.json").read_text())
    assert doc["schema"] == "rlk.attribution.v1" and doc["verdict"]["kind"] == "no_boundary"
    for name in ("attribution.md", "ab-tensors.safetensors", "dumps/train.safetensors", "dumps/rollout.safetensors"):
        assert (out / name).is_file()
    assert "Verdict (no_boundary)" in capsys.readouterr().out
    assert cli.main(["attribute", str(runs["rr"]), "--output", str(out)]) == 2  # exists
    assert cli.main(["attribute", str(runs["rr"]), "--output", str(runs["rr"] / "x")]) == 2  # inside the run
    assert cli.main(["attribute", str(runs["rr"]), "--inject", "train:0:nope", "--output", str(tmp_path / "y")]) == 2
    ab = ["abtest", "--tensors", str(out / "ab-tensors.safetensors"), "--repeats", "1", "--threads", "1"]
    assert cli.main(ab) == 0


def test_dumps_alone_are_compared_but_never_attributed(runs, tmp_path, capsys):
    out = tmp_path / "pp"
    assert cli.main(["attribute", str(runs["pp"]), "--sequences", "0,1", "--repeats", "1", "--output", str(out)]) == 0
    report = json.loads((out / "attribution.json").read_text())
    capsys.readouterr()
    dumps = [str(out / "dumps" / "train.safetensors"), str(out / "dumps" / "rollout.safetensors")]
    assert cli.main(["attribute", "--dumps", *dumps, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["verdict"]["kind"] == "unchecked" and doc["verdict"]["boundary"] is None
    assert doc["verdict"]["first_difference_unattributed"] == report["verdict"]["boundary"]["point"]
    assert {p["status"] for p in doc["probes"]} == {"not_available"}
    assert cli.main(["attribute", "--dumps", *dumps[::-1]]) == 2  # the sides swapped
    assert cli.main(["attribute", str(runs["pp"]), "--dumps", *dumps]) == 2  # both


@pytest.mark.parametrize("tp, expect", [(1, "--engine frameworks needs a CUDA GPU"), (2, "a TP 2 frameworks run")])
def test_a_frameworks_run_is_replayed_on_its_frameworks_or_refused_naming_why(tmp_path, monkeypatch, capsys, tp,
                                                                                expect):
    """A frameworks run is attributed by replaying it on real vLLM + megatron-core (rlk_repro.attribute_frameworks,
    the sitting's ``attribute`` stage); where that cannot run (no GPU here; TP > 1 not built) it exits 2 saying why."""
    from dataclasses import asdict

    from rlk_repro.engine.frameworks import FrameworksRunConfig

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = FrameworksRunConfig(device="cuda", plan=RR, tp=tp)
    run = tmp_path / "fw-run"
    run.mkdir()
    config = {k: v for k, v in asdict(cfg).items() if k not in ("plan", "command", "plan_sources")}
    (run / evidence.MANIFEST).write_text(json.dumps({"schema": evidence.MANIFEST_SCHEMA, "run_id": "fw", "engine":
                                                     "frameworks", "plan": RR.as_dict(), "config": config}))
    assert cli.main(["attribute", str(run)]) == 2
    assert expect in capsys.readouterr().err
    assert not (tmp_path / "fw-run.attribution-r0").exists()
