"""Reference SwiGLU — the specification of contract ``rlk.swiglu.v1``.

Input ``x = [gate | up]`` on the last dimension (vLLM's ``SiluAndMul`` / Megatron's fused GLU layout).
``y = round_to(x.dtype)( (g / (1 + exp(-g))) * u )`` with ``g = f32(gate)``, ``u = f32(up)``: a
negation, ``exp``, an add, a division and a multiplication, each an elementwise fp32 operation, one
rounding. (``torch.sigmoid``/``silu`` are avoided: on the CPU their vectorised and scalar-tail paths
can differ in the last bit, which would make a result depend on where the element sits.)
"""

from __future__ import annotations

import torch


def swiglu_reference(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    g = x[..., :half].float()
    u = x[..., half:].float()
    return ((g / (torch.exp(-g) + 1.0)) * u).to(x.dtype)


def swiglu_backward_reference(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``dx = [dgate | dup]`` in fp32, rounded once to ``x.dtype``: ``s = 1 / (1 + exp(-g))``,
    ``dup = grad * g * s``, ``dgate = grad * u * s * (1 + g * (1 - s))``; elementwise, deterministic."""
    half = x.shape[-1] // 2
    g = x[..., :half].float()
    u = x[..., half:].float()
    dy = grad.float()
    s = 1.0 / (torch.exp(-g) + 1.0)
    dgate = dy * u * s * (1.0 + g * (1.0 - s))
    dup = dy * (g * s)
    return torch.cat([dgate, dup], dim=-1).to(x.dtype)
