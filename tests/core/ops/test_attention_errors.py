"""Bad inputs to the attention ops raise RlkInputError naming the op, the argument, the value and
what is allowed."""

from __future__ import annotations

import pytest
import torch

from rlk_core.errors import RlkInputError
from rlk_core.ops.attention import attention_decode, attention_paged_prefill, attention_varlen, kv_cache_write
from rlk_core.testing.attention import cu_seqlens, vllm_kv_cache

F32 = torch.float32


def _varlen_args(**over):
    args = dict(q=torch.randn(10, 4, 8), k=torch.randn(10, 2, 8), v=torch.randn(10, 2, 8),
                cu_seqlens_q=cu_seqlens([4, 6]), cu_seqlens_k=cu_seqlens([4, 6]), scale=0.3)
    args.update(over)
    return args


@pytest.mark.parametrize(("over", "match"), [
    ({"q": torch.randn(10, 4, 8, dtype=torch.float64)}, r"q has dtype torch.float64; allowed"),
    ({"k": torch.randn(10, 2, 8, dtype=torch.bfloat16)}, r"dtypes must match"),
    ({"k": torch.randn(10, 3, 8), "v": torch.randn(10, 3, 8)}, r"Hq=4 must be a multiple of Hkv=3"),
    ({"k": torch.randn(10, 2, 4), "v": torch.randn(10, 2, 4)}, r"k head size 4 != q head size 8"),
    ({"v": torch.randn(9, 2, 8)}, r"k shape \(10, 2, 8\) != v shape \(9, 2, 8\)"),
    ({"q": torch.randn(10, 4)}, r"q must have 3 dims"),
    ({"q": torch.randn(10, 4, 0), "k": torch.randn(10, 2, 0), "v": torch.randn(10, 2, 0)}, r"head size must be > 0"),
    ({"cu_seqlens_q": cu_seqlens([4, 6]).long()}, r"cu_seqlens_q has dtype torch.int64; allowed: int32"),
    ({"cu_seqlens_q": cu_seqlens([10])}, r"cu_seqlens_q has 2 entries but cu_seqlens_k has 3"),
    ({"cu_seqlens_q": torch.tensor([0], dtype=torch.int32), "cu_seqlens_k": torch.tensor([0], dtype=torch.int32)},
     r"B \+ 1 >= 2"),
    ({"cu_seqlens_q": torch.tensor([0, 6, 4], dtype=torch.int32)}, r"non-decreasing"),
    ({"cu_seqlens_q": cu_seqlens([4, 5])}, r"cu_seqlens_q\[-1\] must equal the number of tokens 10, got 9"),
    ({"cu_seqlens_k": cu_seqlens([0, 10])}, r"sequence 0 has 4 queries but no keys"),
    ({"cu_seqlens_k": cu_seqlens([3, 7])}, r"sequence 0 has Lq=4 > Lk=3"),
    ({"scale": 0.0}, r"scale must be a finite float > 0, got 0.0"),
    ({"scale": float("nan")}, r"scale must be a finite float > 0"),
    ({"q_positions": torch.tensor([0, 1, 2, 4, 0, 1, 2, 3, 4, 5])}, r"q_positions of sequence 0 are in \[0, 4\]; "
                                                                    r"allowed: \[0, 4\)"),
    ({"q_positions": torch.tensor([0, 1, 2, -1, 0, 1, 2, 3, 4, 5])}, r"allowed: \[0, 4\)"),
    ({"q_positions": torch.zeros(9, dtype=torch.int64)}, r"q_positions must have shape \(10,\)"),
    ({"q_positions": torch.zeros(10), }, r"q_positions has dtype torch.float32"),
    ({"q_positions": torch.zeros(10, dtype=torch.int64), "causal": False}, r"only meaningful with causal=True"),
    ({"q": torch.randn(10, 4, 8, device="meta")}, r"all tensors must be on one device"),
    # each of these fails in one test of the checks' fast path only (and so must be refused by it)
    ({"v": torch.randn(10, 2, 8, dtype=torch.float16)}, r"dtypes must match; got q torch.float32, k torch.float32, "
                                                         r"v torch.float16"),
    ({"q": "q"}, r"q must be a tensor, got str"),
    ({"k": torch.randn(1, 10, 2, 8), "v": torch.randn(1, 10, 2, 8)}, r"k must have 3 dims, got shape \(1, 10, 2, 8\)"),
    ({"q": torch.randn(10, 0, 8)}, r"head counts must be > 0; got Hq=0, Hkv=2"),
    ({"cu_seqlens_k": cu_seqlens([4, 6]).long()}, r"cu_seqlens_k has dtype torch.int64; allowed: int32"),
    ({"cu_seqlens_k": cu_seqlens([4, 6]).view(1, 3)}, r"cu_seqlens_k must have 1 dims, got shape \(1, 3\)"),
    ({"k": torch.randn(10, 2, 8, device="meta")}, r"got q on cpu, k on meta, v on cpu"),
    ({"cu_seqlens_q": cu_seqlens([4, 6], "meta")}, r"cu_seqlens_q on meta"),
    ({"q_positions": torch.zeros(10, dtype=torch.int32, device="meta")}, r"q_positions on meta"),
    ({"q_positions": torch.zeros(1, 10, dtype=torch.int32)}, r"q_positions must have shape \(10,\), got \(1, 10\)"),
    ({"scale": float("inf")}, r"scale must be a finite float > 0, got inf"),
])
def test_varlen_bad_inputs(over, match):
    with pytest.raises(RlkInputError, match=r"rlk\.attention_varlen: .*" + match):
        attention_varlen(**_varlen_args(**over))


