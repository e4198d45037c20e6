"""``rms_norm`` on the GPU (backend ``rlk.triton``, contract ``rlk.rms_norm.v1``)."""

from __future__ import annotations

import pytest
import torch

from rlk_core.backends import REGISTRY
from rlk_core.ops import rms_norm
from rlk_core.ops.rms_norm.reference import rms_norm_backward_reference, rms_norm_reference
from rlk_core.testing import assert_bitwise_equal, check_batch_invariance, check_run_to_run, dtype_tols

from ._shapes import M_LIST, RLK_GPU, randn

pytestmark = pytest.mark.gpu
EPS = 1e-6


def test_triton_backend_is_selected():
    x, w = randn((3, 128)), randn((128,))
    # rlk.cuda (the same binaries, AOT-built) where rlk_core._C and the cubins are installed
    assert REGISTRY.select("rms_norm", "cuda", (x, w, EPS), strict=True).backend.id in ("rlk.cuda", "rlk.triton")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("h", [4096, 1024, 128, 1000])
def test_rms_norm_batch_invariant(h, dtype):
    rows, w = randn((64, h), dtype, seed=1), randn((h,), dtype, seed=2)
    ok, detail = check_batch_invariance(lambda a: rms_norm(a, w, EPS), rows, batch_sizes=M_LIST, probe=9)
    assert ok, detail


@pytest.mark.parametrize("h", [4096, 128])
def test_rms_norm_decode_equals_training_batch(h):
    x, w = randn((8192, h), seed=3), randn((h,), seed=4)
    big = rms_norm(x, w, EPS)
    for m in (1, 2, 3, 7, 16, 65):
        for start in (0, 4001, 8192 - m):
            assert_bitwise_equal(rms_norm(x[start:start + m], w, EPS), big[start:start + m],
                                 f"rows {start}..{start + m} alone vs in the batch of 8192")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(65, 4096), (3, 7, 128), (1, 1000), (0, 64)])
def test_rms_norm_matches_reference(shape, dtype):
    x, w = randn(shape, dtype, seed=5), randn((shape[-1],), torch.float32, seed=6)
    torch.testing.assert_close(rms_norm(x, w, EPS).double(), rms_norm_reference(x, w, EPS).double(),
                               **dtype_tols(dtype))


def test_rms_norm_noncontiguous_rows():
    x, w = randn((64, 2, 512), seed=7), randn((512,), seed=8)
    view = x[:, 1]
    assert_bitwise_equal(rms_norm(view, w, EPS), rms_norm(view.contiguous(), w, EPS), "strided vs contiguous")


def test_rms_norm_forward_backward_run_to_run():
    x0, w0, g = randn((1000, 4096), seed=9), randn((4096,), seed=10), randn((1000, 4096), seed=11)

    def step():
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = rms_norm(x, w, EPS)
        y.backward(g)
        return y, x.grad, w.grad

    ok, detail = check_run_to_run(step, repeats=10)
    assert ok, detail


def test_rms_norm_opcheck():
    torch.library.opcheck(torch.ops.rlk.rms_norm.default, (randn((5, 128)), randn((128,)), EPS))


# -- backward: rms_norm_backward on rlk.triton (two launches: dx + fp32 dweight partials, fixed-order merge) -----
def _bwd_inputs(shape, dtype=torch.bfloat16, wdtype=torch.float32, seed=20):
    return randn(shape, dtype, seed=seed), (1 + 0.5 * randn((shape[-1],), torch.float32, seed=seed + 1)).to(wdtype), \
        randn(shape, dtype, seed=seed + 2)


def _close_sum(got, want, dtype):
    """dweight, a sum over every row: within the dtype's rtol in norm (two fp32 summation orders differ per
    element by ~sqrt(M) eps of the sum of |terms|, which an elementwise atol cannot bound near zero)."""
    rel = float((got.double() - want.double()).norm() / want.double().norm())
    assert rel <= dtype_tols(dtype)["rtol"], f"dweight: relative error {rel:.3g} (rtol {dtype_tols(dtype)['rtol']})"


def _close_dx(got, want, g, x, w, dtype):
    """dx = inv * (gw - xhat * mean(gw * xhat)): within the dtype's tolerance plus the fp32 rounding of that
    subtraction, whose terms cancel where a row is short (N = 1: 1 - xhat^2 = eps / (x^2 + eps)), so two fp32
    evaluation orders differ there by a few ulps of the terms, not of the result."""
    xf = x.double()
    inv = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    xhat, gw = xf * inv, g.double() * w.double()
    terms = inv * (gw.abs() + xhat.abs() * (gw * xhat).abs().mean(-1, keepdim=True))
    tol = dtype_tols(dtype)
    err = (got.double() - want.double()).abs()
    bound = tol["rtol"] * want.double().abs() + tol["atol"] + 8 * 2.0**-24 * terms
    over = int((err > bound).sum())
    assert over == 0, f"dx: max error {float(err.max()):.3g}, {over} elements over the bound"


