"""``token_logprobs`` and ``linear_logprobs`` on the GPU (backend ``rlk.triton``, contract
``rlk.logp.v1``): bitwise batch invariance over the issue's M list, decode-sized vs training-sized
batches, fused == unfused, vocab shards 1/2/4/8, run-to-run forward and backward, tolerance vs the
reference, and the torch path (F.linear + log_softmax + gather) as the negative control.

``sanitize_cases()`` runs every log-prob kernel once at small shapes (for compute-sanitizer).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlk_core.backends import REGISTRY
from rlk_core.ops import _logp_tree as L
from rlk_core.ops.linear import linear
from rlk_core.ops.linear_logprobs import linear_logprobs
from rlk_core.ops.linear_logprobs.reference import linear_logprobs_backward_reference, linear_logprobs_reference
from rlk_core.ops.token_logprobs import token_logprobs
from rlk_core.ops.token_logprobs.reference import token_logprobs_backward_reference, token_logprobs_reference
from rlk_core.testing import assert_bitwise_equal, check_batch_invariance, check_run_to_run, dtype_tols
from rlk_core.testing.logp import check_fused_equals_unfused, check_linear_vocab_shard_merge, check_vocab_shard_merge

from ._shapes import RLK_GPU, gen, randn

pytestmark = pytest.mark.gpu

VOCAB = 151936  # Qwen3
M_SIZES = (1, 2, 3, 7, 16, 63, 64, 65, 127, 128, 1000, 4096)


def targets(t: int, v: int, seed: int = 100) -> torch.Tensor:
    return torch.randint(0, v, (t,), device="cuda", generator=gen(seed))


def temps(t: int, seed: int = 200) -> torch.Tensor:
    return 0.5 + torch.rand(t, device="cuda", generator=gen(seed))


def head(v: int, h: int, dtype=torch.bfloat16, seed: int = 1) -> torch.Tensor:
    return randn((v, h), dtype, 2.0 * h ** -0.5, seed)  # logits of order a few units


def stacked(out: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return torch.stack(out, -1)


# -- selection -------------------------------------------------------------------------------------
def test_triton_backend_is_selected():
    x = randn((4, 1000))
    y, t = targets(4, 1000), temps(4)
    sel = REGISTRY.select("token_logprobs", "cuda", ([x], y, t), strict=True)
    assert sel.backend.id in RLK_GPU and sel.fallback_reason is None
    h, w = randn((4, 64)), head(1000, 64)
    sel = REGISTRY.select("linear_logprobs", "cuda", (h, [w], y, t), strict=True)
    assert sel.backend.id in RLK_GPU and sel.fallback_reason is None


# -- batch invariance ------------------------------------------------------------------------------
@pytest.mark.parametrize("v", (VOCAB, 50257, 1000))
def test_token_logprobs_batch_invariant(v):
    logits = randn((64, v), torch.bfloat16, 3.0, seed=3)
    y, t = targets(64, v), temps(64)

    def fn(idx):
        i = idx[:, 0]
        return stacked(token_logprobs(logits[i], y[i], t[i]))

    rows = torch.arange(64, device="cuda")[:, None]
    ok, detail = check_batch_invariance(fn, rows, batch_sizes=M_SIZES, probe=5)
    assert ok, detail


@pytest.mark.parametrize("v,h", ((VOCAB, 1024), (VOCAB, 4096), (50257, 1024)))
def test_linear_logprobs_batch_invariant(v, h):
    hidden, w = randn((64, h), seed=4), head(v, h)
    y, t = targets(64, v), temps(64)

    def fn(idx):
        i = idx[:, 0]
        return stacked(linear_logprobs(hidden[i], w, y[i], t[i]))

    rows = torch.arange(64, device="cuda")[:, None]
    ok, detail = check_batch_invariance(fn, rows, batch_sizes=M_SIZES, probe=5)
    assert ok, detail


def test_linear_logprobs_decode_equals_training_batch_and_unfused():
    """Rows computed in decode-sized batches == the same rows inside a batch of 8192 (where the vocab
    is walked in sub-group column chunks), and the fused result == linear then token_logprobs."""
    t_big, h = 8192, 4096
    hidden, w = randn((t_big, h), seed=5), head(VOCAB, h)
    y, t = targets(t_big, VOCAB), temps(t_big)
    big = stacked(linear_logprobs(hidden, w, y, t))
    for m in (1, 2, 3, 7):
        for start in (0, 4001, t_big - m):
            sl = slice(start, start + m)
            assert_bitwise_equal(stacked(linear_logprobs(hidden[sl], w, y[sl], t[sl])), big[sl],
                                 f"rows {start}..{start + m} alone vs in the batch of {t_big}")
    unfused = stacked(token_logprobs(linear(hidden, w), y, t))
    assert_bitwise_equal(big, unfused, "fused vs linear + token_logprobs at T=8192, H=4096")
    mid = stacked(linear_logprobs(hidden[:4096], w, y[:4096], t[:4096]))
    assert_bitwise_equal(mid, big[:4096], "first 4096 rows vs the same rows in the batch of 8192")


@pytest.mark.parametrize("v,h", ((VOCAB, 1024), (50257, 1024), (1000, 4096)))
def test_fused_equals_unfused(v, h):
    hidden, w = randn((257, h), seed=6), head(v, h)
    ok, detail = check_fused_equals_unfused(hidden, w, targets(257, v), temps(257))
    assert ok, detail


# -- vocab shards ----------------------------------------------------------------------------------
@pytest.mark.parametrize("v", (VOCAB, 50257))
def test_token_logprobs_vocab_shards(v):
    logits = randn((300, v), torch.bfloat16, 3.0, seed=7)
    ok, detail = check_vocab_shard_merge(logits, targets(300, v), temps(300))
    assert ok, detail


@pytest.mark.parametrize("v", (VOCAB, 50257))
def test_linear_logprobs_vocab_shards(v):
    hidden, w = randn((300, 1024), seed=8), head(v, 1024)
    ok, detail = check_linear_vocab_shard_merge(hidden, w, targets(300, v), temps(300))
    assert ok, detail


# -- run to run ------------------------------------------------------------------------------------
def test_token_logprobs_forward_backward_run_to_run():
    x0 = randn((1000, VOCAB), torch.bfloat16, 3.0, seed=9)
    y, t = targets(1000, VOCAB), temps(1000)
    a, b = randn((1000,), torch.float32, seed=10), randn((1000,), torch.float32, seed=11)

    def step():
        x = x0.detach().clone().requires_grad_()
        logp, lse = token_logprobs(x, y, t)
        (logp * a + lse * b).sum().backward()
        return logp, lse, x.grad

    ok, detail = check_run_to_run(step, repeats=10)
    assert ok, detail


@pytest.mark.parametrize("t_rows,h", ((1000, 1024), (256, 4096)))
def test_linear_logprobs_forward_backward_run_to_run(t_rows, h):
    h0, w0 = randn((t_rows, h), seed=12), head(VOCAB, h)
    y, t = targets(t_rows, VOCAB), temps(t_rows)
    a, b = randn((t_rows,), torch.float32, seed=13), randn((t_rows,), torch.float32, seed=14)

    def step():
        hid, w = h0.detach().clone().requires_grad_(), w0.detach().clone().requires_grad_()
        logp, lse = linear_logprobs(hid, w, y, t)
        (logp * a + lse * b).sum().backward()
        return logp, lse, hid.grad, w.grad

    ok, detail = check_run_to_run(step, repeats=10)
    assert ok, detail


# -- tolerance vs the reference (small shapes: the reference on CUDA walks many small kernels) ------
def assert_close_logp(out, ref, what):
    """fp32 results: ``|err| <= atol + rtol * (|lse| + |logp|)`` (logp = z_t - lse cancels)."""
    tols = dtype_tols(torch.float32)
    (lp, lse), (rlp, rlse) = out, ref
    scale = rlse.double().abs() + rlp.double().abs()
    for name, a, e in (("logp", lp, rlp), ("lse", lse, rlse)):
        err = (a.double() - e.double()).abs()
        allowed = tols["atol"] + tols["rtol"] * scale
        assert not bool((err > allowed).any()), f"{what} {name}: worst err/allowed {float((err / allowed).max()):.3g}"


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("t_rows,v", ((7, 5000), (1, 300), (33, 2053)))
def test_token_logprobs_matches_reference(t_rows, v, dtype):
    x = randn((t_rows, v), dtype, 3.0, seed=15)
    x[0, : v // 4] = float("-inf")
    y, t = targets(t_rows, v), temps(t_rows)
    out = token_logprobs(x, y, t)
    assert_close_logp(out, token_logprobs_reference([x], y, t), f"token_logprobs {t_rows}x{v} {dtype}")
    g_logp, g_lse = randn((t_rows,), torch.float32, seed=16), randn((t_rows,), torch.float32, seed=17)
    xg = x.clone().requires_grad_()
    lp, lse = token_logprobs(xg, y, t)
    (lp * g_logp + lse * g_lse).sum().backward()
    ref = token_logprobs_backward_reference([x], y, t, lse, g_logp, g_lse)[0]
    tols = dtype_tols(dtype)
    row_scale = ((g_logp.abs() + g_lse.abs()) / t).double()[:, None]
    allowed = tols["rtol"] * ref.double().abs() + 1e-5 * row_scale + tols["atol"]
    err = (xg.grad.double() - ref.double()).abs()
    assert not bool((err > allowed).any()), f"dlogits: worst err/allowed {float((err / allowed).max()):.3g}"


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_linear_logprobs_matches_reference(dtype):
    t_rows, v, h = 33, 3000, 96
    hidden, w = randn((t_rows, h), dtype, seed=18), head(v, h, dtype, seed=19)
    y, t = targets(t_rows, v), temps(t_rows)
    out = linear_logprobs(hidden, w, y, t)
    assert_close_logp(out, linear_logprobs_reference(hidden, [w], y, t), f"linear_logprobs {dtype}")
    g_logp, g_lse = randn((t_rows,), torch.float32, seed=20), randn((t_rows,), torch.float32, seed=21)
    hg, wg = hidden.clone().requires_grad_(), w.clone().requires_grad_()
    lp, lse = linear_logprobs(hg, wg, y, t)
    (lp * g_logp + lse * g_lse).sum().backward()
    rh, rws = linear_logprobs_backward_reference(hidden, [w], y, t, lse, g_logp, g_lse)
    # condition-aware bound: the sum of |dz| |operand| products (dz in float64 from the formula)
    z = (hidden.double() @ w.double().T) / t.double()[:, None]
    p = torch.softmax(z, -1)
    onehot = F.one_hot(y, v).double()
    dz = (g_logp.double()[:, None] * (onehot - p) + g_lse.double()[:, None] * p) / t.double()[:, None]
    rtol = dtype_tols(dtype)["rtol"]
    for name, got, ref, absdot in (("dhidden", hg.grad, rh, dz.abs() @ w.double().abs()),
                                   ("dW", wg.grad, rws[0], dz.abs().T @ hidden.double().abs())):
        err = (got.double() - ref.double()).abs()
        allowed = rtol * (ref.double().abs() + absdot) + 1e-6
        assert not bool((err > allowed).any()), f"{name} {dtype}: worst err/allowed {float((err / allowed).max()):.3g}"


# -- negative control ------------------------------------------------------------------------------
def _torch_path(x, w):
    """The torch path's log-probs: F.linear (cuBLAS) + log_softmax in fp32 (compared as whole rows, so a
    difference anywhere in the row counts; the gather of the target picks from these rows)."""
    return torch.log_softmax(F.linear(x, w).float(), -1)


def test_torch_path_is_not_batch_invariant_negative_control():
    """The batch-invariance check must be able to fail. On the H200 (torch 2.11 + CUDA 13) cuBLAS gives
    row 0 different bits at M=1 than inside M=2048 for K=12288 (the down-projection shape of
    ``test_linear_gpu.py``); the torch log-prob path through a head of that shape inherits it, while
    rlk's ``linear_logprobs`` on the same head does not."""
    hidden, w = randn((2048, 12288), seed=22), head(4096, 12288)
    y = targets(2048, 4096)
    ls1, lsb = _torch_path(hidden[:1], w), _torch_path(hidden, w)
    assert not torch.equal(ls1, lsb[:1]), "torch path was batch-invariant on the 4096 x 12288 head: control void"
    t = torch.ones(2048, device="cuda")
    assert_bitwise_equal(stacked(linear_logprobs(hidden[:1], w, y[:1], t[:1])),
                         stacked(linear_logprobs(hidden, w, y, t))[:1], "rlk linear_logprobs, M=1 vs M=2048")


