"""Mixture-of-experts ops under contract ``rlk.moe.v1`` (``docs/ops/moe.md``): the router's softmax and top-k
(:func:`moe_topk`), the batch-invariant grouped expert GEMM (:func:`moe_grouped_linear`) and the slot-order combine
(:func:`moe_combine`), each with its backward as a companion op. The block that composes them with ``linear`` and
``swiglu`` (dispatch and un-dispatch are data movement) is :mod:`rlk_core.ops.moe.layer`."""

from __future__ import annotations

import torch

from rlk_core.backends import REGISTRY, Backend
from rlk_core.ops import _checks as C
from rlk_core.ops._backends import register_kernel_backends
from rlk_core.ops._dispatch import define
from rlk_core.ops.moe import reference as R

M = "rlk_core.ops.moe.triton"


# -- moe_topk -----------------------------------------------------------------------------------------------------
def _check_topk(logits: torch.Tensor, top_k: int, normalize: bool) -> None:
    C.float_tensor(logits, "moe_topk", "logits")
    C.ndim(logits, "moe_topk", "logits", (2,))
    C.require(isinstance(top_k, int) and 1 <= top_k <= logits.shape[1], "moe_topk",
              f"top_k must be an int in [1, E = {logits.shape[1]}], got {top_k!r}")


