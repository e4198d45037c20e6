"""The TP-invariant gradients of rlk.gemm.tp.v1 (docs/ops/linear_tp.md, "Gradients"), emulated in one process: a
column-parallel linear's input gradient over component leaves (``column_leaf_rows``) at TP 1/2/4/8 == TP 1
bitwise, with negative controls (the shards' natural row order, the per-rank GEMM + rank sum); the head leaves of
the q/k-norm weight gradient (``group_leaves``); ``-0.0`` as the exact identity of the TP sum that follows."""

import math

import pytest
import torch

import rlk_core.ops as ops
from rlk_collectives import reduce_reference, tree_sum_fp32
from rlk_core.errors import RlkInputError
from rlk_core.ops.linear_tp import DEFAULT_LEAVES, column_leaf_rows, group_leaves

G = DEFAULT_LEAVES
QKV = (64, 32, 32)  # q, k, v rows (TP 1): 8 query heads and 4 KV heads of 8
FC1 = (48, 48)  # gate, up


def _inputs(m, n, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    dy = torch.randn(m, n, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / n**0.5).to(dtype)
    return dy, w


def _local(t: torch.Tensor, components, tp: int, r: int, dim: int) -> torch.Tensor:
    """Rank r's rows (dim 0) / columns (dim 1) of a column-parallel tensor: every component's r-th of tp slices,
    back to back (Megatron's [q_r; k_r; v_r], [gate_r; up_r])."""
    parts, start = [], 0
    for c in components:
        size = c // tp
        parts.append(t.narrow(dim, start + r * size, size))
        start += c
    return torch.cat(parts, dim)


def input_grad(dy, w, components, tp, leaves=G, order=True):
    """dX = dY W of a column-parallel linear at TP ``tp``, emulated: each rank's leaf-major rows through
    linear_tp_partials with G / tp leaves, the partials merged by the rank tree, rounded once. ``order=False``: the
    rank's rows in their natural order (what a plain split of the local N would cut)."""
    parts = []
    for r in range(tp):
        local = [c // tp for c in components]
        dy_r, w_r = _local(dy, components, tp, r, 1), _local(w, components, tp, r, 0)
        rows = torch.tensor(column_leaf_rows(local, leaves // tp)) if order else torch.arange(w_r.shape[0])
        parts.append(ops.linear_tp_partials(dy_r[:, rows], w_r[rows].t().contiguous(), leaves // tp))
    return ops.linear_tp_finish(tree_sum_fp32(parts), None, dy.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("components", [QKV, FC1, (128,)])
@pytest.mark.parametrize("m,k", [(1, 8), (19, 24), (33, 64)])
def test_column_input_gradient_tp_1_2_4_8_is_bitwise_tp_1(components, m, k, dtype):
    dy, w = _inputs(m, sum(components), k, dtype)
    want = input_grad(dy, w, components, 1)
    for tp in (2, 4, 8):
        assert torch.equal(input_grad(dy, w, components, tp), want), tp
    # and it is dY W: close to the float64 product
    ref = (dy.double() @ w.double()).to(dtype)
    torch.testing.assert_close(want, ref, rtol=2e-2 if dtype is torch.bfloat16 else 1e-5, atol=1e-5)


def test_negative_control_the_shards_natural_row_order_differs_across_tp():
    """Leaves cut from a rank's rows as they lie ([q_r; k_r; v_r] split in G / TP pieces) are other leaves at
    every TP: the bits differ (why the leaves are cut per component)."""
    dy, w = _inputs(19, sum(QKV), 24, torch.float32)
    tp1 = input_grad(dy, w, QKV, 1, order=False)
    assert not torch.equal(input_grad(dy, w, QKV, 2, order=False), tp1)


def test_negative_control_the_per_rank_gemm_and_rank_sum_differ_across_tp():
    """Megatron's copy-to-TP backward without invariant mode: each rank's dY_r W_r (rlk.gemm.bi.v1) all-reduced."""
    dy, w = _inputs(19, sum(QKV), 24, torch.float32)

    def naive(tp):
        return reduce_reference([ops.linear(_local(dy, QKV, tp, r, 1), _local(w, QKV, tp, r, 0).t().contiguous())
                                 for r in range(tp)])

    assert not torch.equal(naive(2), naive(1))
    assert not torch.equal(naive(1), input_grad(dy, w, QKV, 1))  # invariant mode is its own arithmetic


def test_column_leaf_rows_is_a_permutation_in_leaf_major_order():
    rows = column_leaf_rows([4, 2], 2)
    assert rows == [0, 1, 4, 2, 3, 5]  # leaf 0: q[0:2], k[0:1]; leaf 1: q[2:4], k[1:2]
    assert sorted(column_leaf_rows(list(QKV), G)) == list(range(sum(QKV)))
    with pytest.raises(RlkInputError, match="multiple of leaves=8"):
        column_leaf_rows([64, 12], 8)


@pytest.mark.parametrize("heads,n", [(16, 8), (32, 8), (40, 8), (8, 8), (4, 4), (2, 2), (1, 1)])
def test_group_leaves_are_whole_on_every_allowed_tp(heads, n):
    assert group_leaves(heads, G) == n
    for tp in (1, 2, 4, 8):
        if heads % tp == 0:  # Megatron's rule (and tp divides G): the rank holds n / tp whole leaves
            assert n % tp == 0 and (heads // tp) % (heads // n) == 0


def test_negative_zero_is_the_exact_identity_of_the_tp_sum():
    """The q/k-norm weight gradient is left on TP rank 0 and -0.0 elsewhere: every x + (-0.0) is x, bit for bit
    (signed zeros, infinities, NaN, subnormals), so Megatron's TP sum returns rank 0's bits in any order."""
    tiny = torch.finfo(torch.float32).tiny
    x = torch.cat([torch.randn(64, generator=torch.Generator().manual_seed(2)),
                   torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, tiny / 4, -tiny / 8])])
    minus = torch.full_like(x, -0.0)
    for got in (x + minus, minus + x, (minus + minus) + x, (x + minus) + minus):
        assert torch.equal(got.view(torch.int32), x.view(torch.int32))
    # negative control: +0.0 is not the identity (-0.0 + 0.0 is +0.0)
    assert not torch.equal((x + torch.zeros_like(x)).view(torch.int32), x.view(torch.int32))
