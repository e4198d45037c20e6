import json
import multiprocessing as mp
import os

import jsonschema
import pytest
import torch

import rlk_core.ops as ops
from rlk_core.errors import RlkPolicyError
from rlk_core.plan import RoutePlan
from rlk_core.readback import ReadbackRecorder, schema


def _validate(doc):
    jsonschema.validate(doc, schema())


def test_rlk_calls_are_counted_in_scope_and_the_document_matches_the_schema(tmp_path):
    plan = RoutePlan("P/R", "R/R", "R/P")
    rec = ReadbackRecorder("local", "train", plan, mode="strict", directory=tmp_path, run_id="r1")
    x, w = torch.randn(3, 8), torch.randn(4, 8)
    with rec.scope("ffn"):
        for _ in range(3):
            ops.linear(x, w)
        ops.rms_norm(x, torch.ones(8))
    with rec.scope("attention"):
        rec.production("attention", "sdpa", "production.torch")
    ops.linear(x, w)  # outside any scope: not counted
    rec.add_hook("rlk.linear", "local.Linear", "engine")
    path = rec.flush()
    doc = json.loads(path.read_text())
    _validate(doc)
    assert path.name == f"local-training-{os.getpid()}.json"
    assert doc["plan"] == {"attention": "P/R", "ffn": "R/R", "logp": "R/P"}
    ffn = doc["modules"]["ffn"]
    assert ffn["case"] == "R" and ffn["implementation"] == "rlk" and ffn["call_count"] == 4
    assert ffn["ops"]["linear"]["call_count"] == 3 and ffn["ops"]["linear"]["backend_id"] == "rlk.reference"
    assert ffn["ops"]["linear"]["contract_id"] == "rlk.gemm.bi.v1" and ffn["fallback"] is False
    att = doc["modules"]["attention"]
    assert att["implementation"] == "production" and att["contract_id"] is None
    assert "logp" not in doc["modules"]


def test_strict_policy_rlk_on_p_side_and_fallback_on_r_side_raise(tmp_path):
    rec = ReadbackRecorder("local", "train", RoutePlan("P/P", "R/R", "R/R"), mode="strict")
    with rec.scope("attention"), pytest.raises(RlkPolicyError, match="P \\(production\\).*rlk backend"):
        ops.rms_norm(torch.randn(2, 4), torch.ones(4))
    with pytest.raises(RlkPolicyError, match="fell back"):
        rec.count("ffn", "linear", "rlk.reference", "rlk.gemm.bi.v1", fallback_reason="rlk.triton: bf16 only")
    with pytest.raises(RlkPolicyError, match="production implementation"):
        rec.production("ffn", "linear", "production.torch")


def test_audit_mode_records_the_fallback_with_its_reason(tmp_path):
    rec = ReadbackRecorder("vllm", "rollout", RoutePlan("R/R", "R/R", "R/R"), mode="audit", directory=tmp_path)
    rec.count("ffn", "linear", "rlk.reference", "rlk.gemm.bi.v1", fallback_reason="rlk.triton: unsupported")
    doc = rec.to_dict()
    _validate(doc)
    assert doc["modules"]["ffn"]["fallback"] is True
    assert "unsupported" in doc["modules"]["ffn"]["fallback_reason"]
    assert doc["target"] == "rollout" and doc["mode"] == "audit"


def test_a_peer_backends_calls_keep_the_first_reason_the_preferred_one_declined_them(tmp_path):
    """Calls the preferred backend declined (its ``same_bits_as`` peer ran them, no fallback) are counted under
    ``provenance.other_backends`` with the first such route reason per backend; the document still validates."""
    from rlk_core.readback import note_op_call

    rec = ReadbackRecorder("local", "rollout", RoutePlan("R/R", "R/R", "R/R"), mode="strict", directory=tmp_path)
    with rec.scope("attention"):
        note_op_call("attention_paged_prefill", "rlk.cuda", "rlk.attn.v1", None, "eager")
        for why in ("rlk.cuda declined: block_table stride 7", "rlk.cuda declined: another reason"):
            note_op_call("attention_paged_prefill", "rlk.triton", "rlk.attn.v1", None, "eager", None, why)
        note_op_call("attention_paged_prefill", "rlk.cuda", "rlk.attn.v1", None, "eager")
    doc = rec.to_dict()
    _validate(doc)
    r = doc["modules"]["attention"]["ops"]["attention_paged_prefill"]
    assert r["backend_id"] == "rlk.cuda" and r["call_count"] == 4
    assert r["provenance"] == {"other_backends": {"rlk.triton": 2},
                               "route_reasons": {"rlk.triton": "rlk.cuda declined: block_table stride 7"}}


