"""Reference RoPE — the specification of contract ``rlk.rope.v1`` (rotate-half / NeoX layout).

Table, for rotary dim ``R`` and absolute position ``p``:

- ``inv_freq[i] = f32(theta ** (-(2 i) / R))`` for ``i < R/2``, computed on the host in float64 by
  Python (identical on every machine that runs the same Python/libm);
- ``angle[p, i] = f32(p) * inv_freq[i]`` — one fp32 multiplication, as vLLM and Hugging Face do;
- ``cos, sin = f32(cos64(angle)), f32(sin64(angle))`` where ``cos64``/``sin64`` are written here
  with elementwise float64 add/multiply only (Cody–Waite reduction by pi/2, Taylor polynomials on
  ``|r| <= pi/4``), so every element is computed the same way on any device and at any position in
  the tensor; the float64 result is rounded once to fp32. Never rounded to bf16.

Rotation, with ``x1 = x[..., :R/2]``, ``x2 = x[..., R/2:R]`` in fp32:
``out1 = x1*cos - x2*sin``, ``out2 = x2*cos + x1*sin`` (products first, then the add/subtract),
rounded once to ``x.dtype``; dims ``R..D`` pass through unchanged.
"""

from __future__ import annotations

import torch

# pi/2 split into 33-bit pieces (fdlibm's values): k * PIO2_1 and k * PIO2_2 are exact for |k| < 2^20.
_PIO2_1 = 1.57079632673412561417e00
_PIO2_2 = 6.07710050630396597660e-11
_PIO2_3 = 2.02226624871116645580e-21
_TWO_OVER_PI = 6.36619772367581382433e-01
_SIN_COEF = [(-1.0) ** j / float(__import__("math").factorial(2 * j + 1)) for j in range(10)]
_COS_COEF = [(-1.0) ** j / float(__import__("math").factorial(2 * j)) for j in range(10)]


def _horner(r2: torch.Tensor, coef: list[float]) -> torch.Tensor:
    acc = torch.full_like(r2, coef[-1])
    for c in reversed(coef[:-1]):
        acc = acc * r2 + c
    return acc


def sincos64(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """sin and cos of a float64 tensor from elementwise add/multiply only (|a| < 2^20 * pi/2)."""
    k = torch.round(a * _TWO_OVER_PI)
    r = ((a - k * _PIO2_1) - k * _PIO2_2) - k * _PIO2_3
    r2 = r * r
    s = r * _horner(r2, _SIN_COEF)
    c = _horner(r2, _COS_COEF)
    q = torch.remainder(k, 4.0)
    sin = torch.where(q == 0, s, torch.where(q == 1, c, torch.where(q == 2, -s, -c)))
    cos = torch.where(q == 0, c, torch.where(q == 1, -s, torch.where(q == 2, -c, s)))
    return sin, cos


def inv_freq(rotary_dim: int, theta: float) -> list[float]:
    return [theta ** (-(2.0 * i) / rotary_dim) for i in range(rotary_dim // 2)]


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(cos, sin)`` tables of shape ``[T, rotary_dim/2]`` for absolute ``positions`` ``[T]``."""
    freqs = torch.tensor(inv_freq(rotary_dim, theta), dtype=torch.float32, device=positions.device)
    angle = positions.to(torch.float32)[:, None] * freqs[None, :]
    sin, cos = sincos64(angle.double())
    return cos.float(), sin.float()


def rope_reference(x: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int) -> torch.Tensor:
    cos, sin = rope_cos_sin(positions, rotary_dim, theta)
    cos, sin = cos[:, None, :], sin[:, None, :]
    half = rotary_dim // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:rotary_dim]
    out1 = x1 * cos - x2 * sin
    out2 = x2 * cos + x1 * sin
    return torch.cat([out1.to(x.dtype), out2.to(x.dtype), x[..., rotary_dim:]], dim=-1)


def rope_backward_reference(grad: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int
                            ) -> torch.Tensor:
    """``dx`` of ``rope``: the inverse rotation of ``grad [T, H, D]`` with the forward's fp32 tables,
    ``dx1 = g1*cos + g2*sin``, ``dx2 = g2*cos - g1*sin`` (products first), rounded once to grad's dtype (the
    forward's output dtype, x's); dims ``R..D`` passed through. Elementwise, deterministic."""
    cos, sin = rope_cos_sin(positions, rotary_dim, theta)
    cos, sin = cos[:, None, :], sin[:, None, :]
    half = rotary_dim // 2
    g = grad.float()
    g1, g2 = g[..., :half], g[..., half:rotary_dim]
    dx1 = g1 * cos + g2 * sin
    dx2 = g2 * cos - g1 * sin
    return torch.cat([dx1.to(grad.dtype), dx2.to(grad.dtype), grad[..., rotary_dim:]], dim=-1)
