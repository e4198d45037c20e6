"""linear_tp_partials' Triton kernel (rlk.gemm.tp.v1) under the Triton interpreter: TP shards with G / TP leaves
merged by the rank tree give the kernel's own TP 1 bits; within tolerance of the reference; the tile rule never
reads the local K or the leaf count. fp32 / fp16 only: the interpreter's bf16 ``tl.dot`` is wrong."""

import torch

from rlk_core.ops.linear_tp import triton as T


def test_kernel_tp_shards_bitwise_and_close_to_the_reference(run_interpreted):
    run_interpreted("""
    from rlk_collectives import tree_sum_fp32
    from rlk_core.ops.linear_tp import triton as T
    from rlk_core.ops.linear_tp.reference import linear_tp_partials_reference as ref
    from rlk_core.testing import dtype_tols

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float16):
        for m, n, k in ((3, 40, 8 * 24), (20, 70, 8 * 16), (17, 33, 8 * 40)):  # decode and row tiles, ragged leaves
            x = torch.randn(m, k, generator=g).to(dtype)
            w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
            full = T.forward(CPU, x, w, 8)
            assert full.dtype == torch.float32
            torch.testing.assert_close(full, ref(x, w, 8), **dtype_tols(torch.float32))
            for tp in (2, 4, 8):
                c = k // tp
                parts = [T.forward(CPU, x[:, r * c:(r + 1) * c], w[:, r * c:(r + 1) * c], 8 // tp) for r in range(tp)]
                assert torch.equal(tree_sum_fp32(parts), full), (dtype, m, n, k, tp)
            # negative control: one leaf over the whole K (the bi GEMM's single loop) is other bits
            assert not torch.equal(T.forward(CPU, x, w, 1), full)
    print("ok")
    """)


def test_the_tile_rule_reads_neither_the_local_k_nor_the_leaf_count():
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for m in (1, 16, 17, 4096):
            for leaf in (128, 256, 1536):
                cfgs = {repr(T.config(dtype, m, 4096, leaf)) for _ in (1, 2, 4, 8)}
                assert len(cfgs) == 1
    assert T.config(torch.bfloat16, 16, 4096, 512) != T.config(torch.bfloat16, 17, 4096, 512)  # M does choose


def test_build_calls_cover_every_tile_and_leaf_count():
    for dtype in (torch.bfloat16, torch.float32):
        seen = {(cfg["BLOCK_M"], args[2], cfg["EVEN_K"]) for _, args in T.build_calls(dtype, 132) for cfg in [args[4]]}
        tiles = [T._FP32] if dtype == torch.float32 else [T._DECODE, T._ROWS]
        assert seen == {(t[0], leaves, even) for t in tiles for leaves in (1, 2, 4, 8) for even in (False, True)}
