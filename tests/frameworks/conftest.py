"""The framework tests launch worker scripts (this folder's ``*_worker.py``, or ``rlk-repro`` itself) as
subprocesses, as TransformerEngine's distributed tests do: each worker builds the real framework in a fresh
process (one vLLM engine, one torch.distributed world), writes a JSON of its checks and exits 1 if a bitwise one
failed. Hardware and frameworks are markers (``gpu``, ``multi_gpu``, ``vllm``, ``megatron``; the root conftest turns
them into skips, and into failures for ``gpu`` tests under ``RLK_REQUIRE_GPU=1``); the CPU tests run the same
workers on tiny models."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the helpers and the workers' modules of this folder

from _frameworks import Worker


@pytest.fixture()
def worker(tmp_path) -> Worker:
    return Worker(tmp_path)
