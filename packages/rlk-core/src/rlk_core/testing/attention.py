"""Attention checks users can run on their own hardware, and input builders for paged KV caches.

``check_prefill_chunked_decode`` and ``check_cp_sharding`` return ``(ok, detail)`` and never assert
(like :mod:`rlk_core.testing.invariance`). The ops default to ``rlk_core.ops.attention``'s public
functions (whatever backend the registry selects on the device); pass other callables with the same
signatures to check a candidate implementation.

``vllm_kv_cache`` builds the cache exactly as vLLM 0.33 hands it to an attention backend (and 0.22
with rlk's layout shim): one buffer, physical order ``[num_blocks, page_size, Hkv, 2 D]``, logical
``(num_blocks, Hkv, page_size, 2 D)``, then ``k_cache, v_cache = kv.transpose(1, 2).split(D, -1)`` —
two **non-contiguous** ``[num_blocks, page_size, Hkv, D]`` views.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from rlk_core.testing.compare import bitwise_diff_report


def _ops():
    from rlk_core.ops import attention

    return attention


def vllm_kv_cache(num_blocks: int, page_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype,
                  device: torch.device | str = "cpu", fill: float = float("nan")) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k_cache, v_cache)`` as non-contiguous views of one vLLM-layout buffer filled with ``fill``
    (NaN by default, so a kernel that reads a slot it must not read shows up)."""
    raw = torch.full((num_blocks, page_size, num_kv_heads, 2 * head_size), fill, dtype=dtype, device=device)
    kv = raw.permute(0, 2, 1, 3)  # logical (num_blocks, Hkv, page_size, 2D), physical [B, N, H, C]
    k_cache, v_cache = kv.transpose(1, 2).split(head_size, dim=-1)
    return k_cache, v_cache


