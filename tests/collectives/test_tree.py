"""``tree_sum_fp32`` (the specification) and ``reduce_rows`` (what every rank runs), in one process."""

from __future__ import annotations

import pytest
import torch

from rlk_collectives import DTYPES, reduce_reference, tree_sum_fp32
from rlk_collectives._tree import reduce_rows
from rlk_core.errors import RlkInputError

WORLDS = (1, 2, 3, 4, 5, 6, 7, 8)


def _f32(*values: float) -> list[torch.Tensor]:
    return [torch.tensor([v], dtype=torch.float32) for v in values]


def test_the_tree_is_pairwise_over_rank_order():
    big = 2.0 ** 24  # the fp32 ulp is 2 from here up
    # W = 4: (x0 + x1) + (x2 + x3) = (2^24 + 1 -> 2^24) + (1 - 2^24, exact) = 1; left to right gives 0
    assert tree_sum_fp32(_f32(big, 1.0, 1.0, -big)).item() == 1.0
    assert ((torch.tensor(big) + 1.0) + 1.0 - big).item() == 0.0
    # W = 3: (x0 + x1) + x2
    assert tree_sum_fp32(_f32(1.0, 2.0 ** -24, 2.0 ** -24)).item() == 1.0  # each tie rounds to 1
    assert tree_sum_fp32(_f32(2.0 ** -24, 2.0 ** -24, 1.0)).item() == 1.0 + 2.0 ** -23  # first pair exact
    # W = 5: ((x0 + x1) + (x2 + x3)) + x4
    assert tree_sum_fp32(_f32(big, 1.0, 1.0, -big, 0.5)).item() == 1.5


def test_fp32_result_and_one_rounding():
    x = [torch.tensor([1.0 + 2.0 ** -7], dtype=torch.bfloat16), torch.tensor([2.0 ** -9], dtype=torch.bfloat16)]
    s = tree_sum_fp32(x)
    assert s.dtype == torch.float32 and s.item() == 1.0 + 2.0 ** -7 + 2.0 ** -9
    assert reduce_rows(torch.stack(x)).item() == s.to(torch.bfloat16).item() == reduce_reference(x).item()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("world", WORLDS)
def test_reduce_rows_is_tree_sum_bitwise(inputs, world, dtype):
    for xs in (inputs.adversarial(world, 5003, dtype, seed=11), inputs.random_bits(world, 5003, dtype, seed=12)):
        expect = reduce_reference(xs)
        assert torch.equal(inputs.bits(reduce_rows(torch.stack(xs))), inputs.bits(expect))
        out = torch.empty(5003, dtype=dtype)
        reduce_rows(torch.stack(xs), out=out)
        assert torch.equal(inputs.bits(out), inputs.bits(expect))


def test_naive_left_to_right_bf16_sum_differs_at_w4(inputs):
    """Negative control: the order matters at W = 4, so a test of the tree can fail."""
    xs = inputs.adversarial(4, 5003, torch.bfloat16, seed=13)
    tree, naive = inputs.bits(reduce_reference(xs)), inputs.bits(inputs.naive_sum(xs))
    assert int((tree != naive).sum()) > 50
    swapped = inputs.bits(reduce_reference([xs[0], xs[2], xs[1], xs[3]]))
    assert int((tree != swapped).sum()) > 0  # the tree's pairing is part of the contract


def test_special_values():
    inf, nan = float("inf"), float("nan")
    bf = torch.bfloat16

    def red(*vals, dtype=bf):
        return reduce_rows(torch.tensor(vals, dtype=dtype)[:, None])[0]

    assert red(inf, 1.0).item() == inf
    assert red(inf, -inf).isnan()
    assert red(nan, 1.0, 2.0, 3.0).isnan()
    assert red(-0.0, -0.0, -0.0, -0.0).view(torch.int16).item() == torch.tensor(-0.0, dtype=bf).view(torch.int16)
    assert red(-0.0, 0.0).view(torch.int16).item() == 0  # +0: any +0 contribution gives +0
    assert red(1.0, -1.0).view(torch.int16).item() == 0  # exact cancellation gives +0
    # subnormals are kept (gradual underflow), in fp32 (bf16's subnormals are fp32 subnormals)
    sub = torch.finfo(bf).smallest_normal * torch.finfo(bf).eps
    assert red(sub, sub).item() == 2 * sub
    h = torch.float16
    hsub = torch.finfo(h).smallest_normal * torch.finfo(h).eps
    assert red(hsub, hsub, dtype=h).item() == 2 * hsub
    # overflow of the fp32 sum, and rounding to inf on the way back to fp16
    big = torch.finfo(bf).max
    assert red(big, big).item() == inf
    assert red(60000.0, 60000.0, dtype=h).item() == inf


@pytest.mark.parametrize(("dtype", "pattern"), [(torch.bfloat16, 0x7FC0), (torch.float16, 0x7E00),
                                                (torch.float32, 0x7FC00000)], ids=str)
def test_nan_is_canonical(inputs, dtype, pattern):
    xs = inputs.random_bits(4, 20000, dtype, seed=14)  # NaNs with every payload and sign
    r = reduce_rows(torch.stack(xs))
    nan = r.isnan()
    assert nan.any() and bool((inputs.bits(r)[nan] == pattern).all())


def test_bad_input():
    with pytest.raises(RlkInputError, match="at least one"):
        tree_sum_fp32([])
    with pytest.raises(RlkInputError, match="all must match"):
        tree_sum_fp32([torch.ones(2), torch.ones(3)])
    with pytest.raises(RlkInputError, match="not supported|supported"):
        tree_sum_fp32([torch.ones(2, dtype=torch.float64)])


def test_w1_is_a_copy():
    x = torch.randn(10)
    y = tree_sum_fp32([x])
    assert torch.equal(x, y) and y.data_ptr() != x.data_ptr()
    z = reduce_rows(x[None])
    assert torch.equal(x, z) and z.data_ptr() != x.data_ptr()
