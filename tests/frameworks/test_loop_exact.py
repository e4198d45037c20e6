"""``rlk-repro run --engine frameworks`` on the GPU, zero tolerance: real vLLM with the plugin samples, real
megatron-core with the provider recomputes the log-probs and takes a GRPO step, the weights go into the running vLLM,
and over the rounds R/R's run directory passes ``rlk-validate --require-bitwise`` while the stock frameworks'
(``--mode native``, same seeds) fails it with ``BITWISE_MISMATCH``. The command is rlk-repro's own; the R/R run
directory this writes (2 rounds x 32 prompts x 8 samples, ~1.6 MB) is the kind kept in
``tests/validate/data/frameworks-rr/``. The CPU side of this engine: ``tests/repro/test_frameworks_engine.py``."""

from __future__ import annotations

import json
import os
import sys

import pytest
from _frameworks import child_env
from vllm_stages import _write_plugin_site

RUN = ["--model", "qwen3-0.6b", "--rounds", "2", "--prompts-per-round", "32", "--samples-per-prompt", "8",
       "--max-new-tokens", "64", "--seed", "1234", "--gpu-memory-utilization", "0.3"]


def _validate(worker, run, report) -> tuple[int, dict]:
    proc = worker([sys.executable, "-m", "rlk_validate", str(run), "--require-bitwise", "--json", str(report)],
                  timeout=180, name=f"validate-{run.parent.name}")
    return proc.returncode, json.loads(report.read_text())


@pytest.mark.gpu
@pytest.mark.vllm
@pytest.mark.megatron
def test_rr_loop_is_bitwise_and_native_loop_is_not_gpu(worker, tmp_path):
    site = tmp_path / "plugin-site"  # how vLLM finds the plugin without pip: its dist-info on PYTHONPATH
    _write_plugin_site(site)
    env = child_env(PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
                    VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_DISABLE_COMPILE_CACHE="1")
    runs = {}
    for mode in ("consistency", "native"):
        out = tmp_path / "runs" / mode
        proc = worker([sys.executable, "-m", "rlk_repro", "run", "--engine", "frameworks", "--mode", mode, *RUN,
                       "--output", str(out)], timeout=240, name=f"loop-{mode}", env=env)
        assert proc.returncode == 0, proc.log[-6000:]
        (runs[mode],) = [p for p in out.iterdir() if p.is_dir()]
    rc, doc = _validate(worker, runs["consistency"], tmp_path / "rr-validation.json")
    assert rc == 0 and doc["verdict"] == "passed", json.dumps(doc["findings"])[:3000]
    assert doc["bitwise"]["mismatch_count"] == 0 and doc["bitwise"]["element_count"] > 20_000
    rows = [json.loads(x) for x in (runs["consistency"] / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert len(rows) == 2 and all(r["weights_changed"] for r in rows)  # the GRPO step reached vLLM every round
    rc, doc = _validate(worker, runs["native"], tmp_path / "pp-validation.json")
    assert rc == 1 and "BITWISE_MISMATCH" in {f["code"] for f in doc["findings"]}
    assert doc["bitwise"]["mismatch_count"] > 0
