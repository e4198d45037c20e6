"""rlk_validate.evidence: the one definition of the evidence formats, its writer, and its generated doc."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from rlk_validate import evidence, evidence_doc

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "packages" / "rlk-validate" / "src" / "rlk_validate"


def test_docs_evidence_md_is_generated_from_evidence_py() -> None:
    text = (ROOT / "docs" / "evidence.md").read_text(encoding="utf-8")
    assert evidence_doc.update(text) == text, (
        "docs/evidence.md is stale: run `python -m rlk_validate.evidence_doc --update docs/evidence.md`"
    )


def test_every_schema_id_is_defined_once_in_rlk_validate() -> None:
    """No module of rlk_validate but evidence.py spells a schema id."""
    pattern = re.compile(r"[\"']rlk\.[a-z-]+\.v[0-9]+[\"']")
    for path in PKG.glob("*.py"):
        if path.name == "evidence.py":
            continue
        assert not pattern.search(path.read_text(encoding="utf-8")), path.name
    assert len(set(evidence.SCHEMAS.values())) == len(evidence.SCHEMAS)


def test_readback_json_schema_agrees_with_the_vocabularies() -> None:
    s = evidence.readback_json_schema()
    props, defs = s["properties"], s["$defs"]
    assert s["$id"] == props["schema"]["const"] == evidence.READBACK_SCHEMA
    assert tuple(props["framework"]["enum"]) == evidence.FRAMEWORKS
    assert tuple(props["target"]["enum"]) == tuple(evidence.TARGETS.values())
    assert tuple(props["side"]["enum"]) == evidence.SIDES
    assert tuple(props["mode"]["enum"]) == evidence.MODES
    assert tuple(props["plan"]["required"]) == evidence.MODULES
    assert tuple(props["modules"]["properties"]) == evidence.MODULES
    assert tuple(defs["case"]["enum"]) == evidence.CASES
    assert tuple(defs["mode"]["enum"]) == evidence.EXECUTION_MODES
    assert tuple(defs["module"]["properties"]["case"]["enum"]) == evidence.LETTERS
    assert sorted(defs["module"]["properties"]["implementation"]["enum"]) == sorted(evidence.IMPLEMENTATIONS)
    assert tuple(s["required"]) == evidence.required_fields("readback")
    assert tuple(defs["module"]["required"]) == evidence.required_fields("readback.module")
    assert tuple(defs["op"]["required"]) == evidence.required_fields("readback.op")


@pytest.mark.parametrize(
    "value, ok",
    [("R/R", True), ("R/R\n", False), (" R/R", False), ("r/r", False), ("R/R/R", False), (b"R/R", False),
     (None, False), (["R/R"], False)],
)
def test_membership_is_exact(value, ok: bool) -> None:
    assert evidence.is_member(value, evidence.CASES) is ok


@pytest.mark.parametrize(
    "value, ok",
    [("rlk.reference", True), ("rlk.", False), ("rlk", False), ("rlkx.triton", False), ("production.torch", False),
     ("rlk.tri\nton", False), (None, False), (1, False)],
)
def test_rlk_backend_ids(value, ok: bool) -> None:
    assert evidence.is_rlk_backend(value) is ok


def test_write_json_atomic(tmp_path: Path) -> None:
    p = tmp_path / "doc.json"
    assert evidence.write_json_atomic(p, {"b": 1, "a": [1.5]}, sort_keys=True) == str(p)
    assert p.read_text() == '{\n  "a": [\n    1.5\n  ],\n  "b": 1\n}\n'
    evidence.write_json_atomic(p, {"x": 1}, indent=None)
    assert json.loads(p.read_text()) == {"x": 1}
    assert os.listdir(tmp_path) == ["doc.json"]


@pytest.mark.parametrize("bad", [{"x": float("nan")}, {"x": float("inf")}, {"x": object()}])
def test_write_json_atomic_refuses_and_leaves_nothing(tmp_path: Path, bad) -> None:
    p = tmp_path / "doc.json"
    p.write_text("old\n")
    with pytest.raises((ValueError, TypeError)):
        evidence.write_json_atomic(p, bad)
    assert os.listdir(tmp_path) == ["doc.json"] and p.read_text() == "old\n"


def test_write_bytes_atomic_cleans_its_temp_on_failure(tmp_path: Path, monkeypatch) -> None:
    def fail(*a):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(evidence.os, "replace", fail)
    with pytest.raises(OSError):
        evidence.write_bytes_atomic(tmp_path / "x.json", b"{}\n")
    assert os.listdir(tmp_path) == []


def test_train_data_tensors() -> None:
    assert evidence.TRAIN_DATA_REQUIRED == ("token_ids", "response_mask", "rollout_logprobs", "train_logprobs")
    assert evidence.TRAIN_DATA_PER_SEQUENCE == ("rewards", "advantages")
    assert evidence.train_data_name(3, 1) == "round-0003.rank1.safetensors"
    assert evidence.readback_name("vllm", "rollout", 7) == "vllm-rollout-7.json"
