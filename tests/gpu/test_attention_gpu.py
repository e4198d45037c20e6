"""Attention on the GPU (backend ``rlk.triton``, contract ``rlk.attention.v1``): prefill == chunked
prefill == decode bit for bit (page sizes 1/16/32/64/128, shuffled block tables, vLLM non-contiguous
layout), batch composition, CP zigzag sharding, run-to-run, tolerance vs the reference, exact
``kv_cache_write``, the backend selection, and torch SDPA as the negative control."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from rlk_core.backends import REGISTRY
from rlk_core.ops._plan import jit_plan
from rlk_core.ops.attention import attention_decode, attention_paged_prefill, attention_varlen, kv_cache_write
from rlk_core.ops.attention.reference import (
    attention_decode_reference,
    attention_paged_prefill_reference,
    attention_varlen_reference,
    kv_cache_write_reference,
)
from rlk_core.testing import assert_bitwise_equal, check_run_to_run, dtype_tols
from rlk_core.testing.attention import (
    build_paged_kv,
    check_cp_sharding,
    check_prefill_chunked_decode,
    cu_seqlens,
    vllm_kv_cache,
)

from ._shapes import RLK_GPU

pytestmark = pytest.mark.gpu

DEV = "cuda"
D = 128
SCALE = D ** -0.5


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


def qkv(length: int, hq: int, hkv: int, d: int = D, dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    g = gen(seed)
    q = torch.randn(length, hq, d, device=DEV, generator=g).to(dtype)
    k = torch.randn(length, hkv, d, device=DEV, generator=g).to(dtype)
    v = torch.randn(length, hkv, d, device=DEV, generator=g).to(dtype)
    return q, k, v


def random_lengths(n: int, high: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, high + 1, (n,), generator=g).tolist()


def assert_close_attention(out, ref, ref_abs, dtype, name):
    """``|out - ref| <= atol + rtol * max(|ref|, ref_abs)`` with ``ref_abs`` the attention of ``|v|``
    (the condition-aware scale of a weighted mean: sum_j p_j |v_j| / l)."""
    tols = dtype_tols(dtype)
    allowed = tols["atol"] + tols["rtol"] * torch.maximum(ref.double().abs(), ref_abs.double())
    err = (out.double() - ref.double()).abs()
    bad = err > allowed
    assert not bool(bad.any()), (f"{name}: {int(bad.sum())} of {err.numel()} elements outside tolerance; "
                                 f"worst error / allowed {float((err / allowed).max()):.3g}")


# -- selection -------------------------------------------------------------------------------------
def test_triton_backend_is_selected():
    q, k, v = qkv(70, 32, 8)
    cu = cu_seqlens([70], DEV)
    cache = build_paged_kv([k], [v], 16, generator=torch.Generator().manual_seed(0))
    seq = torch.tensor([70], dtype=torch.int32, device=DEV)
    cases = {
        "attention_varlen": (q, k, v, cu, cu, SCALE, True, None),
        "attention_paged_prefill": (q, cache.k_cache, cache.v_cache, cache.block_table, cu, seq, SCALE),
        "attention_decode": (q[:1], cache.k_cache, cache.v_cache, cache.block_table, seq, SCALE),
        "kv_cache_write": (k, v, cache.k_cache, cache.v_cache, cache.slot_mapping),
    }
    for op, args in cases.items():
        sel = REGISTRY.select(op, "cuda", args, strict=True)
        assert sel.backend.id in RLK_GPU and sel.fallback_reason is None, (op, sel)


# -- prefill == chunked prefill == decode ------------------------------------------------------------
@pytest.mark.parametrize("hq,hkv", [(32, 8), (16, 8)])
@pytest.mark.parametrize("length", [1, 65, 1000] + random_lengths(2, 8192, seed=1))
def test_prefill_chunked_decode_bitwise(length, hq, hkv):
    q, k, v = qkv(length, hq, hkv, seed=length)
    ok, detail = check_prefill_chunked_decode(q, k, v, SCALE, page_sizes=(16, 64), chunk_sizes=(61, 512),
                                              random_chunkings=1, generator=torch.Generator().manual_seed(length))
    assert ok, detail


def test_prefill_chunked_decode_page_sizes_1_32_128():
    q, k, v = qkv(777, 32, 8, seed=3)
    ok, detail = check_prefill_chunked_decode(q, k, v, SCALE, page_sizes=(1, 32, 128), chunk_sizes=(13, 200),
                                              random_chunkings=2, generator=torch.Generator().manual_seed(3))
    assert ok, detail


def test_prefill_chunked_decode_32k():
    q, k, v = qkv(32768, 32, 8, seed=32)
    ok, detail = check_prefill_chunked_decode(q, k, v, SCALE, page_sizes=(64,), chunk_sizes=(5000,),
                                              random_chunkings=0, generator=torch.Generator().manual_seed(32))
    assert ok, detail


@pytest.mark.parametrize("hq,hkv", [(32, 8), (16, 8)])
def test_prefill_kv_tma_is_only_a_load_path(hq, hkv):
    """The shipped d = 128 prefill loads its unmasked K/V blocks by TMA; with pointer loads instead the
    output is the same, bit for bit (packed sequences, causal and not)."""
    from rlk_core.ops.attention import triton as at

    lens = [1, 65, 300, 2100, 64]
    q, k, v = qkv(sum(lens), hq, hkv, seed=9)
    cu = cu_seqlens(lens, DEV)
    P = jit_plan(q.device)
    cfg = at.config(torch.bfloat16, D)
    assert cfg["KV_TMA"] and at.kv_tma_ok(P, k, v, D, cfg["D_PAD"])
    ks = (k.stride(0), k.stride(0), k.stride(1), k.stride(2))
    vs = (v.stride(0), v.stride(0), v.stride(1), v.stride(2))
    lk = (cu[1:] - cu[:-1]).to(torch.int32)
    for causal in (True, False):
        tma = at._launch(P, q, k, v, cu, 1, 0, ks, vs, cu, len(lens), lk, None, causal, SCALE, "prefill")
        ptr = at._launch(P, q, k, v, cu, 1, 0, ks, vs, cu, len(lens), lk, None, causal, SCALE, "prefill",
                         dict(cfg, KV_TMA=False))
        assert_bitwise_equal(tma, ptr, f"KV_TMA vs pointer loads, causal={causal}")


@pytest.mark.parametrize("dtype,d,hq,hkv", [(torch.float16, 64, 12, 4), (torch.float32, 64, 4, 4),
                                            (torch.bfloat16, 96, 6, 2)])
def test_prefill_chunked_decode_other_dtypes(dtype, d, hq, hkv):
    q, k, v = qkv(300, hq, hkv, d, dtype, seed=5)
    ok, detail = check_prefill_chunked_decode(q, k, v, d ** -0.5, page_sizes=(16,), chunk_sizes=(37,),
                                              random_chunkings=1, generator=torch.Generator().manual_seed(5))
    assert ok, detail


# -- batch composition ---------------------------------------------------------------------------------
def test_batch_composition_independence():
    """A sequence alone == the same sequence packed with others of different lengths (varlen full
    prefill, varlen chunk continuing a prefix, paged chunked prefill, decode)."""
    lens = [1500, 1, 64, 4097, 300, 65]
    chunk = [200, 1, 64, 33, 0, 1]  # the last tokens of each sequence as the new chunk; 0 = no queries
    seqs = [qkv(n, 32, 8, seed=100 + i) for i, n in enumerate(lens)]
    q = torch.cat([s[0] for s in seqs])
    k = torch.cat([s[1] for s in seqs])
    v = torch.cat([s[2] for s in seqs])
    cu = cu_seqlens(lens, DEV)
    full = attention_varlen(q, k, v, cu, cu, SCALE)
    qc = torch.cat([s[0][n - c:] for s, n, c in zip(seqs, lens, chunk)])
    cu_c = cu_seqlens(chunk, DEV)
    part = attention_varlen(qc, k, v, cu_c, cu, SCALE)
    cache = build_paged_kv([s[1] for s in seqs], [s[2] for s in seqs], 16, generator=torch.Generator().manual_seed(1))
    paged = attention_paged_prefill(qc, cache.k_cache, cache.v_cache, cache.block_table, cu_c, cache.seq_lens, SCALE)
    last = torch.stack([s[0][-1] for s in seqs])
    dec = attention_decode(last, cache.k_cache, cache.v_cache, cache.block_table, cache.seq_lens, SCALE)
    c0 = 0
    for i, (s, n, c) in enumerate(zip(seqs, lens, chunk)):
        qi, ki, vi = s
        one = cu_seqlens([n], DEV)
        alone = attention_varlen(qi, ki, vi, one, one, SCALE)
        assert_bitwise_equal(full[cu[i]:cu[i + 1]], alone, f"seq {i} (L={n}) packed vs alone")
        assert_bitwise_equal(part[c0:c0 + c], alone[n - c:], f"seq {i} chunk packed vs alone")
        assert_bitwise_equal(paged[c0:c0 + c], alone[n - c:], f"seq {i} paged chunk packed vs prefill alone")
        assert_bitwise_equal(dec[i], alone[-1], f"seq {i} decode in a batch vs prefill alone")
        c0 += c
    # non-causal: packed == alone as well
    nc = attention_varlen(q, k, v, cu, cu, SCALE, False)
    for i, (qi, ki, vi) in enumerate(seqs):
        one = cu_seqlens([lens[i]], DEV)
        assert_bitwise_equal(nc[cu[i]:cu[i + 1]], attention_varlen(qi, ki, vi, one, one, SCALE, False),
                             f"non-causal seq {i} packed vs alone")


def test_decode_batch_order_and_size():
    """Decode rows do not depend on the other rows of the batch, its size or order."""
    lens = random_lengths(40, 3000, seed=7)
    seqs = [qkv(n, 32, 8, seed=200 + i) for i, n in enumerate(lens)]
    cache = build_paged_kv([s[1] for s in seqs], [s[2] for s in seqs], 64, generator=torch.Generator().manual_seed(2))
    q = torch.stack([s[0][-1] for s in seqs])
    full = attention_decode(q, cache.k_cache, cache.v_cache, cache.block_table, cache.seq_lens, SCALE)
    perm = torch.randperm(len(lens), generator=torch.Generator().manual_seed(4)).to(DEV)
    shuffled = attention_decode(q[perm], cache.k_cache, cache.v_cache, cache.block_table[perm], cache.seq_lens[perm],
                                SCALE)
    assert_bitwise_equal(shuffled, full[perm], "decode batch permuted")
    for i in (0, 17, 39):
        one = attention_decode(q[i:i + 1], cache.k_cache, cache.v_cache, cache.block_table[i:i + 1],
                               cache.seq_lens[i:i + 1], SCALE)
        assert_bitwise_equal(one, full[i:i + 1], f"decode row {i} alone vs in a batch of 40")


def test_many_sequences_scan_schedule():
    """More sequences than one step of the in-kernel schedule scan (find_tile: 128 per step), empty ones
    among them: packed varlen == each alone, decode over 300 rows == each alone."""
    lens = [0 if i % 37 == 5 else n for i, n in enumerate(random_lengths(300, 90, seed=11))]
    seqs = [qkv(max(n, 1), 16, 8, seed=500 + i) for i, n in enumerate(lens)]
    q, k, v = (torch.cat([s[j][:n] for s, n in zip(seqs, lens)]) for j in range(3))
    cu = cu_seqlens(lens, DEV)
    full = attention_varlen(q, k, v, cu, cu, SCALE)
    for i in (0, 5, 127, 128, 129, 200, 299):
        one = cu_seqlens([lens[i]], DEV)
        alone = attention_varlen(q[cu[i]:cu[i + 1]], k[cu[i]:cu[i + 1]], v[cu[i]:cu[i + 1]], one, one, SCALE)
        assert_bitwise_equal(full[cu[i]:cu[i + 1]], alone, f"seq {i} (L={lens[i]}) of 300 packed vs alone")
    live = [i for i, n in enumerate(lens) if n]
    cache = build_paged_kv([seqs[i][1][:lens[i]] for i in live], [seqs[i][2][:lens[i]] for i in live], 16,
                           generator=torch.Generator().manual_seed(5))
    last = torch.stack([q[cu[i + 1] - 1] for i in live])
    dec = attention_decode(last, cache.k_cache, cache.v_cache, cache.block_table, cache.seq_lens, SCALE)
    for j, i in enumerate(live):
        assert_bitwise_equal(dec[j], full[cu[i + 1] - 1], f"decode row {j} (seq {i}) of {len(live)} vs prefill")


# -- context parallel ---------------------------------------------------------------------------------
@pytest.mark.parametrize("length", [4999, 8192])
def test_cp_zigzag_sharding(length):
    q, k, v = qkv(length, 32, 8, seed=9)
    ok, detail = check_cp_sharding(q, k, v, SCALE, cp_sizes=(2, 4, 8))
    assert ok, detail


def test_q_positions_any_order():
    q, k, v = qkv(3000, 16, 8, seed=11)
    cu = cu_seqlens([3000], DEV)
    full = attention_varlen(q, k, v, cu, cu, SCALE)
    pos = torch.randperm(3000, generator=torch.Generator().manual_seed(0))[:999].to(DEV)
    out = attention_varlen(q[pos], k, v, cu_seqlens([999], DEV), cu, SCALE, True, pos)
    assert_bitwise_equal(out, full[pos], "random q_positions vs unsharded")


# -- run to run ---------------------------------------------------------------------------------------
def test_run_to_run():
    lens = [3000, 17, 700]
    q, k, v = qkv(sum(lens), 32, 8, seed=12)
    cu = cu_seqlens(lens, DEV)
    ok, detail = check_run_to_run(lambda: attention_varlen(q, k, v, cu, cu, SCALE), repeats=5)
    assert ok, detail
    cache = build_paged_kv([k[:3000], k[3000:3017], k[3017:]], [v[:3000], v[3000:3017], v[3017:]], 16,
                           generator=torch.Generator().manual_seed(0))
    ok, detail = check_run_to_run(lambda: attention_decode(q[:3], cache.k_cache, cache.v_cache, cache.block_table,
                                                           cache.seq_lens, SCALE), repeats=5)
    assert ok, detail


# -- vs the reference (small shapes: the reference is slow on CUDA) -------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("d,hq,hkv", [(128, 32, 8), (64, 12, 4), (96, 3, 1)])
def test_matches_reference(dtype, d, hq, hkv):
    lens, chunk = [300, 1, 130, 64], [100, 1, 130, 20]
    q, k, v = qkv(sum(lens), hq, hkv, d, dtype, seed=13)
    scale = d ** -0.5
    cu = cu_seqlens(lens, DEV)
    for causal in (True, False):
        out = attention_varlen(q, k, v, cu, cu, scale, causal)
        ref = attention_varlen_reference(q, k, v, cu, cu, scale, causal, None)
        ref_abs = attention_varlen_reference(q, k, v.abs(), cu, cu, scale, causal, None)
        assert_close_attention(out, ref, ref_abs, dtype, f"varlen causal={causal}")
    ks = [k[cu[i]:cu[i + 1]] for i in range(len(lens))]
    vs = [v[cu[i]:cu[i + 1]] for i in range(len(lens))]
    cache = build_paged_kv(ks, vs, 16, generator=torch.Generator().manual_seed(0))
    cache_abs = build_paged_kv(ks, [x.abs() for x in vs], 16, generator=torch.Generator().manual_seed(0))
    qc = torch.cat([q[cu[i + 1] - c:cu[i + 1]] for i, c in enumerate(chunk)])
    cu_c = cu_seqlens(chunk, DEV)
    args = (cache.block_table, cu_c, cache.seq_lens, scale)
    out = attention_paged_prefill(qc, cache.k_cache, cache.v_cache, *args)
    ref = attention_paged_prefill_reference(qc, cache.k_cache, cache.v_cache, *args)
    ref_abs = attention_paged_prefill_reference(qc, cache_abs.k_cache, cache_abs.v_cache, *args)
    assert_close_attention(out, ref, ref_abs, dtype, "paged prefill")
    qd = q[cu[1:] - 1]
    args = (cache.block_table, cache.seq_lens, scale)
    out = attention_decode(qd, cache.k_cache, cache.v_cache, *args)
    ref = attention_decode_reference(qd, cache.k_cache, cache.v_cache, *args)
    ref_abs = attention_decode_reference(qd, cache_abs.k_cache, cache_abs.v_cache, *args)
    assert_close_attention(out, ref, ref_abs, dtype, "decode")
    assert not bool(torch.isnan(out).any())


# -- kv_cache_write --------------------------------------------------------------------------------------
@pytest.mark.parametrize("page", [1, 16, 64])
def test_kv_cache_write_exact(page):
    t, hkv = 300, 8
    num_blocks = 2 * t // page + 3
    g = gen(21)
    k = torch.randn(t, hkv, D, device=DEV, generator=g).bfloat16()
    v = torch.randn(t, hkv, D, device=DEV, generator=g).bfloat16()
    slots = torch.randperm(num_blocks * page, generator=torch.Generator().manual_seed(page))[:t]
    slots[::7] = -1
    slots = slots.to(DEV)

    def raw(cache):  # the whole underlying [num_blocks, page, Hkv, 2D] buffer
        return cache.as_strided((num_blocks, page, hkv, 2 * D), (page * hkv * 2 * D, hkv * 2 * D, 2 * D, 1), 0)

    kc, vc = vllm_kv_cache(num_blocks, page, hkv, D, torch.bfloat16, DEV)
    kc2, vc2 = vllm_kv_cache(num_blocks, page, hkv, D, torch.bfloat16, DEV)
    kv_cache_write(k, v, kc, vc, slots)
    kv_cache_write_reference(k, v, kc2, vc2, slots)
    assert torch.equal(raw(kc).view(torch.int16), raw(kc2).view(torch.int16)), "buffer differs from the reference"
    keep = slots >= 0
    s = slots[keep]
    assert_bitwise_equal(kc[s // page, s % page], k[keep], "written K")
    assert_bitwise_equal(vc[s // page, s % page], v[keep], "written V")
    untouched = torch.ones(num_blocks * page, dtype=torch.bool, device=DEV)
    untouched[s] = False
    assert bool(torch.isnan(raw(kc).reshape(num_blocks * page, -1)[untouched]).all()), "an unwritten slot changed"


# -- negative control --------------------------------------------------------------------------------------
def test_sdpa_negative_control():
    """torch SDPA: the causal prefill row of a token and a one-query decode over its prefix differ in
    bits on the same inputs (the batch-dependent split the contract forbids); rlk's kernels agree."""
    differs = []
    for length in (1000, 2048, 4097):
        q, k, v = qkv(length, 32, 8, seed=length)
        qh = q.transpose(0, 1)[None]  # [1, Hq, L, D]
        kh = k.transpose(0, 1)[None].repeat_interleave(4, dim=1)
        vh = v.transpose(0, 1)[None].repeat_interleave(4, dim=1)
        pre = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)[0, :, -1]
        dec = F.scaled_dot_product_attention(qh[:, :, -1:], kh, vh)[0, :, 0]
        differs.append(not torch.equal(pre, dec))
        cu = cu_seqlens([length], DEV)
        ours_pre = attention_varlen(q, k, v, cu, cu, SCALE)[-1]
        cache = build_paged_kv([k], [v], 16, generator=torch.Generator().manual_seed(0))
        ours_dec = attention_decode(q[-1:], cache.k_cache, cache.v_cache, cache.block_table, cache.seq_lens, SCALE)[0]
        assert_bitwise_equal(ours_dec, ours_pre, f"rlk decode vs prefill, L={length}")
    assert any(differs), "SDPA prefill and decode agreed bit for bit: the negative control lost its power"


