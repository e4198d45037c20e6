"""linear_tp_partials' Triton kernels (rlk.gemm.tp.v1) under the Triton interpreter: every variant (fused, split,
stash) gives the same bits as every other, TP shards with G / TP leaves merged by the rank tree give TP 1's bits in
every variant, the kernels' result is exactly the leaves merged by the adjacent-pairs tree (negative controls: the
sequential sum of the same leaves, one leaf over the whole K); a row's bits do not depend on M across the variant
switch; within tolerance of the reference; the rule never reads the local K or the leaf count.

fp32 / fp16 only: the interpreter's bf16 ``tl.dot`` is wrong. The interpreter's ``tl.dot`` is numpy's matmul of one
block, whose bits depend on the block's shape (the GPU's MMA accumulation does not: ``linear``'s premise, checked on
the GPU by tests/gpu/test_linear_tp_gpu.py), so variants are compared here on one tile: what this proves is each
variant's arithmetic — which leaf each k-step belongs to, the tree, the workspace slots, the persistent loop."""

import torch

from rlk_core.ops.linear_tp import triton as T


def test_every_variant_same_bits_tp_shards_and_the_leaf_tree(run_interpreted):
    run_interpreted("""
    from rlk_collectives import tree_sum_fp32
    from rlk_core.ops.linear_tp import triton as T
    from rlk_core.ops.linear_tp.reference import linear_tp_partials_reference as ref, pairs_sum
    from rlk_core.testing import dtype_tols

    def run(x, w, leaves, v, tile):
        y = torch.empty(x.shape[0], w.shape[0])
        T._launch(CPU, x, w, leaves, y, dict(T.tile_config(tile, x.shape[1] // leaves, x.dtype), VARIANT=v))
        return y

    g = torch.Generator().manual_seed(0)
    # decode, ragged leaves (EVEN_K False: L = 40, BLOCK_K 32 in fp32); (40, 100) on 16x32 tiles: 12 tiles, more than
    # CPU.sms, so the stash kernel's persistent loop reuses its workspace slots (TP 4 is the rule test's)
    for m, n, k, tile, dtype in ((3, 40, 8 * 16, T._SPLIT_DECODE, torch.float16),
                                 (17, 33, 8 * 40, T._DECODE, torch.float32),
                                 (40, 100, 8 * 16, T._SPLIT_DECODE, torch.float16)):
        x = torch.randn(m, k, generator=g).to(dtype)
        w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
        base = run(x, w, 8, "fused", tile)
        torch.testing.assert_close(base, ref(x, w, 8), **dtype_tols(torch.float32))
        for v in T.VARIANTS:
            assert torch.equal(run(x, w, 8, v, tile), base), (dtype, m, n, k, v)
            for tp in (2, 8):
                c = k // tp
                parts = [run(x[:, r * c:(r + 1) * c], w[:, r * c:(r + 1) * c], 8 // tp, v, tile)
                         for r in range(tp)]
                assert torch.equal(tree_sum_fp32(parts), base), (dtype, m, n, k, v, tp)
        leaf = k // 8
        leaves = [run(x[:, j * leaf:(j + 1) * leaf], w[:, j * leaf:(j + 1) * leaf], 1, "split", tile)
                  for j in range(8)]
        assert torch.equal(pairs_sum(leaves), base)
        seq = leaves[0]
        for part in leaves[1:]:
            seq = seq + part
        assert not torch.equal(seq, base), "negative control: another tree over the same leaves"
        assert not torch.equal(run(x, w, 1, "split", tile), base), "negative control: one leaf"
    print("ok")
    """)


def test_rule_tp_shards_bitwise_and_rows_across_the_variant_switch(run_interpreted):
    run_interpreted("""
    from rlk_collectives import tree_sum_fp32
    from rlk_core.ops.linear_tp import triton as T

    g = torch.Generator().manual_seed(1)
    for m in (3, 130):  # the rule's split and stash (fp16), at TP 2, 4, 8
        x = torch.randn(m, 8 * 16, generator=g).half()
        w = (torch.randn(72, 8 * 16, generator=g) / 11.3).half()
        full = T.forward(CPU, x, w, 8)
        assert full.dtype == torch.float32
        for tp in (2, 4, 8):
            c = x.shape[1] // tp
            parts = [T.forward(CPU, x[:, r * c:(r + 1) * c], w[:, r * c:(r + 1) * c], 8 // tp) for r in range(tp)]
            assert torch.equal(tree_sum_fp32(parts), full), (m, tp)
    # fp32 runs every variant on one tile: a row's bits are the same at M = 128 by split and at M = 129 by stash
    x = torch.randn(129, 8 * 16, generator=g)
    w = torch.randn(72, 8 * 16, generator=g) / 11.3
    a = T.partials(CPU, x, w, 8, "stash")[:128]
    assert torch.equal(a, T.partials(CPU, x[:128], w, 8, "split"))
    assert torch.equal(a, T.partials(CPU, x[:128], w, 8, "fused"))
    print("ok")
    """)


