"""Exploration only (not shipped): the GEMM's row split in ONE persistent launch — rows below ``SPLIT_M`` in
128x256 tiles, the rest in 128x128 tiles, both stored by TMA, each K loop with its own pipeline depth.

Why it is here: as two launches the split measured 0.89-0.91 of cuBLAS at 8B qkv TP 4, M = 4096; a first
one-launch version (128x128 loop at 2 stages, pointer stores, so as to fit shared memory beside 128x256 at 3
stages) measured 0.64 and was reverted. Compiled for sm_90 on the CPU machine: with the 128x256 loop at 2
stages both TMA stores fit (128x128 at 3 stages: 193 KiB; at 4: 224 KiB; no spills, no serialised wgmma);
with it at 3 stages nothing fits (240 KiB). ``sweep_kernels.py --sections linear_onelaunch`` times these
against the shipped rule, bit for bit. Same k-steps as the shipped kernel, so the same bits are expected."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from rlk_core.ops.linear import triton as lt

_tile_coords = lt._tile_coords


@triton.jit
def _k_loop(x_desc, w_desc, off_m, off_n, k_tiles, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for kb in tl.range(k_tiles, num_stages=STAGES):
        acc = tl.dot(x_desc.load([off_m, kb * BLOCK_K]), w_desc.load([off_n, kb * BLOCK_K]).T, acc)
    return acc


@triton.jit(do_not_specialize=["M", "SPLIT_M"])
def split_kernel(x_desc, w_desc, y_desc, w2_desc, y2_desc, M, N, K, SPLIT_M,
                 NUM_PROGRAMS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_N2: tl.constexpr, STAGES: tl.constexpr, STAGES2: tl.constexpr):
    big_tiles = tl.cdiv(SPLIT_M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    num_tiles = big_tiles + tl.cdiv(M - SPLIT_M, BLOCK_M) * tl.cdiv(N, BLOCK_N2)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_tiles, NUM_PROGRAMS):
        if tile >= big_tiles:
            pid_m, pid_n = _tile_coords(tile - big_tiles, M - SPLIT_M, N, BLOCK_M, BLOCK_N2, 8)
            off_m = SPLIT_M + pid_m * BLOCK_M
            acc2 = _k_loop(x_desc, w2_desc, off_m, pid_n * BLOCK_N2, k_tiles, BLOCK_M, BLOCK_N2, BLOCK_K, STAGES2)
            y2_desc.store([off_m, pid_n * BLOCK_N2], acc2.to(y2_desc.dtype))
        else:
            pid_m, pid_n = _tile_coords(tile, SPLIT_M, N, BLOCK_M, BLOCK_N, 8)
            acc = _k_loop(x_desc, w_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, k_tiles, BLOCK_M, BLOCK_N, BLOCK_K, STAGES)
            y_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(y_desc.dtype))


def linear_split_one_launch(x: torch.Tensor, w: torch.Tensor, split_m: int, stages: int, stages2: int
                            ) -> torch.Tensor:
    """``x @ w.T`` (bf16, no bias): rows < ``split_m`` in 128x256 tiles, the rest in 128x128, one launch."""
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    tiles = triton.cdiv(split_m, 128) * triton.cdiv(n, 256) + triton.cdiv(m - split_m, 128) * triton.cdiv(n, 128)
    programs = min(tiles, torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 3)
    split_kernel[(programs,)](
        TensorDescriptor.from_tensor(x, [128, 64]), TensorDescriptor.from_tensor(w, [256, 64]),
        TensorDescriptor.from_tensor(y, [128, 256]), TensorDescriptor.from_tensor(w, [128, 64]),
        TensorDescriptor.from_tensor(y, [128, 128]), m, n, k, split_m,
        NUM_PROGRAMS=programs, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, BLOCK_N2=128, STAGES=stages, STAGES2=stages2,
        num_warps=8, num_stages=stages)
    return y
