"""``linear`` on the GPU (backend ``rlk.triton``, contract ``rlk.gemm.bi.v1``): bitwise batch
invariance over the issue's M list, decode-sized vs training-sized batches, run-to-run forward and
backward, tolerance vs the reference, and cuBLAS as the negative control."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlk_core.backends import REGISTRY
from rlk_core.ops import linear
from rlk_core.ops._plan import jit_plan
from rlk_core.ops.linear.reference import linear_reference
from rlk_core.ops.linear.tiles import _LARGE_TMA, shipped_tiles
from rlk_core.testing import assert_bitwise_equal, check_batch_invariance, check_run_to_run, dtype_tols

from ._shapes import M_LIST, RLK_GPU, assert_close_dot, linear_inputs, randn

pytestmark = pytest.mark.gpu

# (N, K): down projection (the large-K shape where cuBLAS is not batch-invariant), qkv, awkward, and qkv at
# TP 4 (at M = 4096 a row split: 128x256 tiles, then 128x128 tiles in a second launch)
SHAPES = [(4096, 12288), (6144, 4096), (333, 1000), (1536, 4096)]


def test_triton_backend_is_selected():
    x, w = linear_inputs(4, 64, 128)
    sel = REGISTRY.select("linear", "cuda", (x, w, None), strict=True)
    # rlk.cuda (the same binaries, AOT-built) where rlk_core._C and the cubins are installed
    assert sel.backend.id in ("rlk.cuda", "rlk.triton") and sel.fallback_reason is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", SHAPES)
def test_linear_batch_invariant(n, k, dtype):
    rows, w = linear_inputs(64, n, k, dtype)
    ok, detail = check_batch_invariance(lambda a: linear(a, w), rows, batch_sizes=M_LIST, probe=5)
    assert ok, detail


def test_linear_fp32_batch_invariant():
    rows, w = linear_inputs(32, 300, 520, torch.float32)
    ok, detail = check_batch_invariance(lambda a: linear(a, w), rows, batch_sizes=M_LIST[:11], probe=3)
    assert ok, detail


@pytest.mark.parametrize("n,k", SHAPES[:2])
def test_linear_decode_equals_training_batch(n, k):
    x, w = linear_inputs(8192, n, k)
    b = randn((n,), seed=7)
    big = linear(x, w, b)
    for m in (1, 2, 3, 7, 16, 63, 65):
        for start in (0, 4001, 8192 - m):
            assert_bitwise_equal(linear(x[start:start + m], w, b), big[start:start + m],
                                 f"rows {start}..{start + m} alone vs in the batch of 8192")


@pytest.mark.parametrize("n,k", SHAPES)
def test_every_shipped_tile_gives_the_same_bits(n, k):
    """The tile rule of ``config`` is a speed choice only: every tile it can pick, through the TMA
    kernel (with the last row block's box shrunk to its rows or not) and the pointer kernel, gives the
    bits of the default choice for the same rows (M = 20, 90: 32-row last boxes; 65: 16 rows)."""
    from rlk_core.ops.linear import triton as lt

    x, w = linear_inputs(1000, n, k)
    b = randn((n,), seed=13)
    for m in (1, 20, 65, 80, 90, 1000):
        want = linear(x[:m], w, b)
        for tile in shipped_tiles():
            for tma, rem_box in ((False, False), (True, False), (True, True)):
                if (tma and not lt.tma_compatible(x, w, want)) or (not tma and len(tile) > 6):
                    continue
                cfg = lt.tile_config(tile, k, tma=tma, rem_box=rem_box)
                assert_bitwise_equal(lt.linear_2d(x[:m], w, b, cfg), want,
                                     f"M={m} {n}x{k}: tile {tile} tma={tma} rem_box={rem_box}")


def _straggling_split(reader: torch.cuda.Stream | None = None):
    """A row split whose first launch has one straggler (133 tiles of 128x256, K = 16384, on 132 programs:
    one program computes two tiles) and whose second launch is small (128 rows); the output starts as NaN
    and is copied right after the second launch, on the same stream or on ``reader`` (ordered after the fill,
    not after the split). Returns (the copy, the output once the device is idle, the first part's rows, x, w)."""
    from rlk_core.ops.linear import triton as lt

    rows = 133 * 128
    x, w = linear_inputs(rows + 128, 256, 16384)
    cfg = dict(lt.tile_config(_LARGE_TMA[0][0], 16384, tma=True), SPLIT_ROWS=rows,
               REST=lt.tile_config(_LARGE_TMA[2][0], 16384, tma=True))
    out = torch.full((rows + 128, 256), float("nan"), dtype=x.dtype, device=x.device)
    filled = torch.cuda.Event()
    filled.record()  # a reader on another stream waits for the NaN fill (else it may read the memory's old bits)
    lt._launch(jit_plan(x.device), x, w, None, out, cfg)
    with torch.cuda.stream(reader or torch.cuda.current_stream()):
        torch.cuda.current_stream().wait_event(filled)
        seen = out.clone()
    torch.cuda.synchronize()
    return seen, out, rows, x, w


def test_row_split_is_complete_for_the_next_kernel():
    """Work queued after a row split's second launch (started early by programmatic dependent launch)
    finds the first launch's rows written, straggler included; the split gives one launch's bits."""
    from rlk_core.ops.linear import triton as lt

    for _ in range(5):
        seen, out, rows, x, w = _straggling_split()
        assert_bitwise_equal(seen, out, "the output as the next kernel saw it vs once the device was idle")
    assert not out.isnan().any()
    assert_bitwise_equal(out, lt.linear_2d(x, w, None, lt.tile_config(_LARGE_TMA[1][0], 16384, tma=True)),
                         "split vs one launch of 128x128 tiles")


def test_row_split_read_unordered_is_seen_unfinished_negative_control():
    """The check above can fail: a copy on another stream, not ordered after the split, sees rows of the
    first launch not yet written."""
    side = torch.cuda.Stream()
    unfinished = 0
    for _ in range(5):
        seen, out, rows, _, _ = _straggling_split(side)
        assert not out.isnan().any()
        unfinished += int(seen[:rows].isnan().any())
    assert unfinished, "the unordered copy never saw the split unfinished: the negative control is void"


def test_linear_3d_and_noncontiguous_rows():
    x, w = linear_inputs(2 * 96, 256, 512)
    x3 = x.view(2, 96, 512)
    assert_bitwise_equal(linear(x3, w), linear(x, w).view(2, 96, 256), "[2, 96, K] vs [192, K]")
    strided = x[::2]  # row stride 2K: a non-contiguous view
    assert_bitwise_equal(linear(strided, w), linear(x, w)[::2], "strided rows vs the same rows in the batch")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m,n,k", [(65, 256, 4096), (7, 130, 1000), (1, 64, 96)])
def test_linear_matches_reference(m, n, k, dtype):
    x, w = linear_inputs(m, n, k, dtype, seed=11)
    b = randn((n,), dtype, seed=12)
    out = linear(x, w, b)
    ref = linear_reference(x, w, b)
    if dtype != torch.float32:  # rounding to bf16/fp16 dominates: the plain elementwise tolerance holds
        torch.testing.assert_close(out.double(), ref.double(), **dtype_tols(dtype))
    absdot = x.double().abs() @ w.double().abs().T + b.double().abs()
    assert_close_dot(out, ref, absdot, dtype, f"linear {m}x{n}x{k} {dtype} vs reference")


def test_linear_forward_backward_run_to_run():
    x0, w0 = linear_inputs(1000, 1536, 4096)
    b0 = randn((1536,), seed=3)
    g = randn((1000, 1536), seed=4)

    def step():
        x, w, b = (t.detach().clone().requires_grad_() for t in (x0, w0, b0))
        y = linear(x, w, b)
        y.backward(g)
        return y, x.grad, w.grad, b.grad

    ok, detail = check_run_to_run(step, repeats=10)
    assert ok, detail


def test_linear_backward_matches_reference():
    x0, w0 = linear_inputs(63, 96, 256, torch.float32)
    g = randn((63, 96), torch.float32, seed=5)
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    linear(x, w).backward(g)
    g64, x64, w64 = g.double(), x0.double(), w0.double()
    assert_close_dot(x.grad, g64 @ w64, g64.abs() @ w64.abs(), torch.float32, "dx vs float64")
    assert_close_dot(w.grad, g64.T @ x64, g64.abs().T @ x64.abs(), torch.float32, "dW vs float64")


def test_cublas_is_not_batch_invariant_negative_control():
    """The check above must be able to fail: on the H200, cuBLAS (torch.mm / F.linear) gives a row
    different bits at M=1 than inside M=2048 for the down projection (12288 -> 4096)."""
    x, w = linear_inputs(2048, 4096, 12288)
    alone_mm, batch_mm = torch.mm(x[:1], w.t()), torch.mm(x, w.t())[:1]
    alone_fl, batch_fl = F.linear(x[:1], w), F.linear(x, w)[:1]
    assert not torch.equal(alone_mm, batch_mm), "torch.mm was batch-invariant here: the negative control is void"
    assert not torch.equal(alone_fl, batch_fl), "F.linear was batch-invariant here: the negative control is void"
    assert_bitwise_equal(linear(x[:1], w), linear(x, w)[:1], "rlk linear, row 0 at M=1 vs M=2048")


def test_linear_opcheck():
    x, w = linear_inputs(5, 48, 64)
    b = randn((48,), seed=9)
    torch.library.opcheck(torch.ops.rlk.linear.default, (x, w, b))


# -- the backward's stored-layout GEMMs (dx = dy W, dW = dy^T x, db = dy^T 1; no operand copies) --------------------
# (N, K) of the Qwen3-0.6B projections at TP 1 (qkv, o, gate_up, down) and an awkward one (rows of 666 / 2000 bytes:
# TMA-compatible, no tile multiple); T: the profile's 4096 tokens, a ragged count, one token
BWD_SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (333, 1000)]


def _backward(x0, w0, b0, g):
    x, w = x0.detach().clone().requires_grad_(), w0.detach().clone().requires_grad_()
    b = None if b0 is None else b0.detach().clone().requires_grad_()
    linear(x, w, b).backward(g)
    return x.grad, w.grad, None if b is None else b.grad


def _bwd_inputs(t, n, k, dtype=torch.bfloat16, bias=True):
    x, w = linear_inputs(t, n, k, dtype, seed=21)
    return x, w, randn((n,), dtype, seed=22) if bias else None, randn((t, n), dtype, seed=23)


@pytest.mark.parametrize("n,k", BWD_SHAPES)
@pytest.mark.parametrize("t", [4096, 1017])
def test_backward_bitwise_run_to_run(t, n, k):
    x, w, b, g = _bwd_inputs(t, n, k)
    ok, detail = check_run_to_run(lambda: _backward(x, w, b, g), repeats=5)
    assert ok, detail


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("t,n,k", [(4096, 1024, 3072), (1017, 333, 1000), (17, 1536, 1024), (1, 64, 96)])
def test_backward_matches_float64_products(t, n, k, dtype):
    x, w, b, g = _bwd_inputs(t, n, k, dtype)
    dx, dw, db = _backward(x, w, b, g)
    g64, x64, w64 = g.double(), x.double(), w.double()
    assert_close_dot(dx, g64 @ w64, g64.abs() @ w64.abs(), dtype, "dx vs float64")
    assert_close_dot(dw, g64.T @ x64, g64.abs().T @ x64.abs(), dtype, "dW vs float64")
    assert_close_dot(db, g64.sum(0), g64.abs().sum(0), dtype, "db vs float64")


def test_backward_gemms_run_on_an_rlk_backend():
    """The backward's views (W.t(), dy.t(), x.t(), the stride-0 ones) take the stored-layout kernels: rlk.cuda's
    binaries of them where the build has them, else rlk.triton's (recorded as such, not as a fallback)."""
    from rlk_core.ops.linear import triton as lt

    x, w, _, g = _bwd_inputs(64, 256, 512)
    ones = g.new_ones(1).as_strided((1, 64), (1, 0))
    for args in ((g, w.t(), None), (g.t(), x.t(), None), (g.t(), ones, None)):
        sel = REGISTRY.select("linear", "cuda", args, strict=True)
        assert sel.backend.id in RLK_GPU and sel.fallback_reason is None
        assert lt.stored_layout(*args)


@pytest.fixture
def triton_linear(monkeypatch):
    """``linear`` forced onto rlk.triton (RLK_BACKENDS), so its JIT caches see every launch."""
    monkeypatch.setenv("RLK_BACKENDS", "linear=rlk.triton")
    REGISTRY.refresh()  # RLK_BACKENDS is read once per process
    yield
    monkeypatch.undo()
    REGISTRY.refresh()


def _cache_entries(*kernels) -> int:
    dev = torch.cuda.current_device()
    return sum(len(k.device_caches[dev][0]) for k in kernels if dev in k.device_caches)


def test_backward_compiles_nothing_new_when_the_token_count_changes(triton_linear):
    """After one backward at T = 1000, backwards at other token counts (ragged, divisible by 16 / 64 / 128 or
    not, one token) add no entry to the stored-layout kernels' JIT caches."""
    from rlk_core.ops.linear import triton as lt

    kernels = (lt._linear_bwd_tma_kernel, lt._linear_bwd_kernel)
    n, k = 1536, 1024
    _backward(*_bwd_inputs(1000, n, k))
    torch.cuda.synchronize()
    before = _cache_entries(*kernels)
    assert before >= 2  # dx + dW (TMA) and db (pointer) compiled
    for t in (1017, 4096, 4097, 64, 17, 1):
        _backward(*_bwd_inputs(t, n, k))
    torch.cuda.synchronize()
    assert _cache_entries(*kernels) == before


def test_cache_count_sees_new_variants_negative_control():
    """The count above can fail: dW by the forward's kernels on contiguous transposed operands (K = the token
    count, unpadded) compiles new variants as T's divisibility by 16 and TMA eligibility change."""
    from rlk_core.ops.linear import triton as lt

    kernels = (lt._linear_tma_kernel, lt._linear_fwd_kernel)
    g, x = randn((2048, 1536), seed=1), randn((2048, 1024), seed=2)
    lt.linear_2d(g[:1024].t().contiguous(), x[:1024].t().contiguous(), None)
    torch.cuda.synchronize()
    before = _cache_entries(*kernels)
    for t in (1032, 1017):  # K not divisible by 16 (TMA rows still aligned); rows of 2034 bytes: no TMA
        lt.linear_2d(g[:t].t().contiguous(), x[:t].t().contiguous(), None)
    torch.cuda.synchronize()
    assert _cache_entries(*kernels) > before
