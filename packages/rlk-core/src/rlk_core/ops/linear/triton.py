"""Triton GEMM for ``linear`` under contract ``rlk.gemm.bi.v1`` (backend ``rlk.triton``).

``y[m, n] = round_to(x.dtype)( acc_K(x[m, :] . w[n, :]) + f32(bias[n]) )`` where ``acc_K`` is one
fp32 accumulator per output element carried through a sequential loop over K in blocks of
``BLOCK_K`` (``acc = tl.dot(a, b, acc)``): no split-K, no atomics, one rounding to the output dtype.

Batch invariance: within one K loop each output element's arithmetic is fixed by the sequence of
``tl.dot`` k-steps (the MMA consumes K in steps of 16, accumulating into the same fp32 register in
increasing k); the tile shape (BLOCK_M/N/K), the warp count, the instruction family (``mma.sync`` for
BLOCK_M < 64, ``wgmma`` from 64), the load path (pointer loads or TMA descriptors) and the persistent
tile order only decide which elements a program computes and how operands reach it. Measured on the
H200: every candidate tile of ``benchmarks/sweep_kernels.py`` gave bit-identical outputs on every
Qwen3 shape and M tried, and the GPU tests check it for the shipped table (every M of the issue's list
against a batch of 8192, row by row). So the tile is chosen per call for speed by :func:`config` — a
fixed rule of (dtype, M, N, K, whether TMA applies, the SM count), no timing, no autotuning — and M
itself is never specialised on (``do_not_specialize``; the TMA kernel's last-row-block box, 0/16/32 rows,
is the only compile-time value derived from it). Rows past M and columns past N are masked (TMA:
zero-filled and clipped), never stored.

bf16/fp16 use tensor cores (wgmma on sm_90); fp32 uses ``input_precision="ieee"`` (no tf32), so it
stays within fp32 tolerance of the reference. Compared with the reference (pairwise-tree K order) the
result is equal within ``dtype_tols``, not bitwise: the K order differs by construction.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor

from rlk_core.ops._triton_common import has_tma

# Tiles: (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages). Chosen from the H200 sweep
# (benchmarks/results/h200/sweep/). TMA = the persistent TMA-descriptor kernel (sm_90+, operands
# with unit last stride and 16-byte aligned rows); otherwise the pointer-load kernel.
_DECODE = ((16, 128, 128, 8, 4, 4), (16, 64, 128, 8, 4, 4), (16, 32, 128, 8, 4, 6))  # M <= 16, pointer
# 64 < M <= 128, tried before _SMALL_TMA; the 128x64 tile only for M > MID_M_128x64: at M = 65 the
# 64-row tiles were faster on every shape measured (sweep_linear_mid), from M = 96 on 128x64 wins or ties
_MID_TMA = ((128, 256, 64, 8, 8, 3), (128, 64, 128, 8, 8, 4))
MID_M_128x64 = 80
_SMALL_TMA = ((64, 128, 64, 8, 4, 5), (64, 64, 128, 8, 4, 4), (64, 32, 256, 8, 4, 4))  # 16 < M <= 128
# 64 < M <= 80 with a weight of more than SMALL_WEIGHT elements: the _SMALL_TMA tiles with a 16-row tail
# (7th entry): a program computes 64 + 16 rows from one read of its weight block (a 64-row dot by wgmma, a
# 16-row dot by mma.sync), so M = 65 costs one row tile, not two (two 64-row tiles stream the weight twice
# from HBM). Measured (sweep_linear_tail): 8b down 0.57 -> 0.77 of cuBLAS, qkv 0.76 -> 0.84, lm_head 0.90
# -> 0.97. Weights that fit in L2 re-read cheaply and keep the 64-row tiles (more programs: faster there).
# Stages lowered where the tail's buffers would exceed shared memory. The first tile whose last wave is
# full enough (WAVE_FILL) is taken.
_TAIL_TMA = ((64, 128, 64, 8, 4, 5, 16), (64, 64, 128, 8, 4, 4, 16), (64, 32, 256, 8, 4, 3, 16))
WAVE_FILL = 0.85
_SMALL_PTR = (64, 64, 128, 8, 4, 4)
# M > 128: (tile, full-wave rate relative to cuBLAS measured in the sweeps, rate when the weight has more
# than SMALL_WEIGHT elements). The 128x64 tile reads the weight once per 128 rows: 0.78-0.87 of cuBLAS
# with weights up to 6.3M elements (in L2), 0.53-0.62 with 25M and more (sweep_linear_mid, M = 1000).
# The 64x32 rate is a guess, only there to rank small-N problems.
_LARGE_TMA = (((128, 256, 64, 8, 8, 3), 0.98, 0.98), ((128, 128, 64, 8, 8, 4), 0.89, 0.89),
              ((128, 64, 128, 8, 8, 4), 0.80, 0.57), ((64, 32, 256, 8, 4, 4), 0.60, 0.60))
SMALL_WEIGHT = 8 << 20
# a margin for the second launch of a row split — as time units of :func:`_wave_time`, the time of a 128x256
# tile with K = SPLIT_GAP_K at cuBLAS's rate (~6 TFLOP/s per SM): 384 ~ 4 us. Started early by programmatic
# dependent launch the second launch costs about half that (sweep_linear_pdl: over 75 splittable shapes and M,
# a gap of 192 separated wins from losses), but the estimate itself errs by more at short K: 0.6B lm_head at
# TP 4 (K = 1024), estimated 270 / 364 such K faster split at M = 1000 / 4096, measured 6% / 2% slower
# (linear bench at 642a3de). With 384 every split the rule takes measured faster than the single tile.
SPLIT_GAP_K = 384
_LARGE_PTR = (128, 128, 64, 8, 8, 3)
_FP32 = (64, 64, 32, 8, 4, 3)
DTYPES = frozenset({torch.bfloat16, torch.float16, torch.float32})  # fp32: pointer kernel, ieee dots
FILL = 0.7  # a smaller tile is taken while the larger one would leave more than 30% of the SMs idle


def _rows(tile: tuple[int, ...]) -> int:
    """Rows per tile: BLOCK_M plus the tail, if any."""
    return tile[0] + (tile[6] if len(tile) > 6 else 0)


def _tiles(m: int, n: int, tile: tuple[int, ...]) -> int:
    return triton.cdiv(m, _rows(tile)) * triton.cdiv(n, tile[1])


def _first_filling(m: int, n: int, sms: int, tiles: tuple[tuple[int, ...], ...]) -> tuple[int, ...] | None:
    return next((t for t in tiles if _tiles(m, n, t) >= FILL * sms), None)


def _fills_waves(m: int, n: int, sms: int, tile: tuple[int, ...]) -> bool:
    """One partial wave with at least FILL of the SMs, or several waves whose last is WAVE_FILL full."""
    tiles = _tiles(m, n, tile)
    return tiles >= FILL * sms if tiles <= sms else tiles / (triton.cdiv(tiles, sms) * sms) >= WAVE_FILL


def _wave_time(m: int, n: int, k: int, sms: int, entry) -> float:
    """Estimated time of one launch in units of one 128x256 tile at cuBLAS's rate: whole waves (the last
    one counts in full) times the tile's area over its measured full-wave rate."""
    tile, rate, rate_big_weight = entry
    return (triton.cdiv(_tiles(m, n, tile), sms) * tile[0] * tile[1] / (128 * 256)
            / (rate if n * k <= SMALL_WEIGHT else rate_big_weight))


