"""The GEMM tile rule of ``rlk.triton``'s ``linear`` (contract ``rlk.gemm.bi.v1``): pure Python, no Triton.

:func:`config` maps ``(dtype, M, N, K, whether TMA applies, SM count)`` to the launch configuration of
:mod:`rlk_core.ops.linear.triton`: a fixed rule, no timing, no autotuning. It is a speed choice only.
Every output element's bits are fixed by the K loop — one fp32 accumulator carried through the MMA
k-steps in increasing k, one rounding — which no tile changes; the tile over M and N (and so the
instruction family and the load path) may vary with M. That every tile gives the same bits is a property
of the GPU, checked on each one by the contract suite (``rlk_core.testing.contracts``) and the GPU tests
(``tests/gpu/test_linear_gpu.py::test_every_shipped_tile_gives_the_same_bits``).

Tiles are tuples ``(BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages[, TAIL_M])``, chosen from
the H200 sweeps (``benchmarks/results/h200/sweep/``; the numbers behind each choice are in
``docs/ops/gpu-kernels.md``). TMA = the persistent TMA-descriptor kernel
(sm_90+, operands with unit last stride and 16-byte aligned rows); otherwise the pointer-load kernel.

:func:`stored_config` is the rule of the stored-layout kernels (operands given as transposed views: the
backward's GEMMs), a fixed rule of dtype and the shape that never reads the token count (below; unswept).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

# M <= 16, pointer kernel: the widest N tile that still gives FILL of the SMs a tile
_DECODE = ((16, 128, 128, 8, 4, 4), (16, 64, 128, 8, 4, 4), (16, 32, 128, 8, 4, 6))
# 64 < M <= 128, tried before _SMALL_TMA. The 128x64 tile only for M > MID_M_128x64: at M = 65 the 64-row
# tiles are faster on every shape swept (sweep_linear_mid); from M = 96 on 128x64 wins or ties.
_MID_TMA = ((128, 256, 64, 8, 8, 3), (128, 64, 128, 8, 8, 4))
MID_M_128x64 = 80
_SMALL_TMA = ((64, 128, 64, 8, 4, 5), (64, 64, 128, 8, 4, 4), (64, 32, 256, 8, 4, 4))  # 16 < M <= 128
# 64 < M <= 80 with a weight of more than SMALL_WEIGHT elements: the _SMALL_TMA tiles with a 16-row tail
# (7th entry). A program computes 64 + 16 rows from one read of its weight block (a 64-row dot by wgmma, a
# 16-row dot by mma.sync), so M = 65 costs one row tile, not two: two 64-row tiles stream the weight twice
# from HBM (sweep_linear_tail: 8B down 0.77 of cuBLAS with the tail against 0.57 without). Weights that fit
# in L2 re-read cheaply and keep the 64-row tiles (more programs: faster there). Stages are lowered where
# the tail's buffers would exceed shared memory. The first tile whose last wave is WAVE_FILL full is taken.
_TAIL_TMA = ((64, 128, 64, 8, 4, 5, 16), (64, 64, 128, 8, 4, 4, 16), (64, 32, 256, 8, 4, 3, 16))
WAVE_FILL = 0.85
_SMALL_PTR = (64, 64, 128, 8, 4, 4)
# M > 128: (tile, full-wave rate relative to cuBLAS from the sweeps, rate when the weight has more than
# SMALL_WEIGHT elements). The 128x64 tile reads the weight once per 128 rows: 0.78-0.87 of cuBLAS with
# weights up to 6.3M elements (in L2), 0.53-0.62 with 25M and more (sweep_linear_mid, M = 1000).
# The 64x32 rate is an estimate, only there to rank small-N problems.
_LARGE_TMA = (((128, 256, 64, 8, 8, 3), 0.98, 0.98), ((128, 128, 64, 8, 8, 4), 0.89, 0.89),
              ((128, 64, 128, 8, 8, 4), 0.80, 0.57), ((64, 32, 256, 8, 4, 4), 0.60, 0.60))
SMALL_WEIGHT = 8 << 20
# The margin for the second launch of a row split, in time units of :func:`_wave_time` (the time of a
# 128x256 tile with K = SPLIT_GAP_K at cuBLAS's rate, ~6 TFLOP/s per SM): 384 ~ 4 us. Started early by
# programmatic dependent launch the second launch costs about half that (sweep_linear_pdl), but the
# estimate itself errs by more at short K (0.6B lm_head at TP 4, K = 1024: estimated faster split, measured
# 2-6% slower); with 384 every split the rule takes measures faster than the single tile.
SPLIT_GAP_K = 384
_LARGE_PTR = (128, 128, 64, 8, 8, 3)
_FP32 = (64, 64, 32, 8, 4, 3)
DTYPES = frozenset({torch.bfloat16, torch.float16, torch.float32})  # fp32: pointer kernel, ieee dots
FILL = 0.7  # a smaller tile is taken while the larger one would leave more than 30% of the SMs idle


def shipped_tiles(dtype: torch.dtype = torch.bfloat16) -> list[tuple[int, ...]]:
    """Every tile :func:`config` can pick for ``dtype`` (any shape, TMA or not, any SM count), sorted."""
    if dtype == torch.float32:
        return [_FP32]
    return sorted({*_DECODE, *_MID_TMA, *_SMALL_TMA, *_TAIL_TMA, _SMALL_PTR, *(e[0] for e in _LARGE_TMA),
                   _LARGE_PTR})


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _rows(tile: tuple[int, ...]) -> int:
    """Rows per tile: BLOCK_M plus the tail, if any."""
    return tile[0] + (tile[6] if len(tile) > 6 else 0)


def _tiles(m: int, n: int, tile: tuple[int, ...]) -> int:
    return _cdiv(m, _rows(tile)) * _cdiv(n, tile[1])


def _first_filling(m: int, n: int, sms: int, tiles: tuple[tuple[int, ...], ...]) -> tuple[int, ...] | None:
    return next((t for t in tiles if _tiles(m, n, t) >= FILL * sms), None)


def _fills_waves(m: int, n: int, sms: int, tile: tuple[int, ...]) -> bool:
    """One partial wave with at least FILL of the SMs, or several waves whose last is WAVE_FILL full."""
    tiles = _tiles(m, n, tile)
    return tiles >= FILL * sms if tiles <= sms else tiles / (_cdiv(tiles, sms) * sms) >= WAVE_FILL


def _wave_time(m: int, n: int, k: int, sms: int, entry) -> float:
    """Estimated time of one launch in units of one 128x256 tile at cuBLAS's rate: whole waves (the last
    one counts in full) times the tile's area over its measured full-wave rate."""
    tile, rate, rate_big_weight = entry
    return (_cdiv(_tiles(m, n, tile), sms) * tile[0] * tile[1] / (128 * 256)
            / (rate if n * k <= SMALL_WEIGHT else rate_big_weight))


