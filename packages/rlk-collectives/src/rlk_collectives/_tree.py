"""The arithmetic of contract ``rlk.collective.v1``: one fixed pairwise tree over rank order, in fp32.

The tree: contributions ``x_0 .. x_{W-1}`` in rank order are widened to fp32; each level adds
neighbours ``(x_0 + x_1), (x_2 + x_3), ...`` in fp32 and carries an odd last term up unchanged, until
one term is left. So ``W = 4`` is ``(x_0 + x_1) + (x_2 + x_3)`` and ``W = 3`` is ``(x_0 + x_1) + x_2``.
Every ``W >= 1`` has exactly one such tree. The reduced value is that fp32 sum rounded once to the
inputs' dtype (:func:`round_to_dtype`: round to nearest even, overflow to inf; a NaN becomes the
canonical quiet NaN of the dtype, so NaN bits do not depend on which NaN operand a CPU's vector unit
happened to propagate, nor on the device).

:func:`tree_sum_fp32` is the single-process specification, written plainly. :func:`reduce_rows` is what
the collectives run on each rank: the same tree over the rows of a ``[W, ...]`` stack, with fewer
passes over memory, tested bitwise against :func:`tree_sum_fp32`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlk_core.errors import RlkInputError

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The NaN every reduction returns: sign +, quiet bit set, payload 0 (bf16 0x7FC0, fp16 0x7E00, fp32 0x7FC00000).
CANONICAL_NAN = float("nan")


def tree_sum_fp32(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Sum ``tensors`` (rank order) in the fixed pairwise tree of ``rlk.collective.v1``, in fp32.

    Parameters
    ----------
    tensors : sequence of W >= 1 tensors of one shape and one dtype (bfloat16, float16 or float32).

    Returns
    -------
    A new float32 tensor of that shape: each input widened to fp32 exactly, neighbours added level by
    level (``(x0 + x1) + (x2 + x3)``; an odd last term is carried up unchanged), not yet rounded.
    ``tree_sum_fp32(xs).to(xs[0].dtype)`` is the value every rank receives from the collectives.
    """
    if len(tensors) == 0:
        raise RlkInputError("tree_sum_fp32 needs at least one tensor, got none")
    first = tensors[0]
    for i, t in enumerate(tensors):
        if t.dtype not in DTYPES:
            raise RlkInputError(f"tree_sum_fp32: tensor {i} has dtype {t.dtype}; supported: bfloat16, float16, float32")
        if t.dtype != first.dtype or t.shape != first.shape:
            raise RlkInputError(f"tree_sum_fp32: tensor {i} is {t.dtype} {tuple(t.shape)}, tensor 0 is "
                                f"{first.dtype} {tuple(first.shape)}; all must match")
    level = [t.to(torch.float32) for t in tensors]
    while len(level) > 1:
        paired = [level[i] + level[i + 1] for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            paired.append(level[-1])
        level = paired
    return level[0].clone() if level[0] is tensors[0] else level[0]


def round_to_dtype(s: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """The contract's one rounding: fp32 ``s`` to ``dtype`` (nearest even), NaNs made canonical."""
    r = s.to(dtype, copy=True) if out is None else out.copy_(s)
    return canonical_nan_(r)


def canonical_nan_(r: torch.Tensor) -> torch.Tensor:
    """Replace every NaN of ``r`` in place by :data:`CANONICAL_NAN`; returns ``r``."""
    return r.masked_fill_(r.isnan(), CANONICAL_NAN)


def reduce_reference(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """What every rank receives: ``round_to_dtype(tree_sum_fp32(tensors), dtype)`` (single process)."""
    return round_to_dtype(tree_sum_fp32(tensors), tensors[0].dtype)


def reduce_rows(stack: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``reduce_reference(list(stack))`` for a ``[W, ...]`` stack, in few memory passes;
    written into ``out`` (shape ``stack.shape[1:]``, ``stack.dtype``) when given.

    ``W = 2`` is one ``torch.add``: PyTorch adds bf16/fp16 tensors in fp32 and rounds the sum once to
    the dtype, which is exactly ``round(fp32(a) + fp32(b))`` (tests check this bitwise against
    :func:`reduce_reference` on the CPU and the GPU). Larger ``W`` widens the even rows and adds the
    odd rows into them in fp32 (the first level), adds level by level in fp32 and rounds once. NaNs
    are made canonical last.
    """
    w = stack.shape[0]
    if w == 2:
        return canonical_nan_(torch.add(stack[0], stack[1], out=out))
    if w == 1:
        level = stack.to(torch.float32)
    else:
        pairs = w // 2
        level = stack[0:2 * pairs:2].to(torch.float32, copy=True)
        level.add_(stack[1:2 * pairs:2])
        if w % 2:
            level = torch.cat([level, stack[w - 1:].to(torch.float32)])
    while level.shape[0] > 1:
        n = level.shape[0]
        pairs = n // 2
        nxt = level[0:2 * pairs:2] + level[1:2 * pairs:2]
        level = torch.cat([nxt, level[n - 1:]]) if n % 2 else nxt
    return round_to_dtype(level[0], stack.dtype, out)
