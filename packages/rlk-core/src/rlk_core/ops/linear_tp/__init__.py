"""``linear_tp_partials``: the TP-invariant row-parallel GEMM of contract ``rlk.gemm.tp.v1``.

K is cut into G fixed contiguous leaves (G = the largest TP the run supports, a power of two, default 8); each leaf
is reduced in the batch-invariant fixed order in fp32 and the leaves are merged by one balanced adjacent-pairs tree
— inside the op for the leaves a rank holds, across ranks by ``rlk_collectives.all_reduce_partials`` for the rest,
fp32 on the wire — and rounded once at the end (:func:`linear_tp_finish`). So TP 1, 2, 4, ..., G give the same bits.
See ``docs/ops/linear_tp.md``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from rlk_core.backends import REGISTRY, Backend
from rlk_core.errors import RlkInputError
from rlk_core.ops import _checks as C
from rlk_core.ops._backends import register_kernel_backends
from rlk_core.ops._dispatch import define
from rlk_core.ops.linear import _linear
from rlk_core.ops.linear_tp.reference import (
    linear_tp_finish_reference,
    linear_tp_partials_reference,
    linear_tp_reference,
    pairs_sum,
)
from rlk_core.tp import DEFAULT_LEAVES

MAX_LEAVES = 8  # the most leaves one call merges (the kernel's unrolled tree; 16 spills registers on sm_90)

__all__ = ["DEFAULT_LEAVES", "MAX_LEAVES", "check_layout", "column_leaf_rows", "group_leaves", "linear_tp",
           "linear_tp_finish", "linear_tp_partials", "pairs_sum"]


def _power_of_two(v: int) -> bool:
    return v >= 1 and not v & (v - 1)


def check_layout(op: str, k_local: int, leaves: int) -> None:
    """``leaves`` a power of two in ``1 .. MAX_LEAVES`` that divides the local K."""
    C.require(isinstance(leaves, int) and not isinstance(leaves, bool) and _power_of_two(leaves)
              and leaves <= MAX_LEAVES, op,
              f"leaves must be a power of two from 1 to {MAX_LEAVES} (the leaves this rank holds: G / TP), "
              f"got {leaves!r}")
    C.require(k_local % leaves == 0, op,
              f"the local K={k_local} is not divisible by leaves={leaves}: every leaf has K / G columns, so the "
              f"global K must be divisible by G (Qwen3's row-parallel K are multiples of 1024)")


def column_leaf_rows(components: Sequence[int], leaves: int) -> list[int]:
    """The local output rows of a column-parallel linear in *leaf-major* order, for its TP-invariant input gradient.

    A column-parallel weight's local rows are its components' shards back to back (QKV: ``[q_r; k_r; v_r]``; a
    gated fc1: ``[gate_r; up_r]``; one component otherwise), ``components`` their local sizes. The input gradient
    ``dX = dY W`` reduces over those rows, which TP splits: under ``rlk.gemm.tp.v1`` it is a row-parallel GEMM over
    N whose leaf ``j`` is the concatenation, in component order, of every component's ``j``-th of ``leaves`` equal
    slices — so rank ``r`` of TP t holds leaves ``r G/t .. (r + 1) G/t - 1`` whole, each of the length it has at
    TP 1. The returned index puts the rows in that order: ``linear_tp_partials(dy[..., rows], W[rows].T, leaves)``
    is the rank's fp32 partial (``docs/ops/linear_tp.md``, "Gradients")."""
    for c in components:
        if not isinstance(c, int) or c < 1 or c % leaves:
            raise RlkInputError(f"column_leaf_rows: every component's local size must be a positive multiple of "
                                f"leaves={leaves} (each component is cut into G leaves), got {list(components)}")
    out, start = [], []
    base = 0
    for c in components:
        start.append(base)
        base += c
    for j in range(leaves):
        for c, s in zip(components, start, strict=True):
            size = c // leaves
            out.extend(range(s + j * size, s + (j + 1) * size))
    return out