def _qk_norm_view(t, heads=16, seed=30):
    """q as rlk's self-attention hands it to the q-norm: a [T, 16, 128] view of a [T, 32, 128] QKV output."""
    return randn((t, heads + 16, 128), seed=seed)[:, :heads]


def test_backward_runs_rlk_triton_from_autograd():
    x, w, g = _bwd_inputs((65, 1024))
    sel = REGISTRY.select("rms_norm_backward", "cuda", (g, x, w, EPS), strict=True)
    assert sel.backend.id in RLK_GPU and sel.fallback_reason is None
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    dx, dw = torch.autograd.grad(rms_norm(xx, ww, EPS), (xx, ww), g)
    want = sel.backend.fn(g, x, w, EPS)
    assert_bitwise_equal(dx, want[0], "autograd dx vs the selected backward")
    assert_bitwise_equal(dw, want[1], "autograd dweight vs the selected backward")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("wdtype", ["x", torch.float32])
@pytest.mark.parametrize("shape", [(4096, 1024), (65, 4096), (1, 1000), (5, 123), (3, 7, 128), (1, 1)])
def test_backward_matches_reference(shape, dtype, wdtype):
    wdtype = dtype if wdtype == "x" else wdtype
    x, w, g = _bwd_inputs(shape, dtype, wdtype)
    dx, dw = torch.ops.rlk.rms_norm_backward(g, x, w, EPS)
    rdx, rdw = rms_norm_backward_reference(g, x, w, EPS)
    assert dx.dtype == dtype and dw.dtype == wdtype
    _close_dx(dx, rdx, g, x, w, dtype)
    _close_sum(dw, rdw, wdtype)


@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
def test_backward_qk_norm_layout_reads_the_view(wdtype):
    """The q/k-norm input [T, heads, 128] as a view of the QKV output: read in place, the bits of its
    contiguous copy, within tolerance of the reference (T = 4096: 65536 rows, 512 partial programs)."""
    x = _qk_norm_view(4096)
    w = (1 + 0.5 * randn((128,), torch.float32, seed=31)).to(wdtype)
    g = randn(x.shape, seed=32)
    dx, dw = torch.ops.rlk.rms_norm_backward(g, x, w, EPS)
    cdx, cdw = torch.ops.rlk.rms_norm_backward(g, x.contiguous(), w, EPS)
    assert_bitwise_equal(dx, cdx, "dx: view vs copy")
    assert_bitwise_equal(dw, cdw, "dweight: view vs copy")
    rdx, rdw = rms_norm_backward_reference(g, x, w, EPS)
    torch.testing.assert_close(dx.double(), rdx.double(), **dtype_tols(torch.bfloat16))
    _close_sum(dw, rdw, wdtype)


def _qk_inputs():
    return _qk_norm_view(4096), randn((128,), torch.float32, seed=33), randn((4096, 16, 128), seed=34)


@pytest.mark.parametrize("make", [lambda: _bwd_inputs((4096, 1024)), _qk_inputs], ids=["hidden-1024", "qk-norm-16x128"])
def test_backward_run_to_run_and_order_control(make):
    """dx and dweight bitwise equal over 10 runs at the training shapes. Control (that the check could fail):
    dweight summed in another order — torch's sum of the fp32 products over the rows — differs in bits
    (fp32 weights: no rounding to bf16 to hide it), so the run-to-run equality is a statement about one fixed
    order, not about an order-insensitive sum."""
    x, w, g = make()
    ok, detail = check_run_to_run(lambda: torch.ops.rlk.rms_norm_backward(g, x, w, EPS), repeats=10)
    assert ok, detail
    _, dw = torch.ops.rlk.rms_norm_backward(g, x, w, EPS)
    xf = x.float().reshape(-1, x.shape[-1])
    xhat = xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) / xf.shape[-1] + EPS)
    other = (g.float().reshape(xhat.shape) * xhat).sum(0)
    assert w.dtype == torch.float32
    _close_sum(dw, other, torch.float32)
    assert not torch.equal(dw, other), "dweight has the bits of another summation order: the control proves nothing"


@pytest.mark.parametrize("h", [1024, 128, 4096])
def test_backward_dx_batch_invariant(h):
    """dx of a row depends on that row alone: alone == inside batches of every M of the list (dweight sums
    every row: deterministic, not batch-invariant by nature)."""
    x, w, g = _bwd_inputs((64, h), seed=40)
    ok, detail = check_batch_invariance(lambda gg, xx: torch.ops.rlk.rms_norm_backward(gg, xx, w, EPS)[0], (g, x),
                                        batch_sizes=M_LIST, probe=9)
    assert ok, detail


def test_backward_opcheck():
    x, w, g = _bwd_inputs((5, 128))
    torch.library.opcheck(torch.ops.rlk.rms_norm_backward.default, (g, x, w, EPS))
