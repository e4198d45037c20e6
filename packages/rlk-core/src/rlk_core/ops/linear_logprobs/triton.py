"""``linear_logprobs`` on the GPU (backend ``rlk.triton``, contract ``rlk.logp.v1``).

Forward: the vocab is walked group by group, each group in column chunks that start on its leaf
blocks (256-column multiples from the group start); a chunk's logits are
``torch.ops.rlk.linear(hidden, W[chunk])`` — the contract GEMM, whose elements do not depend on N
or the column offset — and its block partials come from the very kernel ``token_logprobs`` uses
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


def _partials_into(hidden, weight, target, temperature, vocab_start, vocab_size, m, s, zt) -> None:
    t = hidden.shape[0]
    for i, c0, c1, slot in _chunks(vocab_start, weight.shape[0], vocab_size, t, hidden.element_size()):
        logits = torch.ops.rlk.linear(hidden, weight[c0:c1], None)
        TT.block_partials_into(logits, temperature, target, m[:, i], s[:, i], zt, vocab_start + c0, slot)
        del logits


def linear_logp_partials(hidden, weight, target, temperature, vocab_start, vocab_size):
    target, temperature = target.contiguous(), temperature.contiguous()
    g0, g1 = L.shard_groups("linear_logp_partials", vocab_start, weight.shape[0], vocab_size)
    m, s, zt = TT.new_partials(hidden.shape[0], g1 - g0, vocab_size, hidden.device)
    _partials_into(hidden, weight, target, temperature, vocab_start, vocab_size, m, s, zt)
    gm, gs = TT.merge_blocks(m, s)
    return gm.contiguous(), gs.contiguous(), zt


def forward(hidden: torch.Tensor, weights: list[torch.Tensor], target: torch.Tensor, temperature: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    target, temperature = target.contiguous(), temperature.contiguous()
    vocab_size = sum(w.shape[0] for w in weights)
    m, s, zt = TT.new_partials(hidden.shape[0], L.num_groups(vocab_size), vocab_size, hidden.device)
    start, gi = 0, 0
    for w in weights:
        g0, g1 = L.shard_groups("linear_logprobs", start, w.shape[0], vocab_size)
        _partials_into(hidden, w, target, temperature, start, vocab_size, m[:, gi:gi + g1 - g0],
                       s[:, gi:gi + g1 - g0], zt)
        gi += g1 - g0
        start += w.shape[0]
    return TT.merge_logp_partials(*TT.merge_blocks(m, s), zt, vocab_size)


def backward(hidden: torch.Tensor, weights: list[torch.Tensor], target: torch.Tensor, temperature: torch.Tensor,
             lse: torch.Tensor, grad_logp: torch.Tensor, grad_lse: torch.Tensor
             ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    target, temperature, lse = target.contiguous(), temperature.contiguous(), lse.contiguous()
    g_logp, g_lse = grad_logp.float().contiguous(), grad_lse.float().contiguous()
    vocab_size = sum(w.shape[0] for w in weights)
    t, h = hidden.shape
    dh = torch.zeros((t, h), dtype=torch.float32, device=hidden.device)
    part = torch.empty_like(dh)
    # the dW products read dz and hidden as stored ([T, C], [T, H]: transposed views, the reduction over the tokens):
    # the linear backward's stored-layout kernels, no copy, no padding, no variant that depends on T
    dws, start = [], 0
    for w in weights:
        dw = torch.empty_like(w)
        for _, c0, c1, _ in _chunks(start, w.shape[0], vocab_size, t, hidden.element_size()):
            wc = w[c0:c1]
            dz = torch.ops.rlk.linear(hidden, wc, None)  # logits, overwritten by dz in place
            TT.grad_into(dz, dz, target, temperature, lse, g_logp, g_lse, start + c0)
            LT.linear_2d_into(dz, wc.t(), part)  # dz [T, C] @ W[chunk] [C, H], fp32 out
            dh += part
            LT.linear_2d_into(dz.t(), hidden.t(), dw[c0:c1])  # dz^T [C, T] @ hidden [T, H]
            del dz
        dws.append(dw)
        start += w.shape[0]
    return dh.to(hidden.dtype), dws


def supports(hidden, weights, target, temperature) -> tuple[bool, str]:
    if hidden.dtype not in LT.DTYPES:
        return False, f"dtype {hidden.dtype} has no rlk.triton GEMM configuration"
    return True, ""
