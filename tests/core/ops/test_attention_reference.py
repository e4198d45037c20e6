"""rlk.attention.v1 against a float64 formula (forward and backward), opcheck for every op, and
kv_cache_write (round trip, skipped slots, non-contiguous vLLM views)."""

from __future__ import annotations

import pytest
import torch

from rlk_core.ops.attention import attention_decode, attention_paged_prefill, attention_varlen, kv_cache_write
from rlk_core.ops.attention._core import exp_f32
from rlk_core.testing import assert_close_to_formula, dtype_tols
from rlk_core.testing.attention import build_paged_kv, cu_seqlens, vllm_kv_cache


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def formula64(q, k, v, lens_q, lens_k, scale, causal=True, q_positions=None):
    """Plain ``softmax(q k^T * scale + causal mask) v`` in float64, sequence by sequence."""
    outs, q0, k0 = [], 0, 0
    g = q.shape[1] // k.shape[1]
    for lq, lk in zip(lens_q, lens_k):
        qs = q[q0 : q0 + lq].double()
        ks = k[k0 : k0 + lk].double().repeat_interleave(g, 1)
        vs = v[k0 : k0 + lk].double().repeat_interleave(g, 1)
        if not causal:
            limit = torch.full((lq,), lk - 1)
        elif q_positions is not None:
            limit = q_positions[q0 : q0 + lq].long()
        else:
            limit = torch.arange(lk - lq, lk)
        s = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        s = s.masked_fill(torch.arange(lk)[None, None, :] > limit[None, :, None], float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vs))
        q0, k0 = q0 + lq, k0 + lk
    return torch.cat(outs)


def _attention_tols(dtype, v):
    """dtype_tols, plus the absolute error a flash-style kernel has by design: p is rounded to v.dtype
    before p * v, so outputs near 0 carry an absolute error of about eps(v.dtype) * rms(v)."""
    tols = dtype_tols(dtype)
    if dtype == torch.float32:
        return tols
    rms_v = float(v.float().pow(2).mean().sqrt())
    return {"rtol": tols["rtol"], "atol": max(tols["atol"], torch.finfo(dtype).eps * rms_v)}


def _rand(shape, dtype, g):
    return torch.randn(*shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("hq", "hkv", "d"), [(4, 2, 16), (8, 2, 8), (2, 2, 40)])
def test_varlen_matches_float64_formula(dtype, hq, hkv, d):
    g = torch.Generator().manual_seed(hq * 100 + d)
    lens_q, lens_k = [1, 70, 33, 130], [5, 70, 100, 130]  # chunks continuing a prefix, and full sequences
    q = _rand((sum(lens_q), hq, d), dtype, g)
    k = _rand((sum(lens_k), hkv, d), dtype, g)
    v = _rand((sum(lens_k), hkv, d), dtype, g)
    out = attention_varlen(q, k, v, cu_seqlens(lens_q), cu_seqlens(lens_k), d ** -0.5)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.double(), formula64(q, k, v, lens_q, lens_k, d ** -0.5),
                               **_attention_tols(dtype, v))


def test_varlen_non_causal_and_explicit_positions_match_formula():
    g = torch.Generator().manual_seed(1)
    lens_q, lens_k = [10, 50], [80, 50]
    q, k, v = _rand((60, 4, 16), torch.float32, g), _rand((130, 2, 16), torch.float32, g), _rand((130, 2, 16),
                                                                                                 torch.float32, g)
    out = attention_varlen(q, k, v, cu_seqlens(lens_q), cu_seqlens(lens_k), 0.3, causal=False)
    assert_close_to_formula(out, formula64(q, k, v, lens_q, lens_k, 0.3, causal=False), name="non-causal")
    pos = torch.cat([torch.randperm(80, generator=g)[:10], torch.randperm(50, generator=g)]).to(torch.int32)
    out = attention_varlen(q, k, v, cu_seqlens(lens_q), cu_seqlens(lens_k), 0.3, q_positions=pos)
    assert_close_to_formula(out, formula64(q, k, v, lens_q, lens_k, 0.3, q_positions=pos), name="positions")


def test_large_scores_and_long_context_stay_finite():
    g = torch.Generator().manual_seed(2)
    q, k, v = (_rand((300, 2, 16), torch.float32, g) * 6 for _ in range(3))
    cu = cu_seqlens([300])
    out = attention_varlen(q, k, v, cu, cu, 1.0)
    assert torch.isfinite(out).all()
    # scores reach |s| ~ 1e2: an fp32 score carries an error ~ eps * |s|, which exp turns into a relative
    # error of p (conditioning of softmax, not of the method) — tolerance scaled accordingly
    s_max = float(torch.einsum("qhd,khd->hqk", q.double(), k.double()).abs().max())
    atol = torch.finfo(torch.float32).eps * s_max * float(v.abs().max())
    torch.testing.assert_close(out.double(), formula64(q, k, v, [300], [300], 1.0), rtol=0.0, atol=atol)