def _pick_large(m: int, n: int, k: int, sms: int) -> tuple[tuple[int, ...], int, tuple[int, ...] | None]:
    """M > 128: the fastest single tile by :func:`_wave_time`, or a row split — the first ``rows`` rows by
    128x256 tiles in whole waves, the rest by a smaller tile in a second launch — where that is estimated
    faster, the second launch's start included. Example: 8B qkv at TP 4 (N = 1536), M = 4096: 128x256
    leaves 1.45 waves, 128x128 runs 2.9 waves at its lower rate; one wave of 128x256 and 0.9 of 128x128
    measured 0.95 of cuBLAS against 0.87 (0.92 with the second launch not started early; at M = 3000 0.81
    against 0.55: sweep_linear_pdl)."""
    best = single_tile(m, n, k, sms)
    rows, rest = split_candidate(m, n, k, sms)
    if rows:
        split = (_wave_time(rows, n, k, sms, _LARGE_TMA[0]) + _wave_time(m - rows, n, k, sms, rest)
                 + SPLIT_GAP_K / k)
        if split < _wave_time(m, n, k, sms, best):
            return _LARGE_TMA[0][0], rows, rest[0]
    return best[0], 0, None


def single_tile(m: int, n: int, k: int, sms: int) -> tuple[tuple[int, ...], float, float]:
    """The ``_LARGE_TMA`` entry with the least estimated time (:func:`_wave_time`) for one launch."""
    return min(_LARGE_TMA, key=lambda e: _wave_time(m, n, k, sms, e))


