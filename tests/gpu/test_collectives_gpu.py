"""rlk_collectives on NCCL with two GPUs: the checks of tests/gpu/collectives_worker.py (bitwise equal to
the tree reference from 1 element to 256 MiB, on every path, identical on both ranks, equal to the CPU
specification, zigzag CP, CUDA-graph replays), run under torchrun with a deadline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.multi_gpu]

WORKER = Path(__file__).resolve().parent / "collectives_worker.py"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = Path(os.environ.get("RLK_COLLECTIVES_OUT") or tmp_path_factory.mktemp("coll"))
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", "29517", str(WORKER), str(out)],
                          capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    return json.loads((out / "collectives_gpu.json").read_text())


def test_every_check_passes(results):
    failed = {k: v[1] for k, v in results.items() if not v[0]}
    assert not failed, json.dumps(failed, indent=1)[:6000]


def test_coverage(results):
    names = set(results)
    assert any(n.endswith(f"/{128 << 20}") for n in names), "256 MiB of bf16"
    assert any(n.startswith("all_reduce/") and n.endswith("/1") for n in names), "one element"
    assert sum(n.startswith("graph/") for n in names) >= 10
    assert sum(n.startswith("cpu_spec/") for n in names) == 6