def test_the_rule_reads_neither_the_local_k_nor_the_leaf_count():
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for m in (1, 16, 17, 128, 129, 4096):
            for leaf in (128, 256, 1536):
                cfgs = {repr(T.config(dtype, m, 4096, leaf)) for _ in (1, 2, 4, 8)}
                assert len(cfgs) == 1
    assert T.config(torch.bfloat16, 16, 4096, 512) != T.config(torch.bfloat16, 17, 4096, 512)  # M does choose
    assert T.variant(torch.bfloat16, T.SPLIT_MAX_M, 4096, 512) == "split"
    assert T.variant(torch.bfloat16, T.SPLIT_MAX_M + 1, 4096, 512) == "stash"
    assert T.variant(torch.float32, 1, 4096, 512) == "fused"
    for v in T.VARIANTS:  # a forced variant keeps the rule's BLOCK_K: the leaf's k-steps are the same in every one
        assert T.config(torch.bfloat16, 1, 4096, 512, v)["BLOCK_K"] == T.config(torch.bfloat16, 1, 4096, 512)["BLOCK_K"]


def test_build_calls_cover_every_variant_tile_and_leaf_count():
    for dtype in (torch.bfloat16, torch.float32):
        seen = {(cfg["VARIANT"], cfg["BLOCK_M"], cfg["BLOCK_N"], args[2], cfg["EVEN_K"])
                for _, args in T.build_calls(dtype, 132) for cfg in [args[4]]}
        want = {(v, t[0], t[1], leaves, even) for v in T.VARIANTS
                for t in ([T._FP32] if dtype == torch.float32 else T.TILES[v])
                for leaves in (1, 2, 4, 8) for even in (False, True)}
        assert seen == want


# -- the finished store (linear_tp, TP 1): bias, one rounding, canonical NaN in the last kernel's epilogue ------------
def test_the_finished_store_is_bitwise_linear_tp_finish_on_every_special_value(run_interpreted):
    """The merge kernel's epilogue on crafted fp32 leaves: ties of the rounding, overflow to inf, subnormals, signed
    zeros, infinities, NaNs with payloads and signs, and a bias with the same — bitwise ``linear_tp_finish`` of the
    leaves' tree in bf16, fp16 and fp32. Negative controls: rounding before the bias add (then again after), and the
    conversion without the canonical NaN, each differ on these inputs."""
    run_interpreted("""
    import triton

    from rlk_core.ops import linear_tp_finish
    from rlk_core.ops.linear_tp import triton as T
    from rlk_core.ops.linear_tp.reference import pairs_sum

    def bits(t):
        return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)

    def f32(*words):
        return torch.tensor(list(words), dtype=torch.int64).to(torch.int32).view(torch.float32)

    special = torch.cat([
        torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 1.0 + 2**-11, 1.0 + 3 * 2**-11, 3.4e38, -3.4e38,
                      65520.0, -65520.0, 65519.0, 1e-40, -1e-40, 3e-8, 1e-45, 0.0, -0.0, float("inf"),
                      float("-inf"), 2.5, -7.0]),
        f32(0x7FC00123, 0xFFC00000, 0x7F800001, 0xFFFFFFFF),  # NaNs: a payload, negative, signalling, all ones
    ])
    n = special.numel()
    g = torch.Generator().manual_seed(3)
    for leaves in (2, 8):
        for m in (1, 5, 3000 // n):  # 5 rows: M not a multiple of anything; the last: several merge blocks
            ws = torch.randn(leaves, m, n, generator=g)
            ws[0] = special  # the first leaf the special values, the others zero: the tree keeps them
            ws[1:, :, :] = 0.0
            ws[1:, 1::2] = torch.randn(leaves - 1, ws[:, 1::2].shape[1], n, generator=g)  # some rows: real sums
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                s = pairs_sum(list(ws))
                for i, bias in enumerate((None, special.flip(0).to(dtype), torch.randn(n, generator=g).to(dtype))):
                    got = torch.empty(m, n, dtype=dtype)
                    T._linear_tp_merge_kernel[(triton.cdiv(m * n, T.MERGE_BLOCK),)](
                        ws, got, ws if bias is None else bias, m * n, n, LEAVES=leaves, FINISH=True,
                        HAS_BIAS=bias is not None, BLOCK=T.MERGE_BLOCK)
                    want = linear_tp_finish(s, bias, dtype)
                    assert torch.equal(bits(got), bits(want)), (leaves, m, dtype, bias is None)
                    if i == 2 and m > 1 and dtype != torch.float32:  # a random bias on rows of real sums
                        twice = linear_tp_finish(linear_tp_finish(s, None, dtype).float(), bias, dtype)
                        assert not torch.equal(bits(twice), bits(got)), "negative control: rounded before the bias"
                if dtype != torch.float32:
                    assert not torch.equal(bits(s.to(dtype)), bits(got)), "negative control: NaN not canonical"
    print("ok")
    """)


