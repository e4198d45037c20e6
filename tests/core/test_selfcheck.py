import json

import torch.nn.functional as F

from rlk_core import selfcheck
from rlk_core.backends import REGISTRY, Backend


def test_selfcheck_passes_on_cpu_and_writes_json(tmp_path, capsys):
    out = tmp_path / "sc.json"
    assert selfcheck.main(["--device", "cpu", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["schema"] == "rlk.selfcheck.v1" and report["passed"] is True
    ops = {r["op"]: r for r in report["ops"]}
    assert {"linear", "rms_norm", "swiglu", "rope", "attention_varlen", "linear_logprobs"} <= set(ops)
    assert ops["linear"]["contract_id"] == "rlk.gemm.bi.v1"
    assert all(c["passed"] for r in report["ops"] for c in r["checks"].values())
    table = capsys.readouterr().out
    assert "batch_invariance" in table and "PASSED" in table


def test_selfcheck_fails_when_a_forced_backend_breaks_the_contract(monkeypatch, capsys):
    bad = Backend("acme.blas", "linear", lambda x, w, b: F.linear(x, w, b), devices=("cpu",), builtin=True)
    REGISTRY.register(bad)
    monkeypatch.setenv("RLK_BACKENDS", "linear=acme.blas")
    try:
        assert selfcheck.main(["--device", "cpu"]) == 1
    finally:
        REGISTRY.unregister("linear", "acme.blas")
    out = capsys.readouterr().out
    assert "FAIL" in out and "acme.blas" in out and "FAILED" in out
