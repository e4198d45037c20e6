"""Readbacks of processes on several nodes sharing ``RL_KERNEL_READBACK_DIR`` do not collide: the recorder
files them under ``<dir>/<hostname>/`` (what the validator reads as one node's readbacks). Two recorders in
one process stand for two nodes' processes with the same pid (the hostname is patched per recorder)."""

from __future__ import annotations

import socket

from rlk_core.plan import RoutePlan
from rlk_core.readback import ReadbackRecorder
from rlk_validate.readbacks import check_readbacks
from rlk_validate.safeio import Root

PLAN = RoutePlan("R/R", "R/R", "R/R")
SIDES = (("megatron", "train"), ("vllm", "rollout"))


def _recorder(monkeypatch, host: str, framework: str = "megatron", side: str = "train", **kw) -> ReadbackRecorder:
    monkeypatch.setattr(socket, "gethostname", lambda: host)
    rec = ReadbackRecorder(framework, side, PLAN, mode="strict", run_id="r1", **kw)
    for op in ("linear", "rms_norm", "swiglu"):
        rec.count("ffn", op, "rlk.reference", "rlk.gemm.bi.v1")
    rec.count("attention", "attention_varlen", "rlk.reference", "rlk.attention.v1")
    rec.count("logp", "linear_logprobs", "rlk.reference", "rlk.logp.v1")
    return rec


def test_nodes_sharing_the_directory_keep_their_readbacks(tmp_path, monkeypatch):
    monkeypatch.setenv("RL_KERNEL_READBACK_DIR", str(tmp_path / "readbacks"))
    paths = [_recorder(monkeypatch, host, *fs).flush() for host in ("node0", "node1") for fs in SIDES]
    assert len(set(paths)) == 4
    assert sorted(p.relative_to(tmp_path).as_posix() for p in (tmp_path / "readbacks").rglob("*.json")) == [
        f"readbacks/{h}/{p.name}" for h in ("node0", "node1") for p in sorted(paths[:2])]
    findings, summary = check_readbacks(Root(tmp_path), PLAN.as_dict(), "r1")
    assert findings == [] and summary["files"] == 4


def test_an_explicit_directory_is_used_as_given(tmp_path, monkeypatch):
    """The flat layout (single-node runs that name their directory, e.g. rlk-repro's local engine) — and
    the negative control: there, two hosts' same-pid readbacks overwrite each other."""
    monkeypatch.setenv("RL_KERNEL_READBACK_DIR", str(tmp_path / "elsewhere"))
    paths = [_recorder(monkeypatch, host, *fs, directory=tmp_path / "readbacks").flush()
             for host in ("node0", "node1") for fs in SIDES]
    assert paths[:2] == paths[2:] and all(p.parent == tmp_path / "readbacks" for p in paths)
    assert len(list((tmp_path / "readbacks").iterdir())) == 2  # node1's overwrote node0's
    findings, summary = check_readbacks(Root(tmp_path), PLAN.as_dict(), "r1")
    assert findings == [] and summary["files"] == 2
