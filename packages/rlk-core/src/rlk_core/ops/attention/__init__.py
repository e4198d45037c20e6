"""Attention under contract ``rlk.attention.v1``: varlen prefill, chunked prefill over a paged KV
cache, paged decode, and writing K/V into the paged cache.

Contract ``rlk.attention.v1``: the output for a query at absolute position ``t`` of sequence ``b``
depends only on that query's ``q`` and the K/V of positions ``0..t`` of sequence ``b``. KV is
processed in fixed blocks of ``KV_BLOCK = 64`` positions anchored at position 0, in increasing order;
scores ``q . k`` are reduced over D in a fixed order in fp32 and multiplied by ``scale``; online
softmax in fp32 (running max ``m``, sum ``l``, accumulator ``acc``); ``p`` is rounded to ``v.dtype``
before ``p * v`` and ``l`` sums the unrounded fp32 ``p``; masked positions contribute exactly zero and
a block beyond a query's limit is not processed; ``out = acc / l`` rounded once to ``q.dtype``.
Prefill, chunked prefill and decode therefore give identical bits for the same token, for any page
size, block table, batch composition or context-parallel query sharding. The full formula is in
:mod:`rlk_core.ops.attention._core` and ``docs/ops/attention.md``.
"""

from __future__ import annotations

import torch

from rlk_core.backends import REGISTRY, Backend
from rlk_core.ops._backends import register_kernel_backends
from rlk_core.ops._dispatch import define
from rlk_core.ops.attention import _validate as V
from rlk_core.ops.attention._core import KV_BLOCK
from rlk_core.ops.attention.reference import (
    attention_decode_reference,
    attention_paged_prefill_reference,
    attention_varlen_backward_reference,
    attention_varlen_reference,
    kv_cache_write_reference,
)

__all__ = [
    "KV_BLOCK",
    "attention_decode",
    "attention_paged_prefill",
    "attention_varlen",
    "kv_cache_write",
]

Tensor = torch.Tensor


# -- varlen prefill (with autograd) ---------------------------------------------------------------
@define("attention_varlen")
def _attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                         scale: float, causal: bool, q_positions: Tensor | None) -> Tensor:
    V.check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, q_positions)


@_attention_varlen.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, q_positions):
    V.check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, q_positions)
    return torch.empty_like(q)


@define("attention_varlen_backward")
def _attention_varlen_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                                  cu_seqlens_k: Tensor, scale: float, causal: bool,
                                  q_positions: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    V.check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, q_positions)


@_attention_varlen_backward.register_fake
def _(grad_out, q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, q_positions):
    V.check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, q_positions)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _varlen_setup_context(ctx, inputs, output) -> None:
    q, k, v, cu_q, cu_k, scale, causal, q_positions = inputs
    ctx.save_for_backward(q, k, v, cu_q, cu_k, q_positions)
    ctx.scale, ctx.causal = scale, causal


def _varlen_backward(ctx, grad):
    q, k, v, cu_q, cu_k, q_positions = ctx.saved_tensors
    dq, dk, dv = _attention_varlen_backward(grad.contiguous(), q, k, v, cu_q, cu_k, ctx.scale, ctx.causal,
                      q_positions)
    return dq, dk, dv, None, None, None, None, None


_attention_varlen.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)


def attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, scale: float,
                     causal: bool = True, q_positions: Tensor | None = None) -> Tensor:
    """Attention over packed variable-length sequences (contract ``rlk.attention.v1``).

    Parameters
    ----------
    q : Tensor ``[T, Hq, D]``, float32 / bfloat16 / float16 — queries of all sequences, packed.
    k, v : Tensor ``[Tk, Hkv, D]``, dtype and device of ``q``; ``Hq % Hkv == 0`` (GQA: query head
        ``h`` uses KV head ``h // (Hq // Hkv)``).
    cu_seqlens_q, cu_seqlens_k : Tensor ``[B + 1]`` int32 — offsets of each sequence's queries and keys
        (``0, ..., T`` and ``0, ..., Tk``). Keys of sequence ``b`` are its positions ``0 .. Lk_b - 1``.
    scale : float > 0 — multiplies ``q . k`` (usually ``D ** -0.5``), used as fp32.
    causal : bool — if False every query of sequence ``b`` sees all ``Lk_b`` keys.
    q_positions : Tensor ``[T]`` int32/int64, optional (causal only) — absolute position ``t`` of each
        query inside its sequence, ``0 <= t < Lk_b``; any order, e.g. a zigzag context-parallel shard
        with all-gathered K/V. Default: bottom-right aligned, ``t = Lk_b - Lq_b + i`` for the ``i``-th
        query, so a chunk's queries continue a cached prefix.

    Returns
    -------
    Tensor ``[T, Hq, D]``, dtype of ``q``: ``softmax(q k^T * scale, keys 0..t) v`` per query and head.

    Contract ``rlk.attention.v1``: the output for a query at position ``t`` of sequence ``b`` depends
    only on that query's ``q`` and the K/V of positions ``0..t`` of sequence ``b`` — not on the other
    sequences, the other queries, ``Lk_b`` beyond ``t``, or how the queries are chunked or sharded.
    KV in fixed blocks of 64 positions anchored at position 0, increasing order; ``q . k`` reduced over
    D by the fixed pairwise-halves tree in fp32, times ``scale``; online softmax in fp32; ``p``
    rounded to ``v.dtype`` before ``p * v`` (``l`` sums the fp32 ``p``); masked positions contribute
    exactly 0; ``acc / l`` rounded once to ``q.dtype``. Bitwise equal to
    :func:`attention_paged_prefill` and :func:`attention_decode` for the same token.

    Backward (dq, dk, dv) is the flash-style recomputation in fp32 with every reduction in a fixed
    tree (no atomics): deterministic run to run.
    """
    return _attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, float(scale), bool(causal),
                                          q_positions)


# -- chunked prefill over a paged KV cache ---------------------------------------------------------
@define("attention_paged_prefill")
def _attention_paged_prefill(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor,
                                cu_seqlens_q: Tensor, seq_lens: Tensor, scale: float) -> Tensor:
    V.check_paged_prefill(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, scale)


@_attention_paged_prefill.register_fake
def _(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, scale):
    V.check_paged_prefill(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, scale)
    return torch.empty_like(q)


def attention_paged_prefill(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, cu_seqlens_q: Tensor,
                            seq_lens: Tensor, scale: float) -> Tensor:
    """Chunked prefill against a paged KV cache (contract ``rlk.attention.v1``).

    Parameters
    ----------
    q : Tensor ``[T, Hq, D]``, float32 / bfloat16 / float16 — the new tokens of all sequences, packed.
    k_cache, v_cache : Tensor ``[num_blocks, page_size, Hkv, D]``, dtype of ``q``, any strides (vLLM
        hands non-contiguous views, see ``docs/ops/attention.md``); any page size.
    block_table : Tensor ``[B, max_pages]`` int32 — page ``j`` of sequence ``b`` holds positions
        ``j * page_size .. (j + 1) * page_size - 1``.
    cu_seqlens_q : Tensor ``[B + 1]`` int32 — offsets of each sequence's new tokens in ``q``.
    seq_lens : Tensor ``[B]`` int32 — total length of each sequence *including* the new tokens, whose
        K/V are already in the cache; the ``Lq_b`` new tokens are positions
        ``seq_lens[b] - Lq_b .. seq_lens[b] - 1``.
    scale : float > 0.

    Returns
    -------
    Tensor ``[T, Hq, D]``, dtype of ``q``; causal over the cached prefix and the chunk.

    Contract ``rlk.attention.v1``: a query at position ``t`` depends only on its ``q`` and the K/V of
    positions ``0..t`` of its own sequence; the arithmetic is that of :func:`attention_varlen`, so the
    result is bitwise equal to a full prefill, any other chunking, and :func:`attention_decode`, for
    any page size and block table.
    """
    return _attention_paged_prefill(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens,
                                                 float(scale))


# -- decode over a paged KV cache ------------------------------------------------------------------
@define("attention_decode")
def _attention_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
                         scale: float) -> Tensor:
    V.check_decode(q, k_cache, v_cache, block_table, seq_lens, scale)


