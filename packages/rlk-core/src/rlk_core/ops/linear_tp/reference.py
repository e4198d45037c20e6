"""Reference of contract ``rlk.gemm.tp.v1`` — the TP-invariant row-parallel GEMM (``docs/ops/linear_tp.md``).

``linear_tp_partials(x, w, leaves)[m, n] = pairs_sum_j( tree_sum_k( f32(x[m, jL + k]) * f32(w[n, jL + k]) ) )``
with ``L = K / leaves``: each of the ``leaves`` contiguous K leaves reduced by
:func:`rlk_core.ops._fixed.tree_sum` (the batch-invariant order of ``rlk.gemm.bi.v1`` over L), the leaves merged
by :func:`pairs_sum` — adjacent pairs over leaf order, ``((l0 + l1) + (l2 + l3)) + ...`` — in fp32, never rounded.
``linear_tp_finish(s, bias, dtype) = round_to(dtype)(s + f32(bias))`` with NaN made canonical is the one rounding.
Nothing depends on M, on a row's position, or on how many ranks hold the leaves.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from rlk_core.ops._fixed import matmul_nt

# The NaN the one rounding returns (sign +, quiet bit, zero payload), as rlk_collectives.CANONICAL_NAN.
CANONICAL_NAN = float("nan")


def pairs_sum(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Merge fp32 tensors (leaf order; a power-of-two count) by the balanced adjacent-pairs tree: each level adds
    ``(p0 + p1), (p2 + p3), ...`` — the tree of ``rlk.collective.v1`` over rank order, so that an aligned run of
    leaves held by one rank is one subtree."""
    level = list(parts)
    if not level or len(level) & (len(level) - 1):
        raise ValueError(f"pairs_sum needs a power-of-two number of parts, got {len(level)}")
    while len(level) > 1:
        level = [level[i] + level[i + 1] for i in range(0, len(level), 2)]
    return level[0]


def linear_tp_partials_reference(x: torch.Tensor, weight: torch.Tensor, leaves: int) -> torch.Tensor:
    lead, k = x.shape[:-1], x.shape[-1]
    n = weight.shape[0]
    x2 = x.reshape(math.prod(lead), k).float()  # explicit M: reshape(-1, 0) is ambiguous
    w = weight.float()
    size = k // leaves
    parts = [matmul_nt(x2[:, j * size:(j + 1) * size], w[:, j * size:(j + 1) * size]) for j in range(leaves)]
    return pairs_sum(parts).reshape(*lead, n)


def linear_tp_finish_reference(s: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    if bias is not None:
        s = s + bias.float()
    y = s.to(dtype, copy=True)
    return y.masked_fill_(y.isnan(), CANONICAL_NAN)


def linear_tp_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, leaves: int) -> torch.Tensor:
    """``linear_tp`` (TP 1): the partial over all ``leaves`` leaves and the one rounding."""
    return linear_tp_finish_reference(linear_tp_partials_reference(x, weight, leaves), bias, x.dtype)
