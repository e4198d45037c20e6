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
