"""Checks of contract ``rlk.logp.v1`` that users can run on their own hardware.

Like :mod:`rlk_core.testing.invariance`, each check returns ``(ok, detail)`` and never asserts.

* :func:`check_vocab_shard_merge` — logits split into 1, 2, 4, 8 vocab shards (whole groups, as a
  tensor-parallel LM head splits them) give the same bits as the unsharded call, both through the
  list form of ``token_logprobs`` and through the distributed halves (``logp_partials`` per shard,
  partials concatenated in rank order, ``z_target`` combined by MAX, ``merge_logp_partials``).
* :func:`check_linear_vocab_shard_merge` — the same for ``linear_logprobs`` with LM-head shards.
* :func:`check_fused_equals_unfused` — ``linear_logprobs(h, W, y, t)`` equals
  ``token_logprobs(linear(h, W), y, t)`` bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from rlk_core.ops._logp_tree import GROUPS, group_bounds
from rlk_core.testing.compare import bitwise_diff_report

SHARD_COUNTS = (1, 2, 4, 8)
LogpFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def shard_bounds(vocab_size: int, n: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` of ``n`` (a divisor of 8) contiguous shards of whole groups — for
    ``V`` divisible by 8 these are the ``V/n`` columns per rank a tensor-parallel LM head holds."""
    if GROUPS % n:
        raise ValueError(f"shard count must divide {GROUPS}, got {n}")
    b = group_bounds(vocab_size)
    per = GROUPS // n
    return [(b[i * per], b[(i + 1) * per]) for i in range(n)]


def _compare(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor], what: str) -> str | None:
    for name, a, e in zip(("logp", "lse"), got, want, strict=True):
        report = bitwise_diff_report(a, e, f"{name}, {what}")
        if report is not None:
            return report
    return None


def _merge(parts: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], vocab_size: int):
    """What a tensor-parallel caller does with the gathered per-shard ``(m, s, z_target)``: concatenate the
    group partials in rank order, take the target's z from the shard that owns it, merge."""
    from rlk_core.ops.token_logprobs import merge_logp_partials

    m = torch.cat([p[0] for p in parts], 1)
    s = torch.cat([p[1] for p in parts], 1)
    z_t = torch.stack([p[2] for p in parts]).amax(0)
    return merge_logp_partials(m, s, z_t, vocab_size)


def check_vocab_shard_merge(logits: torch.Tensor, target: torch.Tensor, temperature: float | torch.Tensor = 1.0,
                            shard_counts: Sequence[int] = SHARD_COUNTS,
                            token_fn: LogpFn | None = None, partials: bool = True) -> tuple[bool, str]:
    """Sharded ``token_logprobs`` (list form and, with ``partials``, ``logp_partials`` + merge) ==
    unsharded, bit for bit. The partials path always runs rlk's ops: leave it out when ``token_fn`` is
    another backend's."""
    from rlk_core.ops.token_logprobs import logp_partials, token_logprobs

    fn = token_fn or token_logprobs
    vocab_size = logits.shape[1]
    full = fn(logits, target, temperature)
    for n in shard_counts:
        bounds = shard_bounds(vocab_size, n)
        shards = [logits[:, a:e] for a, e in bounds]
        report = _compare(fn(shards, target, temperature), full, f"{n} shards (list form) vs unsharded")
        if report is not None:
            return False, report
        if not partials:
            continue
        parts = [logp_partials(x, target, temperature, a, vocab_size) for x, (a, _) in zip(shards, bounds)]
        report = _compare(_merge(parts, vocab_size), full,
                          f"{n} shards (logp_partials + merge_logp_partials) vs unsharded")
        if report is not None:
            return False, report
    return True, f"shard counts {list(shard_counts)} identical to unsharded (V={vocab_size})"


def check_linear_vocab_shard_merge(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                   temperature: float | torch.Tensor = 1.0,
                                   shard_counts: Sequence[int] = SHARD_COUNTS,
                                   fused_fn: LogpFn | None = None, partials: bool = True) -> tuple[bool, str]:
    """``linear_logprobs`` with LM-head shards (list form and, with ``partials``, partials + merge through
    rlk's ops) == unsharded."""
    from rlk_core.ops.linear_logprobs import linear_logp_partials, linear_logprobs

    fn = fused_fn or linear_logprobs
    vocab_size = weight.shape[0]
    full = fn(hidden, weight, target, temperature)
    for n in shard_counts:
        bounds = shard_bounds(vocab_size, n)
        shards = [weight[a:e] for a, e in bounds]
        report = _compare(fn(hidden, shards, target, temperature), full, f"{n} weight shards vs unsharded")
        if report is not None:
            return False, report
        if not partials:
            continue
        parts = [linear_logp_partials(hidden, w, target, temperature, a, vocab_size)
                 for w, (a, _) in zip(shards, bounds)]
        report = _compare(_merge(parts, vocab_size), full,
                          f"{n} weight shards (linear_logp_partials + merge) vs unsharded")
        if report is not None:
            return False, report
    return True, f"weight shard counts {list(shard_counts)} identical to unsharded (V={vocab_size})"


def check_fused_equals_unfused(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                               temperature: float | torch.Tensor = 1.0, fused_fn: LogpFn | None = None,
                               linear_fn: Callable[..., torch.Tensor] | None = None,
                               token_fn: LogpFn | None = None) -> tuple[bool, str]:
    """``linear_logprobs(h, W, y, t) == token_logprobs(linear(h, W), y, t)`` bit for bit."""
    from rlk_core.ops.linear import linear
    from rlk_core.ops.linear_logprobs import linear_logprobs
    from rlk_core.ops.token_logprobs import token_logprobs

    fused = (fused_fn or linear_logprobs)(hidden, weight, target, temperature)
    logits = (linear_fn or linear)(hidden, weight)
    unfused = (token_fn or token_logprobs)(logits, target, temperature)
    report = _compare(fused, unfused, "fused linear_logprobs vs linear + token_logprobs")
    if report is not None:
        return False, report
    return True, f"fused == unfused for T={hidden.shape[0]}, H={hidden.shape[1]}, V={weight.shape[0]}, {hidden.dtype}"
