"""Reference RMSNorm — the specification of contract ``rlk.rms_norm.v1``.

``y = round_to(x.dtype)( f32(x) * rsqrt(tree_sum(f32(x)^2) / H + eps) * f32(w) )``

The sum of squares is reduced by :func:`rlk_core.ops._fixed.tree_sum`; the division by H, the
``+ eps``, ``rsqrt`` and both multiplications are elementwise fp32 operations (``x * inv`` first,
then ``* w``); one rounding at the end. Nothing depends on other rows.
"""

from __future__ import annotations

import torch

from rlk_core.ops._fixed import tree_sum


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    ss = tree_sum(xf * xf)
    inv = torch.rsqrt(ss / x.shape[-1] + eps)
    return ((xf * inv[..., None]) * weight.float()).to(x.dtype)
