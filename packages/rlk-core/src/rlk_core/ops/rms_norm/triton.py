"""Triton RMSNorm under contract ``rlk.rms_norm.v1`` (backend ``rlk.triton``).

``y = round_to(x.dtype)( (f32(x) * rsqrt(sum(f32(x)^2) / H + eps)) * f32(w) )``

Each row is loaded whole into registers and its sum of squares is reduced by one ``tl.sum`` whose
order is fixed by the compiled kernel (block width and warps, both functions of H only); ``x * inv``
is multiplied before ``* w``; one rounding. A program handles ``ROWS`` rows side by side (``ROWS`` a
function of H: several short rows per program keep q/k-norm rows of 128 from being launch-bound);
each row is still reduced on its own, by the same instructions, wherever it sits. M is not
specialised on, so every M runs the same binary. Equal to the reference (pairwise-tree order)
within ``dtype_tols``, not bitwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlk_core.ops._triton_common import next_pow2

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


def forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.shape[-1]
    x2 = x.reshape(-1, h)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = weight if weight.stride(0) == 1 else weight.contiguous()
    m = x2.shape[0]
    y = torch.empty((m, h), dtype=x.dtype, device=x.device)
    if m > 0:
        c = config(h)
        grid = (triton.cdiv(m, c["ROWS"]),)
        _rms_norm_fwd_kernel[grid](x2, w, y, m, h, x2.stride(0), y.stride(0), float(eps), **c)
    return y.reshape(x.shape)


def supports(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[bool, str]:
    if x.shape[-1] > MAX_H:
        return False, f"H={x.shape[-1]} > {MAX_H} (one row per program)"
    return True, ""
