"""The autograd backward of the row-wise ops as a registry op of its own (a companion op).

:func:`backward_companion` registers an op's backward as a call of ``<op>_backward`` — ``rms_norm_backward``,
``swiglu_backward``, ``rope_backward`` — so the backward is selected, run and reported like a forward op:
``rlk.reference`` (the closed form in plain torch, CPU and CUDA) or ``rlk.triton`` (one or two fused
kernels), forced together with the main op by ``RLK_BACKENDS`` (``rlk_core.contracts.COMPANION_OF``). The
call goes through the op's call path, which runs the implementation directly inside a
backward pass (no autograd needed there), so a backward costs its kernels and one registry selection.
"""

from __future__ import annotations

import torch

from rlk_core.ops._dispatch import op as op_named


def backward_companion(op, backward_op: str, n_tensor_inputs: int, saved: tuple[int, ...] | None = None) -> None:
    """Register ``op``'s backward as ``backward_op(grad, *saved tensor inputs, *non-tensor inputs)``, which
    returns the gradient of the op's first input, or a tuple of the gradients of its first inputs.
    ``saved``: the indices of the tensor inputs the backward reads (default: all of them)."""
    keep = tuple(range(n_tensor_inputs)) if saved is None else tuple(saved)

    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(*(inputs[i] for i in keep))
        ctx.rest = inputs[n_tensor_inputs:]

    def _backward(ctx, grad):
        grads = backward(grad, *ctx.saved_tensors, *ctx.rest)
        if isinstance(grads, torch.Tensor):
            grads = (grads,)
        needs = ctx.needs_input_grad
        grads = (*grads, *([None] * (len(needs) - len(grads))))
        return tuple(g if need else None for g, need in zip(grads, needs, strict=True))

    backward = op_named(backward_op)
    op.register_autograd(_backward, setup_context=setup_context)