def test_exp_f32_is_correctly_rounded_on_a_sweep():
    x = torch.linspace(-110.0, 0.0, 200001)
    expected = torch.exp(x.double()).float()
    ulps = (exp_f32(x).view(torch.int32) - expected.view(torch.int32)).abs()
    assert int(ulps.max()) <= 1
    assert exp_f32(torch.tensor([float("-inf"), 0.0])).tolist() == [0.0, 1.0]


@pytest.mark.parametrize(("hq", "hkv"), [(4, 2), (8, 2)])
def test_backward_matches_float64_autograd(hq, hkv):
    g = torch.Generator().manual_seed(hq)
    lens_q, lens_k = [40, 9, 80], [40, 70, 80]
    q = _rand((sum(lens_q), hq, 16), torch.float32, g).requires_grad_(True)
    k = _rand((sum(lens_k), hkv, 16), torch.float32, g).requires_grad_(True)
    v = _rand((sum(lens_k), hkv, 16), torch.float32, g).requires_grad_(True)
    grad = _rand((sum(lens_q), hq, 16), torch.float32, g)
    attention_varlen(q, k, v, cu_seqlens(lens_q), cu_seqlens(lens_k), 0.25).backward(grad)
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    formula64(*leaves, lens_q, lens_k, 0.25).backward(grad.double())
    for name, ours, exp in zip("qkv", (q.grad, k.grad, v.grad), leaves):
        # gradients sum many fp32 terms: 10x the forward tolerance of fp32
        tols = {key: 10 * val for key, val in dtype_tols(torch.float32).items()}
        torch.testing.assert_close(ours.double(), exp.grad, msg=lambda m, n=name: f"d{n}: {m}", **tols)


def test_backward_bf16_close_to_float64():
    g = torch.Generator().manual_seed(3)
    q, k, v = (_rand((50, 4, 16), torch.bfloat16, g).requires_grad_(True) for _ in range(3))
    grad = _rand((50, 4, 16), torch.bfloat16, g)
    cu = cu_seqlens([50])
    attention_varlen(q, k, v, cu, cu, 0.25).backward(grad)
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    formula64(*leaves, [50], [50], 0.25).backward(grad.double())
    for name, ours, exp in zip("qkv", (q.grad, k.grad, v.grad), leaves):
        assert ours.dtype == torch.bfloat16
        torch.testing.assert_close(ours.double(), exp.grad, rtol=5e-2, atol=2e-2, msg=lambda m, n=name: f"d{n}: {m}")


def test_paged_forms_match_formula():
    g = torch.Generator().manual_seed(4)
    lens = [3, 100]
    ks = [_rand((n, 2, 16), torch.float32, g) for n in lens]
    vs = [_rand((n, 2, 16), torch.float32, g) for n in lens]
    cache = build_paged_kv(ks, vs, 16, generator=g)
    chunk = [2, 30]
    q = _rand((sum(chunk), 4, 16), torch.float32, g)
    out = attention_paged_prefill(q, cache.k_cache, cache.v_cache, cache.block_table, cu_seqlens(chunk),
                                  cache.seq_lens, 0.25)
    assert_close_to_formula(out, formula64(q, torch.cat(ks), torch.cat(vs), chunk, lens, 0.25), name="paged")
    qd = _rand((2, 4, 16), torch.float32, g)
    out = attention_decode(qd, cache.k_cache, cache.v_cache, cache.block_table, cache.seq_lens, 0.25)
    assert_close_to_formula(out, formula64(qd, torch.cat(ks), torch.cat(vs), [1, 1], lens, 0.25), name="decode")


def test_empty_inputs_that_are_meaningful():
    q = torch.zeros(0, 4, 16)
    k = torch.randn(5, 2, 16)
    out = attention_varlen(q, k, k, cu_seqlens([0]), cu_seqlens([5]), 0.25)
    assert out.shape == (0, 4, 16)
    kc, vc = vllm_kv_cache(2, 16, 2, 16, torch.float32, fill=0.0)
    out = attention_decode(q[:0], kc, vc, torch.zeros(0, 1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32),
                           0.25)
    assert out.shape == (0, 4, 16)
    kv_cache_write(q[:0, :2], q[:0, :2], kc, vc, torch.zeros(0, dtype=torch.int64))


