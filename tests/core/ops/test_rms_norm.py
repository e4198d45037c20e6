"""rms_norm (rlk.rms_norm.v1)."""

import pytest
import torch

import rlk_core.ops as ops
from rlk_core.errors import RlkInputError
from rlk_core.testing import assert_bitwise_equal, assert_close_to_formula, check_batch_invariance, check_run_to_run


def _formula(x, w, eps):
    x6 = x.double()
    return x6 * torch.rsqrt((x6 * x6).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1), (5, 123), (19, 99), (2, 3, 1000), (4, 4096)])
def test_matches_float64_formula(shape, dtype):
    x = torch.randn(shape).to(dtype)
    w = torch.randn(shape[-1]).to(dtype)
    assert_close_to_formula(ops.rms_norm(x, w, 1e-6), _formula(x, w, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariant(dtype):
    x = torch.randn(64, 1000).to(dtype)
    w = torch.randn(1000).to(dtype)
    ok, detail = check_batch_invariance(lambda r: ops.rms_norm(r, w), x, batch_sizes=range(1, 65), probe=3)
    assert ok, detail


def test_non_contiguous_empty_and_run_to_run_with_backward():
    w = torch.randn(16)
    xt = torch.randn(16, 6).T
    assert_bitwise_equal(ops.rms_norm(xt, w), ops.rms_norm(xt.contiguous(), w))
    assert ops.rms_norm(torch.randn(0, 16), w).shape == (0, 16)
    x = torch.randn(9, 16)

    def fwd_bwd():
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = ops.rms_norm(xx, ww)
        (y * y).sum().backward()
        return y, xx.grad, ww.grad

    ok, detail = check_run_to_run(fwd_bwd)
    assert ok, detail


def test_backward_matches_float64_autograd():
    x, w, gy = torch.randn(5, 33), torch.randn(33), torch.randn(5, 33)
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    ops.rms_norm(xx, ww).backward(gy)
    x6, w6 = x.double().requires_grad_(), w.double().requires_grad_()
    _formula(x6, w6, 1e-6).backward(gy.double())
    assert_close_to_formula(xx.grad, x6.grad)
    assert_close_to_formula(ww.grad, w6.grad)


def test_opcheck():
    torch.library.opcheck(torch.ops.rlk.rms_norm, (torch.randn(3, 8, requires_grad=True), torch.randn(8), 1e-6))


@pytest.mark.parametrize("args, match", [
    (lambda: (torch.randn(2, 4), torch.randn(5)), "weight must have shape \\(4,\\)"),
    (lambda: (torch.randn(2, 0), torch.randn(0)), "H > 0"),
    (lambda: (torch.randn(2, 4), torch.randn(4), 0.0), "eps must be > 0"),
    (lambda: (torch.randint(0, 2, (2, 4)), torch.randn(4)), "dtype torch.int64"),
])
def test_bad_inputs(args, match):
    with pytest.raises(RlkInputError, match=match):
        ops.rms_norm(*args())
