"""``linear_logprobs`` and ``linear_logp_partials`` on ``rlk.cuda``: the forward of
:mod:`rlk_core.ops.linear_logprobs.triton` with its log-prob kernels from their AOT cubins
(:mod:`rlk_core.ops.token_logprobs.cuda`'s launches, the same ones ``token_logprobs`` makes) and each chunk's logits
from the public ``linear`` op, as the Triton forward computes them (``torch.ops.rlk.linear``: whichever backend the
registry picks for it, ``rlk.cuda`` or ``rlk.triton``, gives the same bits).

The logits are produced between the launches, so these calls run their launches from Python (each resolved as
the JIT would specialise it); ``supports`` decides a call signature once, on meta stand-ins.

``linear_logprobs_backward`` is registered so that a forced ``rlk.cuda`` (``RLK_BACKENDS``, which forces the
companions too) says why it cannot run: its GEMMs read transposed views (``dhidden``: each weight chunk; ``dW``:
``dz`` and ``hidden``, through ``linear_2d_into``), specialisations of the GEMM kernels the AOT set does not build
(they belong to the linear op's enumeration). Every call is declined, so ``rlk.triton`` runs it (``same_bits_as``:
not a fallback).
"""

from __future__ import annotations

from typing import Any

import torch

from rlk_core.ops import _cuda_calls as cl
from rlk_core.ops import _logp_tree as L
from rlk_core.ops.linear_logprobs import triton as lt
from rlk_core.ops.token_logprobs import cuda as tc

BACKWARD_NOT_BUILT = ("linear_logprobs_backward on rlk.cuda: its GEMMs read their operands transposed (dhidden: "
                      "W[chunk].t(); dW: dz.t() and hidden.t(), linear_2d_into), GEMM specialisations the AOT "
                      "set does not build")


def _partials_into(calls: cl.Calls, hidden, weight, target, temperature, vocab_start, vocab_size, m, s, zt,
                   g_first: int = 0) -> None:
    """``triton._partials_into``: per chunk, its logits (``torch.ops.rlk.linear``; deciding: a stand-in for the
    fresh ``[T, C]`` output) and their block partials into groups ``g_first ...`` of ``m``, ``s``."""
    t = hidden.shape[0]
    for i, c0, c1, slot in lt._chunks(vocab_start, weight.shape[0], vocab_size, t, hidden.element_size()):
        if calls.meta:
            logits = torch.empty((t, c1 - c0), dtype=hidden.dtype, device="meta")
        else:
            logits = torch.ops.rlk.linear(hidden, weight[c0:c1], None)
        tc.block_partials_into(calls, cl.Slice(logits, logits), temperature, target, cl.Slice(m, m[:, g_first + i]),
                               cl.Slice(s, s[:, g_first + i]), zt, vocab_start + c0, slot)
        del logits


def _forward(calls: cl.Calls, hidden, weights, target, temperature) -> tuple[Any, Any]:
    """``triton.forward``."""
    target, temperature = calls.contiguous(target), calls.contiguous(temperature)
    vocab_size = sum(w.shape[0] for w in weights)
    m, s, zt = tc.new_partials(calls, hidden.shape[0], L.num_groups(vocab_size), vocab_size)
    start, gi = 0, 0
    for w in weights:
        g0, g1 = L.shard_groups("linear_logprobs", start, w.shape[0], vocab_size)
        _partials_into(calls, hidden, w, target, temperature, start, vocab_size, m, s, zt, gi)
        gi += g1 - g0
        start += w.shape[0]
    return tc.merge_logp_partials_into(calls, *tc.merge_blocks(calls, m, s), zt)


def _partials(calls: cl.Calls, hidden, weight, target, temperature, vocab_start, vocab_size) -> tuple[Any, Any, Any]:
    """``triton.linear_logp_partials``."""
    target, temperature = calls.contiguous(target), calls.contiguous(temperature)
    g0, g1 = L.shard_groups("linear_logp_partials", vocab_start, weight.shape[0], vocab_size)
    m, s, zt = tc.new_partials(calls, hidden.shape[0], g1 - g0, vocab_size)
    _partials_into(calls, hidden, weight, target, temperature, vocab_start, vocab_size, m, s, zt)
    gm, gs = tc.merge_blocks(calls, m, s)
    return gm, gs, zt


_FORWARD = cl.Served("linear_logprobs", _forward, lt.supports, lambda h, ws, t, temp: (h, *ws, t, temp),
                     lambda h, ws, *_: (len(ws),))
_PARTIALS = cl.Served("linear_logp_partials", _partials, lambda h, w, t, temp, *_: lt.supports(h, [w], t, temp),
                      lambda h, w, t, temp, *_: (h, w, t, temp), lambda h, w, t, temp, start, size: (start, size))
forward, supports = _FORWARD.run, _FORWARD.supports
linear_logp_partials, supports_partials = _PARTIALS.run, _PARTIALS.supports


def backward(hidden, weights, target, temperature, lse, grad_logp, grad_lse):
    raise RuntimeError(BACKWARD_NOT_BUILT)


def supports_backward(hidden, weights, target, temperature, lse, grad_logp, grad_lse) -> tuple[bool, str]:
    return False, BACKWARD_NOT_BUILT
