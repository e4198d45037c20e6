"""rms_norm's backward: the companion op ``rms_norm_backward`` (registry, readback, forcing, autograd wiring)
and its ``rlk.triton`` kernels under the Triton interpreter, against the reference backward."""

from __future__ import annotations

import pytest
import torch

import rlk_core.ops as ops
from rlk_core.errors import RlkInputError
from rlk_core.ops.rms_norm.reference import rms_norm_backward_reference, rms_norm_reference
from rlk_core.testing import dtype_tols

from ._backward_companion import (
    check_forced_with_the_main_op,
    check_registered,
    check_reported,
    check_suite_refuses_broken_backwards,
)

EPS = 1e-6


def _inputs(shape, dtype=torch.float32, wdtype=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(dtype)
    w = (1 + 0.5 * torch.randn(shape[-1], generator=g)).to(wdtype or dtype)
    return x, w, torch.randn(shape, generator=g).to(dtype)


def _fwd_bwd(x, w, grad, fn=ops.rms_norm):
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    return torch.autograd.grad(fn(xx, ww, EPS), (xx, ww), grad)


def test_registered_reported_and_forced_with_rms_norm(clean_registry, monkeypatch):
    check_registered(clean_registry, "rms_norm")
    x, w, grad = _inputs((6, 32))
    check_reported("rms_norm", "ffn", lambda: _fwd_bwd(x, w, grad))
    check_forced_with_the_main_op(clean_registry, monkeypatch, "rms_norm", lambda: _fwd_bwd(x, w, grad))


@pytest.mark.parametrize("path", ["function", "dispatcher"])
@pytest.mark.parametrize("shape,wdtype", [((5, 33), torch.float32), ((3, 4, 16), torch.bfloat16)])
def test_autograd_is_the_backward_op_and_matches_autograd_through_the_reference(path, shape, wdtype):
    """The gradients autograd returns are the companion op's (bitwise, on the eager ``function`` path and
    through the dispatcher), and they agree with torch.autograd.grad through the differentiable reference
    forward within tolerance."""
    x, w, grad = _inputs(shape, wdtype=wdtype)
    fn = ops.rms_norm if path == "function" else torch.ops.rlk.rms_norm
    dx, dw = _fwd_bwd(x, w, grad, fn)
    want = rms_norm_backward_reference(grad, x, w, EPS)
    assert torch.equal(dx, want[0]) and torch.equal(dw, want[1])
    assert dx.dtype == x.dtype and dw.dtype == wdtype
    ax, aw = _fwd_bwd(x, w, grad, rms_norm_reference)
    torch.testing.assert_close(dx, ax, **dtype_tols(torch.float32))
    torch.testing.assert_close(dw.float(), aw.float(), **dtype_tols(wdtype))


def test_frozen_weight_and_empty_batch():
    x, w, grad = _inputs((4, 16))
    xx = x.clone().requires_grad_()
    (dx,) = torch.autograd.grad(ops.rms_norm(xx, w, EPS), (xx,), grad)
    assert torch.equal(dx, rms_norm_backward_reference(grad, x, w, EPS)[0])
    dx0, dw0 = torch.ops.rlk.rms_norm_backward(torch.zeros(0, 16), torch.zeros(0, 16), w, EPS)
    assert dx0.shape == (0, 16) and torch.equal(dw0, torch.zeros(16))


def test_opcheck_and_bad_inputs():
    x, w, grad = _inputs((3, 8))
    torch.library.opcheck(torch.ops.rlk.rms_norm_backward, (grad, x, w, EPS))
    with pytest.raises(RlkInputError, match="grad must have x's shape"):
        torch.ops.rlk.rms_norm_backward(grad[:2], x, w, EPS)


def test_triton_backward_interpreted(run_interpreted):
    """dx and dweight of the kernels vs the reference backward within dtype_tols (awkward widths, one row,
    the [T, heads, 128] q/k-norm layout as a strided view of a QKV output, several partial programs, fp32 and
    bf16 weights, every activation dtype); run to run and view-vs-copy bitwise; a row alone gives the dx
    bits it has inside the batch; a wrong weight is caught by the tolerance check (negative control)."""
    run_interpreted("""
        from rlk_core.ops.rms_norm import triton as K
        from rlk_core.ops.rms_norm.reference import rms_norm_backward_reference as ref
        from rlk_core.testing import dtype_tols

        gen = torch.Generator().manual_seed(0)

        def randn(*shape, dtype=torch.float32):
            return torch.randn(*shape, generator=gen).to(dtype)

        def close(got, want, dtype):
            torch.testing.assert_close(got.double(), want.double(), **dtype_tols(dtype))

        cases = [((1, 1), torch.float32, torch.float32), ((1, 64), torch.bfloat16, torch.float32),
                 ((5, 123), torch.bfloat16, torch.bfloat16), ((5, 123), torch.float16, torch.float32),
                 ((3, 1000), torch.float32, torch.bfloat16), ((2, 4096), torch.bfloat16, torch.float32),
                 ((300, 64), torch.float32, torch.float32), ((2, 3, 1000), torch.float16, torch.float16)]
        for shape, dt, wdt in cases:
            x, g = randn(*shape, dtype=dt), randn(*shape, dtype=dt)
            w = (1 + 0.5 * randn(shape[-1])).to(wdt)
            dx, dw = K.backward(CPU, g, x, w, 1e-6)
            rdx, rdw = ref(g, x, w, 1e-6)
            assert dx.dtype == dt and dw.dtype == wdt and dx.shape == x.shape and dw.shape == w.shape
            close(dx, rdx, dt)
            close(dw, rdw, wdt)
            dx2, dw2 = K.backward(CPU, g, x, w, 1e-6)
            assert torch.equal(dx, dx2) and torch.equal(dw, dw2), shape
            rows_x, rows_g = x.reshape(-1, shape[-1]), g.reshape(-1, shape[-1])
            for r in sorted({0, rows_x.shape[0] // 2, rows_x.shape[0] - 1}):
                alone = K.backward(CPU, rows_g[r:r + 1], rows_x[r:r + 1], w, 1e-6)[0]
                assert torch.equal(alone[0], dx.reshape(-1, shape[-1])[r]), (shape, r)
        assert K.partition(300, 64)[1] == 5  # dweight from 5 partial programs in the (300, 64) case

        # the q/k-norm layout: x a [T, 8, 128] view of a [T, 12, 128] QKV output, the gradient a transposed
        # copy (non-contiguous); 40 tokens = 320 rows: 5 programs of 64 rows
        qkv = randn(40, 12, 128, dtype=torch.bfloat16)
        x = qkv[:, 2:10]
        g = randn(8, 40, 128, dtype=torch.bfloat16).transpose(0, 1)
        for wdt in (torch.float32, torch.bfloat16):
            w = (1 + 0.5 * randn(128)).to(wdt)
            dx, dw = K.backward(CPU, g, x, w, 1e-6)
            rdx, rdw = ref(g, x, w, 1e-6)
            close(dx, rdx, torch.bfloat16)
            close(dw, rdw, wdt)
            cdx, cdw = K.backward(CPU, g.contiguous(), x.contiguous(), w, 1e-6)
            assert torch.equal(dx, cdx) and torch.equal(dw, cdw)
            assert K.rows_view(CPU, x).data_ptr() == x.data_ptr()  # read in place, no copy
        assert K.partition(320, 128) == (64, 5)

        # negative controls: dx with another weight, dweight with another gradient are not within tolerance
        x, g, w = randn(6, 256), randn(6, 256), 1 + 0.5 * randn(256)
        good = ref(g, x, w, 1e-6)
        wrong = (K.backward(CPU, g, x, w * 1.01, 1e-6)[0], K.backward(CPU, g * 1.01, x, w, 1e-6)[1])
        for got, want in zip(wrong, good):
            try:
                close(got, want, torch.float32)
            except AssertionError:
                continue
            raise SystemExit("the tolerance check passed a wrong input")

        dx, dw = K.backward(CPU, torch.zeros(0, 32), torch.zeros(0, 32), w[:32].bfloat16(), 1e-6)
        assert dx.shape == (0, 32) and dw.dtype == torch.bfloat16 and not dw.any()
        print("ok")
    """)


def test_partition_is_a_function_of_the_shape():
    pytest.importorskip("triton")
    from rlk_core.ops.rms_norm import triton as K

    for m, h in ((1, 128), (4096, 1024), (65536, 128), (32768, 128), (4096, 4096), (100, 1000)):
        rpp, programs = K.partition(m, h)
        rows = K.config(h)["ROWS"]
        assert rpp % rows == 0 and rpp >= K.MIN_STEPS * rows and programs <= K.MAX_PROGRAMS
        assert (programs - 1) * rpp < m <= programs * rpp
    assert K.partition(65536, 128) == K.partition(65536, 128) == (128, 512)


def test_the_contract_suite_refuses_broken_backwards():
    check_suite_refuses_broken_backwards("rms_norm")


@pytest.mark.parametrize("shape", [(1, 8), (5, 3, 32), (19, 64)])
def test_the_public_call_is_what_autograd_runs(shape):
    """``rlk_core.ops.rms_norm.rms_norm_backward`` (the TP-invariant norms call it per row group) gives the bits of
    rms_norm's autograd backward, and its weight gradient is the sum over the rows it is given."""
    from rlk_core.ops.rms_norm import rms_norm_backward

    x, w, grad = _inputs(shape)
    dx, dw = rms_norm_backward(grad, x, w, EPS)
    want_dx, want_dw = _fwd_bwd(x, w, grad)
    assert torch.equal(dx, want_dx) and torch.equal(dw, want_dw)
    if shape[0] > 1:  # another row group is another weight gradient (the rows it reduces are the caller's)
        assert not torch.equal(rms_norm_backward(grad[:1], x[:1], w, EPS)[1], dw)
