"""``token_logprobs``: selected-token log-prob and log-sum-exp from logits, contract ``rlk.logp.v1``.

Also the two halves a vocab-parallel caller needs: :func:`logp_partials` (per-shard group partials)
and :func:`merge_logp_partials` (the fixed merge tree over the gathered partials).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlk_core.backends import REGISTRY, Backend
from rlk_core.ops import _checks as C
from rlk_core.ops import _logp_tree as L
from rlk_core.ops._backends import register_kernel_backends
from rlk_core.ops._dispatch import define
from rlk_core.ops.kept_set import as_kept
from rlk_core.ops.token_logprobs.reference import (
    logp_partials_reference,
    merge_logp_partials_reference,
    processed_logp_partials_reference,
    processed_token_logprobs_backward_reference,
    processed_token_logprobs_reference,
    token_logprobs_backward_reference,
    token_logprobs_reference,
)

OP = "token_logprobs"


def _check_logits(op: str, shards: Sequence[torch.Tensor]) -> int:
    """Shards: non-empty list of 2-d float tensors with the same rows, dtype, device; returns V."""
    C.require(len(shards) > 0, op, "logits must be a tensor [T, V] or a non-empty list of vocab shards")
    for i, x in enumerate(shards):
        C.float_tensor(x, op, f"logits[{i}]")
        C.ndim(x, op, f"logits[{i}]", (2,))
        C.require(x.shape[0] == shards[0].shape[0], op,
                  f"vocab shards must have the same rows; shard 0 has {shards[0].shape[0]}, shard {i} has "
                  f"{x.shape[0]}")
    C.same_dtype(op, **{f"logits[{i}]": x for i, x in enumerate(shards)})
    C.same_device(op, **{f"logits[{i}]": x for i, x in enumerate(shards)})
    return L.check_shard_widths(op, [x.shape[1] for x in shards], f"logits shapes {[tuple(x.shape) for x in shards]}")


def _check(shards: Sequence[torch.Tensor], target: torch.Tensor, temperature: torch.Tensor) -> None:
    vocab_size = _check_logits(OP, shards)
    L.check_rows(OP, shards[0].shape[0], target, temperature, vocab_size)
    C.same_device(OP, logits=shards[0], target=target, temperature=temperature)


@define("token_logprobs")
def _token_logprobs(logits: list[torch.Tensor], target: torch.Tensor, temperature: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    _check(logits, target, temperature)


@_token_logprobs.register_fake
def _(logits, target, temperature):
    _check(logits, target, temperature)
    t = logits[0].shape[0]
    return logits[0].new_empty((t,), dtype=torch.float32), logits[0].new_empty((t,), dtype=torch.float32)


@define("token_logprobs_backward")
def _token_logprobs_backward(logits: list[torch.Tensor], target: torch.Tensor, temperature: torch.Tensor,
                                lse: torch.Tensor, grad_logp: torch.Tensor, grad_lse: torch.Tensor
                                ) -> list[torch.Tensor]:
    pass


@_token_logprobs_backward.register_fake
def _(logits, target, temperature, lse, grad_logp, grad_lse):
    return [torch.empty_like(x) for x in logits]


def _setup_context(ctx, inputs, output) -> None:
    logits, target, temperature = inputs
    ctx.save_for_backward(target, temperature, output[1], *logits)


def _backward(ctx, grad_logp, grad_lse):
    target, temperature, lse, *logits = ctx.saved_tensors
    g_logp, g_lse = L.grads_or_zeros(lse, grad_logp, grad_lse)
    grads = _token_logprobs_backward(logits, target, temperature, lse, g_logp, g_lse)
    return list(grads), None, None


_token_logprobs.register_autograd(_backward, setup_context=_setup_context)


def token_logprobs(logits: torch.Tensor | Sequence[torch.Tensor], target: torch.Tensor,
                   temperature: float | torch.Tensor = 1.0, kept=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of the target token and the log-sum-exp over the vocabulary (contract ``rlk.logp.v1``).

    Parameters
    ----------
    logits : Tensor ``[T, V]`` (float32 / bfloat16 / float16), or a list of contiguous vocab shards
        ``[T, V_i]`` in rank order whose boundaries fall on group boundaries (multiples of
        ``ceil(V/8)``, clamped to ``V``) — e.g. the ``V/TP`` columns of each rank for TP 1/2/4/8 when
        ``V`` is divisible by 8.
    target : Tensor ``[T]``, int32 / int64, values in ``[0, V)``.
    temperature : float > 0, or a float tensor ``[T]`` (one per row, > 0); converted to fp32 once.

    Returns
    -------
    (logp, lse) : two float32 Tensors ``[T]``; ``logp = z[target] - lse``, ``lse = log sum exp z``,
    ``z = f32(logits) / f32(temperature)``.

    Contract ``rlk.logp.v1``: a row's results depend only on that row's logits, its temperature and
    its target id — not on the other rows, nor on how the vocabulary is sharded (1, 2, 4, 8 shards give
    identical bits), and they equal :func:`~rlk_core.ops.linear_logprobs.linear_logprobs` bit for bit
    when the logits come from :func:`~rlk_core.ops.linear.linear`. ``z`` is one fp32 division; the
    log-sum-exp runs over 8 groups of ``ceil(V/8)`` columns, leaf blocks of 256 anchored at each group
    start (block max, ``tree_sum`` of ``exp(z - max)``), merged pairwise upper-half-onto-lower-half
    inside a group and ``((g0+g1)+(g2+g3))+((g4+g5)+(g6+g7))`` across groups; the reference is built
    only from elementwise fp32 operations and maxima, so this holds by construction on the CPU.
    Masked (``-inf``) logits contribute exactly nothing. Backward w.r.t. the logits,
    ``(g_logp*(onehot - p) + g_lse*p) / temperature`` with ``p = exp(z - lse)``, is elementwise and
    deterministic.

    ``kept`` (a :class:`~rlk_core.ops.kept_set.KeptSet` or ``(value [T], token_id [T])``): the processed
    log-prob of contract ``rlk.logp.processed.v1`` (``docs/ops/kept_set.md``) — the same tree over
    the kept tokens only (the others ``-inf``); a target outside the kept set gets ``-inf``; the gradient flows
    through the kept tokens only. Op ``processed_token_logprobs``.
    """
    shards = [logits] if isinstance(logits, torch.Tensor) else list(logits)
    C.require(len(shards) > 0 and all(isinstance(x, torch.Tensor) for x in shards), OP,
              "logits must be a tensor [T, V] or a non-empty list of tensor shards")
    _check_logits(OP, shards)
    t = shards[0].shape[0] if shards[0].dim() else 0
    temp = L.as_temperature(OP, temperature, t, shards[0].device)
    if kept is not None:
        return _processed_token_logprobs(shards, target, temp, *as_kept(PROCESSED, kept, t, shards[0].device))
    return _token_logprobs(shards, target, temp)