def _cache(num_blocks=4, page=4):
    return vllm_kv_cache(num_blocks, page, 2, 8, F32, fill=0.0)


def _paged_args(**over):
    kc, vc = _cache()
    args = dict(q=torch.randn(3, 4, 8), k_cache=kc, v_cache=vc, block_table=torch.tensor([[0, 1], [2, 3]],
                dtype=torch.int32), cu_seqlens_q=cu_seqlens([1, 2]), seq_lens=torch.tensor([5, 8], dtype=torch.int32),
                scale=0.3)
    args.update(over)
    return args


@pytest.mark.parametrize(("over", "match"), [
    ({"block_table": torch.tensor([[0, 4], [2, 3]], dtype=torch.int32)},
     r"block_table\[0\] has entries \[4\] in its first 2 pages; allowed: \[0, 4\)"),
    ({"block_table": torch.tensor([[0, 1], [-1, 3]], dtype=torch.int32)}, r"block_table\[1\] has entries \[-1\]"),
    ({"seq_lens": torch.tensor([5, 9], dtype=torch.int32)},
     r"seq_lens\[1\] = 9 exceeds the block-table capacity 2 pages x page_size 4 = 8"),
    ({"seq_lens": torch.tensor([0, 8], dtype=torch.int32)}, r"seq_lens\[0\] = 0; allowed: >= 1"),
    ({"seq_lens": torch.tensor([5, 8])}, r"seq_lens has dtype torch.int64; allowed: int32"),
    ({"block_table": torch.tensor([[0, 1]], dtype=torch.int32)},
     r"block_table has 1 rows and seq_lens 2 entries; both must equal the batch size 2"),
    ({"k_cache": torch.randn(4, 4, 2, 8, dtype=torch.bfloat16)}, r"dtypes must match"),
    ({"k_cache": torch.randn(4, 4, 8)}, r"k_cache must have 4 dims"),
    ({"q": torch.randn(3, 3, 8)}, r"Hq=3 must be a multiple of Hkv=2"),
    ({"cu_seqlens_q": cu_seqlens([1, 1])}, r"cu_seqlens_q\[-1\] must equal the number of tokens 3"),
    # each of these fails in one test of the checks' fast path only (and so must be refused by it)
    ({"v_cache": _cache()[1].half()}, r"dtypes must match; got q torch.float32, k_cache torch.float32, "
                                      r"v_cache torch.float16"),
    ({"block_table": torch.tensor([[0, 1], [2, 3]])}, r"block_table has dtype torch.int64; allowed: int32"),
    ({"block_table": torch.tensor([0, 1], dtype=torch.int32)}, r"block_table must have 2 dims, got shape \(2,\)"),
    ({"seq_lens": torch.tensor([[5, 8]], dtype=torch.int32)}, r"seq_lens must have 1 dims"),
    ({"seq_lens": torch.tensor([5], dtype=torch.int32)}, r"block_table has 2 rows and seq_lens 1 entries"),
    ({"cu_seqlens_q": cu_seqlens([1, 2]).long()}, r"cu_seqlens_q has dtype torch.int64; allowed: int32"),
    ({"cu_seqlens_q": torch.tensor([0], dtype=torch.int32), "block_table": torch.zeros(0, 2, dtype=torch.int32),
      "seq_lens": torch.zeros(0, dtype=torch.int32)}, r"cu_seqlens_q must have B \+ 1 >= 2 entries, got 1"),
    ({"k_cache": torch.zeros(0, 4, 2, 8), "v_cache": torch.zeros(0, 4, 2, 8)},
     r"caches must be \[num_blocks > 0, page_size > 0, Hkv, D\], got \(0, 4, 2, 8\)"),
    ({"k_cache": torch.zeros(4, 0, 2, 8), "v_cache": torch.zeros(4, 0, 2, 8)}, r"page_size > 0"),
    ({"v_cache": torch.zeros(4, 4, 1, 8)}, r"k_cache shape \(4, 4, 2, 8\) != v_cache shape \(4, 4, 1, 8\)"),
    ({"k_cache": torch.zeros(4, 4, 2, 16), "v_cache": torch.zeros(4, 4, 2, 16)}, r"k_cache head size 16 != q head "
                                                                                  r"size 8"),
    ({"seq_lens": torch.tensor([5, 8], dtype=torch.int32, device="meta")}, r"seq_lens on meta"),
    ({"scale": float("nan")}, r"scale must be a finite float > 0, got nan"),
])
def test_paged_prefill_bad_inputs(over, match):
    with pytest.raises(RlkInputError, match=r"rlk\.attention_paged_prefill: .*" + match):
        attention_paged_prefill(**_paged_args(**over))