def split_candidate(m: int, n: int, k: int, sms: int) -> tuple[int, Any]:
    """The row split :func:`_pick_large` weighs: the rows that whole waves of 128x256 tiles cover and the
    ``_LARGE_TMA`` entry (128x128 or 128x64, measured rates only) estimated fastest for the rest; (0, None)
    where the 128x256 tiles make less than one wave or exactly fill their waves."""
    big = _LARGE_TMA[0][0]
    rows = _tiles(m, n, big) // sms * sms // triton.cdiv(n, big[1]) * big[0]
    if not 0 < rows < m:
        return 0, None
    return rows, min(_LARGE_TMA[1:3], key=lambda e: _wave_time(m - rows, n, k, sms, e))


def _pick(m: int, n: int, k: int, sms: int, tma: bool) -> tuple[tuple[int, ...], bool]:
    if m <= 16:
        return _first_filling(m, n, sms, _DECODE) or _DECODE[-1], False
    if m <= 128:
        if not tma:
            return _SMALL_PTR, False
        if 64 < m <= _rows(_TAIL_TMA[0]) and n * k > SMALL_WEIGHT:
            return next((t for t in _TAIL_TMA if _fills_waves(m, n, sms, t)), _TAIL_TMA[-1]), True
        mid = _first_filling(m, n, sms, _MID_TMA if m > MID_M_128x64 else _MID_TMA[:1]) if m > 64 else None
        return mid or _first_filling(m, n, sms, _SMALL_TMA) or _SMALL_TMA[-1], True
    return _LARGE_PTR, False


@functools.lru_cache(maxsize=4096)  # host time: the rule runs once per distinct shape (callers copy the dict)
def config(dtype: torch.dtype, m: int, n: int, k: int, tma: bool = False, sms: int = 132) -> dict[str, Any]:
    """The launch configuration: a fixed rule of dtype, the problem shape, whether the TMA kernel
    applies and the SM count — a speed choice only (every tile gives the same bits). A row split
    (M > 128) adds ``SPLIT_ROWS`` and ``REST``, the configuration of the rows after them."""
    if dtype == torch.float32:
        return tile_config(_FP32, k, dtype, False)
    if m > 128 and tma:
        tile, rows, rest = _pick_large(m, n, k, sms)
        cfg = tile_config(tile, k, dtype, True)
        if rows:
            cfg.update(SPLIT_ROWS=rows, REST=tile_config(rest, k, dtype, True))
        return cfg
    tile, use_tma = _pick(m, n, k, sms, tma)
    return tile_config(tile, k, dtype, use_tma)


def tile_config(tile: tuple[int, ...], k: int, dtype: torch.dtype = torch.bfloat16, tma: bool = False,
                rem_box: bool = True) -> dict[str, int | bool]:
    """Launch arguments of one tile ``(BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages[, TAIL_M])``
    for reduction length ``k``; ``tma`` selects the persistent TMA kernel (operands must suit it; a tile
    with a tail needs it). ``rem_box``: the TMA kernel reads a partial last row block with a box of the
    rows there are (:func:`rem_rows`); False only for benchmarks comparing the two."""
    bm, bn, bk, gm, warps, stages, *tail = tile
    if tail and not tma:
        raise ValueError(f"tile {tile}: a tail tile runs only in the TMA kernel")
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": gm, "num_warps": warps,
            "num_stages": stages, "EVEN_K": k % bk == 0, "IEEE": dtype == torch.float32, "TMA": tma,
            "TAIL_M": tail[0] if tail else 0, "REM_BOX": rem_box}


def rem_rows(m: int, block_m: int) -> int:
    """Rows of the TMA box for the last row block of a 64-row tile when fewer than half its rows are
    there (``M % 64`` in 1..31): 16 or 32; otherwise 0 (the full box). Measured (sweep_linear_split): a
    box of 64 rows holding 1-20 valid rows took up to 1.5x the time of the 16/32-row box (8B qkv at TP 4,
    M = 65: 0.68 -> 1.01 of cuBLAS; 8B down, M = 17: 0.63 -> 0.96); at 32 valid rows (M = 96) and on the
    128-row tiles of M > 128 the smaller box was 0-7% slower (it also ends the persistent loop's
    flattening), and a 64-row box beside 128x256 tiles does not fit in shared memory. A function of M:
    the kernel is compiled at most three times per tile (0, 16, 32)."""
    r = m % block_m
    if block_m != 64 or r == 0 or r >= 32:
        return 0
    return 16 if r <= 16 else 32


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _tma_compatible(*ts: torch.Tensor) -> bool:
    """TMA descriptors need a unit last stride and 16-byte aligned base and row strides."""
    return all(t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0
               for t in ts)