def test_repeated_reports_count_per_mode_and_the_policy_still_sees_what_changes(caplog):
    """A report that passed the policy before is only counted again (note_op_call's first step); a new execution
    mode, provenance or a fallback still goes through :meth:`ReadbackRecorder.count`, and a report that violates
    the policy is never taken for a repeat."""
    from rlk_core.readback import note_op_call

    rec = ReadbackRecorder("vllm", "rollout", RoutePlan("R/R", "R/R", "R/R"), mode="strict")
    with rec.scope("ffn"):
        for mode in ("eager", "eager", "graph", "eager", "graph"):
            note_op_call("linear", "rlk.reference", "rlk.gemm.bi.v1", None, mode)
        note_op_call("linear", "rlk.reference", "rlk.gemm.bi.v1", None, "eager", {"world_size": 2})
        with pytest.raises(RlkPolicyError, match="fell back"):
            note_op_call("linear", "rlk.reference", "rlk.gemm.bi.v1", "rlk.triton: no", "eager")
    r = rec.to_dict()["modules"]["ffn"]["ops"]["linear"]
    assert (r["call_count"], r["execution_mode"], r["provenance"], r["fallback"]) == (6, "mixed", {"world_size": 2},
                                                                                      False)
    audit = ReadbackRecorder("vllm", "rollout", RoutePlan("R/R", "P/P", "R/R"), mode="audit")
    with caplog.at_level("WARNING", logger="rlk"), audit.scope("ffn"):
        for _ in range(3):
            note_op_call("linear", "rlk.reference", "rlk.gemm.bi.v1", None, "eager")
    assert sum("rlk audit" in m for m in caplog.messages) == 3
    assert audit.to_dict()["modules"]["ffn"]["ops"]["linear"]["call_count"] == 3


def test_counting_touches_no_filesystem(tmp_path, monkeypatch):
    rec = ReadbackRecorder("local", "train", RoutePlan("R/R", "R/R", "R/R"), directory=tmp_path)

    def forbidden(*a, **k):
        raise AssertionError("filesystem touched on the hot path")

    monkeypatch.setattr("builtins.open", forbidden)
    monkeypatch.setattr(os, "replace", forbidden)
    with rec.scope("ffn"):
        for _ in range(100):
            ops.swiglu(torch.randn(2, 8))
    monkeypatch.undo()
    assert rec.to_dict()["modules"]["ffn"]["call_count"] == 100
    assert list(tmp_path.iterdir()) == []


def test_route_line_is_logged_once_per_op(caplog):
    rec = ReadbackRecorder("local", "rollout", RoutePlan("R/R", "R/R", "R/R"))
    with caplog.at_level("INFO", logger="rlk"), rec.scope("ffn"):
        for _ in range(5):
            ops.swiglu(torch.randn(2, 8))
            ops.rms_norm(torch.randn(2, 4), torch.ones(4))
    lines = [r.getMessage() for r in caplog.records if "rlk route" in r.getMessage()]
    assert len(lines) == 2 and any("ffn.swiglu" in line for line in lines)


def _writer(directory: str, n: int) -> None:
    rec = ReadbackRecorder("megatron", "train", RoutePlan("R/R", "R/R", "R/R"), directory=directory)
    for _ in range(n):
        rec.count("ffn", "linear", "rlk.reference", "rlk.gemm.bi.v1")
        rec.flush()


def test_concurrent_writers_leave_complete_valid_documents(tmp_path):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), 30)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    files = sorted(tmp_path.iterdir())
    assert len(files) == 4 and all(f.name.startswith("megatron-training-") for f in files)
    for f in files:
        doc = json.loads(f.read_text())
        _validate(doc)
        assert doc["modules"]["ffn"]["call_count"] == 30


