"""Reference entropy — the specification of contract ``rlk.entropy.v1`` (``docs/ops/entropy.md``).

Per row, ``z = f32(logits) / f32(T)`` with ``-inf`` at the columns outside the kept set ``K`` (the threshold
``(value, token_id)`` of contract ``rlk.logp.processed.v1``; ``(-inf, V - 1)`` keeps the whole vocabulary);
``lse`` the log-sum-exp of ``rlk.logp.v1``'s block tree over ``z``; per column ``h_v = p_v * (lse - z_v)`` with
``p_v = exp(z_v - lse)`` on ``K`` and ``h_v = 0`` outside it; ``H = sum h_v`` in the same fixed structure as
the log-sum-exp: 8 groups of ``ceil(V/8)`` columns, leaf blocks of 256 anchored at each group start summed by
``tree_sum``, the group's block sums by pairwise halves (padded with zeros to a power of two), the 8 group sums
by ``((g0+g1)+(g2+g3))+((g4+g5)+(g6+g7))``. Only elementwise fp32 operations, maxima and those fixed sums:
batch-invariant and run-to-run deterministic by construction, the same bits for any vocab sharding (the shards
are concatenated in rank order first; the tree is over global columns).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlk_core.ops import _logp_tree as L
from rlk_core.ops._fixed import tree_sum
from rlk_core.ops.kept_set.reference import in_kept


def _kept_z(shards: list[torch.Tensor], temperature: torch.Tensor, kept_value: torch.Tensor,
            kept_id: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(z with -inf outside K, the mask of K's finite columns)``, ``[T, V]`` over the concatenated shards."""
    z = torch.cat([x.float() for x in shards], 1) / temperature[:, None]
    keep = in_kept(z, kept_value, kept_id, 0) & (z != L.NEG_INF)  # a -inf logit (vocab padding) has p = 0
    return torch.where(keep, z, torch.full_like(z, L.NEG_INF)), keep


def _lse(z: torch.Tensor) -> torch.Tensor:
    vocab = z.shape[1]
    bounds = L.group_bounds(vocab)
    ms, ss = [], []
    for g in range(L.num_groups(vocab)):
        m, s = L.group_partial(z[:, bounds[g]:bounds[g + 1]], vocab)
        ms.append(m)
        ss.append(s)
    m, s = L.tree_merge_groups(torch.stack(ms, 1), torch.stack(ss, 1))
    return m + torch.log(s)


def tree_sum_vocab(h: torch.Tensor) -> torch.Tensor:
    """``[T, V]`` fp32 -> ``[T]``: the fixed group / block / pairwise structure of the module docstring."""
    t, vocab = h.shape
    bounds = L.group_bounds(vocab)
    p = L.padded_blocks(vocab)
    sums = []
    for g in range(L.num_groups(vocab)):
        hg = h[:, bounds[g]:bounds[g + 1]]
        hp = F.pad(hg, (0, p * L.BLOCK - hg.shape[1])).view(t, p, L.BLOCK)
        sums.append(tree_sum(tree_sum(hp)))  # leaf blocks, then the group's blocks (p is a power of two)
    g8 = torch.stack(sums, 1)
    if g8.shape[1] < L.GROUPS:
        g8 = F.pad(g8, (0, L.GROUPS - g8.shape[1]))
    while g8.shape[1] > 1:  # adjacent pairs, as the log-prob op's group merge
        g8 = g8[:, 0::2] + g8[:, 1::2]
    return g8[:, 0]


def entropy_reference(shards: list[torch.Tensor], temperature: torch.Tensor, kept_value: torch.Tensor,
                      kept_id: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(entropy, lse)`` fp32 ``[T]`` of ``softmax(z)`` restricted to the kept set."""
    z, keep = _kept_z(shards, temperature, kept_value, kept_id)
    lse = _lse(z)
    d = lse[:, None] - z
    h = torch.where(keep, torch.exp(-d) * d, torch.zeros_like(z))
    return tree_sum_vocab(h), lse


def entropy_backward_reference(shards: list[torch.Tensor], temperature: torch.Tensor, kept_value: torch.Tensor,
                               kept_id: torch.Tensor, entropy: torch.Tensor, lse: torch.Tensor,
                               grad_entropy: torch.Tensor, grad_lse: torch.Tensor) -> list[torch.Tensor]:
    """``dL/dlogits`` per shard: ``(g_H * (-p * ((z - lse) + H)) + g_lse * p) / T`` on ``K``, 0 outside it;
    elementwise in fp32, rounded once to the logits dtype."""
    z, keep = _kept_z(shards, temperature, kept_value, kept_id)
    logp = z - lse[:, None]
    p = torch.exp(logp)
    g = (grad_entropy[:, None] * (-p * (logp + entropy[:, None])) + grad_lse[:, None] * p) / temperature[:, None]
    g = torch.where(keep, g, torch.zeros_like(g))
    out, start = [], 0
    for x in shards:
        out.append(g[:, start:start + x.shape[1]].to(x.dtype))
        start += x.shape[1]
    return out
