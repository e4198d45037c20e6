"""``rms_norm``: root-mean-square normalisation under contract ``rlk.rms_norm.v1``."""

from __future__ import annotations

import torch

from rlk_core.backends import REGISTRY, Backend
from rlk_core.ops import _checks as C
from rlk_core.ops._dispatch import call, custom_op, run
from rlk_core.ops._grad import closed_form_backward
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


@custom_op("rms_norm")
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    _check(x, weight, eps)
    return run("rms_norm", x.device, x, weight, eps)


@_rms_norm_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    _check(x, weight, eps)
    return torch.empty_like(x)


closed_form_backward(_rms_norm_op, rms_norm_backward_reference, n_tensor_inputs=2)


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
    is multiplied before ``* weight``, one rounding. Backward is deterministic.
    """
    return call("rms_norm", x, weight, float(eps))


REGISTRY.register(Backend("rlk.reference", "rms_norm", rms_norm_reference, devices=("cpu", "cuda"),
                          builtin=True))

from rlk_core.ops._triton_common import triton_backend  # noqa: E402  (imports no Triton until used on CUDA)

REGISTRY.register(triton_backend("rms_norm"))

from rlk_core.ops._cuda_common import cuda_backend  # noqa: E402  (imports neither Triton nor the extension)

REGISTRY.register(cuda_backend("rms_norm"))