@define("moe_topk")
def _moe_topk(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    _check_topk(logits, top_k, normalize)


@_moe_topk.register_fake
def _(logits, top_k, normalize):
    _check_topk(logits, top_k, normalize)
    t = logits.shape[0]
    return logits.new_empty((t, top_k), dtype=torch.float32), logits.new_empty((t, top_k), dtype=torch.int64)


@define("moe_topk_backward")
def _moe_topk_backward(grad: torch.Tensor, logits: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                       normalize: bool) -> torch.Tensor:
    _check_topk(logits, ids.shape[1] if ids.dim() == 2 else 0, normalize)
    want = (logits.shape[0], ids.shape[1])
    for name, t in (("grad", grad), ("weights", weights), ("ids", ids)):
        C.require(tuple(t.shape) == want, "moe_topk_backward", f"{name} must have shape {want}, got {tuple(t.shape)}")
    C.require(weights.dtype == torch.float32, "moe_topk_backward", f"weights must be float32, got {weights.dtype}")
    C.int_tensor(ids, "moe_topk_backward", "ids")
    C.same_device("moe_topk_backward", grad=grad, logits=logits, weights=weights, ids=ids)


@_moe_topk_backward.register_fake
def _(grad, logits, weights, ids, normalize):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _topk_setup(ctx, inputs, output) -> None:
    logits, _, normalize = inputs
    ctx.save_for_backward(logits, *output)
    ctx.normalize = normalize


def _topk_backward(ctx, grad_w, grad_ids):
    logits, weights, ids = ctx.saved_tensors
    if grad_w is None:
        grad_w = torch.zeros_like(weights)
    return _moe_topk_backward(grad_w.float().contiguous(), logits, weights, ids, ctx.normalize), None, None


_moe_topk.register_autograd(_topk_backward, setup_context=_topk_setup)


def moe_topk(logits: torch.Tensor, top_k: int, normalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's fp32 softmax, top-k and renormalised weights (contract ``rlk.moe.v1``).

    Parameters
    ----------
    logits : Tensor ``[T, E]``, float32 / bfloat16 / float16 (the router GEMM's output: ``linear``).
    top_k : int in ``[1, E]``.
    normalize : the weights renormalised over the k selected experts (``norm_topk_prob``).

    Returns
    -------
    (weights, ids) : float32 ``[T, k]`` and int64 ``[T, k]``, slot ``j`` the ``j``-th expert in the order
    (probability desc, expert id asc).

    A row's results depend only on that row: ``p = exp(l - max l) / sum exp(l - max l)`` in fp32 (the reference's
    sum is the fixed tree over E); ties go to the lower expert id; ``normalize``: ``w_j = p_j / (p_0 + ... + p_{k-1})``
    (left to right). Backward w.r.t. the logits (op ``moe_topk_backward``): ``q * (G - c)``, ``c = sum_j g_j w_j``
    left to right, ``G`` the slot gradients at their ids, ``q`` the weights at their ids (``normalize``) or ``p``;
    per row, deterministic.
    """
    return _moe_topk(logits, top_k, normalize)


# -- moe_grouped_linear -------------------------------------------------------------------------------------------
def _check_grouped(op: str, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> None:
    C.float_tensor(x, op, "x")
    C.float_tensor(weight, op, "weight")
    C.ndim(x, op, "x", (2,))
    C.ndim(weight, op, "weight", (3,))
    C.same_dtype(op, x=x, weight=weight)
    C.require(x.shape[1] == weight.shape[2], op,
              f"x has K={x.shape[1]} (shape {tuple(x.shape)}) but weight [E, N, K] has K={weight.shape[2]}")
    C.int_tensor(offsets, op, "offsets")
    C.require(offsets.shape == (weight.shape[0] + 1,), op,
              f"offsets must have shape (E + 1,) = ({weight.shape[0] + 1},), got {tuple(offsets.shape)}")
    C.same_device(op, x=x, weight=weight, offsets=offsets)


@define("moe_grouped_linear")
def _moe_grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    _check_grouped("moe_grouped_linear", x, weight, offsets)


@_moe_grouped_linear.register_fake
def _(x, weight, offsets):
    _check_grouped("moe_grouped_linear", x, weight, offsets)
    return x.new_empty((x.shape[0], weight.shape[1]))


@define("moe_grouped_linear_backward")
def _moe_grouped_linear_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    _check_grouped("moe_grouped_linear_backward", x, weight, offsets)
    want = (x.shape[0], weight.shape[1])
    C.float_tensor(grad, "moe_grouped_linear_backward", "grad")
    C.require(tuple(grad.shape) == want, "moe_grouped_linear_backward",
              f"grad must have shape {want}, got {tuple(grad.shape)}")


@_moe_grouped_linear_backward.register_fake
def _(grad, x, weight, offsets):
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(
        weight, memory_format=torch.contiguous_format)


def _grouped_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _grouped_backward(ctx, grad):
    x, weight, offsets = ctx.saved_tensors
    dx, dw = _moe_grouped_linear_backward(grad.contiguous(), x, weight, offsets)
    return (dx if ctx.needs_input_grad[0] else None), (dw if ctx.needs_input_grad[1] else None), None


_moe_grouped_linear.register_autograd(_grouped_backward, setup_context=_grouped_setup)


def moe_grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The batch-invariant grouped GEMM: ``y[m] = x[m] @ weight[e]^T`` for the rows ``offsets[e] .. offsets[e+1]-1``
    of expert ``e`` (contract ``rlk.moe.v1``).

    Parameters
    ----------
    x : Tensor ``[M, K]``, rows grouped by expert; float32 / bfloat16 / float16.
    weight : Tensor ``[E, N, K]``, same dtype and device (any strides).
    offsets : int32 / int64 Tensor ``[E + 1]``: 0, non-decreasing, ``M`` last (the reference checks the values; the
        kernels read them on the device and trust them).

    Returns
    -------
    Tensor ``[M, N]``, x's dtype. Row ``m`` depends only on ``x[m]`` and its expert's weight — never on M, the
    other experts' counts, the row's place in its group or any padding: fp32 accumulation in one K order, one
    rounding, no split-K, no atomics. Backward (op ``moe_grouped_linear_backward``): ``dx`` the grouped GEMM with
    the weight seen ``[E, K, N]``; ``dweight[e]`` reduced over expert ``e``'s rows in increasing order, rounded once;
    deterministic run to run.
    """
    return _moe_grouped_linear(x, weight, offsets)


# -- moe_combine --------------------------------------------------------------------------------------------------
def _check_combine(op: str, expert_out: torch.Tensor, weights: torch.Tensor) -> None:
    C.float_tensor(expert_out, op, "expert_out")
    C.ndim(expert_out, op, "expert_out", (3,))
    C.require(expert_out.shape[1] >= 1, op, f"expert_out must be [T, k >= 1, H], got {tuple(expert_out.shape)}")
    C.require(isinstance(weights, torch.Tensor) and weights.dtype == torch.float32
              and tuple(weights.shape) == tuple(expert_out.shape[:2]), op,
              f"weights must be float32 [T, k] = {tuple(expert_out.shape[:2])}, got "
              f"{getattr(weights, 'dtype', type(weights).__name__)} {tuple(getattr(weights, 'shape', ()))}")
    C.same_device(op, expert_out=expert_out, weights=weights)


@define("moe_combine")
def _moe_combine(expert_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    _check_combine("moe_combine", expert_out, weights)


@_moe_combine.register_fake
def _(expert_out, weights):
    _check_combine("moe_combine", expert_out, weights)
    return expert_out.new_empty((expert_out.shape[0], expert_out.shape[2]))


@define("moe_combine_backward")
def _moe_combine_backward(grad: torch.Tensor, expert_out: torch.Tensor, weights: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    _check_combine("moe_combine_backward", expert_out, weights)
    want = (expert_out.shape[0], expert_out.shape[2])
    C.float_tensor(grad, "moe_combine_backward", "grad")
    C.require(tuple(grad.shape) == want, "moe_combine_backward",
              f"grad must have shape {want}, got {tuple(grad.shape)}")


@_moe_combine_backward.register_fake
def _(grad, expert_out, weights):
    return (torch.empty_like(expert_out, memory_format=torch.contiguous_format),
            torch.empty_like(weights, memory_format=torch.contiguous_format))


def _combine_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _combine_backward(ctx, grad):
    expert_out, weights = ctx.saved_tensors
    d_out, d_w = _moe_combine_backward(grad.contiguous(), expert_out, weights)
    return (d_out if ctx.needs_input_grad[0] else None), (d_w if ctx.needs_input_grad[1] else None)


_moe_combine.register_autograd(_combine_backward, setup_context=_combine_setup)


def moe_combine(expert_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """A token's k expert outputs weighted and summed in slot order (contract ``rlk.moe.v1``).

    Parameters
    ----------
    expert_out : Tensor ``[T, k, H]``, float32 / bfloat16 / float16: slot ``j`` of token ``t`` is the output of its
        ``j``-th expert.
    weights : float32 Tensor ``[T, k]``.

    Returns
    -------
    Tensor ``[T, H]``, expert_out's dtype: ``w_0 o_0 + w_1 o_1 + ... + w_{k-1} o_{k-1}`` left to right in fp32, one
    rounding; depends only on that token's slots (no atomics, no scatter-add). Backward (op
    ``moe_combine_backward``): ``d_o[t, j] = round(g[t] w[t, j])``, ``d_w[t, j] = sum_h g[t, h] o[t, j, h]`` in fp32
    (the reference's fixed tree over H); deterministic, batch-invariant.
    """
    return _moe_combine(expert_out, weights)


for _op, _fn in (("moe_topk", R.moe_topk_reference), ("moe_topk_backward", R.moe_topk_backward_reference),
                 ("moe_grouped_linear", R.moe_grouped_linear_reference),
                 ("moe_grouped_linear_backward", R.moe_grouped_linear_backward_reference),
                 ("moe_combine", R.moe_combine_reference), ("moe_combine_backward", R.moe_combine_backward_reference)):
    REGISTRY.register(Backend("rlk.reference", _op, _fn, devices=("cpu", "cuda"), builtin=True))

register_kernel_backends("moe_topk", f"{M}:topk_forward", f"{M}:supports_topk")
register_kernel_backends("moe_topk_backward", f"{M}:topk_backward", f"{M}:supports_topk_backward")
register_kernel_backends("moe_grouped_linear", f"{M}:grouped_forward", f"{M}:supports_grouped")
register_kernel_backends("moe_grouped_linear_backward", f"{M}:grouped_backward", f"{M}:supports_grouped_backward")
register_kernel_backends("moe_combine", f"{M}:combine_forward", f"{M}:supports_combine")
register_kernel_backends("moe_combine_backward", f"{M}:combine_backward", f"{M}:supports_combine_backward")

__all__ = ["moe_combine", "moe_grouped_linear", "moe_topk"]
