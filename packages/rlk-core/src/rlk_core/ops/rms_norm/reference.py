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


def rms_norm_backward_reference(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dweight)`` of ``rms_norm`` in fp32, rounded once to the input dtypes: with
    ``xhat = f32(x) * inv`` and ``gw = f32(grad) * f32(w)``, ``dx = inv * (gw - xhat * mean(gw * xhat))``,
    ``dweight = sum over rows of f32(grad) * xhat``. Deterministic (fixed-shape reductions, no atomics);
    the forward's rounding is taken as the identity."""
    xf = x.float()
    inv = torch.rsqrt((xf * xf).sum(-1, keepdim=True) / x.shape[-1] + eps)
    xhat = xf * inv
    g = grad.float()
    gw = g * weight.float()
    dx = inv * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))
    dw = (g * xhat).reshape(-1, x.shape[-1]).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype)
