"""``swiglu`` on the GPU (backend ``rlk.triton``, contract ``rlk.swiglu.v1``)."""

from __future__ import annotations

import pytest
import torch

from rlk_core.backends import REGISTRY
from rlk_core.ops import swiglu
from rlk_core.ops.swiglu.reference import swiglu_backward_reference, swiglu_reference
from rlk_core.testing import assert_bitwise_equal, check_batch_invariance, check_run_to_run, dtype_tols

from ._shapes import M_LIST, RLK_GPU, randn

pytestmark = pytest.mark.gpu


def test_triton_backend_is_selected():
    # rlk.cuda (the same binaries, AOT-built) where rlk_core._C and the cubins are installed
    sel = REGISTRY.select("swiglu", "cuda", (randn((3, 256)),), strict=True)
    assert sel.backend.id in ("rlk.cuda", "rlk.triton")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("inter", [12288, 3072, 768, 100])
def test_swiglu_batch_invariant(inter, dtype):
    rows = randn((64, 2 * inter), dtype, scale=3.0, seed=1)
    ok, detail = check_batch_invariance(swiglu, rows, batch_sizes=M_LIST, probe=9)
    assert ok, detail


def test_swiglu_decode_equals_training_batch():
    x = randn((8192, 2 * 3072), scale=3.0, seed=2)
    big = swiglu(x)
    for m in (1, 2, 3, 7, 16, 65):
        for start in (0, 4001, 8192 - m):
            assert_bitwise_equal(swiglu(x[start:start + m]), big[start:start + m], f"rows {start}..{start + m}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(65, 2 * 12288), (3, 5, 2 * 768), (1, 2 * 100), (0, 64)])
def test_swiglu_matches_reference(shape, dtype):
    x = randn(shape, dtype, scale=3.0, seed=3)
    torch.testing.assert_close(swiglu(x).double(), swiglu_reference(x).double(), **dtype_tols(dtype))


def test_swiglu_forward_backward_run_to_run():
    x0, g = randn((1000, 2 * 3072), scale=3.0, seed=4), randn((1000, 3072), seed=5)

    def step():
        x = x0.clone().requires_grad_()
        y = swiglu(x)
        y.backward(g)
        return y, x.grad

    ok, detail = check_run_to_run(step, repeats=10)
    assert ok, detail


def test_swiglu_opcheck():
    torch.library.opcheck(torch.ops.rlk.swiglu.default, (randn((5, 256)),))


# -- backward: swiglu_backward on rlk.triton (one elementwise launch) ------------------------------------------
def _bwd_inputs(shape, dtype=torch.bfloat16, seed=20):
    return randn(shape, dtype, scale=3.0, seed=seed), randn((*shape[:-1], shape[-1] // 2), dtype, seed=seed + 1)


def test_backward_runs_rlk_triton_from_autograd():
    x, g = _bwd_inputs((65, 2 * 3072))
    sel = REGISTRY.select("swiglu_backward", "cuda", (g, x), strict=True)
    assert sel.backend.id in RLK_GPU and sel.fallback_reason is None
    xx = x.clone().requires_grad_()
    (dx,) = torch.autograd.grad(swiglu(xx), (xx,), g)
    assert_bitwise_equal(dx, sel.backend.fn(g, x), "autograd dx vs the selected backward")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(4096, 2 * 3072), (65, 2 * 12288), (3, 5, 2 * 768), (1, 2 * 100), (1, 2)])
def test_backward_matches_reference(shape, dtype):
    x, g = _bwd_inputs(shape, dtype)
    dx = torch.ops.rlk.swiglu_backward(g, x)
    assert dx.dtype == dtype and dx.shape == x.shape
    torch.testing.assert_close(dx.double(), swiglu_backward_reference(g, x).double(), **dtype_tols(dtype))


def test_backward_non_contiguous_grad_and_input():
    x, g = _bwd_inputs((64, 2 * 3072))
    xt = x.T.contiguous().T  # column-major copy: rows of stride 1 apart
    gt = g.T.contiguous().T
    assert not xt.is_contiguous() and not gt.is_contiguous()
    assert_bitwise_equal(torch.ops.rlk.swiglu_backward(gt, xt), torch.ops.rlk.swiglu_backward(g, x),
                         "non-contiguous vs contiguous")


def test_backward_run_to_run_and_sensitivity_control():
    """dx bitwise equal over 10 runs at the 0.6B shape; control: one changed gate value changes its dgate
    (a kernel that never wrote dx would pass run to run on stale memory, not this)."""
    x, g = _bwd_inputs((4096, 2 * 3072))
    ok, detail = check_run_to_run(lambda: torch.ops.rlk.swiglu_backward(g, x), repeats=10)
    assert ok, detail
    before = torch.ops.rlk.swiglu_backward(g, x)
    x[7, 11] += 1.0
    after = torch.ops.rlk.swiglu_backward(g, x)
    assert after[7, 11] != before[7, 11]
    diff = (after != before).nonzero().tolist()
    assert [7, 11] in diff and all(r == 7 and c in (11, 3072 + 11) for r, c in diff), diff[:5]


@pytest.mark.parametrize("inter", [3072, 100])
def test_backward_batch_invariant(inter):
    x, g = _bwd_inputs((64, 2 * inter), seed=30)
    ok, detail = check_batch_invariance(lambda gg, xx: torch.ops.rlk.swiglu_backward(gg, xx), (g, x),
                                        batch_sizes=M_LIST, probe=9)
    assert ok, detail


def test_backward_opcheck():
    x, g = _bwd_inputs((5, 256))
    torch.library.opcheck(torch.ops.rlk.swiglu_backward.default, (g, x))
