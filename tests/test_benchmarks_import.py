"""Every benchmark script imports on a CPU machine (no GPU, no vLLM engine): a script that cannot even import is
found here, not in a GPU sitting. Each one is loaded as its own module, the way ``python benchmarks/<script>.py``
would see it, in one fresh interpreter for all of them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "benchmarks").rglob("*.py"))

_LOADER = r"""
import importlib.util, json, sys, traceback
out = {}
for i, path in enumerate(sys.argv[1:]):
    folder = path.rsplit("/", 1)[0]
    sys.path.insert(0, folder)
    try:
        spec = importlib.util.spec_from_file_location(f"rlk_bench_import_{i}", path)
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
        out[path] = None
    except BaseException:
        out[path] = traceback.format_exc()[-3000:]
    finally:
        sys.path.remove(folder)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def imported() -> dict[str, str | None]:
    proc = subprocess.run([sys.executable, "-c", _LOADER, *SCRIPTS], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_benchmark_script_is_found():
    assert {"benchmarks/bench_linear.py", "benchmarks/harness.py", "benchmarks/frameworks/vllm_gpu.py"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_script_imports_on_cpu(imported, script):
    assert imported[script] is None, imported[script]