def _pick_large(m: int, n: int, k: int, sms: int) -> tuple[tuple[int, ...], int, tuple[int, ...] | None]:
    """M > 128: the fastest single tile by :func:`_wave_time`, or a row split — the first ``rows`` rows by
    128x256 tiles in whole waves, the rest by a smaller tile in a second launch — where that is estimated
    faster, the second launch's start included. Example: 8B qkv at TP 4 (N = 1536), M = 4096: 128x256
    leaves 1.45 waves, 128x128 runs 2.9 waves at its lower rate; one wave of 128x256 and 0.9 of 128x128
    measure 0.95 of cuBLAS against 0.87 (0.92 with the second launch not started early; at M = 3000 0.81
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
    rows = _tiles(m, n, big) // sms * sms // _cdiv(n, big[1]) * big[0]
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
    there (``M % 64`` in 1..31): 16 or 32; otherwise 0 (the full box). A box of 64 rows holding 1-20 valid
    rows takes up to 1.5x the time of the 16/32-row box (sweep_linear_split: 8B qkv at TP 4, M = 65, 0.68
    of cuBLAS against 1.01; 8B down, M = 17, 0.63 against 0.96); at 32 valid rows (M = 96) and on the
    128-row tiles of M > 128 the smaller box is 0-7% slower (it also ends the persistent loop's
    flattening), and a 64-row box beside 128x256 tiles does not fit in shared memory. A function of M:
    the kernel is compiled at most three times per tile (0, 16, 32)."""
    r = m % block_m
    if block_m != 64 or r == 0 or r >= 32:
        return 0
    return 16 if r <= 16 else 32