# -- kv_cache_write --------------------------------------------------------------------------------
@pytest.mark.parametrize("page", [1, 16, 64])
def test_kv_cache_write_round_trip_and_skip(page):
    g = torch.Generator().manual_seed(page)
    kc, vc = vllm_kv_cache(6, page, 2, 8, torch.bfloat16, fill=0.0)
    assert not kc.is_contiguous() and kc.stride(1) == 2 * 2 * 8
    raw_before = kc.as_strided((kc.untyped_storage().nbytes() // 2,), (1,), 0).clone()
    n_slots = 6 * page
    slots = torch.randperm(n_slots, generator=g)[: min(20, n_slots)]
    slots[::3] = -1
    k = _rand((slots.numel(), 2, 8), torch.bfloat16, g)
    v = _rand((slots.numel(), 2, 8), torch.bfloat16, g)
    kv_cache_write(k, v, kc, vc, slots)
    keep = slots >= 0
    s = slots[keep]
    assert torch.equal(kc[s // page, s % page], k[keep]) and torch.equal(vc[s // page, s % page], v[keep])
    # nothing else in the shared buffer changed
    raw_after = kc.as_strided((kc.untyped_storage().nbytes() // 2,), (1,), 0)
    changed = (raw_after != raw_before).nonzero().numel()
    assert changed <= int(keep.sum()) * 2 * 2 * 8
    untouched = torch.ones(6, page, dtype=torch.bool)
    untouched[s // page, s % page] = False
    assert int(kc[untouched].abs().sum()) == 0 and int(vc[untouched].abs().sum()) == 0


def test_kv_cache_write_then_decode_equals_prefill():
    g = torch.Generator().manual_seed(9)
    q, k, v = (_rand((40, 2, 8), torch.float32, g) for _ in range(3))
    cu = cu_seqlens([40])
    full = attention_varlen(q, k, v, cu, cu, 0.3)
    cache = build_paged_kv([k[:1]], [v[:1]], 16, generator=g)  # one token in, then decode step by step
    table = torch.tensor([[int(cache.block_table[0, 0]), 2, 3]], dtype=torch.int32)
    for t in range(1, 40):
        slot = torch.tensor([int(table[0, t // 16]) * 16 + t % 16])
        kv_cache_write(k[t : t + 1], v[t : t + 1], cache.k_cache, cache.v_cache, slot)
        out = attention_decode(q[t : t + 1], cache.k_cache, cache.v_cache, table,
                               torch.tensor([t + 1], dtype=torch.int32), 0.3)
        assert torch.equal(out[0], full[t]), t


# -- opcheck -----------------------------------------------------------------------------------------
def _paged_args():
    g = torch.Generator().manual_seed(5)
    ks = [_rand((n, 2, 8), torch.float32, g) for n in (5, 20)]
    cache = build_paged_kv(ks, ks, 4, generator=g, fill=0.0)
    return cache


def test_opcheck_attention_varlen():
    g = torch.Generator().manual_seed(6)
    q = _rand((12, 4, 8), torch.float32, g).requires_grad_(True)
    k = _rand((15, 2, 8), torch.float32, g).requires_grad_(True)
    v = _rand((15, 2, 8), torch.float32, g).requires_grad_(True)
    torch.library.opcheck(torch.ops.rlk.attention_varlen.default,
                          (q, k, v, cu_seqlens([4, 8]), cu_seqlens([5, 10]), 0.35, True, None))
    pos = torch.tensor([0, 2, 4, 1, 9, 0, 3, 5, 6, 7, 8, 2])
    torch.library.opcheck(torch.ops.rlk.attention_varlen.default,
                          (q, k, v, cu_seqlens([4, 8]), cu_seqlens([5, 10]), 0.35, True, pos))
    torch.library.opcheck(torch.ops.rlk.attention_varlen.default,
                          (q.detach(), k.detach(), v.detach(), cu_seqlens([4, 8]), cu_seqlens([5, 10]), 0.35,
                           False, None))


def test_opcheck_attention_varlen_backward():
    g = torch.Generator().manual_seed(7)
    q, k, v, do = (_rand((9, 2, 8), torch.float32, g) for _ in range(4))
    torch.library.opcheck(torch.ops.rlk.attention_varlen_backward.default,
                          (do, q, k, v, cu_seqlens([9]), cu_seqlens([9]), 0.35, True, None))


def test_opcheck_paged_ops():
    c = _paged_args()
    g = torch.Generator().manual_seed(8)
    q = _rand((6, 4, 8), torch.float32, g)
    torch.library.opcheck(torch.ops.rlk.attention_paged_prefill.default,
                          (q, c.k_cache, c.v_cache, c.block_table, cu_seqlens([2, 4]), c.seq_lens, 0.35))
    torch.library.opcheck(torch.ops.rlk.attention_decode.default,
                          (q[:2], c.k_cache, c.v_cache, c.block_table, c.seq_lens, 0.35))
    k = _rand((3, 2, 8), torch.float32, g)
    torch.library.opcheck(torch.ops.rlk.kv_cache_write.default,
                          (k, k + 1, c.k_cache, c.v_cache, torch.tensor([0, -1, 7])))
