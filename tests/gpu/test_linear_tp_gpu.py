"""``linear_tp_partials`` on the GPU (rlk.gemm.tp.v1, backend ``rlk.triton``), emulated TP on one device: each rank's
K slice run with that rank's own launch (its shapes, G / TP leaves), the partials merged by rlk.collective.v1's rank
tree in process (``tree_sum_fp32``) and rounded once — TP 1, 2, 4, 8 bitwise equal on the Qwen3-8B row-parallel
shapes at decode and training M; batch-invariant; close to the reference; the native per-rank GEMM + sum differs.
(Part of the GPU suite since it was written: passed in the clean run of `tests/gpu` at `c9d2ad4`.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlk_collectives import reduce_reference, tree_sum_fp32
from rlk_core.ops import linear_tp, linear_tp_finish, linear_tp_partials
from rlk_core.ops.linear_tp.reference import linear_tp_partials_reference
from rlk_core.testing import check_batch_invariance

pytestmark = pytest.mark.gpu

SHAPES = [(4096, 4096), (4096, 12288)]  # o_proj, down_proj of Qwen3-8B: (N, K)
M_LIST = [1, 7, 16, 17, 128, 1000, 4096]


def _inputs(m, n, k, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, generator=g, device="cuda").bfloat16()
    w = (torch.randn(n, k, generator=g, device="cuda") / k**0.5).bfloat16()
    return x, w


def _emulated(x, w, tp, g=8):
    c = x.shape[1] // tp
    parts = [linear_tp_partials(x[:, r * c:(r + 1) * c], w[:, r * c:(r + 1) * c], g // tp) for r in range(tp)]
    return linear_tp_finish(tree_sum_fp32(parts), None, x.dtype)


@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("m", M_LIST)
def test_emulated_tp_1_2_4_8_bitwise(m, n, k):
    x, w = _inputs(m, n, k)
    want = linear_tp(x, w)
    for tp in (1, 2, 4, 8):
        assert torch.equal(_emulated(x, w, tp), want), (m, n, k, tp)


def test_close_to_the_reference_and_batch_invariant():
    x, w = _inputs(64, 512, 4096, seed=1)
    got = linear_tp_partials(x, w, 8)
    ref = linear_tp_partials_reference(x.cpu(), w.cpu(), 8)
    torch.testing.assert_close(got.cpu(), ref, rtol=1e-5, atol=1e-4)
    ok, detail = check_batch_invariance(lambda r: linear_tp(r, w), x, batch_sizes=range(1, 65), probe=5)
    assert ok, detail


def test_negative_control_per_rank_cublas_and_sum_differs():
    x, w = _inputs(256, 4096, 12288, seed=2)
    c = 12288 // 4
    naive = reduce_reference([F.linear(x[:, r * c:(r + 1) * c], w[:, r * c:(r + 1) * c]) for r in range(4)])
    assert not torch.equal(naive, F.linear(x, w))
    assert not torch.equal(naive, linear_tp(x, w))
