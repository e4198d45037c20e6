"""Cached operands. RlkQKVLinear keeps the ``[q; k; v]`` copy of its weight across calls: it must equal the uncached
computation bit for bit (forward, input and weight gradients) and follow every change of the weight —
an optimizer step applied Megatron's way (``param.data.copy_`` from a master copy, no version bump), an
in-place update, ``invalidate_weight_caches()``. The negative control: a hidden write without either
leaves the cache stale, which these comparisons detect. The core attention's per-batch cache of the
packed ``cu_seqlens``: a new batch or an in-place change is read again (two different batches differ, so
a stale entry would be seen)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from test_megatron_provider import MEGATRON_WARNINGS, R_ALL  # noqa: E402

pytestmark = [pytest.mark.megatron, *MEGATRON_WARNINGS]


@pytest.fixture(scope="module")
def facts() -> dict:
    env = {**os.environ, **R_ALL}
    proc = subprocess.run([sys.executable, os.path.join(HERE, "_qkv_cache_worker.py"), str(29300 + os.getpid() % 250)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("fact", [
    "first_equals_uncached", "second_call_equals_first", "weight_grad_nonzero", "version_unchanged_by_data_copy",
    "after_step_equals_uncached", "after_step_differs_from_before", "after_inplace_equals_uncached",
    "control_stale_after_hidden_write", "after_invalidate_equals_uncached",
    "batches_differ", "same_batch_served_from_cache", "new_batch_read_again", "inplace_change_read_again",
])
def test_qkv_weight_cache(facts, fact):
    assert facts[fact] is True, facts
