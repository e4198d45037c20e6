"""``linear``: y = x W^T (+ b) under the batch-invariant GEMM contract ``rlk.gemm.bi.v1``."""

from __future__ import annotations

import torch

from rlk_core.backends import REGISTRY, Backend
from rlk_core.ops import _checks as C
from rlk_core.ops._backends import register_kernel_backends
from rlk_core.ops._dispatch import define
from rlk_core.ops.linear.reference import linear_reference


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    # the common case in a few attribute tests; anything else takes the full checks (and their messages)
    if (isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor) and x.dtype in C.FLOAT_DTYPES
            and weight.dtype == x.dtype and weight.dim() == 2 and x.dim() >= 1 and x.shape[-1] == weight.shape[1]
            and x.device == weight.device
            and (bias is None or (isinstance(bias, torch.Tensor) and bias.dtype == x.dtype
                                  and bias.device == x.device and bias.shape == (weight.shape[0],)))):
        return
    _check_full(x, weight, bias)


def _check_full(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Every check with its message (what :func:`_check` runs where its few attribute tests do not pass)."""
    C.float_tensor(x, "linear", "x")
    C.float_tensor(weight, "linear", "weight")
    C.ndim(weight, "linear", "weight", (2,))
    C.require(x.dim() >= 1, "linear", f"x must have at least 1 dim, got shape {tuple(x.shape)}")
    C.require(x.shape[-1] == weight.shape[1], "linear",
              f"x has K={x.shape[-1]} (shape {tuple(x.shape)}) but weight has K={weight.shape[1]} "
              f"(shape {tuple(weight.shape)})")
    C.same_dtype("linear", x=x, weight=weight, bias=bias)
    C.same_device("linear", x=x, weight=weight, bias=bias)
    if bias is not None:
        C.require(bias.shape == (weight.shape[0],), "linear",
                  f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")


@define("linear")
def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    _check(x, weight, bias)


@_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    _check(x, weight, bias)
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` with unit stride along its rows — what the backward's views need to be read as stored (a copy
    only for an unusual layout: autograd's gradients, saved inputs and parameters already have it)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _backward(ctx, grad):
    # Deterministic (not batch-invariant) backward: dx = dy W, dW = dy^T x, db = dy^T 1, each one GEMM through
    # the op with the operands as views of their storage — W as the [K, N] operand (W.t()), dy and x transposed
    # (the reduction over the tokens), db against a broadcast column of ones: no operand copy, no padding. On
    # rlk.triton such views run the stored-layout kernels (triton.stored_layout), whose compiled variants do not
    # depend on the token count; rlk.cuda declines them (not its layout), rlk.reference reduces each in its tree.
    x, weight = ctx.saved_tensors
    g2 = _rows(grad.reshape(-1, grad.shape[-1]).to(x.dtype))
    dx = dw = db = None
    if ctx.needs_input_grad[0]:
        dx = _linear(g2, _rows(weight).t(), None).reshape(x.shape)
    if ctx.needs_input_grad[1]:
        x2 = _rows(x.reshape(-1, x.shape[-1]))
        dw = _linear(g2.t(), x2.t(), None).to(weight.dtype)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        # one element seen as [1, T] with stride 0 along T (also at T = 1: the strides are the kernel's key)
        ones = g2.new_ones(1).as_strided((1, g2.shape[0]), (1, 0))
        db = _linear(g2.t(), ones, None).reshape(-1).to(weight.dtype)
    return dx, dw, db


_linear.register_autograd(_backward, setup_context=_setup_context)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Batch-invariant ``y = x @ weight.T + bias`` (contract ``rlk.gemm.bi.v1``).

    Parameters
    ----------
    x : Tensor, shape ``[..., K]``, float32 / bfloat16 / float16.
    weight : Tensor, shape ``[N, K]``, same dtype and device as ``x``.
    bias : Tensor, shape ``[N]``, optional.

    Returns
    -------
    Tensor, shape ``[..., N]``, dtype of ``x``.

    Contract ``rlk.gemm.bi.v1``: output row ``m`` depends only on ``x[m]``, ``weight`` and ``bias``.
    Accumulation in fp32 with one K reduction order for every M (the reference uses the fixed
    pairwise-halves tree of :func:`rlk_core.ops._fixed.tree_sum`), bias added in fp32, one rounding
    to the output dtype; no split-K, no atomics. Backward (dx, dW, db) is deterministic run to run.
    """
    return _linear(x, weight, bias)


REGISTRY.register(Backend("rlk.reference", "linear", linear_reference, devices=("cpu", "cuda"),
                          priority=0, builtin=True))
register_kernel_backends("linear", "rlk_core.ops.linear.triton:forward", "rlk_core.ops.linear.triton:supports")
