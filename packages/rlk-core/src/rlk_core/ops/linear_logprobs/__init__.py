"""``linear_logprobs``: token log-probs straight from hidden states and the LM-head weight, without
materialising the logits — the fused form of contract ``rlk.logp.v1``.

Also :func:`linear_logp_partials`, one vocab shard's half for a tensor-parallel caller (merge the
gathered partials with :func:`rlk_core.ops.token_logprobs.merge_logp_partials`).
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
from rlk_core.ops.linear_logprobs.reference import (
    linear_logp_partials_reference,
    linear_logprobs_backward_reference,
    linear_logprobs_reference,
    processed_linear_logp_partials_reference,
    processed_linear_logprobs_backward_reference,
    processed_linear_logprobs_reference,
)
from rlk_core.ops.token_logprobs import _check_kept

OP = "linear_logprobs"


def _check_hidden_weight(op: str, hidden: torch.Tensor, weights: Sequence[torch.Tensor]) -> None:
    C.float_tensor(hidden, op, "hidden")
    C.ndim(hidden, op, "hidden", (2,))
    C.require(len(weights) > 0, op, "weight must be a tensor [V, H] or a non-empty list of vocab shards")
    for i, w in enumerate(weights):
        name = "weight" if len(weights) == 1 else f"weight[{i}]"
        C.float_tensor(w, op, name)
        C.ndim(w, op, name, (2,))
        C.require(w.shape[1] == hidden.shape[1], op,
                  f"hidden has H={hidden.shape[1]} (shape {tuple(hidden.shape)}) but {name} has "
                  f"H={w.shape[1]} (shape {tuple(w.shape)})")
    C.same_dtype(op, hidden=hidden, **{f"weight[{i}]": w for i, w in enumerate(weights)})
    C.same_device(op, hidden=hidden, **{f"weight[{i}]": w for i, w in enumerate(weights)})


def _check(hidden: torch.Tensor, weights: Sequence[torch.Tensor], target: torch.Tensor,
           temperature: torch.Tensor) -> None:
    _check_hidden_weight(OP, hidden, weights)
    vocab_size = L.check_shard_widths(OP, [w.shape[0] for w in weights],
                                      f"weight shapes {[tuple(w.shape) for w in weights]}")
    L.check_rows(OP, hidden.shape[0], target, temperature, vocab_size)
    C.same_device(OP, hidden=hidden, target=target, temperature=temperature)


@define("linear_logprobs")
def _linear_logprobs(hidden: torch.Tensor, weight: list[torch.Tensor], target: torch.Tensor,
                        temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _check(hidden, weight, target, temperature)


@_linear_logprobs.register_fake
def _(hidden, weight, target, temperature):
    _check(hidden, weight, target, temperature)
    t = hidden.shape[0]
    return hidden.new_empty((t,), dtype=torch.float32), hidden.new_empty((t,), dtype=torch.float32)


@define("linear_logprobs_backward")
def _linear_logprobs_backward(hidden: torch.Tensor, weight: list[torch.Tensor], target: torch.Tensor,
                                 temperature: torch.Tensor, lse: torch.Tensor, grad_logp: torch.Tensor,
                                 grad_lse: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    pass


@_linear_logprobs_backward.register_fake
def _(hidden, weight, target, temperature, lse, grad_logp, grad_lse):
    return torch.empty_like(hidden), [torch.empty_like(w) for w in weight]


def _setup_context(ctx, inputs, output) -> None:
    hidden, weight, target, temperature = inputs
    ctx.save_for_backward(hidden, target, temperature, output[1], *weight)


def _backward(ctx, grad_logp, grad_lse):
    hidden, target, temperature, lse, *weight = ctx.saved_tensors
    g_logp, g_lse = L.grads_or_zeros(lse, grad_logp, grad_lse)
    dh, dws = _linear_logprobs_backward(hidden, weight, target, temperature, lse, g_logp, g_lse)
    return dh, list(dws), None, None


_linear_logprobs.register_autograd(_backward, setup_context=_setup_context)


def linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor | Sequence[torch.Tensor], target: torch.Tensor,
                    temperature: float | torch.Tensor = 1.0, kept=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused LM head + token log-prob, never materialising ``[T, V]`` logits (contract ``rlk.logp.v1``).

    Parameters
    ----------
    hidden : Tensor ``[T, H]``, float32 / bfloat16 / float16.
    weight : Tensor ``[V, H]`` (same dtype and device), or a list of contiguous vocab shards
        ``[V_i, H]`` in rank order on group boundaries (see
        :func:`~rlk_core.ops.token_logprobs.token_logprobs`).
    target : Tensor ``[T]``, int32 / int64, values in ``[0, V)``.
    temperature : float > 0, or a float tensor ``[T]`` (> 0); converted to fp32 once.

    Returns
    -------
    (logp, lse) : two float32 Tensors ``[T]``, bit for bit equal to
    ``token_logprobs(linear(hidden, weight), target, temperature)``.

    Contract ``rlk.logp.v1``: a row's results depend only on that row of ``hidden``, the weight, its
    temperature and its target id — not on the other rows, nor on the vocab sharding. The vocab is
    walked in the leaf blocks of the fixed tree (8 groups of ``ceil(V/8)`` columns, blocks of 256
    anchored at each group start); each block's logits are the rlk GEMM's elements
    (:func:`~rlk_core.ops._fixed.matmul_nt` in fp32, one rounding to ``hidden.dtype``), then
    ``z = f32(logits) / f32(temperature)`` and the block partial; the partials merge in the same trees
    as ``token_logprobs``. Extra memory is O(T x 256) logits plus the GEMM's work chunk in the reference
    (on CUDA, backend ``rlk.triton``: one logits chunk of at most 256 MiB), never O(T x V).
    Backward (hidden and weight) recomputes each block's logits, with
    ``dz = (g_logp*(onehot - p) + g_lse*p) / temperature``, ``p = exp(z - lse)`` (the logits rounding
    taken as the identity), accumulates ``dhidden`` over the blocks in column order in fp32 and writes
    ``dW`` per block (each reduction in the fixed tree order); deterministic run to run. On CUDA
    (``rlk.triton``) the products run on the rlk GEMM kernel (sequential K loop, no split-K, no atomics)
    with ``dz`` rounded to ``hidden.dtype``: within ``dtype_tols`` of the reference, deterministic.

    ``kept`` (a :class:`~rlk_core.ops.kept_set.KeptSet` or ``(value [T], token_id [T])``): the processed log-prob
    of contract ``rlk.logp.processed.v1``, applied while streaming the vocab blocks (no ``[T, V]`` logits); equal
    bit for bit to ``token_logprobs(linear(hidden, weight), target, temperature, kept=kept)``. Op
    ``processed_linear_logprobs``.
    """
    weights = [weight] if isinstance(weight, torch.Tensor) else list(weight)
    C.require(isinstance(hidden, torch.Tensor) and hidden.dim() == 2, OP,
              f"hidden must be a tensor [T, H], got {getattr(hidden, 'shape', type(hidden).__name__)}")
    temp = L.as_temperature(OP, temperature, hidden.shape[0], hidden.device)
    if kept is not None:
        return _processed_linear_logprobs(hidden, weights, target, temp,
                                          *as_kept(PROCESSED, kept, hidden.shape[0], hidden.device))
    return _linear_logprobs(hidden, weights, target, temp)


