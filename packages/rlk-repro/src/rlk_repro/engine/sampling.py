"""Per-request seeded sampling with temperature, min-p, top-k and top-p.

The token is drawn from the processed distribution: ``softmax`` of the tempered logits with the tokens outside
the kept set at ``-inf``. Under an R ``logp`` the kept set is rlk's (``rlk_core.ops.kept_set``, contract
``rlk.logp.processed.v1``), under P this module's native filter (:func:`native_processed`, vLLM's rules in
torch). The log-prob the engine records is computed separately by the ``logp`` module's op, over the kept set
(``processed``, the default) or the whole vocabulary (``unfiltered``), as the run's sampling semantics say.
Each draw is an exponential race whose noise is a counter-based hash of (draw seed, vocab id) — the draw seed
derived from (run seed, request id, token index) — computed elementwise in int64, so a request's samples do not
depend on the batch it ran in or on the device, and a whole step's requests are sampled in a few batched
kernels with one host read.
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
    min_p: float = 0.0  # 0: off

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise RlkConfigError(f"temperature must be > 0 (log-probs are of softmax(logits / T)), "
                                 f"got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise RlkConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise RlkConfigError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise RlkConfigError(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")
        if self.max_new_tokens < 1:
            raise RlkConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


def draw_seed(seed: int, request_id: int, index: int) -> int:
    return (seed * 1_000_003 + request_id * 10_007 + index * 7919 + 12345) % (1 << 62)


_M31 = (1 << 31) - 1


def _mix31(x: torch.Tensor) -> torch.Tensor:
    """An integer mixer (xor-shift / multiply rounds) on int64 tensors holding values in [0, 2^31):
    every product stays below 2^58, so nothing relies on integer overflow and CPU and GPU agree."""
    for _ in range(2):
        x = x ^ (x >> 16)
        x = (x * 0x45D9F3B) & _M31
    return x ^ (x >> 16)


def race_noise(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exponential noise ``[B, V]`` (float64) for the race, from draw seeds ``[B]`` (int64, >= 0): two
    31-bit hashes of (seed, vocab id) give a 53-bit uniform in (0, 1], then ``-log``."""
    key = _mix31(_mix31(seeds & _M31) ^ ((seeds >> 31) & _M31))[:, None]
    ids = torch.arange(vocab, device=seeds.device, dtype=torch.int64)[None, :]
    hi = _mix31(_mix31(key ^ 0x2F0B3A5) ^ ids)
    lo = _mix31(_mix31(key ^ 0x61C8864) ^ ids)
    u = (hi * 2**22 + (lo >> 9) + 1).to(torch.float64) * 2.0**-53
    return -torch.log(u)


def filtered(params: SamplingParams) -> bool:
    return params.top_p < 1.0 or params.top_k > 0 or params.min_p > 0.0


def native_processed(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The P side's processed logits ``[B, V]`` fp32: ``logits / T``, then min-p, top-k and top-p as vLLM applies
    them in torch (``-inf`` outside what they keep). No fixed order: the bits may depend on the batch."""
    x = logits.float()
    temp = torch.tensor([p.temperature for p in params], device=x.device, dtype=torch.float32)
    x = x / temp[:, None]
    vocab = x.shape[-1]
    min_p = torch.tensor([p.min_p for p in params], device=x.device, dtype=torch.float32)
    if bool((min_p > 0).any()):
        x = x.masked_fill(x < (x.amax(-1) + torch.log(min_p))[:, None], float("-inf"))
    for k in sorted({p.top_k for p in params if p.top_k and p.top_k < vocab}):
        rows = torch.tensor([i for i, p in enumerate(params) if p.top_k == k], device=x.device)
        kth = torch.topk(x[rows], k, dim=-1).values[:, -1:]
        x[rows] = x[rows].masked_fill(x[rows] < kth, float("-inf"))
    top_p = torch.tensor([p.top_p for p in params], device=x.device, dtype=torch.float32)
    if bool((top_p < 1.0).any()):
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        drop = (torch.cumsum(probs, dim=-1) - probs) > top_p[:, None]  # keep the smallest prefix reaching top_p
        drop &= (top_p < 1.0)[:, None]
        x = x.scatter(-1, order, sorted_x.masked_fill(drop, float("-inf")))
    return x


def race(z: torch.Tensor, seeds: list[int]) -> list[int]:
    """One token per row of the processed logits ``z`` ``[B, V]`` (``-inf`` outside the kept set): the race
    ``argmax(softmax(z) / E)`` with :func:`race_noise` of that row's draw seed."""
    probs = torch.softmax(z, dim=-1).double()
    noise = race_noise(torch.tensor(seeds, device=z.device, dtype=torch.int64), z.shape[-1])
    return torch.argmax(probs / noise, dim=-1).tolist()


def sample_tokens(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int]) -> list[int]:
    """One token per row of ``logits`` ``[B, V]`` with the native filter (:func:`native_processed`) and
    :func:`race`."""
    return race(native_processed(logits, params), seeds)


def sample_token(logits: torch.Tensor, params: SamplingParams, seed: int) -> int:
    """One token from ``logits`` ``[V]`` with draw seed ``seed`` (see :func:`sample_tokens`)."""
    return sample_tokens(logits[None], [params], [seed])[0]
