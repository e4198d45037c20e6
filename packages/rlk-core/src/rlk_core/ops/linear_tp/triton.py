"""Triton kernels of ``linear_tp_partials`` under contract ``rlk.gemm.tp.v1`` (backend ``rlk.triton``).

Every kernel here computes each leaf the same way — a fresh fp32 accumulator through the leaf's K loop, the loop of
``linear``'s pointer kernel (``_linear_fwd_kernel``): ``tl.dot`` k-steps of ``BLOCK_K`` in increasing k over the
leaf's ``LEAF_K`` columns, masked past them (:func:`_leaf`) — and merges the leaves by the balanced adjacent-pairs
tree ``((l0 + l1) + (l2 + l3)) + ...`` in fp32, storing the merged partial once, never rounded. They differ only in
where a leaf runs and where a finished subtree waits for its right sibling (the *variant*):

- ``fused`` (``_linear_tp_fwd_kernel``): one program per output tile runs the leaves in order and keeps the waiting
  subtrees in registers (a binary counter: after leaf ``j``, add it onto its left siblings while ``j + 1`` has
  trailing zero bits) — at most ``log2(LEAVES) + 1`` accumulators alive, which caps the tile at 64x64;
- ``split`` (``_linear_tp_leaf_kernel`` + ``_linear_tp_merge_kernel``): one program per (output tile, leaf), each
  leaf's fp32 tile written to a workspace ``[LEAVES, M, N]``, then an elementwise merge runs the same binary counter
  over the workspace — ``LEAVES`` times the programs of ``fused`` (decode: a memory-bound GEMM needs programs on
  every SM), at the cost of ``LEAVES * M * N * 4`` workspace bytes written and read;
- ``stash`` (``_linear_tp_stash_kernel``): ``fused``'s loop with one accumulator in registers and the waiting
  subtrees in a per-program fp32 workspace (``log2(LEAVES)`` tiles per program of a persistent grid, in L2), so the
  tile can grow to 128x64 at 8 leaves (128x128 still spills registers at 4 and 8 leaves: the slot loads' and
  stores' pointer tensors).

The same operands and the same adds in the same order: the variants give the same bits (tested under the
interpreter; on the GPU, as for ``linear``, the tile decides which elements a program computes, never an element's K
loop — ``tests/gpu/test_linear_tp_gpu.py`` checks every variant against every other). ``BLOCK_K`` is the same in
every variant (:func:`tile_config`): a function of the dtype and the leaf length only.

Configuration (:func:`config`): a fixed rule of (dtype, M, N, LEAF_K) — never of the local K or of ``LEAVES`` — so a
rank at any TP runs each leaf with the configuration TP 1 runs it with. The rule (:func:`variant`) is reasoned, not
measured (docs/ops/linear_tp.md, "Backends"; ``benchmarks/bench_linear_tp.py --variants all`` measures it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlk_core.ops._plan import next_pow2
from rlk_core.ops.linear.triton import _dot, _tile_coords

DTYPES = frozenset({torch.bfloat16, torch.float16, torch.float32})
VARIANTS = ("fused", "split", "stash")
# Forced only (config(..., which=...), the benchmark's --variants all), never the rule's, not in the AOT build:
# smem, the Gluon kernel of rlk_core.ops.linear_tp.gluon (bf16 / fp16, EVEN_K, sm_90; written, not run).
FORCED = ("smem",)
# (BLOCK_M, BLOCK_N, GROUP_M, num_warps, num_stages); BLOCK_K from the leaf length (below). Each compiles for sm_90
# without register spills at 8 leaves (ptxas: tests/core/ops/test_linear_tp_compile_sm90.py); speeds unmeasured.
_DECODE = (16, 64, 8, 4, 3)  # fused, M <= 16: mma.sync
_ROWS = (64, 64, 8, 8, 3)  # fused, M > 16: wgmma; 8 warps (4 warps, or 128x64 tiles, spill at 8 leaves)
_FP32 = (32, 64, 8, 4, 2)  # every variant in fp32: ieee dots (FMA), BLOCK_K <= 32 (fused 64x64 / 4 warps spills)
# split, M <= 16: linear's decode tile for N = 4096 (16x32, the N tile that fills the SMs), one leaf per program
_SPLIT_DECODE = (16, 32, 8, 4, 4)
_SPLIT_ROWS = (64, 128, 8, 4, 4)  # split, M > 16: linear's 64x128 tile (as _SMALL_TMA's, by pointer loads)
_STASH = (128, 64, 8, 8, 4)  # stash: one accumulator alive; 128 rows per weight read (128x128 spills at 4 leaves)
TILES = {"fused": (_DECODE, _ROWS), "split": (_SPLIT_DECODE, _SPLIT_ROWS), "stash": (_STASH,)}
MAX_BLOCK_K = 64
MAX_BLOCK_K_FP32 = 32
# The rule's M boundary (unmeasured). M <= SPLIT_MAX_M: split (programs over tiles x leaves fill the SMs; the
# workspace is LEAVES * M * N * 4 bytes: 16 MiB at M = 128, N = 4096, 8 leaves, mostly in L2); above: stash, whose
# 128x64 tiles make a full wave from M ~ 256 at N = 4096 and read the weight half as often per row as fused's 64x64.
SPLIT_MAX_M = 128
MERGE_BLOCK = 1024


def variant(dtype: torch.dtype, m: int, n: int, leaf_k: int) -> str:
    """The variant the launch plan runs: a fixed rule of (dtype, M, N, the leaf length); a speed choice only (every
    variant gives the same bits). fp32 keeps ``fused``; bf16 / fp16: ``split`` for M <= SPLIT_MAX_M (decode and
    small prefill: programs over the leaves fill the SMs), ``stash`` above (linear's large tile). Unmeasured."""
    if dtype == torch.float32:
        return "fused"
    return "split" if m <= SPLIT_MAX_M else "stash"


def config(dtype: torch.dtype, m: int, n: int, leaf_k: int, which: str | None = None) -> dict[str, int | bool | str]:
    """The launch configuration of a call: a function of (dtype, M, N, the leaf length) only. ``which`` forces a
    variant (benchmarks and tests: every variant gives the same bits); None is the rule (:func:`variant`)."""
    which = which or variant(dtype, m, n, leaf_k)
    if which in FORCED:
        from rlk_core.ops.linear_tp import gluon

        return gluon.config(dtype, leaf_k, tile_config(gluon.TILE[:5], leaf_k, dtype))
    if which not in VARIANTS:
        raise ValueError(f"linear_tp: no variant {which!r}; known: {VARIANTS + FORCED}")
    if dtype == torch.float32:
        tile = _FP32
    else:
        tiles = TILES[which]
        tile = tiles[0] if m <= 16 or len(tiles) == 1 else tiles[1]
    return dict(tile_config(tile, leaf_k, dtype), VARIANT=which)


def tile_config(tile: tuple[int, ...], leaf_k: int, dtype: torch.dtype) -> dict[str, int | bool]:
    bm, bn, group, warps, stages = tile
    bk = min(MAX_BLOCK_K_FP32 if dtype == torch.float32 else MAX_BLOCK_K, max(16, next_pow2(leaf_k)))
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group, EVEN_K=leaf_k % bk == 0,
                IEEE=dtype == torch.float32, num_warps=warps, num_stages=stages)


