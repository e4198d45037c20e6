"""``token_logprobs``, its backward, ``logp_partials`` and ``merge_logp_partials`` on ``rlk.cuda``: ``rlk.triton``'s
log-prob kernels (:mod:`rlk_core.ops.token_logprobs.triton`) from their AOT cubins, launched by ``rlk_core._C``.

Each op's launches are written once below, as the Triton launchers write them, against a
:class:`~rlk_core.ops._cuda_common.Calls`: deciding a call signature (``supports``) runs them on meta stand-ins
— every launch resolved as the JIT would specialise it (only that binary is served; a vocabulary, split or layout
not built is declined and runs on ``rlk.triton``) and kept as a :class:`~rlk_core.ops._cuda_common.Program`; a
signature seen before is one dict lookup in ``supports`` and one in the op, then one ``_C.run_program`` (the
partial buffers allocated and filled, the leaf-block, group and final merges launched, in C++). Calls that need a
copy of an input (non-contiguous targets, temperatures or gradients) run the same launches from Python.
"""

from __future__ import annotations

from typing import Any

import torch

from rlk_core.aot.specs import TRITON_TYPE
from rlk_core.ops import _cuda_calls as cl
from rlk_core.ops import _logp_tree as L
from rlk_core.ops.token_logprobs import triton as tt

F32 = torch.float32


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _target_name(dtype: torch.dtype, target: torch.Tensor) -> str:
    return f"{TRITON_TYPE[dtype]},target={cl.POINTER_TYPES[cl.type_name(target.dtype)][1:]}"


# -- the Triton launchers' launches, on a Calls ----------------------------------------------------------
def new_partials(calls: cl.Calls, t: int, groups: int, vocab_size: int) -> tuple[Any, Any, Any]:
    """``triton.new_partials``: identity-filled ``[T, groups, P]`` partials and ``z_target = -inf``."""
    p = L.padded_blocks(vocab_size)
    return (calls.new((t, groups, p), F32, "-inf"), calls.new((t, groups, p), F32, "zeros"),
            calls.new((t,), F32, "-inf"))


def block_partials_into(calls: cl.Calls, x: cl.Slice, temperature, target, m: cl.Slice, s: cl.Slice, zt, col0: int,
                        slot0: int) -> None:
    """``triton.block_partials_into`` of the columns ``x`` (a slice of an input, or of a logits buffer)."""
    t, w = x.view.shape
    if t == 0 or w == 0:
        return
    assert m.view.stride(1) == 1 and s.view.stride(1) == 1 and m.view.stride(0) == s.view.stride(0)
    args = cl.positional(tt._logp_block_fwd_kernel, x, temperature, target, m, s, zt, t, w, col0, slot0,
                         x.view.stride(0), x.view.stride(1), m.view.stride(0), BLOCK_T=tt.BLOCK_T, BLOCK=L.BLOCK)
    calls.launch(tt._logp_block_fwd_kernel, (_cdiv(t, tt.BLOCK_T), _cdiv(w, L.BLOCK)), args,
                 {"num_warps": tt.NUM_WARPS}, _target_name(x.view.dtype, target))


def shard_block_partials_into(calls: cl.Calls, x, temperature, target, vocab_start: int, vocab_size: int, m, s, zt,
                              g_first: int = 0) -> None:
    """``triton.shard_block_partials_into``: every group of the shard ``x``; its partials are groups
    ``g_first ...`` of the ``[T, G, P]`` buffers ``m``, ``s``."""
    g0, g1 = L.shard_groups("logp_partials", vocab_start, x.shape[1], vocab_size)
    bounds = L.group_bounds(vocab_size)
    for i, g in enumerate(range(g0, g1)):
        lo, hi = bounds[g] - vocab_start, bounds[g + 1] - vocab_start
        block_partials_into(calls, cl.Slice(x, x[:, lo:hi]), temperature, target, cl.Slice(m, m[:, g_first + i]),
                            cl.Slice(s, s[:, g_first + i]), zt, bounds[g], 0)


def merge_blocks(calls: cl.Calls, m, s) -> tuple[Any, Any]:
    """``triton.merge_blocks``: ``[T, G, P]`` block partials -> ``[T, G]`` group partials."""
    t, groups, p = m.shape
    assert p & (p - 1) == 0 and p <= tt.MAX_PADDED_BLOCKS, p
    m, s = calls.contiguous(m), calls.contiguous(s)
    gm, gs = calls.new((t, groups), F32), calls.new((t, groups), F32)
    if t == 0 or groups == 0:
        return gm, gs
    args = cl.positional(tt._merge_blocks_kernel, m, s, gm, gs, t, m.stride(0), m.stride(1), gm.stride(0),
                         BLOCK_T=tt.MERGE_BLOCK_T, P=p)
    calls.launch(tt._merge_blocks_kernel, (_cdiv(t, tt.MERGE_BLOCK_T), groups), args,
                 {"num_warps": tt.NUM_WARPS, "enable_fp_fusion": False}, "fp32")
    return gm, gs


