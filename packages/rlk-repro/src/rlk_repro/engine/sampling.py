"""Per-request seeded sampling with temperature, top-k and top-p.

The token is drawn from the filtered, temperature-scaled distribution; the log-prob the engine records
is computed separately (by the ``logp`` module's op) under the temperature-scaled *unfiltered*
distribution, which is what the trainer recomputes. Each draw uses its own generator seeded from
(run seed, request id, token index), so a request's samples do not depend on the batch it ran in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlk_core.errors import RlkConfigError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    max_new_tokens: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise RlkConfigError(f"temperature must be > 0 (log-probs are of softmax(logits / T)), "
                                 f"got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise RlkConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise RlkConfigError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise RlkConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


def draw_seed(seed: int, request_id: int, index: int) -> int:
    return (seed * 1_000_003 + request_id * 10_007 + index * 7919 + 12345) % (1 << 62)


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token from ``logits`` ``[V]``: temperature, top-k, top-p, then an exponential-race draw."""
    x = logits.float() / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        drop = (torch.cumsum(probs, dim=-1) - probs) > params.top_p  # keep the smallest prefix reaching top_p
        x = x.scatter(0, order, sorted_x.masked_fill(drop, float("-inf")))
    probs = torch.softmax(x, dim=-1)
    race = torch.empty_like(probs).exponential_(generator=generator)
    return int(torch.argmax(probs / race))
