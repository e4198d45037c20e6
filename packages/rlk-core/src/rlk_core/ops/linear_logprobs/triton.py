"""``linear_logprobs`` on the GPU (backend ``rlk.triton``, contract ``rlk.logp.v1``).

Forward: the vocab is walked group by group, each group in column chunks that start on its leaf
blocks (256-column multiples from the group start); a chunk's logits are ``linear``'s own plan on
``(hidden, W[chunk])`` (:func:`rlk_core.ops.linear.triton.forward`) — the contract GEMM, whose elements do not
depend on N or the column offset — and its block partials come from the very kernel ``token_logprobs`` uses
(:mod:`rlk_core.ops.token_logprobs.triton`), written into the same ``[T, groups, P]`` buffer and
merged by the same code. So ``linear_logprobs(h, W) == token_logprobs(linear(h, W))`` bit for bit
by construction. Extra memory: one chunk of logits (at most ``CHUNK_BYTES``) plus the partials.

Backward: per chunk, logits recomputed, ``dz`` written over them in place in ``hidden.dtype`` (bf16 /
fp16 inputs: ``dz`` rounded to bf16 / fp16 for the tensor-core GEMMs; fp32 stays fp32),
``dhidden += dz @ W[chunk]`` (fp32 GEMM output, fp32 accumulation in column order), and
``dW[chunk] = dz^T @ hidden`` — all GEMMs through the rlk Triton GEMM kernel (no split-K, no
atomics), so backward is deterministic run to run.
"""

from __future__ import annotations

import torch

from rlk_core.ops import _logp_tree as L
from rlk_core.ops.linear import triton as LT
from rlk_core.ops.token_logprobs import triton as TT

CHUNK_BYTES = 1 << 28  # logits of one chunk: 256 MiB (T=8192 bf16: 16384 columns)


