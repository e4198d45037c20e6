"""``transpose_padded``: the transposed operand of the log-prob backward's dW GEMM, token count padded with zeros
(linear's own backward reads its operands as stored: tests/core/ops/test_linear_backward.py)."""

from __future__ import annotations

import torch

from rlk_core.ops._layout import transpose_padded


def test_transpose_padded_values_and_zero_padding():
    for t in (1, 63, 64, 65, 130):
        a = torch.randn(t, 5)
        out = transpose_padded(a)
        assert out.shape == (5, -(-t // 64) * 64) and out.is_contiguous()
        assert torch.equal(out[:, :t], a.t()) and not out[:, t:].any()

