"""Operand layouts of the backward passes: the log-prob backward's dW operands (``ops/linear_logprobs/triton.py``).

``linear``'s own backward no longer uses this: its GEMMs read dy, x and W as stored, through views, by kernels
that do not specialise on the token count (``ops/linear/triton.py``: ``stored_layout``), which makes the padding
below unnecessary — ``linear_2d_into`` takes the same views (``dz.t()``, ``hidden.t()``) for the log-prob dW.
"""

from __future__ import annotations

import torch

TOKEN_PAD = 64


def transpose_padded(a: torch.Tensor, multiple: int = TOKEN_PAD) -> torch.Tensor:
    """``a [T, C]`` as a contiguous ``[C, T_pad]`` with ``T_pad`` the next multiple of ``multiple`` and zeros in
    the extra columns.

    For a weight-gradient GEMM run by the forward's kernels, whose reduction length is then the token count:
    a padded length keeps the kernel specialisation (K and the row strides divisible by 16, K a multiple of the
    K block) and the TMA eligibility (16-byte aligned rows) the same for every batch — an unpadded token count
    flips them from step to step, and each flip compiled new kernel variants in the middle of training. The
    zero columns add exact zeros to each sum; the backward is deterministic either way (its contract), not
    bitwise equal to the unpadded product.
    """
    t, c = a.shape
    t_pad = -(-t // multiple) * multiple
    out = torch.empty((c, t_pad), dtype=a.dtype, device=a.device)
    out[:, :t].copy_(a.t())
    out[:, t:].zero_()
    return out
