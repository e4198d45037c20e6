"""``linear_logprobs`` and ``linear_logp_partials`` on ``rlk.cuda``: the forward of
:mod:`rlk_core.ops.linear_logprobs.triton` with its log-prob kernels from their AOT cubins
(:mod:`rlk_core.ops.token_logprobs.cuda`'s launches, the same ones ``token_logprobs`` makes) and each chunk's logits
from the public ``linear`` op, as the Triton forward computes them (``torch.ops.rlk.linear``: whichever backend the
registry picks for it, ``rlk.cuda`` or ``rlk.triton``, gives the same bits).

The logits are produced between the launches, so these calls run their launches from Python (each resolved as
the JIT would specialise it); ``supports`` decides a call signature once, on meta stand-ins.

``linear_logprobs_backward`` the same way: per chunk the logits recomputed (``torch.ops.rlk.linear``), ``dz``
written over them by the log-prob gradient kernel, then the two products on the stored-layout GEMM kernels as the
Triton backward makes them (``linear_2d_into``): ``dhidden``'s ``dz @ W[chunk]`` (``W[chunk].t()`` read as stored,
an fp32 output stored by pointers — a variant built for this op) and ``dW[chunk] = dz^T @ hidden`` (both operands
read as stored: the linear backward's dW variant); ``dhidden`` accumulated in fp32 in column order between them.
"""

from __future__ import annotations

from typing import Any

import torch

from rlk_core.ops import _cuda_calls as cl
from rlk_core.ops import _logp_tree as L
from rlk_core.ops.linear import cuda as lc
from rlk_core.ops.linear_logprobs import triton as lt
from rlk_core.ops.token_logprobs import cuda as tc

F32 = torch.float32


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


def _backward(calls: cl.Calls, hidden, weights, target, temperature, lse, grad_logp, grad_lse) -> tuple[Any, list]:
    """``triton.backward``: ``(dhidden, [dW per shard])``."""
    target, temperature, lse = calls.contiguous(target), calls.contiguous(temperature), calls.contiguous(lse)
    g_logp, g_lse = calls.contiguous(grad_logp, F32), calls.contiguous(grad_lse, F32)
    vocab_size = sum(w.shape[0] for w in weights)
    t, h = hidden.shape
    dh = calls.new((t, h), F32, "zeros")
    part = calls.new((t, h), F32)
    dws, start = [], 0
    for w in weights:
        dw = calls.new(w.shape, w.dtype)
        for _, c0, c1, _ in lt._chunks(start, w.shape[0], vocab_size, t, hidden.element_size()):
            wc = w[c0:c1]
            if calls.meta:  # the logits buffer the linear op returns (a fresh [T, C], overwritten by dz)
                dz = torch.empty((t, c1 - c0), dtype=hidden.dtype, device="meta")
            else:
                dz = torch.ops.rlk.linear(hidden, wc, None)
            tc.grad_into(calls, dz, dz, target, temperature, lse, g_logp, g_lse, start + c0)
            lc.stored_into(calls, dz, wc.t(), part)  # dz [T, C] @ W[chunk] [C, H], fp32 out
            if not calls.meta:
                dh += part
            lc.stored_into(calls, dz.t(), hidden.t(), dw[c0:c1])  # dz^T [C, T] @ hidden [T, H]
            del dz
        dws.append(dw)
        start += w.shape[0]
    return dh.to(hidden.dtype), dws


_BACKWARD = cl.Served("linear_logprobs_backward", _backward,
                      lambda h, ws, t, temp, *_: lt.supports(h, ws, t, temp) if h.shape[0] else (
                          False, "no tokens: rlk.triton's backward has no launch to make"),
                      lambda h, ws, *rest: (h, *ws, *rest), lambda h, ws, *_: (len(ws),),
                      rebuild=lambda outs: (outs[0], list(outs[1])))
backward, supports_backward = _BACKWARD.run, _BACKWARD.supports