def test_torch_path_on_qwen3_lm_head_measured(record_property):
    """Measured, not asserted: on the H200 (torch 2.11 + CUDA 13) cuBLAS was found batch-invariant for the
    151936 x 4096 and 151936 x 1024 LM heads (row alone vs in M = 2..8192), and ``torch.log_softmax``
    alone batch-invariant at V=151936 — so there the torch path happened to give the same bits; nothing
    in cuBLAS promises it. Recorded as properties ``torch_lm_head_path_batch_invariant`` and
    ``log_softmax_alone_batch_invariant``."""
    hidden, w = randn((2048, 4096), seed=22), head(VOCAB, 4096)
    y = targets(2048, VOCAB)
    ls1, lsb = _torch_path(hidden[:1], w), _torch_path(hidden, w)
    record_property("torch_lm_head_path_batch_invariant", bool(torch.equal(ls1, lsb[:1])))
    logits = F.linear(hidden, w).float()
    record_property("log_softmax_alone_batch_invariant",
                    bool(torch.equal(torch.log_softmax(logits[:1], -1), torch.log_softmax(logits, -1)[:1])))
    t = torch.ones(2048, device="cuda")
    assert_bitwise_equal(stacked(linear_logprobs(hidden[:1], w, y[:1], t[:1])),
                         stacked(linear_logprobs(hidden, w, y, t))[:1], "rlk linear_logprobs, M=1 vs M=2048")


