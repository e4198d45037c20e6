"""``swiglu`` on the GPU (backend ``rlk.triton``, contract ``rlk.swiglu.v1``)."""

from __future__ import annotations

import pytest
import torch

from rlk_core.backends import REGISTRY
from rlk_core.ops import swiglu
from rlk_core.ops.swiglu.reference import swiglu_reference
from rlk_core.testing import assert_bitwise_equal, check_batch_invariance, check_run_to_run, dtype_tols

from ._shapes import M_LIST, randn

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
