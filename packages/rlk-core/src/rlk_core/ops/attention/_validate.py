"""Input validation of the attention ops. Shape/dtype/device checks run everywhere (also on fake
tensors): first as a few attribute tests that pass the common valid call without building a message
(``_*_fast``), then, where those do not pass, in full with their messages. Checks on values (offsets,
positions, block-table entries, slots) run where values exist (:func:`rlk_core.ops._checks.values_checked`)."""

from __future__ import annotations

import math

import torch

from rlk_core.ops import _checks as C


def _has_values(*tensors: torch.Tensor | None) -> bool:
    return C.values_checked(*tensors)


# -- the common valid call in a few attribute tests ---------------------------------------------------------
# Each ``_*_fast`` returning True implies that the full checks of its op (all but the value checks) pass; where
# it returns False those run unchanged and raise with their own messages (tests/core/ops/test_attention_checks.py).
def _heads_fast(q, k, v, k_dims: int) -> bool:
    """``q [T, Hq, D]``, ``k`` and ``v`` of one shape ``[..., Hkv, D]`` (``k_dims`` dims), one float dtype,
    ``D > 0``, ``Hq`` a positive multiple of ``Hkv > 0``: what :func:`_heads` and the ops' ``ndim`` checks of
    these three accept."""
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        return False
    dtype = q.dtype
    if not (dtype in C.FLOAT_DTYPES and k.dtype == dtype and v.dtype == dtype and q.dim() == 3 and k.dim() == k_dims):
        return False
    shape = k.shape
    _, hq, d = q.shape
    return v.shape == shape and d > 0 and shape[-1] == d and hq > 0 and shape[-2] > 0 and hq % shape[-2] == 0


def _index_fast(t, dtype: torch.dtype, dims: int) -> bool:
    """What :func:`_index_tensor` accepts."""
    return isinstance(t, torch.Tensor) and t.dtype == dtype and t.dim() == dims


def _scale_fast(scale) -> bool:
    """What :func:`_scale` accepts (NaN fails both comparisons)."""
    return isinstance(scale, float) and 0.0 < scale < math.inf


def _paged_fast(q, k_cache, v_cache, block_table, seq_lens, scale, cu_seqlens_q) -> bool:
    """What the shape checks of :func:`check_decode` (``cu_seqlens_q`` None: one query per sequence) and of
    :func:`check_paged_prefill` accept."""
    if not (_heads_fast(q, k_cache, v_cache, 4) and _index_fast(block_table, torch.int32, 2)
            and _index_fast(seq_lens, torch.int32, 1) and _scale_fast(scale)):
        return False
    device = q.device
    if cu_seqlens_q is None:
        batch = q.shape[0]
    elif _index_fast(cu_seqlens_q, torch.int32, 1) and cu_seqlens_q.shape[0] >= 2 and cu_seqlens_q.device == device:
        batch = cu_seqlens_q.shape[0] - 1
    else:
        return False
    cache = k_cache.shape
    return (cache[0] > 0 and cache[1] > 0 and block_table.shape[0] == batch
            and seq_lens.shape[0] == batch and k_cache.device == device and v_cache.device == device
            and block_table.device == device and seq_lens.device == device)


def _varlen_fast(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, q_positions) -> bool:
    """What the shape checks of :func:`check_varlen` accept."""
    if not (_heads_fast(q, k, v, 3) and _index_fast(cu_seqlens_q, torch.int32, 1)
            and _index_fast(cu_seqlens_k, torch.int32, 1) and _scale_fast(scale)):
        return False
    device = q.device
    if q_positions is not None and not (causal and isinstance(q_positions, torch.Tensor)
                                        and q_positions.dtype in C.INT_DTYPES and q_positions.shape == (q.shape[0],)
                                        and q_positions.device == device):
        return False
    cu = cu_seqlens_q.shape
    return (cu[0] >= 2 and cu_seqlens_k.shape == cu and k.device == device and v.device == device
            and cu_seqlens_q.device == device and cu_seqlens_k.device == device)


def _kv_cache_write_fast(k, v, k_cache, v_cache, slot_mapping) -> bool:
    """What the shape checks of :func:`check_kv_cache_write` accept."""
    if not (isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor) and isinstance(k_cache, torch.Tensor)
            and isinstance(v_cache, torch.Tensor) and _index_fast(slot_mapping, torch.int64, 1)):
        return False
    dtype, device, shape, cache = k.dtype, k.device, k.shape, k_cache.shape
    return (dtype in C.FLOAT_DTYPES and v.dtype == dtype and k_cache.dtype == dtype and v_cache.dtype == dtype
            and k.dim() == 3 and k_cache.dim() == 4 and v.shape == shape and v_cache.shape == cache
            and shape[1:] == cache[2:] and slot_mapping.shape[0] == shape[0] and v.device == device
            and k_cache.device == device and v_cache.device == device and slot_mapping.device == device)


