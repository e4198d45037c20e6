"""The MoE block on rlk ops (contract ``rlk.moe.v1``, ``docs/ops/moe.md``): router GEMM (``linear``), ``moe_topk``,
dispatch, the experts' gate/up and down (``moe_grouped_linear``) around ``swiglu``, un-dispatch, ``moe_combine``.

Dispatch and un-dispatch are data movement: a permutation of the ``T * k`` (token, slot) pairs sorted by (expert,
token, slot) and row gathers. Their backwards hold no arithmetic of their own but rlk's: un-dispatch's is the
inverse gather, dispatch's sums each token's k slot gradients with ``moe_combine`` (weights 1: the slot-order fp32
sum, one rounding) — never ``index_add_`` / ``scatter_add_``, whose order on the GPU is the thread schedule's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlk_core.ops.linear import linear
from rlk_core.ops.moe import moe_combine, moe_grouped_linear, moe_topk
from rlk_core.ops.swiglu import swiglu


@dataclass(frozen=True)
class Routing:
    """Where each (token, slot) pair goes: ``order[m]`` = the pair ``t * k + j`` at sorted row ``m``, ``inv`` its
    inverse, ``offsets [E + 1]`` each expert's rows; ``ids``/``weights`` the router's ``[T, k]`` choice."""

    ids: torch.Tensor
    weights: torch.Tensor
    order: torch.Tensor
    inv: torch.Tensor
    offsets: torch.Tensor

    @property
    def top_k(self) -> int:
        return self.ids.shape[1]


def route(ids: torch.Tensor, weights: torch.Tensor, num_experts: int) -> Routing:
    """Sort the pairs by the unique key ``expert * T * k + t * k + j`` (any correct sort gives this order), the
    offsets by a search of the sorted expert ids — integer work only, no atomics (``bincount`` is not used)."""
    t, k = ids.shape
    pairs = torch.arange(t * k, device=ids.device)
    order = torch.argsort(ids.reshape(-1).to(torch.int64) * (t * k) + pairs)
    inv = torch.empty_like(order)
    inv[order] = pairs
    bounds = torch.arange(num_experts + 1, device=ids.device, dtype=torch.int64)
    offsets = torch.searchsorted(ids.reshape(-1)[order].to(torch.int64).contiguous(), bounds)
    return Routing(ids, weights, order, inv, offsets)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, order, inv, top_k):
        ctx.save_for_backward(inv)
        ctx.shape = (x.shape[0], top_k, x.shape[1])
        return x.index_select(0, torch.div(order, top_k, rounding_mode="floor"))

    @staticmethod
    def backward(ctx, grad):
        (inv,) = ctx.saved_tensors
        t, k, h = ctx.shape
        slots = grad.index_select(0, inv).view(t, k, h)
        return moe_combine(slots, slots.new_ones((t, k), dtype=torch.float32)), None, None, None


class _Undispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, order, inv, top_k):
        ctx.save_for_backward(order)
        return rows.index_select(0, inv).view(-1, top_k, rows.shape[1])

    @staticmethod
    def backward(ctx, grad):
        (order,) = ctx.saved_tensors
        return grad.reshape(-1, grad.shape[2]).index_select(0, order), None, None, None


def dispatch(x: torch.Tensor, r: Routing) -> torch.Tensor:
    """``x [T, H]`` -> the ``[T * k, H]`` rows grouped by expert (pair order within an expert)."""
    return _Dispatch.apply(x, r.order, r.inv, r.top_k)


def undispatch(rows: torch.Tensor, r: Routing) -> torch.Tensor:
    """The grouped rows back to ``[T, k, H]``, slot ``j`` of token ``t`` at ``[t, j]``."""
    return _Undispatch.apply(rows, r.order, r.inv, r.top_k)


def experts(x: torch.Tensor, r: Routing, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Each pair's SwiGLU expert MLP and the combine: ``w13 [E, 2I, H]`` (gate rows, then up), ``w2 [E, H, I]``."""
    h = moe_grouped_linear(dispatch(x, r), w13, r.offsets)
    o = moe_grouped_linear(swiglu(h), w2, r.offsets)
    return moe_combine(undispatch(o, r), r.weights)


def moe_ffn(x: torch.Tensor, router_weight: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
            normalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The routed experts of one MoE block for ``x [T, H]`` (after the post-attention RMSNorm): returns ``(y [T, H],
    ids [T, k])``. ``router_weight [E, H]`` (the router GEMM in x's dtype), ``w13``/``w2`` as :func:`experts`. Shared
    experts, where a model has them, are the dense FFN (``linear``, ``swiglu``, ``linear``) added by the caller."""
    logits = linear(x, router_weight)
    weights, ids = moe_topk(logits, top_k, normalize)
    r = route(ids, weights, router_weight.shape[0])
    return experts(x, r, w13, w2), ids