@triton.jit
def _tile_coords(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped tile order for L2 reuse: changes which tile runs when, never a tile's arithmetic."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = tile // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((tile % num_pid_in_group) % group_size_m)
    pid_n = (tile % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _rows_acc(x_desc, w_desc, off_m, off_n, k_tiles, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """One row block's K loop: ``ROWS`` rows of x (the descriptor's box) against a weight block."""
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for kb in range(k_tiles):
        acc = _dot(x_desc.load([off_m, kb * BLOCK_K]), w_desc.load([off_n, kb * BLOCK_K]).T, acc, IEEE)
    return acc


@triton.jit
def _bias_add(acc, b_ptr, off_n, N, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr):
    if HAS_BIAS:
        cols = off_n + tl.arange(0, BLOCK_N)
        acc = acc + tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit(do_not_specialize=["M"])
def _linear_tma_kernel(
    x_desc, w_desc, y_desc, xt_desc, yt_desc, b_ptr, M, N, K,
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    TAIL_M: tl.constexpr, REM_M: tl.constexpr, PDL: tl.constexpr = 0,
):
    """Persistent: program ``p`` computes tiles ``p, p + NUM_PROGRAMS, ...``; each tile's K loop is the
    pointer kernel's (same k-steps, same accumulator), its operands arrive by TMA (zero-filled past
    M, N and K) and its store is clipped to ``[M, N]``. ``TAIL_M > 0``: a tile is ``BLOCK_M + TAIL_M``
    rows, the last ``TAIL_M`` through ``xt_desc``/``yt_desc`` with their own accumulator and dot — the
    same k-steps into the same kind of fp32 accumulator, sharing the weight block just loaded.
    ``REM_M > 0`` (no tail): the last row block, which holds only ``M % BLOCK_M`` rows, is computed with
    ``REM_M``-row boxes through ``xt_desc``/``yt_desc`` — the TMA's zero fill of rows past M is slow
    (measured: one valid row in a 64-row box cost the tile as much as 64 rows and more), so the box
    shrinks to the rows there are; the k-steps are the same.

    ``PDL`` (a row split's two launches, sm_90+): 1 — the first launch lets the next grid start at once
    (``griddepcontrol.launch_dependents``); 2 — the second launch, made with programmatic dependent launch,
    starts its programs as the first launch's leave their SMs instead of after the first grid has drained,
    and each program waits for the first grid to complete before it exits (``griddepcontrol.wait``), so
    work queued after the second launch finds both parts written. The two launches read the same inputs
    and write disjoint rows, so nothing else orders them. (Measured on the H200: without the wait the next
    kernel also found both parts written, 5 of 5 times with a first launch outlasting the second by ~0.2 ms —
    the stream already orders it; the wait is the ordering PTX documents, and holds only SMs that nothing
    else in the stream may use yet.)"""
    if PDL == 1:
        gdc_launch_dependents()
    ROWS: tl.constexpr = BLOCK_M + TAIL_M
    num_tiles = tl.cdiv(M, ROWS) * tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_tiles, NUM_PROGRAMS, flatten=REM_M == 0):
        pid_m, pid_n = _tile_coords(tile, M, N, ROWS, BLOCK_N, GROUP_M)
        off_m = pid_m * ROWS
        off_n = pid_n * BLOCK_N
        if REM_M > 0 and off_m + BLOCK_M > M:
            acc_r = _rows_acc(xt_desc, w_desc, off_m, off_n, k_tiles, REM_M, BLOCK_N, BLOCK_K, IEEE)
            yt_desc.store([off_m, off_n], _bias_add(acc_r, b_ptr, off_n, N, HAS_BIAS, BLOCK_N).to(yt_desc.dtype))
        elif TAIL_M > 0:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_t = tl.zeros((TAIL_M, BLOCK_N), dtype=tl.float32)
            for kb in range(k_tiles):
                b = w_desc.load([off_n, kb * BLOCK_K])
                acc = _dot(x_desc.load([off_m, kb * BLOCK_K]), b.T, acc, IEEE)
                acc_t = _dot(xt_desc.load([off_m + BLOCK_M, kb * BLOCK_K]), b.T, acc_t, IEEE)
            y_desc.store([off_m, off_n], _bias_add(acc, b_ptr, off_n, N, HAS_BIAS, BLOCK_N).to(y_desc.dtype))
            yt_desc.store([off_m + BLOCK_M, off_n],
                          _bias_add(acc_t, b_ptr, off_n, N, HAS_BIAS, BLOCK_N).to(yt_desc.dtype))
        else:
            acc = _rows_acc(x_desc, w_desc, off_m, off_n, k_tiles, BLOCK_M, BLOCK_N, BLOCK_K, IEEE)
            y_desc.store([off_m, off_n], _bias_add(acc, b_ptr, off_n, N, HAS_BIAS, BLOCK_N).to(y_desc.dtype))
    if PDL == 2:
        gdc_wait()


@triton.jit(do_not_specialize=["M"])
def _linear_fwd_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _tile_coords(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

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
        acc = _dot(a, b, acc, IEEE)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    if HAS_BIAS:
        bias = tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        acc = acc + bias[None, :]
    y_ptrs = y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & (cols[None, :] < N))


def _config_for(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> dict[str, int | bool]:
    dev = x.device.index or 0
    # TMA only for an output in the input dtype: an fp32 output tile would not fit shared memory
    # beside the pipeline buffers of the large tile
    tma = x.is_cuda and out.dtype == x.dtype and has_tma(dev) and _tma_compatible(x, weight, out)
    return config(x.dtype, x.shape[0], weight.shape[0], x.shape[1], tma, _num_sms(dev) if x.is_cuda else 132)


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
            cfg: dict[str, int | bool], pdl: int = 0) -> None:
    m, k = x.shape
    n = weight.shape[0]
    c = dict(cfg)
    rows, rest = c.pop("SPLIT_ROWS", 0), c.pop("REST", None)
    if rows:  # two launches on row ranges of the same operands (views; rows is a multiple of 128), the
        # second by programmatic dependent launch on the GPU (the interpreter has no grid dependency control)
        _launch(x[:rows], weight, bias, out[:rows], c, int(x.is_cuda))
        _launch(x[rows:], weight, bias, out[rows:], rest, 2 * int(x.is_cuda))
        return
    tail = c.pop("TAIL_M")
    rem_box = c.pop("REM_BOX")
    if c.pop("TMA"):
        bm, bn, bk = c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]
        tiles = triton.cdiv(m, bm + tail) * triton.cdiv(n, bn)
        rem = rem_rows(m, bm) if rem_box and not tail else 0
        # one program per SM (on the interpreter 3, so that programs walk several tiles)
        programs = min(tiles, _num_sms(x.device.index or 0) if x.is_cuda else 3)
        x_desc, y_desc = TensorDescriptor.from_tensor(x, [bm, bk]), TensorDescriptor.from_tensor(out, [bm, bn])
        small = tail or rem  # the tail's or the last row block's box
        xt_desc = TensorDescriptor.from_tensor(x, [small, bk]) if small else None
        yt_desc = TensorDescriptor.from_tensor(out, [small, bn]) if small else None
        _linear_tma_kernel[(programs,)](
            x_desc, TensorDescriptor.from_tensor(weight, [bn, bk]), y_desc, xt_desc, yt_desc,
            bias if bias is not None else out, m, n, k,
            HAS_BIAS=bias is not None, IEEE=c["IEEE"], NUM_PROGRAMS=programs, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
            GROUP_M=c["GROUP_M"], TAIL_M=tail, REM_M=rem, num_warps=c["num_warps"], num_stages=c["num_stages"],
            **({"PDL": pdl, "launch_pdl": pdl == 2} if pdl else {}),
        )
        return
    grid = (triton.cdiv(m, c["BLOCK_M"]) * triton.cdiv(n, c["BLOCK_N"]),)
    _linear_fwd_kernel[grid](
        x, weight, bias if bias is not None else out, out,
        m, n, k,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, **c,
    )


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
    _launch(x, weight, bias, y, cfg or _config_for(x, weight, y))
    return y


def forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    lead = x.shape[:-1]
    y = linear_2d(x.reshape(lead.numel(), x.shape[-1]), weight, bias)
    return y.reshape(*lead, weight.shape[0])


def supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[bool, str]:
    if x.dtype not in DTYPES:
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
    _launch(x, weight, None, out, _config_for(x, weight, out))
    return out