def group_leaves(count: int, leaves_total: int) -> int:
    """How many leaves a reduction over ``count`` items that TP (or sequence parallelism) splits into contiguous rank
    slices is cut into under ``rlk.gemm.tp.v1`` with G = ``leaves_total``: ``gcd(count, G)`` (a power of two), each
    leaf ``count / n`` consecutive items. Every TP that divides both ``count`` (the split's own rule: heads per rank,
    tokens per rank) and G divides it, so a rank holds whole leaves. Used for the norms' weight gradients: over the
    attention heads (q/k norms) and over the tokens (sequence parallelism)."""
    return math.gcd(count, leaves_total)


@define("linear_tp_partials")
def _linear_tp_partials(x: torch.Tensor, weight: torch.Tensor, leaves: int) -> torch.Tensor:
    op = "linear_tp_partials"
    C.float_tensor(x, op, "x")
    C.float_tensor(weight, op, "weight")
    C.ndim(weight, op, "weight", (2,))
    C.require(x.dim() >= 1, op, f"x must have at least 1 dim, got shape {tuple(x.shape)}")
    C.require(x.shape[-1] == weight.shape[1], op,
              f"x has K={x.shape[-1]} (shape {tuple(x.shape)}) but weight has K={weight.shape[1]} "
              f"(shape {tuple(weight.shape)})")
    C.same_dtype(op, x=x, weight=weight)
    C.same_device(op, x=x, weight=weight)
    check_layout(op, x.shape[-1], leaves)


@_linear_tp_partials.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, leaves: int) -> torch.Tensor:
    _linear_tp_partials.check(x, weight, leaves)
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=torch.float32)


def _setup_context(ctx, inputs, output) -> None:
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight)


def _backward(ctx, grad):
    # dx = dy W (a reduction over N) and dW = dy^T x (over the tokens): neither runs over the TP split, so both are
    # the GEMMs of ``linear``'s backward (rlk.gemm.bi.v1, deterministic run to run) on dy in x's dtype (exact where
    # dy came through linear_tp_finish from an output in that dtype)
    x, weight = ctx.saved_tensors
    g2 = grad.reshape(-1, grad.shape[-1]).to(x.dtype).contiguous()
    dx = dw = None
    if ctx.needs_input_grad[0]:
        dx = _linear(g2, weight.contiguous().t(), None).reshape(x.shape)
    if ctx.needs_input_grad[1]:
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        dw = _linear(g2.t(), x2.t(), None).to(weight.dtype)
    return dx, dw, None


_linear_tp_partials.register_autograd(_backward, setup_context=_setup_context)


def linear_tp_partials(x: torch.Tensor, weight: torch.Tensor, leaves: int) -> torch.Tensor:
    """The fp32 partial of a TP-invariant row-parallel GEMM over the leaves this rank holds (``rlk.gemm.tp.v1``).

    Parameters
    ----------
    x : Tensor ``[..., K_local]``, float32 / bfloat16 / float16 — this rank's K slice of the input.
    weight : Tensor ``[N, K_local]``, same dtype and device — this rank's K slice of the weight.
    leaves : int, the leaves this rank holds: ``G / TP`` (a power of two; ``K_local`` divisible by it).

    Returns
    -------
    Tensor ``[..., N]``, float32: the ``leaves`` contiguous leaves of ``K_local / leaves`` columns, each reduced in
    the batch-invariant fixed order in fp32, merged by the balanced adjacent-pairs tree, not rounded. Merged across
    the TP ranks by ``rlk_collectives.all_reduce_partials`` (the top levels of the same tree) and rounded once by
    :func:`linear_tp_finish`, the result is the same for every TP dividing G. A row depends only on that row of
    ``x``, ``weight`` and the leaf length. Backward: ``dx``, ``dW`` through :func:`rlk_core.ops.linear`
    (deterministic run to run).
    """
    return _linear_tp_partials(x, weight, leaves)