# -- the vocab-parallel halves ---------------------------------------------------------------------
@define("logp_partials")
def _logp_partials(logits_shard: torch.Tensor, target: torch.Tensor, temperature: torch.Tensor,
                      vocab_start: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_partials(logits_shard, target, temperature, vocab_start, vocab_size)


def _check_partials(x, target, temperature, vocab_start, vocab_size) -> tuple[int, int]:
    op = "logp_partials"
    C.float_tensor(x, op, "logits_shard")
    C.ndim(x, op, "logits_shard", (2,))
    g0, g1 = L.shard_groups(op, vocab_start, x.shape[1], vocab_size)
    L.check_rows(op, x.shape[0], target, temperature, vocab_size)
    C.same_device(op, logits_shard=x, target=target, temperature=temperature)
    return g0, g1


@_logp_partials.register_fake
def _(logits_shard, target, temperature, vocab_start, vocab_size):
    g0, g1 = _check_partials(logits_shard, target, temperature, vocab_start, vocab_size)
    t = logits_shard.shape[0]
    f = torch.float32
    return (logits_shard.new_empty((t, g1 - g0), dtype=f), logits_shard.new_empty((t, g1 - g0), dtype=f),
            logits_shard.new_empty((t,), dtype=f))


def logp_partials(logits_shard: torch.Tensor, target: torch.Tensor, temperature: float | torch.Tensor,
                  vocab_start: int, vocab_size: int, kept=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One vocab shard's half of ``token_logprobs`` (contract ``rlk.logp.v1``).

    Parameters
    ----------
    logits_shard : Tensor ``[T, V_local]``: columns ``[vocab_start, vocab_start + V_local)`` of the
        logits; both ends on group boundaries of ``vocab_size`` (see :func:`token_logprobs`).
    target : Tensor ``[T]`` int, global ids in ``[0, vocab_size)``.
    temperature : float or float tensor ``[T]``, > 0.
    vocab_start, vocab_size : int.

    Returns
    -------
    (m, s, z_target) : float32 ``[T, G_local]``, ``[T, G_local]``, ``[T]`` — the partials ``(max, sum
    exp)`` of the non-empty groups this shard holds, and ``z[target]`` where the target lies in this
    shard, ``-inf`` elsewhere. A distributed caller all-gathers ``m`` and ``s`` along dim 1 in rank
    order (exact data movement), all-reduces ``z_target`` with MAX (exact), and calls
    :func:`merge_logp_partials`; the result equals the unsharded :func:`token_logprobs` bit for bit.
    Each group partial depends only on that row and the group's columns. Not differentiable. With ``kept`` (the
    rows' kept sets, the same pair on every shard): the processed partials (op ``processed_logp_partials``).
    """
    temp = L.as_temperature("logp_partials", temperature, logits_shard.shape[0], logits_shard.device)
    if kept is not None:
        value, token_id = as_kept("processed_logp_partials", kept, logits_shard.shape[0], logits_shard.device)
        return _processed_logp_partials(logits_shard, target, temp, value, token_id, int(vocab_start),
                                        int(vocab_size))
    return _logp_partials(logits_shard, target, temp, int(vocab_start), int(vocab_size))


def _check_merge(m, s, z_target, vocab_size) -> None:
    op = "merge_logp_partials"
    C.require(vocab_size > 0, op, f"vocab_size must be > 0, got {vocab_size}")
    k = L.num_groups(vocab_size)
    for name, x in (("m", m), ("s", s)):
        C.require(isinstance(x, torch.Tensor) and x.dtype == torch.float32 and x.dim() == 2, op,
                  f"{name} must be a float32 tensor [T, {k}]")
        C.require(x.shape[1] == k, op,
                  f"{name} has {x.shape[1]} group partials but vocab_size={vocab_size} has {k} non-empty "
                  f"groups; gather every shard's partials in rank order")
    C.require(m.shape == s.shape, op, f"m {tuple(m.shape)} and s {tuple(s.shape)} must have the same shape")
    C.require(isinstance(z_target, torch.Tensor) and z_target.dtype == torch.float32
              and tuple(z_target.shape) == (m.shape[0],), op, f"z_target must be a float32 tensor [{m.shape[0]}]")
    C.same_device(op, m=m, s=s, z_target=z_target)


@define("merge_logp_partials")
def _merge_logp_partials(m: torch.Tensor, s: torch.Tensor, z_target: torch.Tensor, vocab_size: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    _check_merge(m, s, z_target, vocab_size)


@_merge_logp_partials.register_fake
def _(m, s, z_target, vocab_size):
    _check_merge(m, s, z_target, vocab_size)
    return torch.empty_like(z_target), torch.empty_like(z_target)


def merge_logp_partials(m: torch.Tensor, s: torch.Tensor, z_target: torch.Tensor, vocab_size: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge gathered group partials into ``(logp, lse)`` (contract ``rlk.logp.v1``).

    Parameters
    ----------
    m, s : float32 ``[T, num_groups]``: every shard's :func:`logp_partials` output concatenated along
        dim 1 in rank order (``num_groups = ceil(V / ceil(V/8))``, 8 unless ``V`` is tiny).
    z_target : float32 ``[T]``: ``z[target]`` (the MAX over the shards' ``z_target``).
    vocab_size : int, ``V``.

    Returns
    -------
    (logp, lse) : float32 ``[T]`` each. Fixed tree ``((g0+g1)+(g2+g3))+((g4+g5)+(g6+g7))`` (absent
    trailing groups are exact identities), ``lse = m + log(s)``, ``logp = z_target - lse``. Each row
    depends only on that row's partials.
    """
    return _merge_logp_partials(m, s, z_target, int(vocab_size))


# -- contract rlk.logp.processed.v1: the same ops with a kept set (value, token_id) per row -----------------
PROCESSED = "processed_token_logprobs"


def _check_kept(op: str, t: int, kept_value: torch.Tensor, kept_id: torch.Tensor, like: torch.Tensor) -> None:
    C.require(kept_value.dtype == torch.float32 and tuple(kept_value.shape) == (t,), op,
              f"kept_value must be float32 [{t}], got {kept_value.dtype} {tuple(kept_value.shape)}")
    C.require(kept_id.dtype == torch.int64 and tuple(kept_id.shape) == (t,), op,
              f"kept_id must be int64 [{t}], got {kept_id.dtype} {tuple(kept_id.shape)}")
    C.same_device(op, logits=like, kept_value=kept_value, kept_id=kept_id)


@define(PROCESSED)
def _processed_token_logprobs(logits: list[torch.Tensor], target: torch.Tensor, temperature: torch.Tensor,
                              kept_value: torch.Tensor, kept_id: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _check(logits, target, temperature)
    _check_kept(PROCESSED, logits[0].shape[0], kept_value, kept_id, logits[0])


@_processed_token_logprobs.register_fake
def _(logits, target, temperature, kept_value, kept_id):
    _check(logits, target, temperature)
    t = logits[0].shape[0]
    return logits[0].new_empty((t,), dtype=torch.float32), logits[0].new_empty((t,), dtype=torch.float32)


@define("processed_token_logprobs_backward")
def _processed_token_logprobs_backward(logits: list[torch.Tensor], target: torch.Tensor, temperature: torch.Tensor,
                                       kept_value: torch.Tensor, kept_id: torch.Tensor, lse: torch.Tensor,
                                       grad_logp: torch.Tensor, grad_lse: torch.Tensor) -> list[torch.Tensor]:
    pass


@_processed_token_logprobs_backward.register_fake
def _(logits, target, temperature, kept_value, kept_id, lse, grad_logp, grad_lse):
    return [torch.empty_like(x) for x in logits]


def _processed_setup_context(ctx, inputs, output) -> None:
    logits, target, temperature, kept_value, kept_id = inputs
    ctx.save_for_backward(target, temperature, kept_value, kept_id, output[1], *logits)


def _processed_backward(ctx, grad_logp, grad_lse):
    target, temperature, kept_value, kept_id, lse, *logits = ctx.saved_tensors
    g_logp, g_lse = L.grads_or_zeros(lse, grad_logp, grad_lse)
    grads = _processed_token_logprobs_backward(logits, target, temperature, kept_value, kept_id, lse, g_logp, g_lse)
    return list(grads), None, None, None, None


_processed_token_logprobs.register_autograd(_processed_backward, setup_context=_processed_setup_context)


@define("processed_logp_partials")
def _processed_logp_partials(logits_shard: torch.Tensor, target: torch.Tensor, temperature: torch.Tensor,
                             kept_value: torch.Tensor, kept_id: torch.Tensor, vocab_start: int, vocab_size: int
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_partials(logits_shard, target, temperature, vocab_start, vocab_size)
    _check_kept("processed_logp_partials", logits_shard.shape[0], kept_value, kept_id, logits_shard)


@_processed_logp_partials.register_fake
def _(logits_shard, target, temperature, kept_value, kept_id, vocab_start, vocab_size):
    g0, g1 = _check_partials(logits_shard, target, temperature, vocab_start, vocab_size)
    t, f = logits_shard.shape[0], torch.float32
    return (logits_shard.new_empty((t, g1 - g0), dtype=f), logits_shard.new_empty((t, g1 - g0), dtype=f),
            logits_shard.new_empty((t,), dtype=f))


REGISTRY.register(Backend("rlk.reference", OP, token_logprobs_reference, devices=("cpu", "cuda"), builtin=True))
REGISTRY.register(Backend("rlk.reference", "token_logprobs_backward", token_logprobs_backward_reference,
                          devices=("cpu", "cuda"), builtin=True))
REGISTRY.register(Backend("rlk.reference", "logp_partials", logp_partials_reference, devices=("cpu", "cuda"),
                          builtin=True))
REGISTRY.register(Backend("rlk.reference", "merge_logp_partials", merge_logp_partials_reference,
                          devices=("cpu", "cuda"), builtin=True))
M = "rlk_core.ops.token_logprobs.triton"
register_kernel_backends(OP, f"{M}:forward", f"{M}:supports")
register_kernel_backends("token_logprobs_backward", f"{M}:backward", f"{M}:supports_backward")
register_kernel_backends("logp_partials", f"{M}:logp_partials", f"{M}:supports_partials")
register_kernel_backends("merge_logp_partials", f"{M}:merge_logp_partials", f"{M}:supports_merge")
for _op, _ref, _plan, _sup in (
        (PROCESSED, processed_token_logprobs_reference, "processed_forward", "supports_processed"),
        ("processed_token_logprobs_backward", processed_token_logprobs_backward_reference, "processed_backward",
         "supports_processed_backward"),
        ("processed_logp_partials", processed_logp_partials_reference, "processed_logp_partials",
         "supports_processed_partials")):
    REGISTRY.register(Backend("rlk.reference", _op, _ref, devices=("cpu", "cuda"), builtin=True))
    register_kernel_backends(_op, f"{M}:{_plan}", f"{M}:{_sup}")