def _index_tensor(t: torch.Tensor, op: str, name: str, dtype: torch.dtype, dims: int) -> None:
    C.require(isinstance(t, torch.Tensor), op, f"{name} must be a tensor, got {type(t).__name__}")
    C.require(t.dtype == dtype, op, f"{name} has dtype {t.dtype}; allowed: {str(dtype).replace('torch.', '')}")
    C.ndim(t, op, name, (dims,))


def _heads(op: str, q: torch.Tensor, k_name: str, k: torch.Tensor, v_name: str, v: torch.Tensor) -> None:
    C.float_tensor(q, op, "q")
    C.float_tensor(k, op, k_name)
    C.float_tensor(v, op, v_name)
    C.same_dtype(op, q=q, **{k_name: k, v_name: v})
    C.require(k.shape == v.shape, op, f"{k_name} shape {tuple(k.shape)} != {v_name} shape {tuple(v.shape)}")
    hq, d = q.shape[-2], q.shape[-1]
    hkv, dk = k.shape[-2], k.shape[-1]
    C.require(d > 0, op, f"head size must be > 0, got q shape {tuple(q.shape)}")
    C.require(dk == d, op, f"{k_name} head size {dk} != q head size {d}")
    C.require(hq > 0 and hkv > 0, op, f"head counts must be > 0; got Hq={hq}, Hkv={hkv}")
    C.require(hq % hkv == 0, op, f"Hq={hq} must be a multiple of Hkv={hkv} (GQA group size Hq // Hkv)")


def _scale(op: str, scale: float) -> None:
    C.require(isinstance(scale, float) and math.isfinite(scale) and scale > 0.0, op,
              f"scale must be a finite float > 0, got {scale!r}")


def _cu_seqlens(op: str, name: str, cu: torch.Tensor, total: int) -> list[int]:
    vals = cu.tolist()
    C.require(vals[0] == 0, op, f"{name}[0] must be 0, got {vals[0]}")
    C.require(all(a <= b for a, b in zip(vals, vals[1:])), op, f"{name} must be non-decreasing, got {vals}")
    C.require(vals[-1] == total, op, f"{name}[-1] must equal the number of tokens {total}, got {vals[-1]}")
    return vals


def check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, q_positions) -> None:
    op = "attention_varlen"
    if not _varlen_fast(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, q_positions):
        for name, t in (("q", q), ("k", k), ("v", v)):
            C.float_tensor(t, op, name)
            C.ndim(t, op, name, (3,))
        _heads(op, q, "k", k, "v", v)
        _index_tensor(cu_seqlens_q, op, "cu_seqlens_q", torch.int32, 1)
        _index_tensor(cu_seqlens_k, op, "cu_seqlens_k", torch.int32, 1)
        C.require(cu_seqlens_q.shape[0] >= 2, op,
                  f"cu_seqlens_q must have B + 1 >= 2 entries, got {cu_seqlens_q.shape[0]}")
        C.require(cu_seqlens_q.shape == cu_seqlens_k.shape, op,
                  f"cu_seqlens_q has {cu_seqlens_q.shape[0]} entries but cu_seqlens_k has {cu_seqlens_k.shape[0]}")
        _scale(op, scale)
        if q_positions is not None:
            C.require(causal, op, "q_positions is only meaningful with causal=True")
            C.int_tensor(q_positions, op, "q_positions")
            C.require(tuple(q_positions.shape) == (q.shape[0],), op,
                      f"q_positions must have shape ({q.shape[0]},), got {tuple(q_positions.shape)}")
        C.same_device(op, q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, q_positions=q_positions)
    if not _has_values(cu_seqlens_q, cu_seqlens_k, q_positions):
        return
    cq = _cu_seqlens(op, "cu_seqlens_q", cu_seqlens_q, q.shape[0])
    ck = _cu_seqlens(op, "cu_seqlens_k", cu_seqlens_k, k.shape[0])
    pos = q_positions.tolist() if q_positions is not None else None
    for b in range(len(cq) - 1):
        lq, lk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        if lq == 0:
            continue
        C.require(lk > 0, op, f"sequence {b} has {lq} queries but no keys (cu_seqlens_k gives Lk=0)")
        if pos is not None:
            seg = pos[cq[b] : cq[b + 1]]
            C.require(min(seg) >= 0 and max(seg) < lk, op,
                      f"q_positions of sequence {b} are in [{min(seg)}, {max(seg)}]; allowed: [0, {lk}) (Lk={lk})")
        elif causal:
            C.require(lq <= lk, op, f"sequence {b} has Lq={lq} > Lk={lk}; bottom-right aligned causal attention "
                      "needs Lq <= Lk (pass q_positions otherwise)")


def _paged(op: str, q, k_cache, v_cache, block_table, seq_lens, batch: int) -> None:
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        C.float_tensor(t, op, name)
        C.ndim(t, op, name, (4,))
    _heads(op, q, "k_cache", k_cache, "v_cache", v_cache)
    C.require(k_cache.shape[0] > 0 and k_cache.shape[1] > 0, op,
              f"caches must be [num_blocks > 0, page_size > 0, Hkv, D], got {tuple(k_cache.shape)}")
    _index_tensor(block_table, op, "block_table", torch.int32, 2)
    _index_tensor(seq_lens, op, "seq_lens", torch.int32, 1)
    C.require(block_table.shape[0] == batch and seq_lens.shape[0] == batch, op,
              f"block_table has {block_table.shape[0]} rows and seq_lens {seq_lens.shape[0]} entries; "
              f"both must equal the batch size {batch}")


