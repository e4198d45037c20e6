"""``entropy``: the entropy of the sampling distribution, unfiltered or over a kept set, contract ``rlk.entropy.v1``
(``docs/ops/entropy.md``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlk_core.backends import REGISTRY, Backend
from rlk_core.ops import _checks as C
from rlk_core.ops import _logp_tree as L
from rlk_core.ops._dispatch import define
from rlk_core.ops.entropy.reference import entropy_backward_reference, entropy_reference
from rlk_core.ops.kept_set import as_kept

OP = "entropy"
BACKWARD = "entropy_backward"


def _check(shards: Sequence[torch.Tensor], temperature: torch.Tensor, kept_value: torch.Tensor,
           kept_id: torch.Tensor) -> None:
    C.require(len(shards) > 0, OP, "logits must be a tensor [T, V] or a non-empty list of vocab shards")
    for i, x in enumerate(shards):
        C.float_tensor(x, OP, f"logits[{i}]")
        C.ndim(x, OP, f"logits[{i}]", (2,))
        C.require(x.shape[0] == shards[0].shape[0], OP,
                  f"vocab shards must have the same rows; shard 0 has {shards[0].shape[0]}, shard {i} has "
                  f"{x.shape[0]}")
    C.same_dtype(OP, **{f"logits[{i}]": x for i, x in enumerate(shards)})
    C.same_device(OP, **{f"logits[{i}]": x for i, x in enumerate(shards)})
    C.require(sum(x.shape[1] for x in shards) > 0, OP, "the vocabulary is empty")
    t = shards[0].shape[0]
    L.check_temperature(OP, t, temperature)
    C.require(kept_value.dtype == torch.float32 and tuple(kept_value.shape) == (t,), OP,
              f"kept_value must be float32 [{t}], got {kept_value.dtype} {tuple(kept_value.shape)}")
    C.require(kept_id.dtype == torch.int64 and tuple(kept_id.shape) == (t,), OP,
              f"kept_id must be int64 [{t}], got {kept_id.dtype} {tuple(kept_id.shape)}")
    C.same_device(OP, logits=shards[0], temperature=temperature, kept_value=kept_value, kept_id=kept_id)


@define(OP)
def _entropy(logits: list[torch.Tensor], temperature: torch.Tensor, kept_value: torch.Tensor,
             kept_id: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _check(logits, temperature, kept_value, kept_id)


@_entropy.register_fake
def _(logits, temperature, kept_value, kept_id):
    _check(logits, temperature, kept_value, kept_id)
    t = logits[0].shape[0]
    return logits[0].new_empty((t,), dtype=torch.float32), logits[0].new_empty((t,), dtype=torch.float32)


@define(BACKWARD)
def _entropy_backward(logits: list[torch.Tensor], temperature: torch.Tensor, kept_value: torch.Tensor,
                      kept_id: torch.Tensor, entropy: torch.Tensor, lse: torch.Tensor, grad_entropy: torch.Tensor,
                      grad_lse: torch.Tensor) -> list[torch.Tensor]:
    pass


@_entropy_backward.register_fake
def _(logits, temperature, kept_value, kept_id, entropy, lse, grad_entropy, grad_lse):
    return [torch.empty_like(x) for x in logits]


def _setup_context(ctx, inputs, output) -> None:
    logits, temperature, kept_value, kept_id = inputs
    ctx.save_for_backward(temperature, kept_value, kept_id, output[0], output[1], *logits)


def _backward(ctx, grad_entropy, grad_lse):
    temperature, kept_value, kept_id, ent, lse, *logits = ctx.saved_tensors
    g_h, g_lse = L.grads_or_zeros(lse, grad_entropy, grad_lse)
    grads = _entropy_backward(logits, temperature, kept_value, kept_id, ent, lse, g_h, g_lse)
    return list(grads), None, None, None


_entropy.register_autograd(_backward, setup_context=_setup_context)


def entropy(logits: torch.Tensor | Sequence[torch.Tensor], temperature: float | torch.Tensor = 1.0,
            kept=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Entropy of ``softmax(z)``, ``z = f32(logits) / f32(temperature)``, over the whole vocabulary or over a
    kept set (contract ``rlk.entropy.v1``, ``docs/ops/entropy.md``).

    Parameters
    ----------
    logits : Tensor ``[T, V]`` (float32 / bfloat16 / float16), or a list of contiguous vocab shards ``[T, V_i]``
        in rank order (concatenated; any widths).
    temperature : float > 0, or a float tensor ``[T]``.
    kept : None (the whole vocabulary: the unfiltered distribution), or a
        :class:`~rlk_core.ops.kept_set.KeptSet` / ``(value [T] fp32, token_id [T] int64)`` threshold of contract
        ``rlk.logp.processed.v1`` (the processed distribution vLLM samples from under top-k / top-p / min-p).

    Returns
    -------
    (entropy, lse) : float32 ``[T]`` each. ``lse`` is bitwise the ``lse`` of
    :func:`~rlk_core.ops.token_logprobs.token_logprobs` with the same ``kept``; ``entropy = sum_{v in K}
    p_v (lse - z_v)``, ``p_v = exp(z_v - lse)``, summed in the log-prob op's fixed vocab-block structure (8
    groups, leaf blocks of 256, pairwise halves, adjacent pairs across groups). A row's results depend only on
    that row's logits, temperature and kept set — not on the other rows nor on the sharding. Differentiable
    w.r.t. the logits: ``(g_H * (-p (log p + H)) + g_lse * p) / T`` on ``K``, 0 outside it (elementwise).
    """
    shards = [logits] if isinstance(logits, torch.Tensor) else list(logits)
    C.require(len(shards) > 0 and all(isinstance(x, torch.Tensor) and x.dim() == 2 for x in shards), OP,
              "logits must be a tensor [T, V] or a non-empty list of 2-d tensor shards")
    t, dev = shards[0].shape[0], shards[0].device
    vocab = sum(x.shape[1] for x in shards)
    temp = L.as_temperature(OP, temperature, t, dev)
    if kept is None:  # the whole vocabulary, in the threshold form of rlk.logp.processed.v1
        value = torch.full((t,), L.NEG_INF, dtype=torch.float32, device=dev)
        token_id = torch.full((t,), max(vocab - 1, 0), dtype=torch.int64, device=dev)
    else:
        value, token_id = as_kept(OP, kept, t, dev)
    return _entropy(shards, temp, value, token_id)


REGISTRY.register(Backend("rlk.reference", OP, entropy_reference, devices=("cpu", "cuda"), builtin=True))
REGISTRY.register(Backend("rlk.reference", BACKWARD, entropy_backward_reference, devices=("cpu", "cuda"),
                          builtin=True))

__all__ = ["entropy"]
