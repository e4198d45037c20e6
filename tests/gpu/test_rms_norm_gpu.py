"""``rms_norm`` on the GPU (backend ``rlk.triton``, contract ``rlk.rms_norm.v1``)."""

from __future__ import annotations

import pytest
import torch

from rlk_core.backends import REGISTRY
from rlk_core.ops import rms_norm
from rlk_core.ops.rms_norm.reference import rms_norm_reference
from rlk_core.testing import assert_bitwise_equal, check_batch_invariance, check_run_to_run, dtype_tols

from ._shapes import M_LIST, randn

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
