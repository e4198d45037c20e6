"""Reference MoE ops — the specification of contract ``rlk.moe.v1`` (``docs/ops/moe.md``).

Every reduction is a fixed-order fp32 reduction of :mod:`rlk_core.ops._fixed` or a left-to-right sum over the
k slots, written with elementwise tensor operations whose structure depends only on the reduced length: the
result for a token depends only on that token (and the weights), on the CPU by construction.

- :func:`moe_topk_reference`: ``p = exp(l - max l) / tree_sum(exp(l - max l))`` in fp32; slots take the experts
  in the order (p desc, id asc) — a stable descending sort of the row; ``normalize``: ``w_j = p_j / S`` with
  ``S = p_0 + ... + p_{k-1}`` left to right.
- :func:`moe_grouped_linear_reference`: each expert's rows through :func:`linear_reference` with its weight.
- :func:`moe_combine_reference`: ``acc = w_0 o_0; acc = acc + w_j o_j`` for ``j = 1..k-1``, in fp32, one rounding.
"""

from __future__ import annotations

import torch

from rlk_core.ops import _checks as C
from rlk_core.ops._fixed import matmul_nt, tree_sum
from rlk_core.ops.linear.reference import linear_reference


def softmax_fp32(logits: torch.Tensor) -> torch.Tensor:
    """``p`` of a ``[T, E]`` row block: max (exact), ``exp`` elementwise, the fixed tree over E, a division."""
    lf = logits.float()
    z = torch.exp(lf - lf.amax(dim=-1, keepdim=True))
    return z / tree_sum(z)[:, None]


def _slot_sum(v: torch.Tensor) -> torch.Tensor:
    """``v[:, 0] + v[:, 1] + ... `` left to right in fp32 (``[T, k]`` -> ``[T]``)."""
    acc = v[:, 0].clone()
    for j in range(1, v.shape[1]):
        acc = acc + v[:, j]
    return acc


def moe_topk_reference(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    p = softmax_fp32(logits)
    # stable: equal probabilities keep their index order, so the lower expert id comes first
    vals, ids = torch.sort(p, dim=-1, descending=True, stable=True)
    vals, ids = vals[:, :top_k].contiguous(), ids[:, :top_k].contiguous()
    if normalize:
        vals = vals / _slot_sum(vals)[:, None]
    return vals, ids


def moe_topk_backward_reference(grad: torch.Tensor, logits: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                                normalize: bool) -> torch.Tensor:
    """``dl = q * (G - c)``: ``c = g_0 w_0 + ... + g_{k-1} w_{k-1}`` left to right, ``G`` the slot gradients at
    their ids, ``q`` the weights at their ids (``normalize``) or the full softmax ``p``; one rounding."""
    g = grad.float()
    c = _slot_sum(g * weights)
    big_g = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(1, ids, g)
    if normalize:
        q = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(1, ids, weights)
    else:
        q = softmax_fp32(logits)
    return (q * (big_g - c[:, None])).to(logits.dtype)


def _bounds(offsets: torch.Tensor, m: int, op: str) -> list[int]:
    """The offsets as host integers, checked: ``0 = o[0] <= o[1] <= ... <= o[E] = M``."""
    o = [int(v) for v in offsets.tolist()]
    C.require(o[0] == 0 and o[-1] == m and all(a <= b for a, b in zip(o, o[1:], strict=False)), op,
              f"offsets must rise from 0 to the {m} rows, got {o if len(o) <= 12 else o[:12] + ['...']}")
    return o


def moe_grouped_linear_reference(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    o = _bounds(offsets, x.shape[0], "moe_grouped_linear")
    y = x.new_empty((x.shape[0], weight.shape[1]))
    for e in range(weight.shape[0]):
        if o[e + 1] > o[e]:
            y[o[e]:o[e + 1]] = linear_reference(x[o[e]:o[e + 1]], weight[e], None)
    return y


def moe_grouped_linear_backward_reference(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                                          offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``dx`` = the grouped GEMM of ``grad`` with ``weight`` seen as ``[E, K, N]``; ``dweight[e]`` = ``grad[seg]^T
    x[seg]`` reduced over the segment's rows by the fixed tree, rounded once; zeros for an empty segment."""
    o = _bounds(offsets, x.shape[0], "moe_grouped_linear_backward")
    dx = moe_grouped_linear_reference(grad.to(x.dtype), weight.transpose(1, 2), offsets)
    dw = torch.zeros(weight.shape, dtype=weight.dtype, device=weight.device)
    for e in range(weight.shape[0]):
        if o[e + 1] > o[e]:
            g, xs = grad[o[e]:o[e + 1]].float(), x[o[e]:o[e + 1]].float()
            dw[e] = matmul_nt(g.t().contiguous(), xs.t().contiguous()).to(weight.dtype)
    return dx, dw


def moe_combine_reference(expert_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    acc = weights[:, 0, None] * expert_out[:, 0].float()
    for j in range(1, expert_out.shape[1]):
        acc = acc + weights[:, j, None] * expert_out[:, j].float()
    return acc.to(expert_out.dtype)


def moe_combine_backward_reference(grad: torch.Tensor, expert_out: torch.Tensor, weights: torch.Tensor
                                   ) -> tuple[torch.Tensor, torch.Tensor]:
    g = grad.float()
    d_out = (g[:, None, :] * weights[:, :, None]).to(expert_out.dtype)
    d_w = tree_sum(g[:, None, :] * expert_out.float())
    return d_out, d_w
