"""Deterministic backward for reference-defined ops: recompute the reference forward under autograd.

The reference forward is built only from elementwise operations and fixed-order reductions, so
autograd's backward through it is elementwise too and deterministic run to run on the CPU.
GPU backends replace this with their own kernels where they register a backward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def recompute_backward(op, reference: Callable[..., torch.Tensor], n_tensor_inputs: int) -> None:
    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(*inputs[:n_tensor_inputs])
        ctx.rest = inputs[n_tensor_inputs:]

    def backward(ctx, grad):
        saved = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(ctx.needs_input_grad[i]) for i, t in enumerate(saved)]
            out = reference(*leaves, *ctx.rest)
            wanted = [leaf for leaf in leaves if leaf.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True)) if wanted else iter(())
        result = [next(grads) if leaf.requires_grad else None for leaf in leaves]
        return (*result, *([None] * len(ctx.rest)))

    op.register_autograd(backward, setup_context=setup_context)
