"""The pieces of a Qwen3 layer other than the row-parallel GEMM are TP-invariant already (docs/ops/linear_tp.md):
column-parallel GEMMs (a column shard gives those columns' bits, on the reference and on rlk.triton whose tile rule
reads the local N), attention per head (heads per rank change nothing), RMSNorm on replicated or sequence-sharded
rows. The vocab-parallel log-probs: tests/core/ops/test_token_logprobs.py / test_linear_logprobs.py
(``test_vocab_shards_1_2_4_8_bitwise``); the vocab-parallel embedding: tests/collectives/test_partials_gloo.py."""

import pytest
import torch

import rlk_core.ops as ops
from rlk_core.ops.linear import tiles


def _randn(*shape, seed=0, dtype=torch.bfloat16, scale=1.0):
    return (scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).to(dtype)


def _column_shards(w, tp):
    n = w.shape[0] // tp
    return [w[r * n:(r + 1) * n] for r in range(tp)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 7, 64])
def test_column_parallel_shards_give_the_columns_bits(dtype, m):
    x = _randn(m, 256, seed=1, dtype=dtype)
    w = _randn(512, 256, seed=2, dtype=dtype, scale=256**-0.5)
    b = _randn(512, seed=3, dtype=dtype)
    full = ops.linear(x, w, b)
    for tp in (1, 2, 4, 8):
        parts = [ops.linear(x, ws, bs) for ws, bs in zip(_column_shards(w, tp), _column_shards(b, tp), strict=True)]
        assert torch.equal(torch.cat(parts, -1), full), tp


def test_column_parallel_on_the_triton_kernel_with_tiles_chosen_by_the_local_n(run_interpreted):
    """rlk.triton's tile rule picks BLOCK_N (and stages) from the local N — for the decode rows 128 / 32 columns at
    N = 512 / 64 (the same BLOCK_K): each shard's launch writes exactly the full GEMM's columns. The interpreter's dot
    is numpy's matmul, whose fp32 summation order follows the BLAS kernel chosen for the tile's shape and the CPU (on
    one machine tile 128 vs 32 gave other bits), so the inputs are small integers whose every sum is exact: this checks
    the tiles' indexing; the rounding order across tiles is the GPU's (tests/gpu/test_linear_gpu.py). (fp16: the
    interpreter's bf16 dot is wrong.)"""
    picked = {tiles.config(torch.float16, 4, n, 128, False, 3)["BLOCK_N"] for n in (512, 128, 64)}
    assert picked == {128, 32}, picked  # the rule does read N: the test compares different tiles
    run_interpreted("""
    from rlk_core.ops.linear import triton as lt
    g = torch.Generator().manual_seed(4)
    x = torch.randint(-4, 5, (4, 128), generator=g).half()  # |sum| <= 128 * 16: exact in fp32 and in fp16
    w = torch.randint(-4, 5, (512, 128), generator=g).half()
    full = lt.forward(CPU, x, w, None)
    for tp in (4, 8):
        n = 512 // tp
        parts = [lt.forward(CPU, x, w[r * n:(r + 1) * n], None) for r in range(tp)]
        assert torch.equal(torch.cat(parts, -1), full), tp
    print("ok")
    """)


@pytest.mark.parametrize("hq, hkv", [(8, 4), (16, 2)])
def test_attention_heads_per_rank_change_nothing(hq, hkv):
    d, cu = 64, torch.tensor([0, 3, 9, 16], dtype=torch.int32)
    t = int(cu[-1])
    q, k, v = _randn(t, hq, d, seed=5), _randn(t, hkv, d, seed=6), _randn(t, hkv, d, seed=7)
    scale = d**-0.5
    full = ops.attention_varlen(q, k, v, cu, cu, scale)
    for tp in (1, 2, 4, 8):
        if hkv % tp and tp % hkv:
            continue
        kv_per = max(hkv // tp, 1)  # KV heads replicated when TP > hkv (Megatron / vLLM)
        q_per = hq // tp
        for r in range(tp):
            kv0 = (r * q_per) // (hq // hkv)
            out = ops.attention_varlen(q[:, r * q_per:(r + 1) * q_per], k[:, kv0:kv0 + kv_per],
                                       v[:, kv0:kv0 + kv_per], cu, cu, scale)
            assert torch.equal(out, full[:, r * q_per:(r + 1) * q_per]), (tp, r)


def test_rms_norm_rows_replicated_or_sequence_sharded():
    x, w = _randn(48, 96, seed=8), _randn(96, seed=9)
    full = ops.rms_norm(x, w, 1e-6)
    for tp in (1, 2, 4, 8):
        rows = 48 // tp
        shards = [ops.rms_norm(x[r * rows:(r + 1) * rows], w, 1e-6) for r in range(tp)]
        assert torch.equal(torch.cat(shards), full), tp