@dataclass
class PagedKV:
    """A paged KV cache holding whole sequences: caches, ``block_table [B, max_pages]`` int32 and
    ``seq_lens [B]`` int32; ``slot_mapping`` lists every written token's slot (sequence order)."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    slot_mapping: torch.Tensor


def build_paged_kv(k_seqs: Sequence[torch.Tensor], v_seqs: Sequence[torch.Tensor], page_size: int, *,
                   generator: torch.Generator | None = None, spare_pages: int = 3, spare_table_cols: int = 1,
                   pad_entry: int = 0, fill: float = float("nan"),
                   write: Callable[..., None] | None = None) -> PagedKV:
    """Put each sequence's K/V (``[L_b, Hkv, D]``) into a fresh :func:`vllm_kv_cache` through
    ``kv_cache_write``, on pages drawn in a random (shuffled) order from a pool with ``spare_pages``
    unused pages; block-table entries past a sequence's pages are ``pad_entry``."""
    write = write or _ops().kv_cache_write
    k0 = k_seqs[0]
    lens = [int(k.shape[0]) for k in k_seqs]
    pages = [(n + page_size - 1) // page_size for n in lens]
    num_blocks = sum(pages) + spare_pages
    k_cache, v_cache = vllm_kv_cache(num_blocks, page_size, k0.shape[1], k0.shape[2], k0.dtype, k0.device, fill)
    perm = torch.randperm(num_blocks, generator=generator).tolist()
    max_pages = max(pages, default=0) + spare_table_cols
    table = torch.full((len(k_seqs), max_pages), pad_entry, dtype=torch.int32)
    slots = []
    used = 0
    for b, n in enumerate(lens):
        mine = perm[used : used + pages[b]]
        used += pages[b]
        table[b, : pages[b]] = torch.tensor(mine, dtype=torch.int32)
        pos = torch.arange(n)
        slots.append(torch.tensor(mine, dtype=torch.int64)[pos // page_size] * page_size + pos % page_size
                     if n else torch.zeros(0, dtype=torch.int64))
    slot_mapping = torch.cat(slots) if slots else torch.zeros(0, dtype=torch.int64)
    if slot_mapping.numel():
        write(torch.cat(list(k_seqs)), torch.cat(list(v_seqs)), k_cache, v_cache, slot_mapping.to(k0.device))
    return PagedKV(k_cache, v_cache, table.to(k0.device), torch.tensor(lens, dtype=torch.int32, device=k0.device),
                   slot_mapping.to(k0.device))


def cu_seqlens(lengths: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """``[0, l0, l0 + l1, ...]`` as int32."""
    out = [0]
    for n in lengths:
        out.append(out[-1] + int(n))
    return torch.tensor(out, dtype=torch.int32, device=device)


def random_chunking(length: int, generator: torch.Generator | None = None, max_chunk: int = 100) -> list[int]:
    """Random chunk sizes (each >= 1) summing to ``length``."""
    sizes, left = [], length
    while left:
        c = min(left, int(torch.randint(1, max_chunk + 1, (1,), generator=generator)))
        sizes.append(c)
        left -= c
    return sizes


def uniform_chunking(length: int, chunk: int) -> list[int]:
    return [min(chunk, length - s) for s in range(0, length, chunk)]


def zigzag_positions(length: int, cp_size: int, rank: int) -> torch.Tensor:
    """Query positions a context-parallel rank owns under the zigzag split (Megatron-style load balance):
    the sequence is cut into ``2 * cp_size`` nearly equal chunks; rank ``r`` owns chunks ``r`` and
    ``2 * cp_size - 1 - r``."""
    bounds = [length * i // (2 * cp_size) for i in range(2 * cp_size + 1)]
    mine = (rank, 2 * cp_size - 1 - rank)
    return torch.cat([torch.arange(bounds[c], bounds[c + 1]) for c in mine])


def _compare(actual: torch.Tensor, expected: torch.Tensor, what: str) -> str | None:
    return bitwise_diff_report(actual, expected, what)


def check_prefill_chunked_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *,
    page_sizes: Sequence[int] = (1, 16, 64), chunk_sizes: Sequence[int] = (13, 64),
    random_chunkings: int = 1, generator: torch.Generator | None = None,
    varlen: Callable[..., torch.Tensor] | None = None, paged_prefill: Callable[..., torch.Tensor] | None = None,
    decode: Callable[..., torch.Tensor] | None = None,
) -> tuple[bool, str]:
    """One sequence ``q [L, Hq, D]``, ``k, v [L, Hkv, D]``: the full causal prefill must equal, bit for
    bit, (a) varlen chunked prefill (each chunk against the prefix K/V), and for every page size with a
    shuffled block table in a non-contiguous vLLM-layout cache, (b) paged chunked prefill for every
    chunking (uniform ``chunk_sizes`` plus ``random_chunkings`` random ones) and (c) decode at every
    position (one batch of ``L`` rows, row ``t`` with ``seq_len = t + 1``)."""
    ops = _ops()
    varlen = varlen or ops.attention_varlen
    paged_prefill = paged_prefill or ops.attention_paged_prefill
    decode = decode or ops.attention_decode
    length = q.shape[0]
    dev = q.device
    full = varlen(q, k, v, cu_seqlens([length], dev), cu_seqlens([length], dev), scale)
    chunkings = [uniform_chunking(length, c) for c in chunk_sizes]
    chunkings += [random_chunking(length, generator) for _ in range(random_chunkings)]
    for sizes in chunkings:
        s = 0
        for c in sizes:
            e = s + c
            out = varlen(q[s:e], k[:e], v[:e], cu_seqlens([c], dev), cu_seqlens([e], dev), scale)
            report = _compare(out, full[s:e], f"varlen chunk [{s}, {e}) of chunking {sizes[:6]}... vs prefill")
            if report:
                return False, report
            s = e
    for page in page_sizes:
        cache = build_paged_kv([k], [v], page, generator=generator)
        for sizes in chunkings:
            s = 0
            for c in sizes:
                e = s + c
                seq = torch.tensor([e], dtype=torch.int32, device=dev)
                out = paged_prefill(q[s:e], cache.k_cache, cache.v_cache, cache.block_table, cu_seqlens([c], dev),
                                    seq, scale)
                report = _compare(out, full[s:e], f"page {page}: paged chunk [{s}, {e}) vs prefill")
                if report:
                    return False, report
                s = e
        table = cache.block_table.expand(length, -1).contiguous()
        lens = torch.arange(1, length + 1, dtype=torch.int32, device=dev)
        out = decode(q, cache.k_cache, cache.v_cache, table, lens, scale)
        report = _compare(out, full, f"page {page}: decode at every position vs prefill")
        if report:
            return False, report
    return True, (f"L={length}: prefill == varlen/paged chunked prefill ({len(chunkings)} chunkings) == decode at "
                  f"every position, page sizes {list(page_sizes)}")


def check_cp_sharding(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *,
                      cp_sizes: Sequence[int] = (2, 4), varlen: Callable[..., torch.Tensor] | None = None
                      ) -> tuple[bool, str]:
    """Context-parallel sharding changes nothing: each zigzag shard's queries, with all K/V and their
    ``q_positions``, equal the same rows of the unsharded causal prefill."""
    varlen = varlen or _ops().attention_varlen
    length, dev = q.shape[0], q.device
    cu = cu_seqlens([length], dev)
    full = varlen(q, k, v, cu, cu, scale)
    for cp in cp_sizes:
        for rank in range(cp):
            pos = zigzag_positions(length, cp, rank).to(dev)
            out = varlen(q[pos], k, v, cu_seqlens([pos.numel()], dev), cu, scale, True, pos)
            report = _compare(out, full[pos], f"cp={cp} rank {rank} (zigzag) vs unsharded")
            if report:
                return False, report
    return True, f"L={length}: zigzag shards for cp sizes {list(cp_sizes)} equal the unsharded pass"