def _check_partials(hidden, weight, target, temperature, vocab_start, vocab_size) -> tuple[int, int]:
    op = "linear_logp_partials"
    _check_hidden_weight(op, hidden, [weight])
    g0, g1 = L.shard_groups(op, vocab_start, weight.shape[0], vocab_size)
    L.check_rows(op, hidden.shape[0], target, temperature, vocab_size)
    C.same_device(op, hidden=hidden, target=target, temperature=temperature)
    return g0, g1


@define("linear_logp_partials")
def _linear_logp_partials(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                             temperature: torch.Tensor, vocab_start: int, vocab_size: int
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_partials(hidden, weight, target, temperature, vocab_start, vocab_size)


@_linear_logp_partials.register_fake
def _(hidden, weight, target, temperature, vocab_start, vocab_size):
    g0, g1 = _check_partials(hidden, weight, target, temperature, vocab_start, vocab_size)
    t, f = hidden.shape[0], torch.float32
    return (hidden.new_empty((t, g1 - g0), dtype=f), hidden.new_empty((t, g1 - g0), dtype=f),
            hidden.new_empty((t,), dtype=f))


def linear_logp_partials(hidden: torch.Tensor, weight_shard: torch.Tensor, target: torch.Tensor,
                         temperature: float | torch.Tensor, vocab_start: int, vocab_size: int, kept=None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One tensor-parallel rank's half of :func:`linear_logprobs` (contract ``rlk.logp.v1``).

    ``weight_shard`` ``[V_local, H]`` holds rows ``[vocab_start, vocab_start + V_local)`` of the LM
    head, on group boundaries of ``vocab_size``. Returns ``(m, s, z_target)`` exactly as
    :func:`~rlk_core.ops.token_logprobs.logp_partials` returns them for
    ``linear(hidden, weight_shard)``; gather and merge them with
    :func:`~rlk_core.ops.token_logprobs.merge_logp_partials`. Not differentiable. With ``kept``: the processed
    partials (op ``processed_linear_logp_partials``).
    """
    temp = L.as_temperature("linear_logp_partials", temperature, hidden.shape[0], hidden.device)
    if kept is not None:
        value, token_id = as_kept("processed_linear_logp_partials", kept, hidden.shape[0], hidden.device)
        return _processed_linear_logp_partials(hidden, weight_shard, target, temp, value, token_id,
                                               int(vocab_start), int(vocab_size))
    return _linear_logp_partials(hidden, weight_shard, target, temp, int(vocab_start),
                                              int(vocab_size))


# -- contract rlk.logp.processed.v1: the same ops with a kept set (value, token_id) per row -----------------
PROCESSED = "processed_linear_logprobs"


@define(PROCESSED)
def _processed_linear_logprobs(hidden: torch.Tensor, weight: list[torch.Tensor], target: torch.Tensor,
                               temperature: torch.Tensor, kept_value: torch.Tensor, kept_id: torch.Tensor
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    _check(hidden, weight, target, temperature)
    _check_kept(PROCESSED, hidden.shape[0], kept_value, kept_id, hidden)


@_processed_linear_logprobs.register_fake
def _(hidden, weight, target, temperature, kept_value, kept_id):
    _check(hidden, weight, target, temperature)
    t = hidden.shape[0]
    return hidden.new_empty((t,), dtype=torch.float32), hidden.new_empty((t,), dtype=torch.float32)


@define("processed_linear_logprobs_backward")
def _processed_linear_logprobs_backward(hidden: torch.Tensor, weight: list[torch.Tensor], target: torch.Tensor,
                                        temperature: torch.Tensor, kept_value: torch.Tensor, kept_id: torch.Tensor,
                                        lse: torch.Tensor, grad_logp: torch.Tensor, grad_lse: torch.Tensor
                                        ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    pass


@_processed_linear_logprobs_backward.register_fake
def _(hidden, weight, target, temperature, kept_value, kept_id, lse, grad_logp, grad_lse):
    return torch.empty_like(hidden), [torch.empty_like(w) for w in weight]


def _processed_setup_context(ctx, inputs, output) -> None:
    hidden, weight, target, temperature, kept_value, kept_id = inputs
    ctx.save_for_backward(hidden, target, temperature, kept_value, kept_id, output[1], *weight)


def _processed_backward(ctx, grad_logp, grad_lse):
    hidden, target, temperature, kept_value, kept_id, lse, *weight = ctx.saved_tensors
    g_logp, g_lse = L.grads_or_zeros(lse, grad_logp, grad_lse)
    dh, dws = _processed_linear_logprobs_backward(hidden, weight, target, temperature, kept_value, kept_id, lse,
                                                  g_logp, g_lse)
    return dh, list(dws), None, None, None, None


_processed_linear_logprobs.register_autograd(_processed_backward, setup_context=_processed_setup_context)


@define("processed_linear_logp_partials")
def _processed_linear_logp_partials(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                    temperature: torch.Tensor, kept_value: torch.Tensor, kept_id: torch.Tensor,
                                    vocab_start: int, vocab_size: int
                                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_partials(hidden, weight, target, temperature, vocab_start, vocab_size)
    _check_kept("processed_linear_logp_partials", hidden.shape[0], kept_value, kept_id, hidden)


@_processed_linear_logp_partials.register_fake
def _(hidden, weight, target, temperature, kept_value, kept_id, vocab_start, vocab_size):
    g0, g1 = _check_partials(hidden, weight, target, temperature, vocab_start, vocab_size)
    t, f = hidden.shape[0], torch.float32
    return (hidden.new_empty((t, g1 - g0), dtype=f), hidden.new_empty((t, g1 - g0), dtype=f),
            hidden.new_empty((t,), dtype=f))


REGISTRY.register(Backend("rlk.reference", OP, linear_logprobs_reference, devices=("cpu", "cuda"), builtin=True))
REGISTRY.register(Backend("rlk.reference", "linear_logprobs_backward", linear_logprobs_backward_reference,
                          devices=("cpu", "cuda"), builtin=True))
REGISTRY.register(Backend("rlk.reference", "linear_logp_partials", linear_logp_partials_reference,
                          devices=("cpu", "cuda"), builtin=True))
M = "rlk_core.ops.linear_logprobs.triton"
register_kernel_backends(OP, f"{M}:forward", f"{M}:supports")
register_kernel_backends("linear_logprobs_backward", f"{M}:backward", f"{M}:supports_backward")
register_kernel_backends("linear_logp_partials", f"{M}:linear_logp_partials", f"{M}:supports_partials")
for _op, _ref, _plan, _sup in (
        (PROCESSED, processed_linear_logprobs_reference, "processed_forward", "supports_processed"),
        ("processed_linear_logprobs_backward", processed_linear_logprobs_backward_reference, "processed_backward",
         "supports_processed_backward"),
        ("processed_linear_logp_partials", processed_linear_logp_partials_reference, "processed_linear_logp_partials",
         "supports_processed_partials")):
    REGISTRY.register(Backend("rlk.reference", _op, _ref, devices=("cpu", "cuda"), builtin=True))
    register_kernel_backends(_op, f"{M}:{_plan}", f"{M}:{_sup}")
