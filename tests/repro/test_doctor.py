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


# -- the frameworks and the compiled ops (issue 41) ------------------------------------------------------
def _check(doc: dict, name: str) -> dict:
    return next(c for c in doc["checks"] if c["name"] == name)


def _doctor_json(tmp_path, *args: str) -> tuple[int, dict]:
    out = tmp_path / "doctor.json"
    code = cli.main(["doctor", "--device", "cpu", "--json", str(out), *args])
    return code, json.loads(out.read_text())


def test_frameworks_in_range_and_the_plugin_entry_point_are_reported(tmp_path, monkeypatch):
    import importlib.metadata as md

    from rlk_megatron_provider import _compat as mc
    from rlk_vllm_plugin import _compat as vc

    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    code, doc = _doctor_json(tmp_path, "--engine", "frameworks")
    for dist, compat in (("vllm", vc), ("megatron-core", mc)):
        check = _check(doc, dist)
        try:
            version = md.version(dist)
        except md.PackageNotFoundError:  # without the package: FAIL for --engine frameworks
            assert check["status"] == "FAIL" and "not installed" in check["detail"]
            continue
        lo, hi = compat.SUPPORTED
        assert version in check["detail"] and f"{lo[0]}.{lo[1]} <= v < {hi[0]}.{hi[1]}" in check["detail"]
        assert check["status"] == "ok"
    assert _check(doc, "vllm plugin") == {"name": "vllm plugin", "status": "ok",
                                          "detail": "entry point vllm.general_plugins: rlk = rlk_vllm_plugin:register"}
    assert _check(doc, "VLLM_PLUGINS")["status"] == "ok"


def test_vllm_plugins_without_rlk_fails_for_the_frameworks_and_warns_for_local(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("VLLM_PLUGINS", "other_plugin")
    code, doc = _doctor_json(tmp_path, "--engine", "frameworks")
    assert code == cli.EXIT_MISMATCH
    check = _check(doc, "VLLM_PLUGINS")
    assert check["status"] == "FAIL" and "does not list rlk" in check["detail"]
    code, doc = _doctor_json(tmp_path)
    assert code == cli.EXIT_OK and _check(doc, "VLLM_PLUGINS")["status"] == "warn"


def test_a_vllm_outside_the_plugins_range_fails(tmp_path, monkeypatch):
    from rlk_repro import doctor

    real = doctor._installed
    monkeypatch.setattr(doctor, "_installed", lambda dist: "0.21.3" if dist == "vllm" else real(dist))
    code, doc = _doctor_json(tmp_path, "--engine", "vime")
    check = _check(doc, "vllm")
    assert code == cli.EXIT_MISMATCH and check["status"] == "FAIL"
    assert "0.21.3 is outside the range (supported 0.22 <= v < 0.34" in check["detail"]


def test_a_build_without_compiled_ops_says_it_lacks_rlk_cuda(tmp_path):
    import importlib.util

    code, doc = _doctor_json(tmp_path)
    check = _check(doc, "rlk.cuda")
    if importlib.util.find_spec("rlk_core._C") is None:
        assert check["status"] == "ok" and "lacks rlk.cuda: rlk_core._C is not built" in check["detail"]
    else:
        assert "rlk_core._C is built" in check["detail"]


def test_rlk_cuda_first_is_not_a_fallback_where_triton_is_available():
    """On CUDA, rlk.cuda (rlk.triton's binaries, same_bits_as) ahead of an available rlk.triton is the route as
    designed; only an unavailable rlk.triton under another backend is a fallback."""
    from rlk_repro.doctor import FAIL, OK, WARN, op_status

    cuda = Backend("rlk.cuda", "linear", F.linear, devices=("cuda",), same_bits_as="rlk.triton")
    other = Backend("acme.blas", "linear", F.linear, devices=("cuda",))
    assert op_status(cuda, (True, ""), True) == (OK, "")
    assert op_status(cuda, (False, "no triton"), True) == (OK, "")
    assert op_status(other, (True, ""), True) == (OK, "")
    assert op_status(other, (False, "no triton"), True) == (FAIL, "; rlk.triton unavailable: no triton")
    assert op_status(other, (False, "no triton"), False)[0] == WARN