def test_opcheck_gpu():
    x = randn((5, 1000), torch.float32, 3.0, seed=23)
    y, t = targets(5, 1000), temps(5)
    torch.library.opcheck(torch.ops.rlk.token_logprobs.default, ([x], y, t))
    h, w = randn((5, 64), torch.float32, seed=24), head(1000, 64, torch.float32)
    torch.library.opcheck(torch.ops.rlk.linear_logprobs.default, (h, [w], y, t))


# -- compute-sanitizer driver ----------------------------------------------------------------------
def sanitize_cases() -> None:
    """Every log-prob kernel once at small, awkward shapes (the lead runs this under compute-sanitizer);
    raises if a result is outside tolerance of the reference."""
    from rlk_core.ops._plan import jit_plan
    from rlk_core.ops.linear_logprobs import triton as llt
    from rlk_core.ops.token_logprobs import triton as tt

    P = jit_plan(torch.device("cuda"))
    for dtype in (torch.bfloat16, torch.float32):
        for t_rows, v in ((1, 9), (17, 1000), (5, 2053)):
            x = randn((t_rows, v), dtype, 3.0, seed=30)
            y, t = targets(t_rows, v), temps(t_rows)
            out = tt.forward(P, [x], y, t)
            # references on CPU copies: under racecheck every GPU kernel is instrumented, and the
            # references' many small kernels would dominate the run
            xc, yc, tc = x.cpu(), y.cpu(), t.cpu()
            assert_close_logp([o.cpu() for o in out], token_logprobs_reference([xc], yc, tc),
                              f"sanitize token {t_rows}x{v}")
            b = L.group_bounds(v)
            m, s, zt = tt.logp_partials(P, x[:, b[0]:b[4]], y, t, 0, v)
            assert m.shape == (t_rows, 4) and s.shape == (t_rows, 4) and zt.shape == (t_rows,)
            g = torch.ones(t_rows, device="cuda")
            d = tt.backward(P, [x], y, t, out[1], g, g)[0].cpu()
            r = token_logprobs_backward_reference([xc], yc, tc, out[1].cpu(), g.cpu(), g.cpu())[0]
            torch.testing.assert_close(d.double(), r.double(), rtol=dtype_tols(dtype)["rtol"], atol=1e-4)
        hidden, w = randn((7, 96), dtype, seed=31), head(1000, 96, dtype, seed=32)
        y, t = targets(7, 1000), temps(7)
        out = llt.forward(P, hidden, [w], y, t)
        assert_close_logp(out, linear_logprobs_reference(hidden, [w], y, t), "sanitize linear_logprobs")
        g = torch.ones(7, device="cuda")
        dh, dws = llt.backward(P, hidden, [w], y, t, out[1], g, g)
        assert dh.shape == hidden.shape and dws[0].shape == w.shape and bool(torch.isfinite(dws[0]).all())
    torch.cuda.synchronize()
