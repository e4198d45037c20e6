"""Triton SwiGLU under contract ``rlk.swiglu.v1`` (backend ``rlk.triton``).

``y = round_to(x.dtype)( (g / (1 + exp(-g))) * u )`` with ``g, u`` the fp32 gate and up halves of
``x = [gate | up]``: elementwise, one rounding. ``exp`` is Triton's ``tl.exp`` and ``/`` its fp32
division (both the fast hardware forms, portable to HIP); the result is equal to the reference
within ``dtype_tols``, not bitwise, and depends only on the element (no reduction, M not specialised).

Backward (:func:`backward`, one launch of ``_swiglu_bwd_kernel`` on the forward's grid): per element, in
fp32, ``s = 1 / (1 + exp(-g))``, ``dgate = dy * u * s * (1 + g * (1 - s))``, ``dup = dy * (g * s)`` (the
reference's expressions, left to right), each rounded once to x's dtype into ``dx = [dgate | dup]``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlk_core.ops._plan import next_pow2


def config(inter: int) -> dict[str, int]:
    block = min(2048, next_pow2(inter))
    return {"BLOCK": block, "num_warps": max(1, min(8, block // 256))}


@triton.jit(do_not_specialize=["M"])
def _swiglu_fwd_kernel(x_ptr, y_ptr, M, INTER, stride_xm, stride_ym, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    g = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_xm + INTER + cols, mask=mask, other=0.0).to(tl.float32)
    y = (g / (tl.exp(-g) + 1.0)) * u
    tl.store(y_ptr + row * stride_ym + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _swiglu_bwd_kernel(x_ptr, g_ptr, dx_ptr, M, INTER, stride_xm, stride_gm, stride_dxm, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    a = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_xm + INTER + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(g_ptr + row * stride_gm + cols, mask=mask, other=0.0).to(tl.float32)
    s = 1.0 / (tl.exp(-a) + 1.0)
    dgate = dy * u * s * (1.0 + a * (1.0 - s))
    dup = dy * (a * s)
    tl.store(dx_ptr + row * stride_dxm + cols, dgate.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dx_ptr + row * stride_dxm + INTER + cols, dup.to(dx_ptr.dtype.element_ty), mask=mask)


def _rows(p, t: torch.Tensor) -> torch.Tensor:
    t2 = p.reshape(t, -1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else p.contiguous(t2)


def forward(p, x: torch.Tensor) -> torch.Tensor:
    inter = x.shape[-1] // 2
    x2 = _rows(p, x)
    m = x2.shape[0]
    y = p.new((*x.shape[:-1], inter), x.dtype)
    if m > 0:
        c = config(inter)
        p.launch(_swiglu_fwd_kernel, (m, triton.cdiv(inter, c["BLOCK"])), x2, y, m, inter, x2.stride(0), inter, **c)
    return y


def backward(p, grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``dx = [dgate | dup]`` of ``x [..., 2I]`` for ``grad [..., I]`` (see the module docstring)."""
    two_i = x.shape[-1]
    inter = two_i // 2
    x2, g2 = _rows(p, x), _rows(p, grad)
    m = x2.shape[0]
    dx = p.new(x.shape, x.dtype)
    if m > 0:
        c = config(inter)
        p.launch(_swiglu_bwd_kernel, (m, triton.cdiv(inter, c["BLOCK"])), x2, g2, dx, m, inter, x2.stride(0),
                 g2.stride(0), two_i, **c)
    return dx


def supports(x: torch.Tensor) -> tuple[bool, str]:
    if triton.cdiv(x.shape[-1] // 2, config(x.shape[-1] // 2)["BLOCK"]) > 65535:
        return False, f"intermediate size {x.shape[-1] // 2} exceeds the grid's second dimension"
    return True, ""


def supports_backward(grad: torch.Tensor, x: torch.Tensor) -> tuple[bool, str]:
    return supports(x)


def build_calls(dtype: torch.dtype, sms: int):
    """Per distinct :func:`config` (``BLOCK = min(2048, next_pow2(I))``) with ``I`` a multiple of 16: the forward
    and the backward on contiguous rows."""
    for inter in (16 << i for i in range(8)):
        x = torch.empty((64, 2 * inter), dtype=dtype, device="meta")
        yield forward, (x,)
        yield backward, (x.new_empty((64, inter)), x)
