"""On a CUDA GPU: the host syncs of the rlk spec's training step, measured by torch's sync debug mode (the GPU
side of test_host_syncs.py, whose docstring lists what remains and why). The tiny all-R GPTModel in bf16,
the GRPO step of ``benchmarks/frameworks/megatron_gpu.py`` without the optimizer:

- a fresh packed batch: exactly one, the provider's read of ``cu_seqlens_q`` (``attention.py:_packed_batch``);
  none inside rlk_core's kernels (rope reads its reserved table; attention, linear, norms, log-probs issue
  none) nor in Megatron on this path;
- the same batch again: none;
- control: with the rope table not reserved (another theta), ``rlk_core/ops/rope/triton.py`` sizes its table
  from the positions on every call — one sync per rope call, two per layer — which the same measurement sees.

Run on the GPU machine: ``RLK_REQUIRE_GPU=1 python -m pytest -q tests/megatron/test_host_syncs_gpu.py``.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _model
from test_megatron_provider import MEGATRON_WARNINGS, R_ALL

pytestmark = [pytest.mark.gpu, pytest.mark.megatron, *MEGATRON_WARNINGS]


@pytest.fixture(scope="module")
def runs() -> dict:
    return _model.run_worker("_sync_count_gpu_worker.py", 30410, R_ALL, timeout=900)  # first Triton compiles


def _files(run: dict) -> dict[str, int]:
    out: dict[str, int] = {}
    for site, n in run["sites"].items():
        path = site.rsplit(":", 1)[0]
        out[path] = out.get(path, 0) + n
    return out


def test_a_fresh_packed_batch_costs_one_host_sync(runs):
    run = runs["fresh_batch"]
    assert run["per_step"] == 1 and _files(run) == {"rlk_megatron_provider/attention.py": 1}, run


def test_the_same_batch_again_costs_none(runs):
    assert runs["same_batch"]["per_step"] == 0, runs["same_batch"]


def test_control_unreserved_rope_syncs_per_call(runs):
    files = _files(runs["control_unreserved_rope"])
    assert files.get("rlk_core/ops/rope/triton.py") == 2 * runs["layers"], runs["control_unreserved_rope"]
