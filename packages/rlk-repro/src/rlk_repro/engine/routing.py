"""The routing diagnostic of an MoE model (issue 36): per round, how many tokens were sent to another set of experts
by the rollout engine than by the trainer.

Both sides record, for every token they run through the model (a sequence's prompt and its response but the last
token: the positions whose hidden states feed the compared log-probs), the ``k`` expert ids each layer's router
selected. A token's *expert set* at a layer is those ids as a set (slot order aside: the two sides may list the same
experts in another order — ``torch.topk`` promises none); the token **differs** where its set differs at any layer.
Under R/R the two sides' routers compute the same bits, so no token may differ; a P side (``torch.topk`` over a
softmax of logits from a batch-dependent GEMM) can send a token near a tie to another expert — the drift MoE users
look for next to the log-prob mismatches (slime / Miles, IsoExec).
"""

from __future__ import annotations

from typing import Any

import torch

from rlk_core.errors import RlkConfigError


def expert_sets(ids: torch.Tensor) -> torch.Tensor:
    """``ids [..., k]`` with each row's ids sorted ascending: equal rows <=> equal sets (a token meets an expert
    once per layer)."""
    return ids.sort(dim=-1).values


def routing_metrics(rollout: list[torch.Tensor], train: list[torch.Tensor]) -> dict[str, Any]:
    """The round's routing fields of ``metrics.jsonl`` from each sample's ``[tokens, layers, k]`` expert ids on the two
    sides (the same samples, in the same order):

    - ``routing_compared_tokens``: tokens whose routing both sides recorded;
    - ``routing_mismatch_tokens``: tokens whose expert set differs at one layer or more;
    - ``routing_mismatch_fraction``: their share of the compared tokens;
    - ``routing_mismatch_layer_tokens``: the (token, layer) pairs whose sets differ.
    """
    if len(rollout) != len(train):
        raise RlkConfigError(f"routing of {len(rollout)} rollout samples against {len(train)} trained samples")
    for i, (r, t) in enumerate(zip(rollout, train, strict=True)):
        if r.shape != t.shape:
            raise RlkConfigError(f"sample {i}: the rollout routed {tuple(r.shape)} (tokens, layers, k), the trainer "
                                 f"{tuple(t.shape)}")
    if not rollout:
        return {"routing_compared_tokens": 0, "routing_mismatch_tokens": 0, "routing_mismatch_fraction": 0.0,
                "routing_mismatch_layer_tokens": 0}
    roll = expert_sets(torch.cat([r.cpu() for r in rollout]))
    tr = expert_sets(torch.cat([t.cpu() for t in train]))
    per_layer = (roll != tr).any(dim=-1)  # [tokens, layers]
    tokens = int(per_layer.any(dim=-1).sum())
    n = roll.shape[0]
    return {"routing_compared_tokens": n, "routing_mismatch_tokens": tokens,
            "routing_mismatch_fraction": tokens / n if n else 0.0,
            "routing_mismatch_layer_tokens": int(per_layer.sum())}


def rollout_routing(requests: list[Any]) -> list[torch.Tensor]:
    """Each request's ``[tokens, layers, k]`` expert ids, its steps' rows in order (the rollout engine's
    ``Request.routing``)."""
    return [torch.cat(r.routing) for r in requests]
