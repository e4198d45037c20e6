import json
import subprocess
import sys

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


def test_selfcheck_shows_each_check_on_stderr_as_it_goes(capsys):
    assert selfcheck.main(["--device", "cpu"]) == 0
    captured = capsys.readouterr()
    done = [line for line in captured.err.splitlines() if line.endswith("s)")]
    total = sum(1 for line in captured.out.splitlines() if line.endswith(("pass", "pass  ", "FAIL")))
    assert done and len(done) == total, captured.err
    assert done[0].startswith(f"[1/{total}] linear ") and done[-1].startswith(f"[{total}/{total}] ")
    assert "op  " not in captured.err  # the table goes to stdout


def test_help_answers_without_importing_torch():
    code = ("import sys\nfrom rlk_core import selfcheck\ntry:\n    selfcheck.main(['--help'])\n"
            "except SystemExit as e:\n    assert e.code == 0, e.code\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO TORCH')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "usage: rlk-selfcheck" in proc.stdout and proc.stdout.strip().endswith("NO TORCH"), proc.stdout


def test_a_bad_device_is_refused_before_torch_is_imported():
    code = ("import sys\nfrom rlk_core import selfcheck\ntry:\n    selfcheck.main(['--device', 'tpu'])\n"
            "except SystemExit as e:\n    print(e.code, 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "2 False" and "allowed cpu, cuda" in proc.stderr, (proc.stdout, proc.stderr)
