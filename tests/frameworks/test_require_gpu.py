"""``RLK_REQUIRE_GPU=1`` turns the skip of a ``gpu`` test into a failure when a framework it needs is missing too,
not only the device: the sitting runs tests/frameworks where both frameworks are installed, and a framework test
that skipped there would pass a GPU run that checked nothing. The root conftest's hooks run in a fresh pytest on
a probe table with a GPU and without vLLM."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"


@pytest.fixture()
def session(tmp_path):
    (tmp_path / "conftest.py").write_text(textwrap.dedent(f"""
        import importlib.util
        spec = importlib.util.spec_from_file_location("rlk_root_conftest", {str(CONFTEST)!r})
        root = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(root)
        root._probes = lambda: {{"gpu": (True, ""), "multi_gpu": (True, ""),
                                 "vllm": (False, "needs the vllm package"), "megatron": (True, "")}}
        pytest_collection_modifyitems = root.pytest_collection_modifyitems
        pytest_runtest_setup = root.pytest_runtest_setup

        def pytest_configure(config):
            for name in ("gpu", "multi_gpu", "vllm", "megatron"):
                config.addinivalue_line("markers", name)
        """))
    (tmp_path / "test_probe.py").write_text(textwrap.dedent("""
        import pytest

        @pytest.mark.gpu
        @pytest.mark.vllm
        def test_gpu_and_vllm():
            pass

        @pytest.mark.vllm
        def test_vllm_on_the_cpu():
            pass
        """))

    def run(require: str) -> str:
        env = {**os.environ, "RLK_REQUIRE_GPU": require}
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfs", "-p", "no:cacheprovider", str(tmp_path)],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        return proc.stdout

    return run


def test_a_gpu_test_missing_its_framework_fails_under_require_gpu(session):
    out = session("1")
    assert "1 skipped, 1 error" in out, out
    assert "RLK_REQUIRE_GPU=1 but this test needs the vllm package" in out


def test_without_require_gpu_both_skip(session):
    out = session("0")
    assert "2 skipped" in out, out
