"""The torch ops the provider adds around the rlk ops, counted on the CPU (the same ops launch kernels on the
GPU): a training step's forward + backward of the tiny all-R GPTModel issues, from the provider's own code,
exactly one kernel per layer — the gather of the QKV weight gradient back to Megatron's row order — and no
copy of the QKV output (``RlkSelfAttention`` splits the ``[q | k | v]`` GEMM output into views instead of
Megatron regrouping it per KV head and copying the query heads). The control puts Megatron's
``get_query_key_value_tensors`` back: the same counter then sees the regrouping copies (a cat forward, three
column copies backward, per layer, from the provider) and Megatron's query copy."""

from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _model  # noqa: E402
from test_megatron_provider import MEGATRON_WARNINGS, R_ALL  # noqa: E402

pytestmark = [pytest.mark.megatron, *MEGATRON_WARNINGS]


@pytest.fixture(scope="module")
def counts() -> dict:
    return _model.run_worker("_op_count_worker.py", 29550, R_ALL)


def _by(ops: dict, who: str) -> dict:
    return {k.split(" ", 1)[1]: v for k, v in ops.items() if k.startswith(who + " ")}


def test_provider_issues_one_kernel_per_layer(counts):
    n = counts["layers"]
    assert _by(counts["fast"], "provider") == {"index_select": n}


def test_megatron_query_copy_is_gone(counts):
    n = counts["layers"]
    fast, control = _by(counts["fast"], "megatron"), _by(counts["control"], "megatron")
    assert control.get("clone", 0) - fast.get("clone", 0) == n
    assert {k: v for k, v in control.items() if k != "clone"} == {k: v for k, v in fast.items() if k != "clone"}


def test_control_counter_sees_the_regrouping_copies(counts):
    n = counts["layers"]
    assert _by(counts["control"], "provider") == {"index_select": n, "cat": n, "copy_": 3 * n}
