"""Reference GEMM — the specification of contract ``rlk.gemm.bi.v1``.

``y[m, n] = round_to(x.dtype)( tree_sum_k( f32(x[m, k]) * f32(w[n, k]) ) + f32(bias[n]) )``

The K reduction is :func:`rlk_core.ops._fixed.tree_sum` (pairwise halves, structure fixed by K);
products of bf16/fp16 inputs are exact in fp32; the bias is added in fp32 after the reduction; the
result is rounded once to the activation dtype. Nothing depends on M or on a row's position.
"""

from __future__ import annotations

import math

import torch

from rlk_core.ops._fixed import matmul_nt


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    lead = x.shape[:-1]
    x2 = x.reshape(math.prod(lead), x.shape[-1]).float()  # explicit M: reshape(-1, 0) is ambiguous
    y = matmul_nt(x2, weight.float())
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*lead, weight.shape[0])
