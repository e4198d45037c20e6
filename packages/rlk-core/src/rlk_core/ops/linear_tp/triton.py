"""Triton kernel of ``linear_tp_partials`` under contract ``rlk.gemm.tp.v1`` (backend ``rlk.triton``).

One program per ``BLOCK_M x BLOCK_N`` output tile. For each of the ``LEAVES`` leaves in order, a fresh fp32
accumulator runs that leaf's K loop — the loop of ``linear``'s pointer kernel (``_linear_fwd_kernel``): ``tl.dot``
k-steps in increasing k over the leaf's ``LEAF_K`` columns, masked past them — and the finished leaves are merged
on chip by a binary counter over leaf order (after leaf ``j``: add it onto its left siblings while ``j + 1`` has
trailing zero bits), which is the balanced adjacent-pairs tree ``((l0 + l1) + (l2 + l3)) + ...`` of the contract with
at most ``log2(LEAVES) + 1`` accumulators alive. The merged partial is stored once, in fp32, never rounded.

Configuration (:func:`config`): a fixed rule of (dtype, M, N, LEAF_K) — never of the local K or of ``LEAVES`` — so a
rank at any TP runs each leaf with the configuration TP 1 runs it with; as for ``linear``, the tile decides which
elements a program computes, never an element's K loop. Unswept on the GPU (docs/ops/linear_tp.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlk_core.ops._plan import next_pow2
from rlk_core.ops.linear.triton import _dot, _tile_coords

DTYPES = frozenset({torch.bfloat16, torch.float16, torch.float32})
# (BLOCK_M, BLOCK_N, GROUP_M, num_warps, num_stages); BLOCK_K from the leaf length (below)
# Chosen to compile for sm_90 without register spills at 8 leaves (four live accumulators; ptxas, checked by
# tests/core/ops/test_kernels_compile_sm90.py); their speed is unmeasured.
_DECODE = (16, 64, 8, 4, 3)  # M <= 16: mma.sync
_ROWS = (64, 64, 8, 8, 3)  # M > 16: wgmma; 8 warps (4 warps, or 128x64 tiles, spill at 8 leaves)
_FP32 = (32, 64, 8, 4, 2)  # ieee dots (FMA), BLOCK_K <= 32 (64x64 with 4 warps spills at 8 leaves)
TILES = (_DECODE, _ROWS, _FP32)
MAX_BLOCK_K = 64
MAX_BLOCK_K_FP32 = 32


def config(dtype: torch.dtype, m: int, n: int, leaf_k: int) -> dict[str, int | bool]:
    """The launch configuration of a call: a function of (dtype, M, N, the leaf length) only."""
    if dtype == torch.float32:
        tile = _FP32
    else:
        tile = _DECODE if m <= 16 else _ROWS
    return tile_config(tile, leaf_k, dtype)


def tile_config(tile: tuple[int, ...], leaf_k: int, dtype: torch.dtype) -> dict[str, int | bool]:
    bm, bn, group, warps, stages = tile
    bk = min(MAX_BLOCK_K_FP32 if dtype == torch.float32 else MAX_BLOCK_K, max(16, next_pow2(leaf_k)))
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group, EVEN_K=leaf_k % bk == 0,
                IEEE=dtype == torch.float32, num_warps=warps, num_stages=stages)


@triton.jit
def _leaf(x_ptr, w_ptr, rows, cols, row_ok, k0, LEAF_K, stride_xm, stride_xk, stride_wn, stride_wk,
          EVEN_K: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr):
    """One leaf ``[k0, k0 + LEAF_K)``: a fresh fp32 accumulator through its k-steps in increasing k."""
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + (k0 + offs_k[None, :]).to(tl.int64) * stride_xk
    w_ptrs = w_ptr + cols[None, :].to(tl.int64) * stride_wn + (k0 + offs_k[:, None]).to(tl.int64) * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(LEAF_K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
            b = tl.load(w_ptrs)
        else:
            k_left = LEAF_K - kb * BLOCK_K
            a = tl.load(x_ptrs, mask=row_ok[:, None] & (offs_k[None, :] < k_left), other=0.0)
            b = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc = _dot(a, b, acc, IEEE)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    return acc


@triton.jit(do_not_specialize=["M"])
def _linear_tp_fwd_kernel(
    x_ptr, w_ptr, y_ptr, M, N, LEAF_K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
    LEAVES: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _tile_coords(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    cols_ld = tl.max_contiguous(tl.multiple_of(cols % N, BLOCK_N), BLOCK_N)
    # the binary counter: s1, s2, s4 hold finished subtrees of 1, 2, 4 leaves waiting for their right sibling; s8 the
    # whole tree of 8
    s1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    s2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    s4 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    s8 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for j in tl.static_range(LEAVES):
        t = _leaf(x_ptr, w_ptr, rows, cols_ld, row_ok, j * LEAF_K, LEAF_K, stride_xm, stride_xk, stride_wn,
                  stride_wk, EVEN_K, IEEE, BLOCK_M, BLOCK_N, BLOCK_K)
        if j % 2 == 1:
            t = s1 + t
        if j % 4 == 3:
            t = s2 + t
        if j % 8 == 7:
            t = s4 + t
        if (j + 1) % 8 == 0:
            s8 = t
        elif (j + 1) % 4 == 0:
            s4 = t
        elif (j + 1) % 2 == 0:
            s2 = t
        else:
            s1 = t
    if LEAVES == 1:
        out = s1
    elif LEAVES == 2:
        out = s2
    elif LEAVES == 4:
        out = s4
    else:
        out = s8
    y_ptrs = y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :] * stride_yn
    tl.store(y_ptrs, out, mask=row_ok[:, None] & (cols[None, :] < N))


# -- the launch plan (rlk_core.ops._plan) -------------------------------------------------------------------------
def forward(p, x: torch.Tensor, weight: torch.Tensor, leaves: int) -> torch.Tensor:
    """The op ``linear_tp_partials``: ``x [..., K_local]``, ``weight [N, K_local]`` into a fresh fp32 ``[..., N]``."""
    lead, k = x.shape[:-1], x.shape[-1]
    n = weight.shape[0]
    m = lead.numel()
    y = p.new((*lead, n), torch.float32, "zeros" if k == 0 else "empty")
    if m and n and k:
        x2 = p.reshape(x, m, k)
        if x2.stride(-1) != 1:
            x2 = p.contiguous(x2)
        _launch(p, x2, weight, leaves, y.view(m, n), config(x.dtype, m, n, k // leaves))
    return y


def _launch(p, x: torch.Tensor, weight: torch.Tensor, leaves: int, out: torch.Tensor,
            cfg: dict[str, int | bool]) -> None:
    m, k = x.shape
    n = weight.shape[0]
    c = dict(cfg)
    p.launch(_linear_tp_fwd_kernel, (triton.cdiv(m, c["BLOCK_M"]) * triton.cdiv(n, c["BLOCK_N"]),),
             x, weight, out, m, n, k // leaves,
             x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
             LEAVES=leaves, **c)


def supports(x: torch.Tensor, weight: torch.Tensor, leaves: int) -> tuple[bool, str]:
    if x.dtype not in DTYPES:
        return False, f"dtype {x.dtype} has no rlk.triton linear_tp configuration"
    return True, ""


# -- what the AOT build compiles (rlk_core.aot.build) ---------------------------------------------------------------
def build_calls(dtype: torch.dtype, sms: int):
    """Every tile :func:`config` can pick for ``dtype``, for every leaf count 1 .. 8, with and without ``EVEN_K``, on
    aligned operands with sizes multiples of 16."""
    tiles = [_FP32] if dtype == torch.float32 else [_DECODE, _ROWS]
    rows = {_DECODE: 16, _ROWS: 256, _FP32: 64}
    bk = MAX_BLOCK_K_FP32 if dtype == torch.float32 else MAX_BLOCK_K
    for tile in tiles:
        for leaves in (1, 2, 4, 8):
            for leaf_k in (bk * 4, bk * 4 + 16):
                k = leaf_k * leaves
                x = torch.empty((rows[tile], k), dtype=dtype, device="meta")
                w = torch.empty((256, k), dtype=dtype, device="meta")
                y = torch.empty((rows[tile], 256), dtype=torch.float32, device="meta")
                yield _launch, (x, w, leaves, y, tile_config(tile, leaf_k, dtype))
