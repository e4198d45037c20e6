"""The ``KV_TMA`` load path of the rlk.triton forward attention kernel under the Triton
interpreter (CPU) at tiny shapes: varlen prefill with ``KV_TMA=True`` gives exactly the output of the
pointer-load path (``torch.equal``; in the interpreter both are exact emulations of the same loads),
the unmasked KV blocks — and only those — go through the descriptors (descriptor loads are counted:
2 * Hkv per unmasked block, several per program), and ``KV_TMA`` falls back to pointer loads for paged
calls, a head size below its power-of-two pad and non-contiguous heads. ``config()`` turns it on for
the d = 128 prefill entries only. Identical bits on the GPU: ``tests/gpu/test_attention_gpu.py``.

Runs in a subprocess because ``TRITON_INTERPRET`` must be set before Triton is imported. fp16/fp32
only: the interpreter's ``tl.dot`` on bfloat16 is wrong (numpy has no bfloat16)."""

from __future__ import annotations

SCRIPT = """
    import triton.runtime.interpreter as interp
    from rlk_core.ops.attention import triton as at
    from rlk_core.ops.attention import reference as R
    from rlk_core.testing.attention import build_paged_kv, cu_seqlens

    loads = [0]
    _desc_load = interp.InterpreterBuilder.create_descriptor_load

    def _counted(self, *args, **kwargs):
        loads[0] += 1
        return _desc_load(self, *args, **kwargs)

    interp.InterpreterBuilder.create_descriptor_load = _counted

    for (dt, d_pad), forms in at.CONFIGS.items():
        for form in forms:
            assert at.config(dt, d_pad, form)["KV_TMA"] == (form == "prefill" and d_pad == 128 and dt != torch.float32)

    def varlen(q, k, v, lq, lk, causal, cfg):
        cq, ck = cu_seqlens(lq), cu_seqlens(lk)
        lens = (ck[1:] - ck[:-1]).to(torch.int32)
        ks = (k.stride(0), k.stride(0), k.stride(1), k.stride(2))
        vs = (v.stride(0), v.stride(0), v.stride(1), v.stride(2))
        loads[0] = 0
        out = at._launch(CPU, q, k, v, ck, 1, 0, ks, vs, cq, cq.shape[0] - 1, lens, None, causal,
                         q.shape[-1] ** -0.5, "prefill", cfg)
        return out, loads[0]

    def unmasked_blocks(lq, lk, causal, tok, block_n):
        # per program (tile): n_full = (first + 1) // BLOCK_N, first = the smallest row limit of the tile
        n = []
        for a, c in zip(lq, lk):
            for tok0 in range(0, a, tok):
                first = c - a + tok0 if causal else c - 1
                n.append((first + 1) // block_n)
        return n

    torch.manual_seed(0)
    hq, hkv = 4, 2
    for dtype, tol in ((torch.float32, 2e-6), (torch.float16, 2e-3)):
        d = 64  # == its power-of-two pad, so TMA applies
        for lq, lk in (([70, 150], [70, 150]), ([5, 40], [70, 200])):
            q = torch.randn(sum(lq), hq, d).to(dtype)
            k = torch.randn(sum(lk), hkv, d).to(dtype)
            v = torch.randn(sum(lk), hkv, d).to(dtype)
            cfg = at.config(dtype, d)
            assert at.kv_tma_ok(CPU, k, v, d, cfg["D_PAD"])
            tok = cfg["BLOCK_M"] // 2  # G = G_PAD = 2
            for causal in (True, False):
                ptr, n_ptr = varlen(q, k, v, lq, lk, causal, cfg)
                tma, n_tma = varlen(q, k, v, lq, lk, causal, dict(cfg, KV_TMA=True))
                n_full = unmasked_blocks(lq, lk, causal, tok, cfg["BLOCK_N"])
                assert max(n_full) >= 2, (dtype, lq, causal, n_full)  # some programs load several by TMA
                n_full = sum(n_full)
                assert n_ptr == 0 and n_tma == 2 * hkv * n_full, (dtype, lq, causal, n_ptr, n_tma, n_full)
                assert torch.equal(tma, ptr), (dtype, lq, causal)
                ref = R.attention_varlen_reference(q, k, v, cu_seqlens(lq), cu_seqlens(lk), d ** -0.5, causal, None)
                err = (tma.double() - ref.double()).abs().max()
                assert err <= tol, (dtype, lq, causal, float(err))

    # fallbacks to pointer loads: KV_TMA is dropped per call, the output is the pointer path's
    dtype, lq, lk = torch.float16, [70, 150], [70, 150]
    cq, ck = cu_seqlens(lq), cu_seqlens(lk)
    for d, heads_stride in ((24, 24), (64, 128)):  # head size below its pad; heads not contiguous
        q = torch.randn(sum(lq), hq, d).to(dtype)
        k = torch.randn(sum(lk), hkv, heads_stride).to(dtype)[..., :d]
        v = torch.randn(sum(lk), hkv, heads_stride).to(dtype)[..., :d]
        cfg = at.config(dtype, d)
        assert not at.kv_tma_ok(CPU, k, v, d, cfg["D_PAD"]), d
        ptr, _ = varlen(q, k, v, lq, lk, True, cfg)
        tma, n_tma = varlen(q, k, v, lq, lk, True, dict(cfg, KV_TMA=True))
        assert n_tma == 0 and torch.equal(tma, ptr), (d, n_tma)
    d = 64
    q = torch.randn(sum(lq), hq, d).to(dtype)
    ks = [torch.randn(n, hkv, d).to(dtype) for n in lk]
    vs = [torch.randn(n, hkv, d).to(dtype) for n in lk]
    c = build_paged_kv(ks, vs, 16, generator=torch.Generator().manual_seed(0),
                       write=lambda *a: at.kv_cache_write(CPU, *a))
    cfg = dict(at.config(dtype, d), KV_TMA=True)
    loads[0] = 0
    out = at._launch(CPU, q, c.k_cache, c.v_cache, c.block_table, c.block_table.stride(0), 16,
                     tuple(c.k_cache.stride()), tuple(c.v_cache.stride()), cq, cq.shape[0] - 1, c.seq_lens, None,
                     True, d ** -0.5, "prefill", cfg)
    assert loads[0] == 0
    assert torch.equal(out, at.attention_paged_prefill(CPU, q, c.k_cache, c.v_cache, c.block_table, cq, c.seq_lens,
                                                       d ** -0.5))
    print("ok")
"""


def test_attention_kv_tma_interpreted(run_interpreted):
    run_interpreted(SCRIPT, timeout=300)
