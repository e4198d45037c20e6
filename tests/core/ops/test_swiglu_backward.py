"""swiglu's backward: the companion op ``swiglu_backward`` (registry, readback, forcing, autograd wiring) and its
``rlk.triton`` kernel under the Triton interpreter, against the reference backward."""

from __future__ import annotations

import pytest
import torch

import rlk_core.ops as ops
from rlk_core.errors import RlkInputError
from rlk_core.ops.swiglu.reference import swiglu_backward_reference, swiglu_reference
from rlk_core.testing import dtype_tols

from ._backward_companion import (
    check_forced_with_the_main_op,
    check_registered,
    check_reported,
    check_suite_refuses_broken_backwards,
)


def _inputs(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(shape, generator=g)).to(dtype)
    return x, torch.randn((*shape[:-1], shape[-1] // 2), generator=g).to(dtype)


def _fwd_bwd(x, grad, fn=ops.swiglu):
    xx = x.clone().requires_grad_()
    return torch.autograd.grad(fn(xx), (xx,), grad)


def test_registered_reported_and_forced_with_swiglu(clean_registry, monkeypatch):
    check_registered(clean_registry, "swiglu")
    x, grad = _inputs((6, 32))
    check_reported("swiglu", "ffn", lambda: _fwd_bwd(x, grad))
    check_forced_with_the_main_op(clean_registry, monkeypatch, "swiglu", lambda: _fwd_bwd(x, grad))


@pytest.mark.parametrize("path", ["function", "dispatcher"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_autograd_is_the_backward_op_and_matches_autograd_through_the_reference(path, dtype):
    x, grad = _inputs((3, 5, 18), dtype)
    (dx,) = _fwd_bwd(x, grad, ops.swiglu if path == "function" else torch.ops.rlk.swiglu)
    assert torch.equal(dx, swiglu_backward_reference(grad, x)) and dx.dtype == dtype
    (auto,) = _fwd_bwd(x, grad, swiglu_reference)
    torch.testing.assert_close(dx.double(), auto.double(), **dtype_tols(dtype))


def test_opcheck_and_bad_inputs():
    x, grad = _inputs((3, 8))
    torch.library.opcheck(torch.ops.rlk.swiglu_backward, (grad, x))
    with pytest.raises(RlkInputError, match="grad must have shape"):
        torch.ops.rlk.swiglu_backward(x, x)


def test_triton_backward_interpreted(run_interpreted):
    """dx of the kernel vs the reference backward within dtype_tols (awkward widths, one row, a second column
    block past 2048, every dtype, a 3-d input); run to run bitwise; a row alone gives the bits it has in the
    batch; non-contiguous grad and x equal their contiguous copies bitwise; a wrong gradient is caught by the
    tolerance check (negative control)."""
    run_interpreted("""
        from rlk_core.ops.swiglu import triton as K
        from rlk_core.ops.swiglu.reference import swiglu_backward_reference as ref
        from rlk_core.testing import dtype_tols

        gen = torch.Generator().manual_seed(0)

        def randn(*shape, dtype=torch.float32, scale=1.0):
            return (scale * torch.randn(*shape, generator=gen)).to(dtype)

        def close(got, want, dtype):
            torch.testing.assert_close(got.double(), want.double(), **dtype_tols(dtype))

        for shape in [(1, 2), (5, 246), (3, 7, 198), (2, 2 * 2500)]:
            for dt in (torch.float32, torch.bfloat16, torch.float16):
                x = randn(*shape, dtype=dt, scale=3.0)
                g = randn(*shape[:-1], shape[-1] // 2, dtype=dt)
                dx = K.backward(CPU, g, x)
                assert dx.dtype == dt and dx.shape == x.shape
                close(dx, ref(g, x), dt)
                assert torch.equal(dx, K.backward(CPU, g, x))
                rows_x, rows_g, rows_dx = (t.reshape(-1, t.shape[-1]) for t in (x, g, dx))
                for r in sorted({0, rows_x.shape[0] - 1}):
                    assert torch.equal(K.backward(CPU, rows_g[r:r + 1], rows_x[r:r + 1])[0], rows_dx[r]), (shape, r)

        x = randn(16, 9, dtype=torch.bfloat16, scale=3.0).T[:, ::2]  # [9, 8] strided both ways
        g = randn(4, 9, dtype=torch.bfloat16).T                     # [9, 4] transposed
        dx = K.backward(CPU, g, x)
        assert torch.equal(dx, K.backward(CPU, g.contiguous(), x.contiguous()))
        close(dx, ref(g, x), torch.bfloat16)

        x, g = randn(4, 64, scale=3.0), randn(4, 32)
        try:
            close(K.backward(CPU, g * 1.01, x), ref(g, x), torch.float32)
        except AssertionError:
            pass
        else:
            raise SystemExit("the tolerance check passed a wrong gradient")
        assert K.backward(CPU, torch.zeros(0, 4), torch.zeros(0, 8)).shape == (0, 8)
        print("ok")
    """)


def test_the_contract_suite_refuses_broken_backwards():
    check_suite_refuses_broken_backwards("swiglu")