# -- compute-sanitizer driver ------------------------------------------------------------------------------
def sanitize_cases() -> None:
    """Every attention kernel once at small, awkward shapes (for compute-sanitizer memcheck/racecheck);
    raises if a result is outside tolerance of the reference or NaN leaks from unused (NaN-filled)
    cache slots."""
    from rlk_core.ops.attention import triton as at

    P = jit_plan(torch.device(DEV))

    def check(plan_fn, ref_fn, args, v_pos, dtype, name):
        fn = functools.partial(plan_fn, P)
        # the reference runs on CPU copies: under racecheck every GPU kernel is instrumented, and the
        # reference's hundreds of small kernels would dominate (a run with them exceeded 240 s)
        out = fn(*args).cpu()
        cpu_args = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
        ref = ref_fn(*cpu_args)
        cpu_args[v_pos] = cpu_args[v_pos].abs()
        assert not bool(torch.isnan(out).any()), f"{name}: NaN"
        assert_close_attention(out, ref, ref_fn(*cpu_args), dtype, name)

    for dtype, d, hq, hkv in ((torch.bfloat16, 128, 32, 8), (torch.float32, 64, 3, 1), (torch.float16, 96, 4, 2)):
        lens, chunk = [70, 1, 130], [5, 1, 64]
        q, k, v = qkv(sum(lens), hq, hkv, d, dtype, seed=1)
        scale = d ** -0.5
        cu = cu_seqlens(lens, DEV)
        for causal in (True, False):
            check(at.attention_varlen, attention_varlen_reference, (q, k, v, cu, cu, scale, causal, None), 2, dtype,
                  f"varlen {dtype} causal={causal}")
        pos = torch.tensor([69, 0, 3, 0, 129, 64, 63, 1], dtype=torch.int64, device=DEV)
        cu_p = torch.tensor([0, 3, 4, 8], dtype=torch.int32, device=DEV)
        check(at.attention_varlen, attention_varlen_reference, (q[:8], k, v, cu_p, cu, scale, True, pos), 2, dtype,
              f"varlen {dtype} q_positions")
        ks = [k[cu[i]:cu[i + 1]] for i in range(3)]
        vs = [v[cu[i]:cu[i + 1]] for i in range(3)]
        for page in (1, 16, 64):
            cache = build_paged_kv(ks, vs, page, generator=torch.Generator().manual_seed(page),
                                   write=functools.partial(at.kv_cache_write, P))
            qc = torch.cat([q[cu[i + 1] - c:cu[i + 1]] for i, c in enumerate(chunk)])
            cu_c = cu_seqlens(chunk, DEV)
            check(at.attention_paged_prefill, attention_paged_prefill_reference,
                  (qc, cache.k_cache, cache.v_cache, cache.block_table, cu_c, cache.seq_lens, scale), 2, dtype,
                  f"paged prefill {dtype} page {page}")
            check(at.attention_decode, attention_decode_reference,
                  (q[cu[1:] - 1], cache.k_cache, cache.v_cache, cache.block_table, cache.seq_lens, scale), 2, dtype,
                  f"decode {dtype} page {page}")
    torch.cuda.synchronize()