def _paged_values(op: str, k_cache, block_table, seq_lens, min_len: list[int]) -> None:
    lens = seq_lens.tolist()
    page, num_blocks = k_cache.shape[1], k_cache.shape[0]
    capacity = block_table.shape[1] * page
    table = block_table.tolist()
    for b, n in enumerate(lens):
        C.require(n >= min_len[b], op, f"seq_lens[{b}] = {n}; allowed: >= {min_len[b]}")
        C.require(n <= capacity, op, f"seq_lens[{b}] = {n} exceeds the block-table capacity "
                  f"{block_table.shape[1]} pages x page_size {page} = {capacity}")
        used = table[b][: (n + page - 1) // page]
        bad = [e for e in used if not 0 <= e < num_blocks]
        C.require(not bad, op, f"block_table[{b}] has entries {bad[:4]} in its first {len(used)} pages; "
                  f"allowed: [0, {num_blocks}) (num_blocks)")


def check_paged_prefill(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, scale) -> None:
    op = "attention_paged_prefill"
    if not _paged_fast(q, k_cache, v_cache, block_table, seq_lens, scale, cu_seqlens_q):
        C.float_tensor(q, op, "q")
        C.ndim(q, op, "q", (3,))
        _index_tensor(cu_seqlens_q, op, "cu_seqlens_q", torch.int32, 1)
        C.require(cu_seqlens_q.shape[0] >= 2, op,
                  f"cu_seqlens_q must have B + 1 >= 2 entries, got {cu_seqlens_q.shape[0]}")
        _paged(op, q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q.shape[0] - 1)
        _scale(op, scale)
        C.same_device(op, q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table, cu_seqlens_q=cu_seqlens_q,
                      seq_lens=seq_lens)
    if not _has_values(block_table, cu_seqlens_q, seq_lens):
        return
    cq = _cu_seqlens(op, "cu_seqlens_q", cu_seqlens_q, q.shape[0])
    _paged_values(op, k_cache, block_table, seq_lens, [cq[b + 1] - cq[b] for b in range(len(cq) - 1)])


def check_decode(q, k_cache, v_cache, block_table, seq_lens, scale) -> None:
    op = "attention_decode"
    if not _paged_fast(q, k_cache, v_cache, block_table, seq_lens, scale, None):
        C.float_tensor(q, op, "q")
        C.ndim(q, op, "q", (3,))
        _paged(op, q, k_cache, v_cache, block_table, seq_lens, q.shape[0])
        _scale(op, scale)
        C.same_device(op, q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table, seq_lens=seq_lens)
    if _has_values(block_table, seq_lens):
        _paged_values(op, k_cache, block_table, seq_lens, [1] * q.shape[0])


def check_kv_cache_write(k, v, k_cache, v_cache, slot_mapping) -> None:
    op = "kv_cache_write"
    if not _kv_cache_write_fast(k, v, k_cache, v_cache, slot_mapping):
        for name, t in (("k", k), ("v", v)):
            C.float_tensor(t, op, name)
            C.ndim(t, op, name, (3,))
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            C.float_tensor(t, op, name)
            C.ndim(t, op, name, (4,))
        C.same_dtype(op, k=k, v=v, k_cache=k_cache, v_cache=v_cache)
        C.require(k.shape == v.shape, op, f"k shape {tuple(k.shape)} != v shape {tuple(v.shape)}")
        C.require(k_cache.shape == v_cache.shape, op,
                  f"k_cache shape {tuple(k_cache.shape)} != v_cache shape {tuple(v_cache.shape)}")
        C.require(tuple(k.shape[1:]) == tuple(k_cache.shape[2:]), op,
                  f"k is [T, Hkv, D] = {tuple(k.shape)} but the cache is [num_blocks, page_size, Hkv, D] = "
                  f"{tuple(k_cache.shape)}")
        _index_tensor(slot_mapping, op, "slot_mapping", torch.int64, 1)
        C.require(slot_mapping.shape[0] == k.shape[0], op,
                  f"slot_mapping has {slot_mapping.shape[0]} entries for {k.shape[0]} tokens")
        C.same_device(op, k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    if not _has_values(slot_mapping) or slot_mapping.numel() == 0:
        return
    n_slots = k_cache.shape[0] * k_cache.shape[1]
    C.in_range(slot_mapping, op, "slot_mapping", -1, n_slots)
    used = slot_mapping[slot_mapping >= 0]
    uniq = torch.unique(used)
    C.require(uniq.numel() == used.numel(), op,
              "slot_mapping has duplicate slots (the result would depend on write order); allowed: "
              "distinct slots in [0, num_blocks * page_size), or -1 to skip")
