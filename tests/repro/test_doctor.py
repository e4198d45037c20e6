"""``rlk-repro doctor``: ready on a working CPU setup; FAIL (exit 1) for a missing device, a bad
environment variable, or an R-route op whose preferred backend is a third party that fails its checks."""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from rlk_core.backends import Backend
from rlk_core.contracts import OP_CONTRACTS
from rlk_repro import cli


def test_ready_on_cpu_with_every_op_listed(tmp_path, capsys):
    out = tmp_path / "doctor.json"
    assert cli.main(["doctor", "--device", "cpu", "--json", str(out)]) == cli.EXIT_OK
    doc = json.loads(out.read_text())
    assert doc["ready"] is True and doc["plan"] == {"attention": "R/R", "ffn": "R/R", "logp": "R/R"}
    names = {c["name"] for c in doc["checks"]}
    assert {f"op {op}" for op in OP_CONTRACTS} <= names
    assert "rlk-repro doctor: ready" in capsys.readouterr().out


def test_missing_gpu_fails(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["doctor", "--device", "cuda"]) == cli.EXIT_MISMATCH
    assert "sees no CUDA GPU" in capsys.readouterr().out


def test_bad_environment_variable_fails(monkeypatch, capsys):
    monkeypatch.setenv("RLK_VALUE_CHECKS", "sometimes")
    assert cli.main(["doctor", "--device", "cpu"]) == cli.EXIT_MISMATCH
    out = capsys.readouterr().out
    assert "environment" in out and "RLK_VALUE_CHECKS" in out


def test_an_unqualified_third_party_backend_on_an_r_route_fails(clean_registry, capsys):
    clean_registry.register(Backend("acme.blas", "linear", lambda x, w, b: F.linear(x, w, b), devices=("cpu",),
                              priority=60, origin="acme-kernels"))
    assert cli.main(["doctor", "--device", "cpu", "--mode", "consistency"]) == cli.EXIT_MISMATCH
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("op linear ")][0]
    assert "FAIL" in line and "NOT qualified" in line and "acme-kernels" in line
