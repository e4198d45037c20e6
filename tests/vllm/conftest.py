"""The vLLM suite: real vLLM (``scripts/install-vllm-cpu.sh``) on the CPU, through the test-only platform
plugin ``tests/vllm/cpu_platform`` (``RLK_TEST_VLLM_CPU_PLATFORM=1``, ``VLLM_TARGET_DEVICE`` unset: vLLM 0.33 would
take that as its own CPU platform and skip platform plugins). Every test module is marked ``vllm``
(``pytestmark``) and skips where vLLM is not importable. Tests that build a model or initialise
``torch.distributed`` run in a fresh Python (``run_script``), so nothing they install leaks into the rest
of the suite."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

HERE = Path(__file__).parent
PLAN_VARS = ("RL_KERNEL_ATTENTION_CASE", "RL_KERNEL_FFN_CASE", "RL_KERNEL_LOGP_CASE", "RL_KERNEL_MODE",
             "RL_KERNEL_READBACK_DIR", "RL_KERNEL_VLLM_UNFILTERED_LOGPROBS", "RL_KERNEL_VLLM_ATTENTION_OVERRIDE",
             "VLLM_PLUGINS")


@pytest.fixture(autouse=True)
def _cpu_platform(monkeypatch):
    monkeypatch.setenv("RLK_TEST_VLLM_CPU_PLATFORM", "1")
    monkeypatch.delenv("VLLM_TARGET_DEVICE", raising=False)
    for name in PLAN_VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def vllm_config():
    """A default ``VllmConfig`` set as current (what building a vLLM layer outside an engine needs)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    with set_current_vllm_config(VllmConfig()):
        yield


@pytest.fixture
def plugin(monkeypatch):
    """``plugin(**cases)``: register the plugin in this process for the given plan; undone afterwards."""
    import rlk_vllm_plugin

    def install(attention="P/P", ffn="P/P", logp="P/P", mode="strict", **extra):
        monkeypatch.setenv("RL_KERNEL_ATTENTION_CASE", attention)
        monkeypatch.setenv("RL_KERNEL_FFN_CASE", ffn)
        monkeypatch.setenv("RL_KERNEL_LOGP_CASE", logp)
        monkeypatch.setenv("RL_KERNEL_MODE", mode)
        for k, v in extra.items():
            monkeypatch.setenv(k, v)
        rlk_vllm_plugin.register()
        return rlk_vllm_plugin._runtime.current()

    yield install
    rlk_vllm_plugin.uninstall()


@pytest.fixture
def run_script(tmp_path):
    """``run_script(body, env=None, timeout=600)``: run ``body`` in a fresh Python with the CPU platform; it
    must exit 0 and print ``ok`` last. Returns stdout."""

    def run(body: str, env: dict[str, str] | None = None, timeout: int = 600) -> str:
        full = {k: v for k, v in os.environ.items() if k not in PLAN_VARS and k != "VLLM_TARGET_DEVICE"}
        full.update({"RLK_TEST_VLLM_CPU_PLATFORM": "1", "PYTHONWARNINGS": "ignore",
                     "PYTHONPATH": os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p),
                     **(env or {})})  # HERE: the scripts' shared helpers (vllm_tiny.py)
        proc = subprocess.run([sys.executable, "-c", textwrap.dedent(body)], capture_output=True, text=True,
                              timeout=timeout, env=full, cwd=tmp_path)
        assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-4000:] + proc.stderr[-6000:]
        return proc.stdout
    return run