@_attention_decode.register_fake
def _(q, k_cache, v_cache, block_table, seq_lens, scale):
    V.check_decode(q, k_cache, v_cache, block_table, seq_lens, scale)
    return torch.empty_like(q)


def attention_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
                     scale: float) -> Tensor:
    """Single-token decode against a paged KV cache (contract ``rlk.attention.v1``).

    Parameters
    ----------
    q : Tensor ``[B, Hq, D]``, float32 / bfloat16 / float16 — one new token per sequence, at position
        ``seq_lens[b] - 1``; its K/V are already in the cache.
    k_cache, v_cache : Tensor ``[num_blocks, page_size, Hkv, D]``, dtype of ``q``, any strides.
    block_table : Tensor ``[B, max_pages]`` int32.
    seq_lens : Tensor ``[B]`` int32, ``1 <= seq_lens[b] <= max_pages * page_size``.
    scale : float > 0.

    Returns
    -------
    Tensor ``[B, Hq, D]``, dtype of ``q``.

    Contract ``rlk.attention.v1``: row ``b`` depends only on ``q[b]`` and the K/V of positions
    ``0..seq_lens[b] - 1`` of sequence ``b`` — not on the batch, the page size or the block table; the
    arithmetic (fixed 64-position KV blocks from position 0, fp32 online softmax, the same conversion
    points) is that of :func:`attention_varlen`, so decode at position ``t`` is bitwise equal to the
    prefill output at ``t``. No split of the KV length that depends on the batch.
    """
    return _attention_decode(q, k_cache, v_cache, block_table, seq_lens, float(scale))


# -- writing K/V into the paged cache --------------------------------------------------------------
@define("kv_cache_write", mutates_args=("k_cache", "v_cache"))
def _kv_cache_write(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    V.check_kv_cache_write(k, v, k_cache, v_cache, slot_mapping)


@_kv_cache_write.register_fake
def _(k, v, k_cache, v_cache, slot_mapping):
    V.check_kv_cache_write(k, v, k_cache, v_cache, slot_mapping)


def kv_cache_write(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Write new tokens' K/V into a paged cache, in place (contract ``rlk.attention.v1``: exact data movement).

    Parameters
    ----------
    k, v : Tensor ``[T, Hkv, D]``, dtype of the cache.
    k_cache, v_cache : Tensor ``[num_blocks, page_size, Hkv, D]``, any strides (e.g. vLLM's
        non-contiguous views into one ``[num_blocks, page_size, Hkv, 2 D]`` buffer); mutated.
    slot_mapping : Tensor ``[T]`` int64 — ``slot = page_index * page_size + offset``; ``-1`` skips the
        token (vLLM's padding convention). Slots other than ``-1`` must be distinct.

    Returns
    -------
    None. ``k_cache[slot // page_size, slot % page_size] = k[i]`` (and ``v``) for every ``slot >= 0``;
    nothing else in the caches (or their underlying buffer) changes.
    """
    _kv_cache_write(k, v, k_cache, v_cache, slot_mapping)


for _op, _fn in (("attention_varlen", attention_varlen_reference),
                 ("attention_paged_prefill", attention_paged_prefill_reference),
                 ("attention_decode", attention_decode_reference),
                 ("kv_cache_write", kv_cache_write_reference),
                 ("attention_varlen_backward", attention_varlen_backward_reference)):
    REGISTRY.register(Backend("rlk.reference", _op, _fn, devices=("cpu", "cuda"), builtin=True))

M, B = "rlk_core.ops.attention.triton", "rlk_core.ops.attention.triton_backward"
register_kernel_backends("attention_varlen", f"{M}:attention_varlen", f"{M}:supports_varlen")
register_kernel_backends("attention_paged_prefill", f"{M}:attention_paged_prefill", f"{M}:supports_paged_prefill")
register_kernel_backends("attention_decode", f"{M}:attention_decode", f"{M}:supports_decode")
register_kernel_backends("kv_cache_write", f"{M}:kv_cache_write", f"{M}:supports_kv_cache_write")
register_kernel_backends("attention_varlen_backward", f"{B}:attention_varlen_backward", f"{B}:supports_backward")