def test_flush_is_atomic_under_concurrent_flushes_of_one_recorder(tmp_path):
    import threading

    rec = ReadbackRecorder("local", "train", RoutePlan("R/R", "R/R", "R/R"), directory=tmp_path)
    rec.count("ffn", "linear", "rlk.reference", "rlk.gemm.bi.v1")
    threads = [threading.Thread(target=lambda: [rec.flush() for _ in range(20)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [p.name for p in tmp_path.iterdir()] == [rec.filename]
    _validate(json.loads((tmp_path / rec.filename).read_text()))


def test_schema_rejects_broken_documents():
    rec = ReadbackRecorder("local", "train", RoutePlan("R/R", "R/R", "R/R"))
    rec.count("ffn", "linear", "rlk.reference", "rlk.gemm.bi.v1")
    good = rec.to_dict()
    _validate(good)
    for mutate in (lambda d: d.update(schema="rlk.readback.v0"), lambda d: d.pop("plan"),
                   lambda d: d["modules"]["ffn"].update(call_count=-1),
                   lambda d: d["plan"].update(ffn="R/X")):
        bad = json.loads(json.dumps(good))
        mutate(bad)
        with pytest.raises(jsonschema.ValidationError):
            _validate(bad)


def test_scopes_nest_restore_on_exit_and_on_error_and_refuse_unknown_modules():
    from rlk_core.errors import RlkConfigError
    from rlk_core.readback import active_scope

    rec = ReadbackRecorder("vllm", "rollout", RoutePlan("R/R", "R/R", "R/R"))
    other = ReadbackRecorder("vllm", "rollout", RoutePlan("R/R", "R/R", "R/R"))
    assert active_scope() is None
    with rec.scope("ffn") as entered:
        assert entered is rec and active_scope() == (rec, "ffn")
        with other.scope("attention"):
            assert active_scope() == (other, "attention")
            with rec.scope("ffn"):  # the same scope re-entered: its exit restores the outer one
                assert active_scope() == (rec, "ffn")
            assert active_scope() == (other, "attention")
        assert active_scope() == (rec, "ffn")
        with pytest.raises(ValueError), rec.scope("logp"):
            raise ValueError("inside")
        assert active_scope() == (rec, "ffn")
    assert active_scope() is None
    with pytest.raises(RlkConfigError, match="is not one of"):
        rec.scope("mlp")


def test_annotations_tally_counts_and_marks_into_the_document(tmp_path):
    """Issue 40: an adapter's per-process counters and marks (``tally`` / ``annotate``) are the readback's
    ``annotations``; ``replace=False`` sets a default a later mark changes; bad names and values are refused; the
    schema accepts the field and rejects a broken one; a recorder that annotated nothing writes no field."""
    from rlk_core.errors import RlkConfigError

    rec = ReadbackRecorder("vllm", "rollout", RoutePlan("P/P", "P/P", "P/P"), mode="strict", directory=tmp_path)
    assert "annotations" not in rec.to_dict()
    rec.tally("sampling", greedy=1, greedy_with_logprobs=1)
    rec.tally("sampling", sampled=2, greedy=1)
    rec.annotate("sampling", replace=False, comparable=True, reason=None)
    rec.annotate("sampling", comparable=False, reason="argmax")
    rec.annotate("sampling", replace=False, comparable=True, counted="requests")  # a default: only new keys
    doc = json.loads(rec.flush().read_text())
    _validate(doc)
    assert doc["annotations"] == {"sampling": {"counts": {"greedy": 2, "greedy_with_logprobs": 1, "sampled": 2},
                                               "comparable": False, "reason": "argmax", "counted": "requests"}}
    for bad in (lambda: rec.tally("Sampling", n=1), lambda: rec.tally("sampling", n=-1),
                lambda: rec.tally("sampling", n=True), lambda: rec.annotate("sampling", counts=1),
                lambda: rec.annotate("sampling", why=[1]), lambda: rec.annotate("sampling", x=float("nan"))):
        with pytest.raises(RlkConfigError):
            bad()
    for mutate in (lambda d: d["annotations"]["sampling"]["counts"].update(greedy=-1),
                   lambda d: d["annotations"]["sampling"].update(reason={"a": 1}),
                   lambda d: d["annotations"].update(Bad={})):
        broken = json.loads(json.dumps(doc))
        mutate(broken)
        with pytest.raises(jsonschema.ValidationError):
            _validate(broken)