# -- the stored-layout GEMMs (the backward) -----------------------------------------------------------------------
# Tiles of the kernels that read an operand given as a transposed view in its stored layout
# (ops/linear/triton.py: _linear_bwd_tma_kernel, _linear_bwd_kernel) — the backward's dx = dy W (W read as the
# [K, N] operand), dW = dy^T x and db = dy^T 1 (both reduced over the tokens). The token count is the rows of dx
# and the reduction of dW and db; it changes every step, so :func:`stored_config` never reads it (compiled variants
# must not multiply with it): its inputs are the dtype, the output's columns, its rows where they are not the
# token count (an operand stored [K, M]: dW's and db's rows are the weight's), whether TMA applies, the SM count.
#
# UNSWEPT: no backward sweep exists; the choices are reasoned from the forward's (docs/ops/gpu-kernels.md).
# Candidates are the forward's M > 128 TMA tiles with their full-wave rates relative to cuBLAS
# (the rates without the weight re-read discount: both operands of dW stream over the tokens, and dx's weight is
# read as in the forward). A fixed reduction of 4096 tokens is as long as the K >= 2048 the rates were measured at.
# - token rows (dx): many waves at training sizes, so the tile with the least padded columns per unit of rate,
#   cdiv(N, BLOCK_N) * BLOCK_N / rate: 128x256 for N >= 256 multiples, 128x128 or 128x64 for narrow outputs;
# - weight rows (dW): the least estimated time, whole waves x tile area / rate (as the forward's M > 128 rule).
# A TMA box with its K extent along the stored rows holds the same bytes as the forward's, so the forward's
# stage counts fit shared memory (tests/core/ops/test_kernels_compile_sm90.py). Outputs of N <= 16 columns (db)
# and everything TMA cannot take run the pointer kernel (every load masked: the token count is not specialised).
_STORED_TMA = (((128, 256, 64, 8, 8, 3), 0.98), ((128, 128, 64, 8, 8, 4), 0.89), ((128, 64, 128, 8, 8, 4), 0.80))
_STORED_F32_OUT = (128, 128, 64, 8, 8, 3)  # TMA loads, an fp32 output stored by pointers (`into`)
_STORED_PTR = {torch.bfloat16: _LARGE_PTR, torch.float16: _LARGE_PTR, torch.float32: _FP32}
_STORED_NARROW = {torch.bfloat16: (64, 16, 128, 8, 4, 3), torch.float16: (64, 16, 128, 8, 4, 3),
                  torch.float32: (64, 16, 32, 8, 4, 3)}  # N <= 16 (db: one column)
NARROW_N = 16


def stored_tiles(dtype: torch.dtype = torch.bfloat16) -> list[tuple[int, ...]]:
    """Every tile :func:`stored_config` can pick for ``dtype`` (TMA or not, any shape), sorted."""
    tma = [] if dtype == torch.float32 else [*(e[0] for e in _STORED_TMA), _STORED_F32_OUT]
    return sorted({*tma, _STORED_PTR[dtype], _STORED_NARROW[dtype]})


def _stored_time(m: int | None, n: int, sms: int, entry) -> float:
    tile, rate = entry
    if m is None:  # the rows are the token count: per row block, the padded columns over the rate
        return _cdiv(n, tile[1]) * tile[1] / rate
    return _cdiv(_tiles(m, n, tile), sms) * tile[0] * tile[1] / (128 * 256) / rate


@functools.lru_cache(maxsize=1024)
def stored_config(dtype: torch.dtype, m: int | None, n: int, tma: bool = False, sms: int = 132,
                  f32_out: bool = False) -> dict[str, Any]:
    """The launch configuration of the stored-layout kernels: ``m`` the output's rows where they are not the
    token count (an operand stored ``[K, M]``: dW, db), None where they are (dx: never read); ``n`` its columns;
    ``tma`` whether the TMA kernel applies (bf16/fp16, both operands TMA-compatible as stored); ``f32_out`` an
    fp32 output (stored by pointers, a smaller tile). A speed choice only, of no input the token count changes."""
    tma = tma and dtype != torch.float32 and n > NARROW_N
    if not tma:
        tile = (_STORED_NARROW if n <= NARROW_N else _STORED_PTR)[dtype]
    elif f32_out:
        tile = _STORED_F32_OUT
    else:
        tile = min(_STORED_TMA, key=lambda e: _stored_time(m, n, sms, e))[0]
    return stored_tile_config(tile, dtype, tma)


def stored_tile_config(tile: tuple[int, ...], dtype: torch.dtype = torch.bfloat16, tma: bool = False
                       ) -> dict[str, int | bool]:
    """Launch arguments of one tile ``(BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages)`` for the
    stored-layout kernels (no ``EVEN_K``: every K loop is masked; ``tma`` selects the persistent TMA kernel)."""
    bm, bn, bk, gm, warps, stages = tile
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": gm, "num_warps": warps, "num_stages": stages,
            "IEEE": dtype == torch.float32, "TMA": tma}
