"""Triton RMSNorm under contract ``rlk.rms_norm.v1`` (backend ``rlk.triton``).

``y = round_to(x.dtype)( (f32(x) * rsqrt(sum(f32(x)^2) / H + eps)) * f32(w) )``

Each row is loaded whole into registers and its sum of squares is reduced by one ``tl.sum`` whose
order is fixed by the compiled kernel (block width and warps, both functions of H only); ``x * inv``
is multiplied before ``* w``; one rounding. A program handles ``ROWS`` rows side by side (``ROWS`` a
function of H: several short rows per program keep q/k-norm rows of 128 from being launch-bound);
each row is still reduced on its own, by the same instructions, wherever it sits. M is not
specialised on, so every M runs the same binary. Equal to the reference (pairwise-tree order)
within ``dtype_tols``, not bitwise.

Backward (:func:`backward`, two launches): ``_rms_norm_bwd_kernel`` walks a fixed block of rows per
program, ``ROWS`` rows side by side per step as the forward, and computes each row's ``dx`` from that
row alone (``inv`` recomputed by the forward's ``tl.sum``, ``mean(gw * xhat)`` by one more), rounded once
to x's dtype; it adds the step's ``tl.sum`` over its rows of ``g * xhat`` to a per-program fp32 partial of
``dweight``, steps in increasing row order, and writes the partial (no atomics).
``_rms_norm_bwd_dw_kernel`` sums the ``[P, H]`` partials over P in blocks of ``DW_BLOCK_P`` in increasing
order (a ``tl.sum`` per block) and rounds once to the weight's dtype. The rows per program are a function
of (M, H) only (:func:`partition`), so every run of one shape reduces ``dweight`` in the same order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlk_core.ops._plan import next_pow2

MAX_H = 65536  # one row must fit one program


def config(h: int) -> dict[str, int]:
    """Block width, rows per program and warps: a pure function of the row length H."""
    block_h = next_pow2(h)
    rows = max(1, min(16, 2048 // block_h))
    warps = max(1, min(16, block_h * rows // 512))
    return {"BLOCK_H": block_h, "ROWS": rows, "num_warps": warps}


@triton.jit(do_not_specialize=["M"])
def _rms_norm_fwd_kernel(x_ptr, w_ptr, y_ptr, M, H, stride_xm, stride_ym, eps,
                         BLOCK_H: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_H)
    mask = (rows[:, None] < M) & (cols[None, :] < H)
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    ss = tl.sum(x * x, axis=1)
    inv = tl.math.rsqrt(ss / H + eps)
    w = tl.load(w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
    y = (x * inv[:, None]) * w[None, :]
    tl.store(y_ptr + rows64[:, None] * stride_ym + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


MAX_PROGRAMS = 512  # backward: at most this many programs, i.e. rows of fp32 dweight partials
MIN_STEPS = 4  # backward: a program walks at least this many steps of ROWS rows (fewer partials at small M)
DW_BLOCK_P, DW_BLOCK_N = 64, 32  # the dweight merge: partials per step, columns per program
DW_WARPS = 4


def partition(m: int, h: int) -> tuple[int, int]:
    """``(rows_per_program, programs)`` of the backward: a pure function of the shape (M rows of H)."""
    rows = config(h)["ROWS"]
    steps = max(MIN_STEPS, triton.cdiv(triton.cdiv(m, rows), MAX_PROGRAMS))
    return rows * steps, triton.cdiv(m, rows * steps)


@triton.jit(do_not_specialize=["M", "NH", "RPP"])
def _rms_norm_bwd_kernel(x_ptr, w_ptr, g_ptr, dx_ptr, part_ptr, M, H, NH, RPP,
                         stride_x0, stride_x1, stride_g0, stride_g1, eps,
                         BLOCK_H: tl.constexpr, ROWS: tl.constexpr):
    # row r of the [M, H] view is (r // NH, r % NH) of x and g seen as [M / NH, NH, H] with unit last stride
    # (the q/k-norm input is such a view of the QKV output); dx is a fresh contiguous [M, H]
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < H
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    first = pid * RPP
    for step in range(0, RPP, ROWS):
        rows = first + step + tl.arange(0, ROWS)
        mask = (rows[:, None] < M) & cmask[None, :]
        outer, inner = (rows // NH).to(tl.int64), (rows % NH).to(tl.int64)
        xo = outer * stride_x0 + inner * stride_x1
        go = outer * stride_g0 + inner * stride_g1
        x = tl.load(x_ptr + xo[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + go[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        inv = tl.math.rsqrt(tl.sum(x * x, axis=1) / H + eps)
        xhat = x * inv[:, None]
        gw = g * w[None, :]
        mean = tl.sum(gw * xhat, axis=1) / H
        dx = inv[:, None] * (gw - xhat * mean[:, None])
        tl.store(dx_ptr + rows.to(tl.int64)[:, None] * H + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        acc += tl.sum(g * xhat, axis=0)
    tl.store(part_ptr + pid.to(tl.int64) * H + cols, acc, mask=cmask)


@triton.jit(do_not_specialize=["P"])
def _rms_norm_bwd_dw_kernel(part_ptr, dw_ptr, P, H, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < H
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        tile = tl.load(part_ptr + p.to(tl.int64)[:, None] * H + cols[None, :],
                       mask=(p[:, None] < P) & cmask[None, :], other=0.0)
        acc += tl.sum(tile, axis=0)
    tl.store(dw_ptr + cols, acc.to(dw_ptr.dtype.element_ty), mask=cmask)


def rows_view(p, t: torch.Tensor) -> torch.Tensor:
    """``t [..., H]`` as ``[A, NH, H]`` (``NH = t.shape[-2]``, 1 for a vector) with a unit last stride: a view
    where one exists (a [T, heads, D] slice of a wider tensor is one), else a contiguous copy viewed so."""
    h = t.shape[-1]
    nh = t.shape[-2] if t.dim() >= 2 else 1
    try:
        t3 = t.view(-1, nh, h)
    except RuntimeError:
        t3 = None
    if t3 is None or (h > 1 and t3.stride(2) != 1):
        t3 = p.contiguous(t).view(-1, nh, h)
    return t3


def forward(p, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.shape[-1]
    x2 = p.reshape(x, -1, h)
    if x2.stride(-1) != 1:
        x2 = p.contiguous(x2)
    w = weight if weight.stride(0) == 1 else p.contiguous(weight)
    m = x2.shape[0]
    y = p.new(x.shape, x.dtype)
    if m > 0:
        c = config(h)
        p.launch(_rms_norm_fwd_kernel, (triton.cdiv(m, c["ROWS"]),), x2, w, y, m, h, x2.stride(0), h, float(eps), **c)
    return y


def backward(p, grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dweight)`` (see the module docstring): dx in x's dtype, dweight in the weight's."""
    h = x.shape[-1]
    m = x.numel() // h if h else 0
    dx = p.new(x.shape, x.dtype)
    if m == 0:
        return dx, p.new((h,), weight.dtype, "zeros")
    x3, g3 = rows_view(p, x), rows_view(p, grad)
    w = weight if weight.stride(0) == 1 else p.contiguous(weight)
    rpp, programs = partition(m, h)
    part = p.new((programs, h), torch.float32)
    p.launch(_rms_norm_bwd_kernel, (programs,), x3, w, g3, dx, part, m, h, x3.shape[1], rpp, x3.stride(0),
             x3.stride(1), g3.stride(0), g3.stride(1), float(eps), **config(h))
    dw = p.new((h,), weight.dtype)
    p.launch(_rms_norm_bwd_dw_kernel, (triton.cdiv(h, DW_BLOCK_N),), part, dw, programs, h, BLOCK_P=DW_BLOCK_P,
             BLOCK_N=DW_BLOCK_N, num_warps=DW_WARPS)
    return dx, dw


def supports(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[bool, str]:
    if x.shape[-1] > MAX_H:
        return False, f"H={x.shape[-1]} > {MAX_H} (one row per program)"
    return True, ""


def supports_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[bool, str]:
    return supports(x, weight, eps)


def build_calls(dtype: torch.dtype, sms: int):
    """Per distinct :func:`config` (a function of ``next_pow2(H)``) with ``H`` a multiple of 16: the forward and the
    backward on contiguous rows, the weight in the input dtype or fp32."""
    for h in (1 << i for i in range(4, MAX_H.bit_length())):
        for wdtype in sorted({dtype, torch.float32}, key=str):
            x = torch.empty((64, h), dtype=dtype, device="meta")
            w = torch.empty((h,), dtype=wdtype, device="meta")
            yield forward, (x, w, 1e-6)
            yield backward, (x.new_empty(x.shape), x, w, 1e-6)