def test_every_variant_finished_is_bitwise_its_partial_finished(run_interpreted):
    """Each variant (and the rule) with its store finished — fused's and stash's epilogue, split's merge, split's leaf
    kernel at one leaf — gives ``linear_tp_finish`` of its own fp32 partial, bit for bit: bf16, fp16, fp32; with and
    without a bias; inputs with inf and NaN; M = 1, 16, 17, 129 (the decode tile's edge, stash's second tile row);
    1, 2 and 8 leaves; K = 0."""
    run_interpreted("""
    from rlk_core.ops import linear_tp_finish
    from rlk_core.ops.linear_tp import triton as T

    def bits(t):
        return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)

    g = torch.Generator().manual_seed(4)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for m in (1, 16, 17, 129):
            x = torch.randn(m, 8 * 16, generator=g).to(dtype)
            w = (torch.randn(40, 8 * 16, generator=g) / 11.3).to(dtype)
            b = torch.randn(40, generator=g).to(dtype)
            b[3] = float("-inf")
            x[0, 7], x[0, 100] = float("inf"), float("-inf")  # row 0: +-inf, NaN where the tree adds inf to -inf
            x[m - 1, 70] = float("nan")  # the last row: NaN
            for which in (*T.VARIANTS, None):
                for leaves in (1, 2, 8):
                    s = T.partials(CPU, x, w, leaves, which)
                    for bias in (None, b):
                        got = T.finished(CPU, x, w, bias, leaves, which)
                        assert got.dtype == dtype and got.shape == (m, 40)
                        want = linear_tp_finish(s, bias, dtype)
                        assert torch.equal(bits(got), bits(want)), (dtype, m, which, leaves, bias is None)
                        if bias is not None and which is None and leaves == 8:
                            assert torch.equal(bits(T.forward_finished(CPU, x, w, bias, 8)), bits(want))
            if dtype != torch.bfloat16:  # the interpreter's bf16 dot drops inf and NaN (its partial is still finished)
                assert got[m - 1].isnan().all() and (m == 1 or got[0].isnan().any() and got[0].isinf().any())
    # K = 0: the finish of a zero partial (a -0.0 bias gives +0.0)
    b = torch.tensor([-0.0, 1.5, float("nan")])
    z = T.finished(CPU, torch.empty(2, 0), torch.empty(3, 0), b, 1)
    assert torch.equal(bits(z), bits(linear_tp_finish(torch.zeros(2, 3), b, torch.float32)))
    print("ok")
    """)


def test_build_calls_compile_the_finished_store_of_every_variant():
    for dtype in (torch.bfloat16, torch.float32):
        seen = set()
        for _, args in T.build_calls(dtype, 132):
            finish, bias = (args[6], args[5] is not None) if len(args) > 5 else (False, False)
            seen.add((args[4]["VARIANT"], args[2], args[4]["EVEN_K"], finish, bias))
        want = {(v, leaves, even, fin, bias) for v in T.VARIANTS for leaves in (1, 2, 4, 8) for even in (False, True)
                for fin, bias in ((False, False), (True, False), (True, True))}
        assert seen == want
        for _, args in T.build_calls(dtype, 132):
            assert args[3].dtype == (dtype if len(args) > 5 else torch.float32)
