"""``transpose_padded``: the transposed operand of the token-reduction GEMMs, token count padded with zeros."""

from __future__ import annotations

import torch

from rlk_core import ops
from rlk_core.ops._layout import transpose_padded


def test_transpose_padded_values_and_zero_padding():
    for t in (1, 63, 64, 65, 130):
        a = torch.randn(t, 5)
        out = transpose_padded(a)
        assert out.shape == (5, -(-t // 64) * 64) and out.is_contiguous()
        assert torch.equal(out[:, :t], a.t()) and not out[:, t:].any()


def test_linear_weight_and_bias_grads_with_padded_token_reduction():
    """dW, db through the padded operands equal the float64 products (69 tokens: 59 zero columns)."""
    x, w, b = torch.randn(3, 23, 40, dtype=torch.float64), torch.randn(24, 40), torch.randn(24)
    x32 = x.float().requires_grad_()
    w32, b32 = w.clone().requires_grad_(), b.clone().requires_grad_()
    g = torch.randn(3, 23, 24)
    ops.linear(x32, w32, b32).backward(g)
    g2, x2 = g.double().reshape(-1, 24), x.reshape(-1, 40)
    torch.testing.assert_close(w32.grad.double(), g2.t() @ x2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b32.grad.double(), g2.sum(0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x32.grad.double(), (g2 @ w.double()).reshape(3, 23, 40), rtol=1e-5, atol=1e-5)
