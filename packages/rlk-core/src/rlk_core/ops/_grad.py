"""Deterministic backward passes for the elementwise/row-wise ops.

:func:`closed_form_backward` registers an op's backward as a closed-form function of the saved inputs
(``<op>_backward_reference``): elementwise fp32 operations and single torch reductions over a fixed
shape, which are deterministic run to run on the CPU and on CUDA (no atomics) and cost a handful of
kernels — unlike autograd through the reference forward, which launches one kernel per step of its
reduction trees.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlk_core.ops._dispatch import register_autograd


def closed_form_backward(op, backward: Callable[..., tuple[torch.Tensor | None, ...]], n_tensor_inputs: int) -> None:
    """``backward(*saved_tensor_inputs, *non_tensor_inputs, grad)`` returns one gradient per tensor input."""
    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(*inputs[:n_tensor_inputs])
        ctx.rest = inputs[n_tensor_inputs:]

    def _backward(ctx, grad):
        grads = backward(*ctx.saved_tensors, *ctx.rest, grad)
        result = [g if need else None for g, need in zip(grads, ctx.needs_input_grad, strict=False)]
        return (*result, *([None] * len(ctx.rest)))

    register_autograd(op, _backward, setup_context)