def slots(leaves: int) -> int:
    """Waiting subtrees of the binary counter over ``leaves`` leaves (``stash``'s workspace tiles per program)."""
    return max(1, leaves.bit_length() - 1)


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


@triton.jit
def _tile(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """A tile's rows, columns (and the columns to load: wrapped into range, marked contiguous) and row mask."""
    pid_m, pid_n = _tile_coords(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_ld = tl.max_contiguous(tl.multiple_of(cols % N, BLOCK_N), BLOCK_N)
    return rows, cols, cols_ld, rows < M


@triton.jit
def _store(y_ptr, v, rows, cols, M, N, stride_ym, stride_yn):
    y_ptrs = y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :] * stride_yn
    tl.store(y_ptrs, v, mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def _round(v, y_ptr):
    """``linear_tp_finish``'s conversion in one step: fp32 ``v`` rounded to ``y_ptr``'s dtype (nearest even), a NaN
    made the canonical quiet NaN of that dtype — the bits ``masked_fill(isnan, nan)`` writes: 0x7FC0 (bf16), 0x7E00
    (fp16), 0x7FC00000 (fp32), set after the conversion (the GPU's conversion of a NaN has its own bits). A value is
    NaN after the rounding exactly where it is NaN before. bf16 is rounded on the bits (add ``0x7FFF`` plus the kept
    part's lowest bit, drop the low half: round to nearest even, overflow to inf — c10's conversion, and what the
    GPU's ``cvt.rn.bf16.f32`` gives for every number), because Triton's interpreter truncates; fp16 by the
    conversion (nearest even on the GPU and in the interpreter's numpy)."""
    ty: tl.constexpr = y_ptr.dtype.element_ty
    nan = v != v
    if ty == tl.bfloat16:
        u = v.to(tl.uint32, bitcast=True)
        r = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
        y = tl.where(nan, 0x7FC0, r).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    elif ty == tl.float16:
        canon = tl.full(v.shape, 0x7E00, tl.int16).to(tl.float16, bitcast=True)
        y = tl.where(nan, canon, v.to(tl.float16))
    else:
        canon = tl.full(v.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
        y = tl.where(nan, canon, v)
    return y


@triton.jit
def _f32(b):
    """A loaded bias in fp32, exactly: bf16 by its bits (the upper half of the fp32 word; Triton's interpreter
    converts bf16 subnormals wrongly), the others by the conversion."""
    if b.dtype == tl.bfloat16:
        out = (b.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        out = b.to(tl.float32)
    return out


@triton.jit
def _store_out(y_ptr, b_ptr, v, rows, cols, M, N, stride_ym, stride_yn, FINISH: tl.constexpr,
               HAS_BIAS: tl.constexpr):
    """A tile's merged fp32 partial ``v`` stored as it is, or (``FINISH``) finished: ``f32(bias)`` added once, then
    :func:`_round` — ``linear_tp_finish(v, bias, dtype)``'s fp32 add and one rounding, in the kernel's epilogue."""
    if FINISH:
        if HAS_BIAS:
            v = v + _f32(tl.load(b_ptr + cols, mask=cols < N, other=0.0))[None, :]
        v = _round(v, y_ptr)
    _store(y_ptr, v, rows, cols, M, N, stride_ym, stride_yn)


@triton.jit
def _count(t, s1, s2, s4, s8, J: tl.constexpr):
    """Leaf ``J``'s value ``t`` into the binary counter of finished subtrees (``s1``: one leaf, ``s2``: two, ...): the
    adjacent-pairs tree in leaf order, fp32 adds, at most log2(G) + 1 values alive."""
    if J % 2 == 1:
        t = s1 + t
    if J % 4 == 3:
        t = s2 + t
    if J % 8 == 7:
        t = s4 + t
    if (J + 1) % 8 == 0:
        s8 = t
    elif (J + 1) % 4 == 0:
        s4 = t
    elif (J + 1) % 2 == 0:
        s2 = t
    else:
        s1 = t
    return s1, s2, s4, s8


@triton.jit
def _root(s1, s2, s4, s8, LEAVES: tl.constexpr):
    """The tree's root after all ``LEAVES`` leaves went through :func:`_count`."""
    if LEAVES == 1:
        out = s1
    elif LEAVES == 2:
        out = s2
    elif LEAVES == 4:
        out = s4
    else:
        out = s8
    return out


@triton.jit(do_not_specialize=["M"])
def _linear_tp_fwd_kernel(
    x_ptr, w_ptr, y_ptr, b_ptr, M, N, LEAF_K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
    LEAVES: tl.constexpr, FINISH: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """``fused``: every leaf of a tile in one program, the waiting subtrees in registers; ``FINISH``: the root
    finished in the epilogue (:func:`_store_out`)."""
    rows, cols, cols_ld, row_ok = _tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    # the binary counter: s1, s2, s4 hold finished subtrees of 1, 2, 4 leaves waiting for their right sibling; s8 the
    # whole tree of 8
    s1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    s2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    s4 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    s8 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for j in tl.static_range(LEAVES):
        t = _leaf(x_ptr, w_ptr, rows, cols_ld, row_ok, j * LEAF_K, LEAF_K, stride_xm, stride_xk, stride_wn,
                  stride_wk, EVEN_K, IEEE, BLOCK_M, BLOCK_N, BLOCK_K)
        s1, s2, s4, s8 = _count(t, s1, s2, s4, s8, j)
    out = _root(s1, s2, s4, s8, LEAVES)
    _store_out(y_ptr, b_ptr, out, rows, cols, M, N, stride_ym, stride_yn, FINISH, HAS_BIAS)


@triton.jit(do_not_specialize=["M"])
def _linear_tp_leaf_kernel(
    x_ptr, w_ptr, y_ptr, b_ptr, M, N, LEAF_K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_yl, stride_ym, stride_yn,
    FINISH: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """``split``'s first launch: program (tile, j) writes leaf ``j`` of the tile, unmerged fp32, to ``y[j]`` (the
    workspace ``[LEAVES, M, N]``, or the output itself when the call has one leaf — then finished there with
    ``FINISH``)."""
    j = tl.program_id(1)
    rows, cols, cols_ld, row_ok = _tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    t = _leaf(x_ptr, w_ptr, rows, cols_ld, row_ok, j * LEAF_K, LEAF_K, stride_xm, stride_xk, stride_wn, stride_wk,
              EVEN_K, IEEE, BLOCK_M, BLOCK_N, BLOCK_K)
    _store_out(y_ptr + j.to(tl.int64) * stride_yl, b_ptr, t, rows, cols, M, N, stride_ym, stride_yn, FINISH,
               HAS_BIAS)


@triton.jit
def _linear_tp_merge_kernel(ws_ptr, y_ptr, b_ptr, MN, N, LEAVES: tl.constexpr, FINISH: tl.constexpr,
                            HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """``split``'s second launch: per element of the contiguous ``[M, N]`` output, the adjacent-pairs tree over the
    ``LEAVES`` workspace values — the binary counter of ``fused`` in the same order, fp32 adds; ``FINISH``: the root
    finished before the store (``f32(bias[col])`` added once, :func:`_round`)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    s1 = tl.zeros((BLOCK,), dtype=tl.float32)
    s2 = tl.zeros((BLOCK,), dtype=tl.float32)
    s4 = tl.zeros((BLOCK,), dtype=tl.float32)
    s8 = tl.zeros((BLOCK,), dtype=tl.float32)
    ptrs = ws_ptr + offs
    for j in tl.static_range(LEAVES):
        t = tl.load(ptrs, mask=ok, other=0.0)
        ptrs += MN  # leaf j + 1 (a pointer step: no int32 product j * MN)
        s1, s2, s4, s8 = _count(t, s1, s2, s4, s8, j)
    out = _root(s1, s2, s4, s8, LEAVES)
    if FINISH:
        if HAS_BIAS:
            out = out + _f32(tl.load(b_ptr + offs % N, mask=ok, other=0.0))
        out = _round(out, y_ptr)
    tl.store(y_ptr + offs, out, mask=ok)


@triton.jit(do_not_specialize=["M"])
def _linear_tp_stash_kernel(
    x_ptr, w_ptr, y_ptr, b_ptr, ws_ptr, M, N, LEAF_K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
    LEAVES: tl.constexpr, SLOTS: tl.constexpr, NUM_PROGRAMS: tl.constexpr, FINISH: tl.constexpr,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """``stash``: ``fused``'s loop with one accumulator in registers. A finished subtree of ``2^s`` leaves waits for
    its right sibling in slot ``s`` of this program's workspace (``SLOTS`` fp32 tiles: exact stores and loads);
    persistent over the tiles (``NUM_PROGRAMS`` programs, so the workspace is ``NUM_PROGRAMS * SLOTS`` tiles). The
    barriers order one thread's stash stores before another's loads of them (the store and load layouts need not
    match) and the loads before the slot is written again. ``FINISH``: the root finished in the epilogue."""
    pid = tl.program_id(0)
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    tile_offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    ws = ws_ptr + pid.to(tl.int64) * (SLOTS * BLOCK_M * BLOCK_N) + tile_offs
    for tile in range(pid, num_tiles, NUM_PROGRAMS):
        rows, cols, cols_ld, row_ok = _tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        for j in tl.static_range(LEAVES):
            t = _leaf(x_ptr, w_ptr, rows, cols_ld, row_ok, j * LEAF_K, LEAF_K, stride_xm, stride_xk, stride_wn,
                      stride_wk, EVEN_K, IEEE, BLOCK_M, BLOCK_N, BLOCK_K)
            if j % 2 == 1:
                tl.debug_barrier()
                t = tl.load(ws) + t
            if j % 4 == 3:
                t = tl.load(ws + BLOCK_M * BLOCK_N) + t
            if j % 8 == 7:
                t = tl.load(ws + 2 * BLOCK_M * BLOCK_N) + t
            if j == LEAVES - 1:
                _store_out(y_ptr, b_ptr, t, rows, cols, M, N, stride_ym, stride_yn, FINISH, HAS_BIAS)
            else:
                tl.debug_barrier()
                if (j + 1) % 4 == 0:
                    tl.store(ws + 2 * BLOCK_M * BLOCK_N, t)
                elif (j + 1) % 2 == 0:
                    tl.store(ws + BLOCK_M * BLOCK_N, t)
                else:
                    tl.store(ws, t)


# -- the launch plan (rlk_core.ops._plan) -------------------------------------------------------------------------
def forward(p, x: torch.Tensor, weight: torch.Tensor, leaves: int) -> torch.Tensor:
    """The op ``linear_tp_partials``: ``x [..., K_local]``, ``weight [N, K_local]`` into a fresh fp32 ``[..., N]``."""
    return partials(p, x, weight, leaves)


def forward_finished(p, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     leaves: int) -> torch.Tensor:
    """The op ``linear_tp`` (TP 1: the whole tree in one call): ``x [..., K]``, ``weight [N, K]``, ``bias [N]`` or
    None into a fresh ``[..., N]`` of ``x``'s dtype, finished in the last kernel's epilogue."""
    return finished(p, x, weight, bias, leaves)


def partials(p, x: torch.Tensor, weight: torch.Tensor, leaves: int, which: str | None = None) -> torch.Tensor:
    """:func:`forward` with ``which`` forcing a variant (benchmarks and tests; None: the rule, as the op runs)."""
    lead, k = x.shape[:-1], x.shape[-1]
    n = weight.shape[0]
    m = lead.numel()
    y = p.new((*lead, n), torch.float32, "zeros" if k == 0 else "empty")
    if m and n and k:
        x2 = p.reshape(x, m, k)
        if x2.stride(-1) != 1:
            x2 = p.contiguous(x2)
        _launch(p, x2, weight, leaves, y.view(m, n), config(x.dtype, m, n, k // leaves, which))
    return y


def finished(p, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, leaves: int,
             which: str | None = None) -> torch.Tensor:
    """:func:`forward_finished` with ``which`` forcing a variant: the launches of :func:`partials` (the same
    configuration, the same leaves and tree) with the last kernel's store finished — ``f32(bias)`` added once, one
    rounding to ``x``'s dtype, NaN canonical — so the result is bitwise ``linear_tp_finish(partials(...), bias,
    x.dtype)``, in one launch fewer than three torch ones (four with a bias)."""
    lead, k = x.shape[:-1], x.shape[-1]
    n = weight.shape[0]
    m = lead.numel()
    y = p.new((*lead, n), x.dtype)
    if m and n and not k:  # no leaf: the finish of a zero partial (bias or not: 0 + (-0.0) is +0.0)
        from rlk_core.ops.linear_tp.reference import linear_tp_finish_reference

        p.host(lambda: y.copy_(linear_tp_finish_reference(y.new_zeros(y.shape, dtype=torch.float32), bias,
                                                          x.dtype)))
    elif m and n:
        x2 = p.reshape(x, m, k)
        if x2.stride(-1) != 1:
            x2 = p.contiguous(x2)
        _launch(p, x2, weight, leaves, y.view(m, n), config(x.dtype, m, n, k // leaves, which), bias, True)
    return y


def _launch(p, x: torch.Tensor, weight: torch.Tensor, leaves: int, out: torch.Tensor,
            cfg: dict[str, int | bool | str], bias: torch.Tensor | None = None, finish: bool = False) -> None:
    """``out`` (``[M, N]``, contiguous for ``split`` with more than one leaf) = the call's merged partial: fp32, or
    with ``finish`` that partial plus ``f32(bias)``, rounded once to ``out``'s dtype with NaN canonical (the last
    kernel's epilogue: fused's and stash's store, split's merge — its leaf kernel at one leaf). The workspaces are
    buffers of the call (``p.new``), never freed early: ``rlk.cuda`` keeps a plan with no ``free`` as one
    program."""
    m, k = x.shape
    n = weight.shape[0]
    c = dict(cfg)
    which = c.pop("VARIANT", "fused")
    tiles = triton.cdiv(m, c["BLOCK_M"]) * triton.cdiv(n, c["BLOCK_N"])
    xs = (x.stride(0), x.stride(1), weight.stride(0), weight.stride(1))
    fin = dict(FINISH=finish, HAS_BIAS=finish and bias is not None)
    b = bias if fin["HAS_BIAS"] else out  # an unread pointer without a bias
    if which == "fused":
        p.launch(_linear_tp_fwd_kernel, (tiles,), x, weight, out, b, m, n, k // leaves, *xs,
                 out.stride(0), out.stride(1), LEAVES=leaves, **fin, **c)
    elif which == "split":
        if leaves == 1:  # one leaf: the leaf kernel writes (and finishes) the output itself
            p.launch(_linear_tp_leaf_kernel, (tiles, 1), x, weight, out, b, m, n, k, *xs,
                     m * n, out.stride(0), out.stride(1), **fin, **c)
            return
        ws = p.new((leaves, m, n), torch.float32)
        p.launch(_linear_tp_leaf_kernel, (tiles, leaves), x, weight, ws, ws, m, n, k // leaves, *xs,
                 m * n, ws.stride(-2), ws.stride(-1), FINISH=False, HAS_BIAS=False, **c)
        p.launch(_linear_tp_merge_kernel, (triton.cdiv(m * n, MERGE_BLOCK),), ws, out,
                 b if fin["HAS_BIAS"] else ws, m * n, n, LEAVES=leaves, **fin, BLOCK=MERGE_BLOCK, num_warps=4)
    elif which == "stash":
        programs = min(tiles, p.sms)
        ws = p.new((programs * slots(leaves) * c["BLOCK_M"] * c["BLOCK_N"],), torch.float32)
        p.launch(_linear_tp_stash_kernel, (programs,), x, weight, out, b, ws, m, n, k // leaves, *xs,
                 out.stride(0), out.stride(1), LEAVES=leaves, SLOTS=slots(leaves), NUM_PROGRAMS=p.sms, **fin, **c)
    elif which == "smem":
        from rlk_core.ops.linear_tp import gluon

        gluon.launch(p, x, weight, leaves, out, c, bias, finish)
    else:
        raise ValueError(f"linear_tp: no variant {which!r}; known: {VARIANTS + FORCED}")


def supports(x: torch.Tensor, weight: torch.Tensor, leaves: int) -> tuple[bool, str]:
    if x.dtype not in DTYPES:
        return False, f"dtype {x.dtype} has no rlk.triton linear_tp configuration"
    return True, ""


def supports_finished(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      leaves: int) -> tuple[bool, str]:
    return supports(x, weight, leaves)


# -- what the AOT build compiles (rlk_core.aot.build) ---------------------------------------------------------------
def build_calls(dtype: torch.dtype, sms: int):
    """Every (variant, tile) :func:`config` can pick for ``dtype`` — the rule's and the forced variants the benchmark
    runs — for every leaf count 1 .. 8, with and without ``EVEN_K``, on aligned operands with sizes multiples of 16,
    each as the fp32 partial (``linear_tp_partials``) and finished to ``dtype`` without and with a bias
    (``linear_tp``). ``split`` also compiles its merge for 2, 4 and 8 leaves; ``stash`` its persistent kernel with
    ``sms`` programs."""
    bk = MAX_BLOCK_K_FP32 if dtype == torch.float32 else MAX_BLOCK_K
    bias = torch.empty((256,), dtype=dtype, device="meta")
    for which in VARIANTS:
        tiles = [_FP32] if dtype == torch.float32 else TILES[which]
        for tile in tiles:
            rows = 16 if tile[0] == 16 else 256
            for leaves in (1, 2, 4, 8):
                for leaf_k in (bk * 4, bk * 4 + 16):
                    k = leaf_k * leaves
                    x = torch.empty((rows, k), dtype=dtype, device="meta")
                    w = torch.empty((256, k), dtype=dtype, device="meta")
                    cfg = dict(tile_config(tile, leaf_k, dtype), VARIANT=which)
                    y = torch.empty((rows, 256), dtype=torch.float32, device="meta")
                    yield _launch, (x, w, leaves, y, cfg)
                    y = torch.empty((rows, 256), dtype=dtype, device="meta")
                    for b in (None, bias):
                        yield _launch, (x, w, leaves, y, cfg, b, True)
