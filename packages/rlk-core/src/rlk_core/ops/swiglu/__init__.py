"""``swiglu``: ``silu(gate) * up`` under contract ``rlk.swiglu.v1``."""

from __future__ import annotations

import torch

from rlk_core.backends import REGISTRY, Backend
from rlk_core.ops import _checks as C
from rlk_core.ops._backends import register_kernel_backends
from rlk_core.ops._dispatch import define
from rlk_core.ops._grad import backward_companion
from rlk_core.ops.swiglu.reference import swiglu_backward_reference, swiglu_reference


def _check(x: torch.Tensor) -> None:
    if isinstance(x, torch.Tensor) and x.dtype in C.FLOAT_DTYPES and x.dim() >= 1:
        last = x.shape[-1]
        if last > 0 and last % 2 == 0:
            return
    _check_full(x)


def _check_full(x: torch.Tensor) -> None:
    """Every check with its message (what :func:`_check` runs where its few attribute tests do not pass)."""
    C.float_tensor(x, "swiglu", "x")
    C.require(x.dim() >= 1 and x.shape[-1] % 2 == 0 and x.shape[-1] > 0, "swiglu",
              f"x must be [..., 2*I] (gate then up) with an even, non-zero last dim, got {tuple(x.shape)}")


@define("swiglu")
def _swiglu(x: torch.Tensor) -> torch.Tensor:
    _check(x)


@_swiglu.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    _check(x)
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


@define("swiglu_backward")
def _swiglu_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    _check_backward(grad, x)


@_swiglu_backward.register_fake
def _(grad, x):
    _check_backward(grad, x)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _check_backward(grad: torch.Tensor, x: torch.Tensor) -> None:
    _check(x)
    want = (*x.shape[:-1], x.shape[-1] // 2)
    if not (isinstance(grad, torch.Tensor) and grad.shape == want and grad.dtype in C.FLOAT_DTYPES):
        C.float_tensor(grad, "swiglu_backward", "grad")
        C.require(False, "swiglu_backward", f"grad must have shape {want}, got {tuple(grad.shape)}")
    C.same_device("swiglu_backward", grad=grad, x=x)


# autograd: swiglu_backward(grad, x) -> dx, a registry op (reported, forced with swiglu)
backward_companion(_swiglu, "swiglu_backward", n_tensor_inputs=1)


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU of a concatenated ``[gate | up]`` tensor (contract ``rlk.swiglu.v1``).

    Parameters
    ----------
    x : Tensor ``[..., 2*I]``: gate in ``[..., :I]``, up in ``[..., I:]``; float32 / bfloat16 / float16.

    Returns
    -------
    Tensor ``[..., I]``, dtype of ``x``: ``gate / (1 + exp(-gate)) * up`` in fp32, rounded once.

    Contract ``rlk.swiglu.v1``: each output element depends only on its gate and up elements.

    Backward (op ``swiglu_backward``, same contract id): with ``s = 1 / (1 + exp(-g))`` in fp32,
    ``dgate = dy * u * s * (1 + g * (1 - s))``, ``dup = dy * (g * s)``, each element from its own gate, up
    and output gradient, rounded once to x's dtype. Deterministic run to run (elementwise, no reduction).
    """
    return _swiglu(x)


REGISTRY.register(Backend("rlk.reference", "swiglu", swiglu_reference, devices=("cpu", "cuda"), builtin=True))
REGISTRY.register(Backend("rlk.reference", "swiglu_backward", swiglu_backward_reference, devices=("cpu", "cuda"),
                          builtin=True))

M = "rlk_core.ops.swiglu.triton"
register_kernel_backends("swiglu", f"{M}:forward", f"{M}:supports")
register_kernel_backends("swiglu_backward", f"{M}:backward", f"{M}:supports_backward")
