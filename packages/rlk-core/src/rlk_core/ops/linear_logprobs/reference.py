"""Reference fused log-probs from hidden states — contract ``rlk.logp.v1`` without full logits.

The vocab is walked group by group, leaf block by leaf block (the blocks of
:mod:`rlk_core.ops._logp_tree`). Each block's logits are computed with the rlk GEMM arithmetic —
``rlk_core.ops.linear(hidden, weight[block])`` — the GEMM op itself, whichever backend it runs on
this device, so exactly the elements ``linear(hidden, weight)`` produces — then
``z = f32(logits) / f32(temperature)`` and the block partial
``(m, s)``. Block partials merge in the same trees as ``token_logprobs``, so
``linear_logprobs(h, W, y, t) == token_logprobs(linear(h, W), y, t)`` bit for bit, by construction.
Extra memory is O(T * 256) for logits plus the blocked GEMM's work chunk; never O(T * V).

Backward recomputes each block's logits and, in the same block order, accumulates
``dhidden += dz @ W[block]`` (fp32, fixed order) and writes ``dW[block] = dz^T @ hidden``, with
``dz = (g_logp * (onehot - p) + g_lse * p) / temperature``, ``p = exp(z - lse)``; the rounding of
the logits is treated as the identity. Deterministic run to run.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from rlk_core.ops import _logp_tree as L
from rlk_core.ops._fixed import matmul_nt
from rlk_core.ops.kept_set.reference import in_kept
from rlk_core.ops.token_logprobs.reference import Kept


def _blocks(vocab_start: int, width: int, vocab_size: int) -> Iterator[tuple[int, list[tuple[int, int]]]]:
    """``(group, [(lo, hi), ...])`` in column order for the groups of a shard; columns are local."""
    g0, g1 = L.shard_groups("linear_logprobs", vocab_start, width, vocab_size)
    bounds = L.group_bounds(vocab_size)
    for g in range(g0, g1):
        lo, hi = bounds[g] - vocab_start, bounds[g + 1] - vocab_start
        yield g, [(b, min(b + L.BLOCK, hi)) for b in range(lo, hi, L.BLOCK)]


def _block_z(hidden: torch.Tensor, weight: torch.Tensor, lo: int, hi: int, temperature: torch.Tensor,
             kept: Kept = None, col0: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """fp32 weight block, ``z`` of one leaf block (``-inf`` outside a kept set; global ids from ``col0``) and the
    kept mask. The block's logits come from the ``linear`` op itself (whichever backend it selects on this
    device), so they are exactly the elements ``linear(hidden, weight)`` produces: the GEMM contract makes each
    element independent of N."""
    logits = torch.ops.rlk.linear(hidden, weight[lo:hi], None)
    z = logits.float() / temperature[:, None]
    if kept is None:
        return weight[lo:hi].float(), z, None
    keep = in_kept(z, kept[0], kept[1], col0 + lo)
    return weight[lo:hi].float(), torch.where(keep, z, torch.full_like(z, L.NEG_INF)), keep


def linear_logp_partials_reference(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                   temperature: torch.Tensor, vocab_start: int, vocab_size: int, kept: Kept = None
                                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group partials ``(m, s)`` of the shard ``weight = W[vocab_start : vocab_start + Vl]`` and its
    ``z[target]`` (``-inf`` where the target lies elsewhere), as ``logp_partials`` would give for
    ``linear(hidden, weight)``."""
    t = hidden.shape[0]
    z_t = torch.full((t,), L.NEG_INF, dtype=torch.float32, device=hidden.device)
    gm, gs = [], []
    for _, blocks in _blocks(vocab_start, weight.shape[0], vocab_size):
        bm, bs = [], []
        for lo, hi in blocks:
            _, z, _ = _block_z(hidden, weight, lo, hi, temperature, kept, vocab_start)
            m, s = L.block_partials(L.pad_block(z))
            bm.append(m)
            bs.append(s)
            z_t = L.select_target(z, target, vocab_start + lo, z_t)
        m, s = L.group_partial_from_blocks(bm, bs, vocab_size)
        gm.append(m)
        gs.append(s)
    if gm:
        return torch.stack(gm, 1), torch.stack(gs, 1), z_t
    m, s = L.identity((t, 0), hidden)
    return m, s, z_t


def linear_logprobs_reference(hidden: torch.Tensor, weights: list[torch.Tensor], target: torch.Tensor,
                              temperature: torch.Tensor, kept: Kept = None) -> tuple[torch.Tensor, torch.Tensor]:
    vocab_size = sum(w.shape[0] for w in weights)
    ms, ss, z_t, start = [], [], None, 0
    for w in weights:
        m, s, zt = linear_logp_partials_reference(hidden, w, target, temperature, start, vocab_size, kept)
        ms.append(m)
        ss.append(s)
        z_t = zt if z_t is None else torch.maximum(z_t, zt)
        start += w.shape[0]
    return L.finish(*L.tree_merge_groups(torch.cat(ms, 1), torch.cat(ss, 1)), z_t)


def linear_logprobs_backward_reference(hidden: torch.Tensor, weights: list[torch.Tensor], target: torch.Tensor,
                                       temperature: torch.Tensor, lse: torch.Tensor, grad_logp: torch.Tensor,
                                       grad_lse: torch.Tensor, kept: Kept = None
                                       ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``(dhidden, [dW shard, ...])``: block by block in column order; dhidden accumulated in fp32 in
    that order (the same order for any whole-group sharding), each dW block reduced over T by the
    fixed tree, each rounded once to its input's dtype."""
    vocab_size = sum(w.shape[0] for w in weights)
    h32 = hidden.float()
    h32_t = h32.t().contiguous()
    dh = torch.zeros_like(h32)
    dws, start = [], 0
    for w in weights:
        dw = torch.empty_like(w)
        for _, blocks in _blocks(start, w.shape[0], vocab_size):
            for lo, hi in blocks:
                w32, z, keep = _block_z(hidden, w, lo, hi, temperature, kept, start)
                dz = L.grad_z(z, target, start + lo, temperature, lse, grad_logp, grad_lse, keep)
                dh = dh + matmul_nt(dz, w32.t().contiguous())
                dw[lo:hi] = matmul_nt(dz.t().contiguous(), h32_t).to(w.dtype)
        dws.append(dw)
        start += w.shape[0]
    return dh.to(hidden.dtype), dws


# -- contract rlk.logp.processed.v1: the same functions with a kept set (value, token_id) ------------------
def processed_linear_logprobs_reference(hidden, weights, target, temperature, kept_value, kept_id):
    return linear_logprobs_reference(hidden, weights, target, temperature, (kept_value, kept_id))


def processed_linear_logprobs_backward_reference(hidden, weights, target, temperature, kept_value, kept_id, lse,
                                                 grad_logp, grad_lse):
    return linear_logprobs_backward_reference(hidden, weights, target, temperature, lse, grad_logp, grad_lse,
                                              (kept_value, kept_id))


def processed_linear_logp_partials_reference(hidden, weight, target, temperature, kept_value, kept_id, vocab_start,
                                             vocab_size):
    return linear_logp_partials_reference(hidden, weight, target, temperature, vocab_start, vocab_size,
                                          (kept_value, kept_id))