def test_paged_prefill_chunk_longer_than_sequence():
    with pytest.raises(RlkInputError, match=r"seq_lens\[1\] = 1; allowed: >= 2"):
        attention_paged_prefill(**_paged_args(seq_lens=torch.tensor([5, 1], dtype=torch.int32)))


def test_decode_bad_inputs():
    a = _paged_args()
    ok = dict(q=torch.randn(2, 4, 8), k_cache=a["k_cache"], v_cache=a["v_cache"], block_table=a["block_table"],
              seq_lens=a["seq_lens"], scale=0.3)
    attention_decode(**ok)
    with pytest.raises(RlkInputError, match=r"rlk\.attention_decode: seq_lens\[0\] = 0; allowed: >= 1"):
        attention_decode(**{**ok, "seq_lens": torch.tensor([0, 3], dtype=torch.int32)})
    with pytest.raises(RlkInputError, match=r"rlk\.attention_decode: block_table has 2 rows .* batch size 3"):
        attention_decode(**{**ok, "q": torch.randn(3, 4, 8)})
    with pytest.raises(RlkInputError, match=r"rlk\.attention_decode: block_table\[1\] has entries \[7\]"):
        attention_decode(**{**ok, "block_table": torch.tensor([[0, 1], [2, 7]], dtype=torch.int32)})
    with pytest.raises(RlkInputError, match=r"rlk\.attention_decode: v_cache must have 4 dims"):
        attention_decode(**{**ok, "v_cache": torch.randn(4, 4, 16)})


def _decode_args(**over):
    a = _paged_args()
    args = dict(q=torch.randn(2, 4, 8), k_cache=a["k_cache"], v_cache=a["v_cache"], block_table=a["block_table"],
                seq_lens=a["seq_lens"], scale=0.3)
    args.update(over)
    return args


