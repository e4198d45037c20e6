"""Reference attention — the specification of contract ``rlk.attention.v1``.

Every form gathers the K/V of each query's sequence (exact data movement: slicing a packed tensor or
reading pages of a paged cache through the block table, for any page size and any strides) and then
runs the per-row arithmetic of :func:`rlk_core.ops.attention._core.attend` (see that module for the
formula: KV blocks of 64 anchored at position 0 in increasing order, ``tree_sum`` reductions, online
softmax in fp32, ``p`` rounded to ``v.dtype`` before ``p * v``, one rounding of ``acc / l``). A query
at absolute position ``t`` of sequence ``b`` sees keys ``0..t`` of sequence ``b``:

- varlen prefill: ``t = q_positions[i]``, default bottom-right aligned ``Lk_b - Lq_b + i``;
  non-causal: ``t = Lk_b - 1`` for every query;
- chunked prefill over a paged cache: the chunk is the last ``Lq_b`` positions, ``t = seq_lens[b] - Lq_b + i``;
- decode: ``t = seq_lens[b] - 1``.

The same ``(q row, keys 0..t)`` therefore gives the same bits in all three forms and in any batch.
"""

from __future__ import annotations

import torch

from rlk_core.ops.attention._core import attend, attend_backward


def query_limits(cu_seqlens_q: list[int], cu_seqlens_k: list[int], b: int, causal: bool,
                 q_positions: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """Last visible key position of each query of sequence ``b`` (int64 ``[Lq_b]``)."""
    q0, q1 = cu_seqlens_q[b], cu_seqlens_q[b + 1]
    lk = cu_seqlens_k[b + 1] - cu_seqlens_k[b]
    if not causal:
        return torch.full((q1 - q0,), lk - 1, dtype=torch.int64, device=device)
    if q_positions is not None:
        return q_positions[q0:q1].to(device=device, dtype=torch.int64)
    return torch.arange(lk - (q1 - q0), lk, dtype=torch.int64, device=device)


def attention_varlen_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                               cu_seqlens_k: torch.Tensor, scale: float, causal: bool,
                               q_positions: torch.Tensor | None) -> torch.Tensor:
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    for b in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
        if q1 == q0:
            continue
        limit = query_limits(cq, ck, b, causal, q_positions, q.device)
        out[q0:q1] = attend(q[q0:q1], k[None, k0:k1], v[None, k0:k1], limit, scale)
    return out


def attention_varlen_backward_reference(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                        cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, scale: float,
                                        causal: bool, q_positions: torch.Tensor | None
                                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of :func:`attention_varlen_reference`, per sequence by
    :func:`rlk_core.ops.attention._core.attend_backward`; rounded once to the input dtypes."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    dq = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    for b in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
        if q1 == q0:
            continue
        limit = query_limits(cq, ck, b, causal, q_positions, q.device)
        gq, gk, gv = attend_backward(grad_out[q0:q1], q[q0:q1], k[k0:k1], v[k0:k1], limit, scale)
        dq[q0:q1] = gq.to(q.dtype)
        dk[k0:k1] = gk.to(k.dtype)
        dv[k0:k1] = gv.to(v.dtype)
    return dq, dk, dv


def gather_pages(cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """K or V of each sequence from a paged cache: ``[B, n_pages * page_size, Hkv, D]``.

    ``cache`` is ``[num_blocks, page_size, Hkv, D]`` with any strides. Row ``b`` holds the pages
    ``block_table[b, :ceil(seq_lens[b] / page_size)]`` in order; table entries past a sequence's last
    page are never read (page 0 stands in, and those positions are masked).
    """
    page = cache.shape[1]
    n_pages = int((int(seq_lens.max()) + page - 1) // page) if seq_lens.numel() else 0
    table = block_table[:, :n_pages].to(device=cache.device, dtype=torch.int64)
    used = torch.arange(n_pages, device=cache.device)[None, :] < ((seq_lens.to(cache.device).long() + page - 1)
                                                                   // page)[:, None]
    table = torch.where(used, table, 0)
    return cache[table].reshape(table.shape[0], n_pages * page, cache.shape[2], cache.shape[3])


def attention_paged_prefill_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                      block_table: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                                      scale: float) -> torch.Tensor:
    cq, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    for b in range(len(cq) - 1):
        q0, q1 = cq[b], cq[b + 1]
        if q1 == q0:
            continue
        ks = gather_pages(k_cache, block_table[b : b + 1], seq_lens[b : b + 1])
        vs = gather_pages(v_cache, block_table[b : b + 1], seq_lens[b : b + 1])
        limit = torch.arange(lens[b] - (q1 - q0), lens[b], dtype=torch.int64, device=q.device)
        out[q0:q1] = attend(q[q0:q1], ks, vs, limit, scale)
    return out


def attention_decode_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    if q.shape[0] == 0:
        return torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    ks = gather_pages(k_cache, block_table, seq_lens)
    vs = gather_pages(v_cache, block_table, seq_lens)
    limit = seq_lens.to(device=q.device, dtype=torch.int64) - 1
    return attend(q, ks, vs, limit, scale)


def kv_cache_write_reference(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             slot_mapping: torch.Tensor) -> None:
    """``cache[slot // page_size, slot % page_size] = new`` for every ``slot >= 0``; ``-1`` is skipped."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].to(device=k_cache.device, dtype=torch.int64)
    page = k_cache.shape[1]
    pages, offsets = slots // page, slots % page
    k_cache[pages, offsets] = k[keep].to(k_cache.dtype)
    v_cache[pages, offsets] = v[keep].to(v_cache.dtype)
