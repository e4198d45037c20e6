"""Triton GEMM for ``linear`` under contract ``rlk.gemm.bi.v1`` (backend ``rlk.triton``).

``y[m, n] = round_to(x.dtype)( acc_K(x[m, :] . w[n, :]) + f32(bias[n]) )`` where ``acc_K`` is one
fp32 accumulator per output element carried through a sequential loop over K in blocks of
``BLOCK_K`` (``acc = tl.dot(a, b, acc)``): no split-K, no atomics, one rounding to the output dtype.

Batch invariance: the tile configuration (``CONFIGS``) is a function of dtype and K only, M is not
specialised on (``do_not_specialize``), so every M runs the same binary, and within it each output
row is computed by the same instruction sequence wherever it sits in a tile. Rows past M in the last
tile are masked (loaded as zeros, never stored); columns past N are wrapped (``% N``) for the loads.

bf16/fp16 use tensor cores (wgmma on sm_90); fp32 uses ``input_precision="ieee"`` (no tf32), so it
stays within fp32 tolerance of the reference. Compared with the reference (pairwise-tree K order) the
result is equal within ``dtype_tols``, not bitwise: the K order differs by construction.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# One configuration per dtype (the reduction length K only selects the masked/unmasked K loop).
# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages)
CONFIGS: dict[torch.dtype, tuple[int, int, int, int, int, int]] = {
    torch.bfloat16: (128, 128, 64, 8, 8, 4),
    torch.float16: (128, 128, 64, 8, 8, 4),
    torch.float32: (64, 64, 32, 8, 4, 3),
}


def config(dtype: torch.dtype, k: int) -> dict[str, int | bool]:
    """The launch configuration for ``dtype`` and reduction length ``k`` — never a function of M."""
    bm, bn, bk, gm, warps, stages = CONFIGS[dtype]
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": gm, "num_warps": warps,
            "num_stages": stages, "EVEN_K": k % bk == 0, "IEEE": dtype == torch.float32}


@triton.jit(do_not_specialize=["M"])
def _linear_fwd_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # grouped tile order for L2 reuse; it changes which tile runs when, never a tile's arithmetic
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    cols_ld = tl.max_contiguous(tl.multiple_of(cols % N, BLOCK_N), BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + cols_ld[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
            b = tl.load(w_ptrs)
        else:
            k_left = K - kb * BLOCK_K
            a = tl.load(x_ptrs, mask=row_ok[:, None] & (offs_k[None, :] < k_left), other=0.0)
            b = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    if HAS_BIAS:
        bias = tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        acc = acc + bias[None, :]
    y_ptrs = y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & (cols[None, :] < N))


def linear_2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              cfg: dict[str, int | bool] | None = None) -> torch.Tensor:
    """``x [M, K] @ weight[N, K]^T (+ bias)`` with the contract configuration (``cfg`` is for
    exploratory benchmarks only; anything but :func:`config` is outside the contract)."""
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.copy_(bias.float().expand(m, n) if bias is not None else torch.zeros_like(y))
    c = dict(cfg or config(x.dtype, k))
    grid = (triton.cdiv(m, c["BLOCK_M"]) * triton.cdiv(n, c["BLOCK_N"]),)
    _linear_fwd_kernel[grid](
        x, weight, bias if bias is not None else y, y,
        m, n, k,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), y.stride(0), y.stride(1),
        HAS_BIAS=bias is not None, **c,
    )
    return y


def forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    lead = x.shape[:-1]
    y = linear_2d(x.reshape(lead.numel(), x.shape[-1]), weight, bias)
    return y.reshape(*lead, weight.shape[0])


def supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[bool, str]:
    if x.dtype not in CONFIGS:
        return False, f"dtype {x.dtype} has no rlk.triton GEMM configuration"
    return True, ""


def linear_2d_into(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Internal: ``out[M, N] = x[M, K] @ weight[N, K]^T`` with the contract configuration of
    ``x.dtype``, any strides on all three (transposed views need no copy), rounded once to
    ``out.dtype`` (an fp32 ``out`` keeps the fp32 accumulator). The same kernel and arithmetic as
    :func:`linear_2d`; used by the log-prob backward GEMMs."""
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and tuple(out.shape) == (m, n), (x.shape, weight.shape, out.shape)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    c = config(x.dtype, k)
    grid = (triton.cdiv(m, c["BLOCK_M"]) * triton.cdiv(n, c["BLOCK_N"]),)
    _linear_fwd_kernel[grid](
        x, weight, out, out,
        m, n, k,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=False, **c,
    )
    return out