def merge_logp_partials_into(calls: cl.Calls, m, s, z_target) -> tuple[Any, Any]:
    """``triton.merge_logp_partials``: ``[T, k]`` group partials and ``z[target]`` -> ``(logp, lse)``."""
    t, k = m.shape
    assert k <= L.GROUPS, k
    m, s, z_target = (calls.contiguous(x, F32) for x in (m, s, z_target))
    logp, lse = calls.new((t,), F32), calls.new((t,), F32)
    if t == 0:
        return logp, lse
    args = cl.positional(tt._merge_groups_kernel, m, s, z_target, logp, lse, t, k, m.stride(0), s.stride(0),
                         BLOCK_T=tt.MERGE_BLOCK_T, GROUPS=L.GROUPS)
    calls.launch(tt._merge_groups_kernel, (_cdiv(t, tt.MERGE_BLOCK_T),), args,
                 {"num_warps": tt.NUM_WARPS, "enable_fp_fusion": False}, "fp32")
    return logp, lse


def grad_into(calls: cl.Calls, x, out, target, temperature, lse, g_logp, g_lse, col0: int) -> None:
    """``triton.grad_into``: ``out = dL/dlogits`` of ``x`` (columns ``[col0, col0 + w)``)."""
    t, w = x.shape
    if t == 0 or w == 0:
        return
    args = cl.positional(tt._logp_grad_kernel, x, out, temperature, target, lse, g_logp, g_lse, t, w, col0,
                         x.stride(0), x.stride(1), out.stride(0), out.stride(1), BLOCK_T=tt.GRAD_BLOCK_T,
                         BLOCK_N=tt.GRAD_BLOCK_N)
    calls.launch(tt._logp_grad_kernel, (_cdiv(t, tt.GRAD_BLOCK_T), _cdiv(w, tt.GRAD_BLOCK_N)), args,
                 {"num_warps": tt.NUM_WARPS}, _target_name(x.dtype, target))


# -- the ops -------------------------------------------------------------------------------------------
def _forward(calls: cl.Calls, shards, target, temperature) -> tuple[Any, Any]:
    """``triton.forward``."""
    target, temperature = calls.contiguous(target), calls.contiguous(temperature)
    vocab_size = sum(x.shape[1] for x in shards)
    t = shards[0].shape[0]
    m, s, zt = new_partials(calls, t, L.num_groups(vocab_size), vocab_size)
    start, gi = 0, 0
    for x in shards:
        g0, g1 = L.shard_groups("token_logprobs", start, x.shape[1], vocab_size)
        shard_block_partials_into(calls, x, temperature, target, start, vocab_size, m, s, zt, gi)
        gi += g1 - g0
        start += x.shape[1]
    return merge_logp_partials_into(calls, *merge_blocks(calls, m, s), zt)


def _backward(calls: cl.Calls, shards, target, temperature, lse, grad_logp, grad_lse) -> list[Any]:
    """``triton.backward``."""
    out, start = [], 0
    target, temperature = calls.contiguous(target), calls.contiguous(temperature)
    g_logp, g_lse = calls.contiguous(grad_logp, F32), calls.contiguous(grad_lse, F32)
    lse = calls.contiguous(lse)
    for x in shards:
        d = calls.new(x.shape, x.dtype)
        grad_into(calls, x, d, target, temperature, lse, g_logp, g_lse, start)
        out.append(d)
        start += x.shape[1]
    return out


def _logp_partials(calls: cl.Calls, x, target, temperature, vocab_start, vocab_size) -> tuple[Any, Any, Any]:
    """``triton.logp_partials`` (``gm.contiguous()`` is ``gm``: a fresh ``[T, G]``)."""
    g0, g1 = L.shard_groups("logp_partials", vocab_start, x.shape[1], vocab_size)
    m, s, zt = new_partials(calls, x.shape[0], g1 - g0, vocab_size)
    shard_block_partials_into(calls, x, temperature, target, vocab_start, vocab_size, m, s, zt)
    gm, gs = merge_blocks(calls, m, s)
    return gm, gs, zt


def _merge(calls: cl.Calls, m, s, z_target, vocab_size) -> tuple[Any, Any]:
    return merge_logp_partials_into(calls, m, s, z_target)


def _dtype_ok(x: torch.Tensor) -> tuple[bool, str]:
    return tt.supports([x], None, None)


_FORWARD = cl.Served("token_logprobs", _forward, lambda shards, *_: _dtype_ok(shards[0]),
                     lambda shards, target, temperature: (*shards, target, temperature),
                     lambda shards, *_: (len(shards),))
_BACKWARD = cl.Served("token_logprobs_backward", _backward, lambda shards, *_: _dtype_ok(shards[0]),
                      lambda shards, *rest: (*shards, *rest), lambda shards, *_: (len(shards),), rebuild=list)
_PARTIALS = cl.Served("logp_partials", _logp_partials, lambda x, *_: _dtype_ok(x), lambda x, t, temp, *_: (x, t, temp),
                      lambda x, t, temp, vocab_start, vocab_size: (vocab_start, vocab_size))
_MERGE = cl.Served("merge_logp_partials", _merge, lambda m, *_: _dtype_ok(m), lambda m, s, zt, _: (m, s, zt),
                   lambda m, s, zt, vocab_size: (vocab_size,))

forward, supports = _FORWARD.run, _FORWARD.supports
backward, supports_backward = _BACKWARD.run, _BACKWARD.supports
logp_partials, supports_logp_partials = _PARTIALS.run, _PARTIALS.supports
merge_logp_partials, supports_merge_logp_partials = _MERGE.run, _MERGE.supports
