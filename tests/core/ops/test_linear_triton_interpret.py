"""The rlk.triton GEMM kernels under the Triton interpreter (CPU) at tiny shapes: the persistent TMA
kernel (also with a row tail, with the last row block's smaller box, and as a row split into two launches)
and the pointer kernel, several tiles, bias, ragged M/N/K edges — within
tolerance of a float64 product. The interpreter does not reproduce GPU bits; bitwise properties are tested in
tests/gpu/test_linear_gpu.py. fp16/fp32 only (the interpreter's bf16 ``tl.dot`` is wrong)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

SCRIPT = """
    from rlk_core.ops.linear import triton as LT

    torch.manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 1e-2)):
        for m, n, k in ((5, 48, 40), (70, 40, 72), (1, 16, 8), (90, 24, 40)):
            x, w, b = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype), torch.randn(n).to(dtype)
            ref = x.double() @ w.double().T + b.double()
            scale = max(1.0, float(ref.abs().max()))  # the output's own rounding is relative to its size
            # 64-row tiles read a last row block of M % 64 < 32 rows with a 16- or 32-row box (M = 5, 70, 90)
            for tile in ((16, 16, 16, 2, 4, 2), (32, 16, 32, 2, 4, 2), (64, 16, 16, 2, 4, 2), (16, 16, 16, 2, 4, 2, 16),
                         (32, 16, 32, 2, 4, 2, 16)):
                for tma in (False, True) if len(tile) == 6 else (True,):  # a tail tile needs the TMA kernel
                    cfg = LT.tile_config(tile, k, dtype, tma)
                    err = float((LT.linear_2d(x, w, b, cfg).double() - ref).abs().max())
                    assert err <= tol * scale, (dtype, m, n, k, tile, tma, err)
            # a row split: the first 32 rows by one tile, the rest (with a 16-row last box) by another
            cfg = dict(LT.tile_config((32, 16, 32, 2, 4, 2), k, dtype, True), SPLIT_ROWS=32,
                       REST=LT.tile_config((32, 32, 16, 2, 4, 2), k, dtype, True))
            if m > 32:
                err = float((LT.linear_2d(x, w, b, cfg).double() - ref).abs().max())
                assert err <= tol * scale, (dtype, m, n, k, "split", err)
    print("ok")
"""


def test_linear_triton_kernels_interpreted(run_interpreted):
    run_interpreted(SCRIPT, timeout=300)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_launch_does_not_mutate_the_cached_rule():
    """``config`` is cached per shape; ``_launch`` pops keys from its own copy, never from the cache."""
    from rlk_core.ops._plan import jit_plan
    from rlk_core.ops.linear import tiles
    from rlk_core.ops.linear import triton as lt

    before = dict(tiles.config(torch.float32, 5, 48, 40, False, 132))
    x, w = torch.randn(5, 40), torch.randn(48, 40)
    with pytest.raises(Exception):  # noqa: B017  (no GPU, no interpreter: the launch fails after the copy)
        lt._launch(jit_plan(x.device), x, w, None, torch.empty(5, 48),
                   tiles.config(torch.float32, 5, 48, 40, False, 132))
    assert tiles.config(torch.float32, 5, 48, 40, False, 132) == before