@pytest.mark.parametrize(("over", "match"), [
    # each of these fails in one test of the checks' fast path only (and so must be refused by it)
    ({"q": torch.randn(2, 4, 8, dtype=torch.bfloat16)}, r"dtypes must match; got q torch.bfloat16"),
    ({"q": torch.randn(2, 4, 8, dtype=torch.float64)}, r"q has dtype torch.float64; allowed"),
    ({"q": torch.randn(2, 32)}, r"q must have 3 dims, got shape \(2, 32\)"),
    ({"q": torch.randn(2, 3, 8)}, r"Hq=3 must be a multiple of Hkv=2"),
    ({"q": torch.randn(2, 4, 4)}, r"k_cache head size 8 != q head size 4"),
    ({"k_cache": torch.zeros(4, 4, 2, 8).half(), "v_cache": torch.zeros(4, 4, 2, 8).half()}, r"dtypes must match"),
    ({"block_table": torch.tensor([[0, 1], [2, 3]], dtype=torch.int16)}, r"block_table has dtype torch.int16"),
    ({"seq_lens": torch.tensor([5, 8])}, r"seq_lens has dtype torch.int64; allowed: int32"),
    ({"seq_lens": torch.tensor([5, 8, 1], dtype=torch.int32)}, r"block_table has 2 rows and seq_lens 3 entries"),
    ({"q": torch.randn(2, 4, 8, device="meta")}, r"all tensors must be on one device; got q on meta"),
    ({"block_table": torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device="meta")}, r"block_table on meta"),
    ({"v_cache": torch.zeros(4, 4, 2, 8, device="meta")}, r"v_cache on meta"),
    ({"k_cache": "cache"}, r"k_cache must be a tensor, got str"),
    ({"scale": -0.3}, r"scale must be a finite float > 0, got -0.3"),
])
def test_decode_bad_inputs_each_fast_test(over, match):
    with pytest.raises(RlkInputError, match=r"rlk\.attention_decode: .*" + match):
        attention_decode(**_decode_args(**over))


def test_kv_cache_write_bad_inputs():
    kc, vc = _cache()
    k = torch.randn(3, 2, 8)
    good = torch.tensor([0, 5, -1])
    kv_cache_write(k, k, kc, vc, good)
    cases = [
        ((k, k, kc, vc, torch.tensor([0, 16, 1])), r"slot_mapping has values in \[0, 16\]; allowed: \[-1, 16\)"),
        ((k, k, kc, vc, torch.tensor([0, -2, 1])), r"allowed: \[-1, 16\)"),
        ((k, k, kc, vc, torch.tensor([3, 3, -1])), r"duplicate slots"),
        ((k, k, kc, vc, good.int()), r"slot_mapping has dtype torch.int32; allowed: int64"),
        ((k, k, kc, vc, good[:2]), r"slot_mapping has 2 entries for 3 tokens"),
        ((torch.randn(3, 1, 8), torch.randn(3, 1, 8), kc, vc, good), r"k is \[T, Hkv, D\] = \(3, 1, 8\)"),
        ((k.bfloat16(), k.bfloat16(), kc, vc, good), r"dtypes must match"),
        ((k, torch.randn(2, 2, 8), kc, vc, good), r"k shape \(3, 2, 8\) != v shape \(2, 2, 8\)"),
        # each of these fails in one test of the checks' fast path only (and so must be refused by it)
        ((k, k.half(), kc, vc, good), r"dtypes must match; got k torch.float32, v torch.float16"),
        ((k, k, kc, vc.half(), good), r"v_cache torch.float16"),
        ((k, k, kc, torch.zeros(4, 4, 1, 8), good), r"k_cache shape \(4, 4, 2, 8\) != v_cache shape \(4, 4, 1, 8\)"),
        ((k, k, kc, vc, good.view(1, 3)), r"slot_mapping must have 1 dims, got shape \(1, 3\)"),
        ((k[..., 0], k[..., 0], kc[..., 0], vc[..., 0], good), r"k must have 3 dims, got shape \(3, 2\)"),
        ((torch.randn(3, 2, 4), torch.randn(3, 2, 4), kc, vc, good), r"k is \[T, Hkv, D\] = \(3, 2, 4\)"),
        ((k, k, kc, vc, good.to("meta")), r"slot_mapping on meta"),
        ((k, k, kc, vc.to("meta"), good), r"v_cache on meta"),
        ((k, k, "cache", vc, good), r"k_cache must be a tensor, got str"),
    ]
    for args, match in cases:
        with pytest.raises(RlkInputError, match=r"rlk\.kv_cache_write: .*" + match):
            kv_cache_write(*args)
