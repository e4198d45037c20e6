"""swiglu (rlk.swiglu.v1)."""

import pytest
import torch
import torch.nn.functional as F

import rlk_core.ops as ops
from rlk_core.errors import RlkInputError
from rlk_core.testing import assert_bitwise_equal, assert_close_to_formula, check_batch_invariance, check_run_to_run


def _formula(x):
    g, u = x.double().chunk(2, dim=-1)
    return F.silu(g) * u


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 2), (5, 246), (3, 7, 198), (2, 2000)])
def test_matches_float64_formula(shape, dtype):
    x = (3 * torch.randn(shape)).to(dtype)
    assert_close_to_formula(ops.swiglu(x), _formula(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariant_where_torch_silu_is_not_guaranteed(dtype):
    x = (3 * torch.randn(64, 2 * 999)).to(dtype)  # odd width: elements land in vector bodies and tails
    ok, detail = check_batch_invariance(ops.swiglu, x, batch_sizes=range(1, 65), probe=7)
    assert ok, detail


def test_non_contiguous_empty_run_to_run_and_backward():
    x = torch.randn(8, 6).T
    assert_bitwise_equal(ops.swiglu(x), ops.swiglu(x.contiguous()))
    assert ops.swiglu(torch.randn(0, 8)).shape == (0, 4)
    x = torch.randn(5, 10)

    def fwd_bwd():
        xx = x.clone().requires_grad_()
        y = ops.swiglu(xx)
        (y * y).sum().backward()
        return y, xx.grad

    ok, detail = check_run_to_run(fwd_bwd)
    assert ok, detail
    xx, x6 = x.clone().requires_grad_(), x.double().requires_grad_()
    gy = torch.randn(5, 5)
    ops.swiglu(xx).backward(gy)
    _formula(x6).backward(gy.double())
    assert_close_to_formula(xx.grad, x6.grad)


def test_opcheck():
    torch.library.opcheck(torch.ops.rlk.swiglu, (torch.randn(3, 8, requires_grad=True),))


@pytest.mark.parametrize("x, match", [(torch.randn(2, 5), "even"), (torch.randn(2, 0), "even, non-zero"),
                                      (torch.ones(2, 4, dtype=torch.int32), "dtype torch.int32")])
def test_bad_inputs(x, match):
    with pytest.raises(RlkInputError, match=match):
        ops.swiglu(x)