def linear_tp_finish(s: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The one rounding of ``rlk.gemm.tp.v1``: ``round_to(dtype)(s + f32(bias))``, a NaN made the canonical quiet NaN
    (``rlk_collectives.CANONICAL_NAN``). ``s``: the merged fp32 partial ``[..., N]``; ``bias``: ``[N]`` or None."""
    op = "linear_tp_finish"
    C.require(isinstance(s, torch.Tensor) and s.dtype == torch.float32, op,
              f"s must be the float32 merged partial, got {getattr(s, 'dtype', type(s))}")
    C.require(dtype in C.FLOAT_DTYPES, op, f"dtype must be one of {C.FLOAT_DTYPES}, got {dtype}")
    if bias is not None:
        C.float_tensor(bias, op, "bias")
        C.require(bias.shape == (s.shape[-1],), op, f"bias must have shape ({s.shape[-1]},), got {tuple(bias.shape)}")
    return linear_tp_finish_reference(s, bias, dtype)


@define("linear_tp")
def _linear_tp(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, leaves: int) -> torch.Tensor:
    _linear_tp_partials.check(x, weight, leaves)
    if bias is not None:
        op = "linear_tp"
        C.float_tensor(bias, op, "bias")
        C.same_dtype(op, x=x, bias=bias)
        C.same_device(op, x=x, bias=bias)
        C.require(bias.shape == (weight.shape[0],), op,
                  f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")


@_linear_tp.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, leaves: int) -> torch.Tensor:
    _linear_tp.check(x, weight, bias, leaves)
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _setup_context_tp(ctx, inputs, output) -> None:
    x, weight, bias, _ = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _backward_tp(ctx, grad):
    # the partials' backward on dy (the rounding passes the gradient through, as the TP > 1 merge's identity
    # backward does); the bias's gradient as autograd takes it through linear_tp_finish's fp32 add
    dx, dw, _ = _backward(ctx, grad)
    db = None
    if ctx.has_bias and ctx.needs_input_grad[2]:
        db = grad.float().sum_to_size(grad.shape[-1]).to(grad.dtype)
    return dx, dw, db, None


_linear_tp.register_autograd(_backward_tp, setup_context=_setup_context_tp)


def linear_tp(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
              leaves: int = DEFAULT_LEAVES) -> torch.Tensor:
    """The whole row-parallel GEMM on one process (TP 1) under ``rlk.gemm.tp.v1`` (``torch.ops.rlk.linear_tp``):
    bitwise ``linear_tp_finish(linear_tp_partials(x, weight, leaves), bias, x.dtype)`` with ``leaves = G`` — the
    same leaves, tree, fp32 bias add and one rounding (canonical NaN), on ``rlk.triton`` in the last kernel's
    epilogue (one launch, not the partial's and the finish's). Bitwise what TP ranks holding K slices compute with
    :func:`linear_tp_partials` and merge with ``rlk_collectives.all_reduce_partials``. ``bias``: ``[N]`` in ``x``'s
    dtype (another float dtype takes the two steps: the same bits). Backward: ``dx``, ``dW`` as
    :func:`linear_tp_partials`' on ``dy`` (the rounding passes the gradient through)."""
    if isinstance(bias, torch.Tensor) and isinstance(x, torch.Tensor) and bias.dtype != x.dtype:
        return linear_tp_finish(linear_tp_partials(x, weight, leaves), bias, x.dtype)
    return _linear_tp(x, weight, bias, leaves)


REGISTRY.register(Backend("rlk.reference", "linear_tp_partials", linear_tp_partials_reference,
                          devices=("cpu", "cuda"), priority=0, builtin=True))
REGISTRY.register(Backend("rlk.reference", "linear_tp", linear_tp_reference, devices=("cpu", "cuda"), priority=0,
                          builtin=True))
register_kernel_backends("linear_tp_partials", "rlk_core.ops.linear_tp.triton:forward",
                         "rlk_core.ops.linear_tp.triton:supports")
register_kernel_backends("linear_tp", "rlk_core.ops.linear_tp.triton:forward_finished",
                         "rlk_core.ops.linear_tp.triton:supports_finished")