def chunk_cols(t: int, itemsize: int) -> int:
    """Columns per chunk: a multiple of the leaf block, at least one block. Depends on T only through
    memory; it never changes any element's arithmetic (GEMM elements and block partials are per row
    and per column)."""
    cols = CHUNK_BYTES // max(1, t * itemsize)
    return max(L.BLOCK, cols // L.BLOCK * L.BLOCK)


def _chunks(vocab_start: int, width: int, vocab_size: int, t: int, itemsize: int):
    """``(group index in shard, lo, hi, first slot)`` local column chunks in column order."""
    g0, g1 = L.shard_groups("linear_logprobs", vocab_start, width, vocab_size)
    bounds = L.group_bounds(vocab_size)
    max_blocks = chunk_cols(t, itemsize) // L.BLOCK
    for i, g in enumerate(range(g0, g1)):
        lo, hi = bounds[g] - vocab_start, bounds[g + 1] - vocab_start
        blocks = -(-(hi - lo) // L.BLOCK)
        n = -(-blocks // max_blocks)  # chunks of this group, of (nearly) equal width: no thin tail chunk
        step = -(-blocks // n) * L.BLOCK if blocks else L.BLOCK
        for c0 in range(lo, hi, step):
            yield i, c0, min(c0 + step, hi), (c0 - lo) // L.BLOCK


def _partials_into(p, hidden, weight, target, temperature, vocab_start, vocab_size, m, s, zt, kept=None) -> None:
    t = hidden.shape[0]
    for i, c0, c1, slot in _chunks(vocab_start, weight.shape[0], vocab_size, t, hidden.element_size()):
        logits = LT.forward(p, hidden, weight[c0:c1], None)
        TT.block_partials_into(p, logits, temperature, target, m[:, i], s[:, i], zt, vocab_start + c0, slot, kept)
        p.free(logits)
        del logits


def linear_logp_partials(p, hidden, weight, target, temperature, vocab_start, vocab_size, kept=None):
    target, temperature = p.contiguous(target), p.contiguous(temperature)
    kept = TT._contiguous_kept(p, kept)
    g0, g1 = L.shard_groups("linear_logp_partials", vocab_start, weight.shape[0], vocab_size)
    m, s, zt = TT.new_partials(p, hidden.shape[0], g1 - g0, vocab_size)
    _partials_into(p, hidden, weight, target, temperature, vocab_start, vocab_size, m, s, zt, kept)
    gm, gs = TT.merge_blocks(p, m, s)
    return gm, gs, zt


def forward(p, hidden: torch.Tensor, weights: list[torch.Tensor], target: torch.Tensor, temperature: torch.Tensor,
            kept=None) -> tuple[torch.Tensor, torch.Tensor]:
    target, temperature = p.contiguous(target), p.contiguous(temperature)
    kept = TT._contiguous_kept(p, kept)
    vocab_size = sum(w.shape[0] for w in weights)
    m, s, zt = TT.new_partials(p, hidden.shape[0], L.num_groups(vocab_size), vocab_size)
    start, gi = 0, 0
    for w in weights:
        g0, g1 = L.shard_groups("linear_logprobs", start, w.shape[0], vocab_size)
        _partials_into(p, hidden, w, target, temperature, start, vocab_size, m[:, gi:gi + g1 - g0],
                       s[:, gi:gi + g1 - g0], zt, kept)
        gi += g1 - g0
        start += w.shape[0]
    return TT.merge_logp_partials(p, *TT.merge_blocks(p, m, s), zt, vocab_size)


def backward(p, hidden: torch.Tensor, weights: list[torch.Tensor], target: torch.Tensor, temperature: torch.Tensor,
             lse: torch.Tensor, grad_logp: torch.Tensor, grad_lse: torch.Tensor, kept=None
             ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    target, temperature, lse = p.contiguous(target), p.contiguous(temperature), p.contiguous(lse)
    kept = TT._contiguous_kept(p, kept)
    g_logp, g_lse = p.contiguous(grad_logp, torch.float32), p.contiguous(grad_lse, torch.float32)
    vocab_size = sum(w.shape[0] for w in weights)
    t, h = hidden.shape
    dh = p.new((t, h), torch.float32, "zeros")
    part = p.new((t, h), torch.float32)
    # the dW products read dz and hidden as stored ([T, C], [T, H]: transposed views, the reduction over the tokens):
    # the linear backward's stored-layout kernels, no copy, no padding, no variant that depends on T
    dws, start = [], 0
    for w in weights:
        dw = p.new(w.shape, w.dtype)
        for _, c0, c1, _ in _chunks(start, w.shape[0], vocab_size, t, hidden.element_size()):
            wc = w[c0:c1]
            dz = LT.forward(p, hidden, wc, None)  # logits, overwritten by dz in place
            TT.grad_into(p, dz, dz, target, temperature, lse, g_logp, g_lse, start + c0, kept)
            LT.into(p, dz, wc.t(), None, part)  # dz [T, C] @ W[chunk] [C, H], fp32 out
            p.host(dh.add_, part)
            LT.into(p, dz.t(), hidden.t(), None, dw[c0:c1])  # dz^T [C, T] @ hidden [T, H]
            p.free(dz)
            del dz
        dws.append(dw)
        start += w.shape[0]
    return p.host(dh.to, hidden.dtype), dws


# -- contract rlk.logp.processed.v1: the same plans with a kept set ---------------------------------------
def processed_forward(p, hidden, weights, target, temperature, kept_value, kept_id):
    return forward(p, hidden, weights, target, temperature, (kept_value, kept_id))


def processed_backward(p, hidden, weights, target, temperature, kept_value, kept_id, lse, grad_logp, grad_lse):
    return backward(p, hidden, weights, target, temperature, lse, grad_logp, grad_lse, (kept_value, kept_id))


def processed_linear_logp_partials(p, hidden, weight, target, temperature, kept_value, kept_id, vocab_start,
                                   vocab_size):
    return linear_logp_partials(p, hidden, weight, target, temperature, vocab_start, vocab_size,
                                (kept_value, kept_id))


def supports_processed(hidden, weights, target, temperature, kept_value, kept_id) -> tuple[bool, str]:
    return supports(hidden, weights, target, temperature)


def supports_processed_partials(hidden, weight, target, temperature, kept_value, kept_id, vocab_start, vocab_size):
    return supports(hidden, [weight], target, temperature)


def supports_processed_backward(hidden, weights, target, temperature, kept_value, kept_id, lse, grad_logp,
                                grad_lse) -> tuple[bool, str]:
    return supports_backward(hidden, weights, target, temperature, lse, grad_logp, grad_lse)


def supports(hidden, weights, target, temperature) -> tuple[bool, str]:
    if hidden.dtype not in LT.DTYPES:
        return False, f"dtype {hidden.dtype} has no rlk.triton GEMM configuration"
    return True, ""


def supports_partials(hidden, weight, target, temperature, vocab_start, vocab_size) -> tuple[bool, str]:
    return supports(hidden, [weight], target, temperature)


def supports_backward(hidden, weights, target, temperature, lse, grad_logp, grad_lse) -> tuple[bool, str]:
    if hidden.shape[0] == 0:
        return False, "no tokens: nothing to launch"
    return supports(hidden, weights, target, temperature)


def build_calls(dtype: torch.dtype, sms: int):
    """The forward and the backward at a Qwen3 LM head (hidden 1024, vocabulary 151936) whole and split over 2 and
    8 shards, target ids int32 or int64, at a token count whose chunks start on every class of leaf slot (a
    multiple of 16, one, neither): the chunk GEMMs are ``linear``'s variants, the partials and merges
    ``token_logprobs``', the backward's ``dz @ W[chunk]`` the stored-layout kernel into an fp32 output."""
    vocab, h = 151936, 1024
    for tp in (1, 2, 8):
        w = torch.empty((vocab // tp, h), dtype=dtype, device="meta")
        for t in (17, 1 << 19):  # chunks of CHUNK_BYTES // (t * itemsize) columns: one a group / one leaf block each
            hidden = torch.empty((t, h), dtype=dtype, device="meta")
            f32 = torch.empty((t,), dtype=torch.float32, device="meta")
            for target_dtype in (torch.int32, torch.int64):
                target = torch.empty((t,), dtype=target_dtype, device="meta")
                yield forward, (hidden, [w] * tp, target, f32)
            yield backward, (hidden, [w] * tp, target, f32, f32, f32, f32)
            kid = torch.empty((t,), dtype=torch.int64, device="meta")
            yield processed_forward, (hidden, [w] * tp, target, f32, f32, kid)
            yield processed_backward, (hidden, [w] * tp, target, f32, f32, kid, f32, f32, f32)
