"""The rlk.triton attention kernels under the Triton interpreter (CPU) at tiny shapes: within
tolerance of the reference for varlen (causal, non-causal, q_positions), paged chunked prefill and
decode over NaN-filled shuffled vLLM-layout caches, and exact ``kv_cache_write``. The interpreter does
not reproduce GPU bits; the bitwise properties are tested in tests/gpu/test_attention_gpu.py.

Runs in a subprocess because ``TRITON_INTERPRET`` must be set before Triton is imported. fp16/fp32
only: the interpreter's ``tl.dot`` on bfloat16 is wrong (numpy has no bfloat16)."""

from __future__ import annotations

SCRIPT = """
    from rlk_core.ops.attention import triton as at
    from rlk_core.ops.attention import reference as R
    from rlk_core.testing.attention import build_paged_kv, cu_seqlens, vllm_kv_cache

    torch.manual_seed(0)
    for dtype, tol in ((torch.float32, 2e-6), (torch.float16, 2e-3)):
        hq, hkv, d = 3, 1, 24
        lens, lq = [70, 1, 66], [5, 1, 66]
        q = torch.randn(sum(lq), hq, d).to(dtype)
        k = torch.randn(sum(lens), hkv, d).to(dtype)
        v = torch.randn(sum(lens), hkv, d).to(dtype)
        cq, ck, scale = cu_seqlens(lq), cu_seqlens(lens), d ** -0.5
        pos = torch.cat([torch.randint(0, n, (m,)) for n, m in zip(lens, lq)])
        for causal, qp in ((True, None), (False, None), (True, pos)):
            err = (at.attention_varlen(CPU, q, k, v, cq, ck, scale, causal, qp).double()
                   - R.attention_varlen_reference(q, k, v, cq, ck, scale, causal, qp).double()).abs().max()
            assert err <= tol, ("varlen", dtype, causal, qp is not None, float(err))
        ks = [k[ck[i]:ck[i + 1]] for i in range(3)]
        vs = [v[ck[i]:ck[i + 1]] for i in range(3)]
        for page in (1, 16):
            c = build_paged_kv(ks, vs, page, generator=torch.Generator().manual_seed(page),
                               write=lambda *a: at.kv_cache_write(CPU, *a))
            args = (c.k_cache, c.v_cache, c.block_table, cq, c.seq_lens, scale)
            out = at.attention_paged_prefill(CPU, q, *args)
            err = (out.double() - R.attention_paged_prefill_reference(q, *args).double()).abs().max()
            assert err <= tol and not out.isnan().any(), ("paged", dtype, page, float(err))
            qd = q[cq[1:] - 1]
            args = (c.k_cache, c.v_cache, c.block_table, c.seq_lens, scale)
            out = at.attention_decode(CPU, qd, *args)
            err = (out.double() - R.attention_decode_reference(qd, *args).double()).abs().max()
            assert err <= tol and not out.isnan().any(), ("decode", dtype, page, float(err))

    k = torch.randn(5, 2, 16)
    v = torch.randn(5, 2, 16)
    slots = torch.tensor([3, -1, 7, 15, 0])
    kc, vc = vllm_kv_cache(4, 4, 2, 16, torch.float32)
    kc2, vc2 = vllm_kv_cache(4, 4, 2, 16, torch.float32)
    at.kv_cache_write(CPU, k, v, kc, vc, slots)
    R.kv_cache_write_reference(k, v, kc2, vc2, slots)
    raw = lambda c: c.as_strided((4, 4, 2, 32), (256, 64, 32, 1), 0).contiguous().view(torch.int32)
    assert torch.equal(raw(kc), raw(kc2)) and torch.equal(raw(vc), raw(vc2))
    print("ok")
"""


def test_attention_triton_kernels_interpreted(run_interpreted):
    run_interpreted(SCRIPT, timeout=120)
