"""Reference token log-probs — the specification of contract ``rlk.logp.v1`` (unfused form).

``z = f32(logits) / f32(temperature)`` (one IEEE fp32 division per element, per-row temperature);
``lse`` = the fixed vocab-block tree of :mod:`rlk_core.ops._logp_tree` (8 groups of ``ceil(V/8)``
columns, leaf blocks of 256 anchored at each group start, pairwise halves inside a group,
``((g0+g1)+(g2+g3))+((g4+g5)+(g6+g7))`` across groups); ``logp = z[target] - lse``.

Logits may be given as contiguous vocab shards (rank order); each shard yields the partials of the
groups it holds, the gathered partials merge in the same tree, so 1, 2, 4 or 8 shards give the same
bits. Nothing depends on other rows.
"""

from __future__ import annotations

import torch

from rlk_core.ops import _logp_tree as L
from rlk_core.ops.kept_set.reference import in_kept, mask_outside

Kept = tuple[torch.Tensor, torch.Tensor] | None  # (value [T], token_id [T]) of contract rlk.logp.processed.v1


def tempered_z(logits: torch.Tensor, temperature: torch.Tensor, kept: Kept, col_start: int) -> torch.Tensor:
    """``z = f32(logits) / f32(T)``; with a kept set, ``-inf`` at the columns outside it."""
    z = logits.float() / temperature[:, None]
    return z if kept is None else mask_outside(z, kept[0], kept[1], col_start)


def logp_partials_reference(logits: torch.Tensor, target: torch.Tensor, temperature: torch.Tensor,
                            vocab_start: int, vocab_size: int, kept: Kept = None
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group partials ``(m, s)`` ``[T, g1 - g0]`` of the shard's groups, and ``z[target]`` (``-inf``
    where the target lies outside this shard, or outside the kept set)."""
    g0, g1 = L.shard_groups("logp_partials", vocab_start, logits.shape[1], vocab_size)
    bounds = L.group_bounds(vocab_size)
    z = tempered_z(logits, temperature, kept, vocab_start)
    ms, ss = [], []
    for g in range(g0, g1):
        m, s = L.group_partial(z[:, bounds[g] - vocab_start : bounds[g + 1] - vocab_start], vocab_size)
        ms.append(m)
        ss.append(s)
    t = logits.shape[0]
    if ms:
        m, s = torch.stack(ms, 1), torch.stack(ss, 1)
    else:
        m, s = L.identity((t, 0), logits)
    return m, s, L.select_target(z, target, vocab_start)


def merge_logp_partials_reference(m: torch.Tensor, s: torch.Tensor, z_target: torch.Tensor, vocab_size: int
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Gathered group partials ``[T, num_groups(V)]`` (rank order) -> ``(logp, lse)``."""
    return L.finish(*L.tree_merge_groups(m, s), z_target)


def token_logprobs_reference(shards: list[torch.Tensor], target: torch.Tensor, temperature: torch.Tensor,
                             kept: Kept = None) -> tuple[torch.Tensor, torch.Tensor]:
    vocab_size = sum(x.shape[1] for x in shards)
    ms, ss, z_t, start = [], [], None, 0
    for x in shards:
        m, s, zt = logp_partials_reference(x, target, temperature, start, vocab_size, kept)
        ms.append(m)
        ss.append(s)
        # the owner's z[target] and -inf elsewhere: a max is exact (an all-reduce MAX across ranks)
        z_t = zt if z_t is None else torch.maximum(z_t, zt)
        start += x.shape[1]
    return merge_logp_partials_reference(torch.cat(ms, 1), torch.cat(ss, 1), z_t, vocab_size)


def token_logprobs_backward_reference(shards: list[torch.Tensor], target: torch.Tensor,
                                      temperature: torch.Tensor, lse: torch.Tensor, grad_logp: torch.Tensor,
                                      grad_lse: torch.Tensor, kept: Kept = None) -> list[torch.Tensor]:
    """``dL/dlogits`` per shard, elementwise in fp32, rounded once to the logits dtype (0 outside a kept set)."""
    out, start = [], 0
    for x in shards:
        z = x.float() / temperature[:, None]
        keep = None if kept is None else in_kept(z, kept[0], kept[1], start)
        if keep is not None:
            z = torch.where(keep, z, torch.full_like(z, L.NEG_INF))
        out.append(L.grad_z(z, target, start, temperature, lse, grad_logp, grad_lse, keep).to(x.dtype))
        start += x.shape[1]
    return out


# -- contract rlk.logp.processed.v1: the same functions with a kept set (value, token_id) ------------------
def processed_token_logprobs_reference(shards, target, temperature, kept_value, kept_id):
    return token_logprobs_reference(shards, target, temperature, (kept_value, kept_id))


def processed_token_logprobs_backward_reference(shards, target, temperature, kept_value, kept_id, lse, grad_logp,
                                                grad_lse):
    return token_logprobs_backward_reference(shards, target, temperature, lse, grad_logp, grad_lse,
                                             (kept_value, kept_id))


def processed_logp_partials_reference(logits, target, temperature, kept_value, kept_id, vocab_start, vocab_size):
    return logp_partials_reference(logits, target, temperature, vocab_start, vocab_size, (kept_value, kept_id))
