"""Cached operands. RlkQKVLinear keeps the ``[q; k; v]`` copy of its weight across calls: it must equal the uncached
computation bit for bit (forward, input and weight gradients) and follow every change of the weight —
an optimizer step applied Megatron's way (``param.data.copy_`` from a master copy, no version bump), an
in-place update, ``invalidate_weight_caches()``. The negative control: a hidden write without either
leaves the cache stale, which these comparisons detect. The core attention's per-batch cache of the
packed ``cu_seqlens``: a new batch or an in-place change is read again (two different batches differ, so
a stale entry would be seen)."""

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
def facts() -> dict:
    return _model.run_worker("_qkv_cache_worker.py", 29300, R_ALL)


@pytest.mark.parametrize("fact", [
    "first_equals_uncached", "second_call_equals_first", "weight_grad_nonzero", "version_unchanged_by_data_copy",
    "after_step_equals_uncached", "after_step_differs_from_before", "after_inplace_equals_uncached",
    "control_stale_after_hidden_write", "after_invalidate_equals_uncached",
    "batches_differ", "same_batch_served_from_cache", "new_batch_read_again", "inplace_change_read_again",
])
def test_qkv_weight_cache(facts, fact):
    assert facts[fact] is True, facts
