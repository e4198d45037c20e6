"""``rms_norm``: root-mean-square normalisation under contract ``rlk.rms_norm.v1``."""

from __future__ import annotations

import torch

from rlk_core.backends import REGISTRY, Backend
from rlk_core.ops import _checks as C
from rlk_core.ops._backends import register_kernel_backends
from rlk_core.ops._dispatch import define
from rlk_core.ops._grad import backward_companion
from rlk_core.ops.rms_norm.reference import rms_norm_backward_reference, rms_norm_reference


def _check(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    # the common case in a few attribute tests; anything else takes the full checks (and their messages)
    if (isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor) and x.dtype in C.FLOAT_DTYPES
            and weight.dtype in C.FLOAT_DTYPES and x.dim() >= 1 and weight.shape == (x.shape[-1],)
            and x.shape[-1] > 0 and eps > 0.0 and x.device == weight.device):
        return
    _check_full(x, weight, eps)


def _check_full(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """Every check with its message (what :func:`_check` runs where its few attribute tests do not pass)."""
    C.float_tensor(x, "rms_norm", "x")
    C.float_tensor(weight, "rms_norm", "weight")
    C.require(x.dim() >= 1 and x.shape[-1] > 0, "rms_norm", f"x must be [..., H] with H > 0, got {tuple(x.shape)}")
    C.require(weight.shape == (x.shape[-1],), "rms_norm",
              f"weight must have shape ({x.shape[-1]},), got {tuple(weight.shape)}")
    C.require(eps > 0.0, "rms_norm", f"eps must be > 0, got {eps}")
    C.same_device("rms_norm", x=x, weight=weight)


@define("rms_norm")
def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    _check(x, weight, eps)


@_rms_norm.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    _check(x, weight, eps)
    return torch.empty_like(x)


@define("rms_norm_backward")
def _rms_norm_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    _check_backward(grad, x, weight, eps)


@_rms_norm_backward.register_fake
def _(grad, x, weight, eps):
    _check_backward(grad, x, weight, eps)
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight)


def _check_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    _check(x, weight, eps)
    if not (isinstance(grad, torch.Tensor) and grad.shape == x.shape and grad.dtype in C.FLOAT_DTYPES):
        C.float_tensor(grad, "rms_norm_backward", "grad")
        C.require(False, "rms_norm_backward", f"grad must have x's shape {tuple(x.shape)}, got {tuple(grad.shape)}")
    C.same_device("rms_norm_backward", grad=grad, x=x)


# autograd: rms_norm_backward(grad, x, weight, eps) -> (dx, dweight), a registry op (reported, forced with rms_norm)
backward_companion(_rms_norm, "rms_norm_backward", n_tensor_inputs=2)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Batch-invariant RMSNorm (contract ``rlk.rms_norm.v1``).

    Parameters
    ----------
    x : Tensor ``[..., H]``, float32 / bfloat16 / float16.
    weight : Tensor ``[H]`` (any float dtype; used in fp32).
    eps : float > 0.

    Returns
    -------
    Tensor ``[..., H]``, dtype of ``x``:
    ``x * rsqrt(mean(x^2) + eps) * weight`` computed in fp32 and rounded once.

    Contract ``rlk.rms_norm.v1``: a row's result depends only on that row, ``weight`` and ``eps``; the
    sum of squares is reduced in a fixed order (reference: pairwise-halves tree over H), ``x * inv``
    is multiplied before ``* weight``, one rounding.

    Backward (op ``rms_norm_backward``, same contract id): with ``inv`` as above, ``xhat = f32(x) * inv``,
    ``gw = f32(grad) * f32(w)``: ``dx = inv * (gw - xhat * mean(gw * xhat))`` per row, from that row alone,
    rounded once to x's dtype; ``dweight = sum over rows of f32(grad) * xhat`` in fp32, reduced in an order
    fixed by the shape (no atomics), rounded once to the weight's dtype. Deterministic run to run.
    """
    return _rms_norm(x, weight, float(eps))


REGISTRY.register(Backend("rlk.reference", "rms_norm", rms_norm_reference, devices=("cpu", "cuda"),
                          builtin=True))
def rms_norm_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dweight)`` of :func:`rms_norm` — the registry op its autograd runs (same contract id; ``dweight`` the
    sum over ``x``'s rows), for callers that reduce the weight gradient over row groups of their own (the
    TP-invariant norms of ``rlk_megatron_provider.tp_grads``, docs/ops/linear_tp.md "Gradients")."""
    return _rms_norm_backward(grad, x, weight, eps)


REGISTRY.register(Backend("rlk.reference", "rms_norm_backward", rms_norm_backward_reference,
                          devices=("cpu", "cuda"), builtin=True))

M = "rlk_core.ops.rms_norm.triton"
register_kernel_backends("rms_norm", f"{M}:forward", f"{M}:supports")
register_kernel_backends("rms_norm_backward", f"{M}:backward", f"{M}:supports_backward")
