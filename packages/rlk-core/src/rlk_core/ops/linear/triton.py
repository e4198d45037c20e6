"""Triton GEMM for ``linear`` under contract ``rlk.gemm.bi.v1`` (backend ``rlk.triton``).

``y[m, n] = round_to(x.dtype)( acc_K(x[m, :] . w[n, :]) + f32(bias[n]) )`` where ``acc_K`` is one
fp32 accumulator per output element carried through a sequential loop over K in blocks of
``BLOCK_K`` (``acc = tl.dot(a, b, acc)``): no split-K, no atomics, one rounding to the output dtype.

Batch invariance: each output element's arithmetic is fixed by its K loop — the sequence of ``tl.dot``
k-steps (the MMA consumes K in steps of 16, accumulating into the same fp32 register in increasing k) —
which is the same in both kernels and for every tile. The tile over M and N (BLOCK_M/N/K), the warp count,
the instruction family (``mma.sync`` for BLOCK_M < 64, ``wgmma`` from 64), the load path (pointer loads
or TMA descriptors) and the persistent tile order only decide which elements a program computes and how
operands reach it. So the tile is chosen per call for speed by the rule of
:mod:`rlk_core.ops.linear.tiles` (:func:`config`: dtype, M, N, K, whether TMA applies, the SM count; no
timing, no autotuning), and may vary with M. That every tile gives the same bits is a property of the
GPU, checked on each one by the contract suite (``rlk_core.testing.contracts``) and the GPU tests. M itself
is never specialised on (``do_not_specialize``; the TMA kernel's last-row-block box, 0/16/32 rows, is the
only compile-time value derived from it). Rows past M and columns past N are masked (TMA: zero-filled and
clipped), never stored.

bf16/fp16 use tensor cores (wgmma on sm_90); fp32 uses ``input_precision="ieee"`` (no tf32), so it
stays within fp32 tolerance of the reference. Compared with the reference (pairwise-tree K order) the
result is equal within ``dtype_tols``, not bitwise: the K order differs by construction.

Stored-layout kernels (``_linear_bwd_tma_kernel``, ``_linear_bwd_kernel``): a call whose ``x`` or ``weight``
is a transposed view (:func:`stored_layout`; the backward's ``W.t()``, ``dy.t()``, ``x.t()``) reads that operand
as its storage holds it — no copy, no padding — with the same K loop (one fp32 accumulator through the MMA
k-steps in increasing k, one rounding). Either M or K may be the token count, so neither is specialised, no
flag depends on them, and their tile rule (:func:`~rlk_core.ops.linear.tiles.stored_config`) reads neither
where it is the token count: a training run compiles each variant once (``docs/ops/linear.md``, Backward).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from rlk_core.ops.linear import tiles as rule
from rlk_core.ops.linear.tiles import DTYPES, config, rem_rows, stored_config, stored_tile_config, tile_config

__all__ = ["DTYPES", "build_calls", "config", "forward", "into", "linear_2d", "rem_rows", "stored_config",
           "stored_layout", "stored_tile_config", "supports", "tile_config", "tma_compatible"]


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
    (one valid row in a 64-row box costs the tile as much as 64 rows and more), so the box
    shrinks to the rows there are; the k-steps are the same.

    ``PDL`` (a row split's two launches, sm_90+): 1 — the first launch lets the next grid start at once
    (``griddepcontrol.launch_dependents``); 2 — the second launch, made with programmatic dependent launch,
    starts its programs as the first launch's leave their SMs instead of after the first grid has drained,
    and each program waits for the first grid to complete before it exits (``griddepcontrol.wait``), so
    work queued after the second launch finds both parts written. The two launches read the same inputs
    and write disjoint rows, so nothing else orders them. (The stream already orders the next kernel after
    both parts in practice; the wait is the ordering PTX documents, and holds only SMs that nothing else in
    the stream may use yet.)"""
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


@triton.jit
def _stored_a(a_desc, off_m, k, A_KM: tl.constexpr):
    """The ``[ROWS, BLOCK_K]`` block of the left operand: stored ``[M, K]``, or ``[K, M]`` (``A_KM``) and
    transposed in shared memory (the MMA reads it M-major; no copy in memory)."""
    if A_KM:  # a static branch (one return: Triton types a return after a constexpr `if` too)
        a = a_desc.load([k, off_m]).T
    else:
        a = a_desc.load([off_m, k])
    return a


@triton.jit
def _stored_b(b_desc, off_n, k, B_KN: tl.constexpr):
    """The ``[BLOCK_K, BLOCK_N]`` block of the right operand: stored ``[K, N]`` (``B_KN``), or ``[N, K]``."""
    if B_KN:
        b = b_desc.load([k, off_n])
    else:
        b = b_desc.load([off_n, k]).T
    return b


@triton.jit
def _store_tile(y_ptr, acc, rows, cols, M, N, stride_ym, stride_yn):
    """Round ``acc`` once to ``y``'s dtype and store the rows < M, columns < N."""
    ptrs = y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :].to(tl.int64) * stride_yn
    tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit(do_not_specialize=["M", "K"])
def _linear_bwd_tma_kernel(
    a_desc, b_desc, y_desc, y_ptr, M, N, K, stride_ym, stride_yn,
    A_KM: tl.constexpr, B_KN: tl.constexpr, Y_TMA: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """``y[M, N] = a @ b`` with each operand read by TMA in its stored layout (``A_KM``: a stored ``[K, M]``;
    ``B_KN``: b stored ``[K, N]``), zero-filled past M, N and K — the backward's dx (``B_KN``) and dW (both),
    with no transposed copy and no padding. Persistent over the tiles like ``_linear_tma_kernel``
    (``NUM_PROGRAMS`` is the SM count, never the tile count: the launch's grid is ``min(tiles, SMs)``); each
    tile's K loop is one fp32 accumulator carried through the MMA k-steps in increasing k, one rounding.
    ``M`` and ``K`` are not specialised: either can be the token count. ``Y_TMA``: the store by a TMA
    descriptor (output in the input dtype), otherwise by masked pointer stores (an fp32 output)."""
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_tiles, NUM_PROGRAMS, flatten=True):
        pid_m, pid_n = _tile_coords(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(k_tiles):
            k = kb * BLOCK_K
            acc = tl.dot(_stored_a(a_desc, off_m, k, A_KM), _stored_b(b_desc, off_n, k, B_KN), acc)
        if Y_TMA:
            y_desc.store([off_m, off_n], acc.to(y_desc.dtype))
        else:
            _store_tile(y_ptr, acc, off_m + tl.arange(0, BLOCK_M), off_n + tl.arange(0, BLOCK_N), M, N,
                        stride_ym, stride_yn)


@triton.jit(do_not_specialize=["M", "K"])
def _linear_bwd_kernel(
    a_ptr, b_ptr, y_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_ym, stride_yn,
    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """``y[M, N] = a @ b`` by pointer loads at any strides (``a[m, k]`` at ``m * stride_am + k * stride_ak``,
    ``b[k, n]`` at ``k * stride_bk + n * stride_bn``; a zero stride broadcasts, as db's column of ones does):
    what the TMA kernel cannot take (fp32, misaligned or broadcast operands, no TMA). One program per tile;
    every load masked (no ``EVEN_K``), ``M`` and ``K`` not specialised — either can be the token count; the
    same fixed K loop (one fp32 accumulator, increasing k) and one rounding."""
    pid_m, pid_n = _tile_coords(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + cols[None, :].to(tl.int64) * stride_bn + offs_k[:, None] * stride_bk
    row_ok = rows[:, None] < M
    col_ok = cols[None, :] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & col_ok, other=0.0)
        acc = _dot(a, b, acc, IEEE)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    _store_tile(y_ptr, acc, rows, cols, M, N, stride_ym, stride_yn)


def tma_compatible(*ts: torch.Tensor) -> bool:
    """TMA descriptors need a unit last stride and 16-byte aligned base and row strides."""
    return all(t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0
               for t in ts)


def _transposed(t: torch.Tensor) -> bool:
    """A 2-D operand given as a transposed view: unit stride along its rows (its storage holds ``t.t()``)."""
    return t.stride(0) == 1 and t.stride(1) != 1


def stored_layout(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether a call runs the stored-layout kernels: ``x`` or ``weight`` a transposed view, no bias — the
    backward's dx (``weight.t()``), dW and db (``dy.t()``). Everything else runs the forward's kernels."""
    return bias is None and (_transposed(x) or _transposed(weight))


# -- the launch plans (rlk_core.ops._plan) ------------------------------------------------------------------------
def forward(p, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The op ``linear``: ``x [..., K] @ weight[N, K]^T (+ bias)`` into a fresh ``[..., N]``."""
    lead, k = x.shape[:-1], x.shape[-1]
    n = weight.shape[0]
    y = p.new((*lead, n), x.dtype)
    m = lead.numel()
    if m and n:
        x2, y2 = p.reshape(x, m, k), y.view(m, n)
        if k and not stored_layout(x2, weight, bias):  # the forward's kernels (the common case, launched from here)
            _launch(p, x2, weight, bias, y2, _rule(p, x2, weight, y2))
        else:
            into(p, x2, weight, bias, y2)
    return y


def _rule(p, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> dict[str, int | bool]:
    """The forward kernels' configuration of a call (:func:`config`). TMA only for an output in the input dtype: an
    fp32 output tile would not fit shared memory beside the pipeline buffers of the large tile."""
    tma = p.tma and out.dtype == x.dtype and tma_compatible(x, weight, out)
    return config(x.dtype, x.shape[0], weight.shape[0], x.shape[1], tma, p.sms)


def into(p, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
         cfg: dict[str, int | bool] | None = None) -> torch.Tensor:
    """``out[M, N] = x[M, K] @ weight[N, K]^T (+ bias)``, rounded once to ``out``'s dtype (an fp32 ``out`` keeps the
    fp32 accumulator), any strides on all three: transposed views run the stored-layout kernels
    (:func:`stored_layout`), the rest the forward's. ``cfg`` only for benchmarks and the tile tests (anything but
    :func:`config` / :func:`stored_config` is outside the contract)."""
    m, k = x.shape
    n = weight.shape[0]
    if m == 0 or n == 0:
        return out
    if k == 0:
        p.host(lambda: out.copy_(bias.float().expand(m, n) if bias is not None else torch.zeros_like(out)))
    elif stored_layout(x, weight, bias):
        _launch_stored(p, x, weight, out, cfg)
    else:
        _launch(p, x, weight, bias, out, cfg or _rule(p, x, weight, out))
    return out


def _launch(p, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
            cfg: dict[str, int | bool], pdl: int = 0) -> None:
    m, k = x.shape
    n = weight.shape[0]
    c = dict(cfg)
    rows, rest = c.pop("SPLIT_ROWS", 0), c.pop("REST", None)
    if rows:  # two launches on row ranges of the same operands (views; rows is a multiple of 128), the second by
        # programmatic dependent launch on an sm_90 GPU (the interpreter has no grid dependency control)
        _launch(p, x[:rows], weight, bias, out[:rows], c, int(p.tma))
        _launch(p, x[rows:], weight, bias, out[rows:], rest, 2 * int(p.tma))
        return
    tail = c.pop("TAIL_M")
    rem_box = c.pop("REM_BOX")
    b = bias if bias is not None else out
    if c.pop("TMA"):
        bm, bn, bk = c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]
        tiles = triton.cdiv(m, bm + tail) * triton.cdiv(n, bn)
        rem = rem_rows(m, bm) if rem_box and not tail else 0
        small = tail or rem  # the tail's or the last row block's box
        # NUM_PROGRAMS is the SM count whatever the tile count; a grid of fewer tiles leaves each program one tile
        p.launch(_linear_tma_kernel, (min(tiles, p.sms),),
                 p.desc(x, [bm, bk]), p.desc(weight, [bn, bk]), p.desc(out, [bm, bn]),
                 p.desc(x, [small, bk]) if small else None, p.desc(out, [small, bn]) if small else None, b, m, n, k,
                 HAS_BIAS=bias is not None, IEEE=c["IEEE"], NUM_PROGRAMS=p.sms, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                 GROUP_M=c["GROUP_M"], TAIL_M=tail, REM_M=rem, num_warps=c["num_warps"], num_stages=c["num_stages"],
                 **({"PDL": pdl, "launch_pdl": pdl == 2} if pdl else {}))
        return
    p.launch(_linear_fwd_kernel, (triton.cdiv(m, c["BLOCK_M"]) * triton.cdiv(n, c["BLOCK_N"]),),
             x, weight, b, out, m, n, k,
             x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
             HAS_BIAS=bias is not None, **c)


def _launch_stored(p, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor,
                   cfg: dict[str, int | bool] | None) -> None:
    """``out = x @ weight^T`` by the stored-layout kernels, each operand read as its storage holds it."""
    m, k = x.shape
    n = weight.shape[0]
    a_km, b_kn = _transposed(x), _transposed(weight)
    a, b = (x.t() if a_km else x), (weight.t() if b_kn else weight)
    if cfg is None:
        # the output's rows are read only where they are not the token count (x stored [K, M]: dW, db)
        cfg = stored_config(x.dtype, m if a_km else None, n, p.tma and tma_compatible(a, b), p.sms,
                            out.dtype != x.dtype)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    common = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg["GROUP_M"], num_warps=cfg["num_warps"],
                  num_stages=cfg["num_stages"])
    if cfg["TMA"]:
        y_tma = out.dtype == x.dtype and tma_compatible(out)
        p.launch(_linear_bwd_tma_kernel, (min(tiles, p.sms),),
                 p.desc(a, [bk, bm] if a_km else [bm, bk]), p.desc(b, [bk, bn] if b_kn else [bn, bk]),
                 p.desc(out, [bm, bn]) if y_tma else None, out, m, n, k, out.stride(0), out.stride(1),
                 A_KM=a_km, B_KN=b_kn, Y_TMA=y_tma, NUM_PROGRAMS=p.sms, **common)
        return
    p.launch(_linear_bwd_kernel, (tiles,), x, weight, out, m, n, k, x.stride(0), x.stride(1), weight.stride(1),
             weight.stride(0), out.stride(0), out.stride(1), IEEE=cfg["IEEE"], **common)


def supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[bool, str]:
    if x.dtype not in DTYPES:
        return False, f"dtype {x.dtype} has no rlk.triton GEMM configuration"
    return True, ""


def linear_2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              cfg: dict[str, int | bool] | None = None) -> torch.Tensor:
    """``x [M, K] @ weight[N, K]^T (+ bias)`` on rlk.triton, into a fresh ``[M, N]`` (``cfg``: see :func:`into`)."""
    y = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    return into(jit_plan(x.device), x, weight, bias, y, cfg)


# -- what the AOT build compiles (rlk_core.aot.build) ---------------------------------------------------------------
def build_calls(dtype: torch.dtype, sms: int):
    """The calls whose launches the AOT build compiles for ``dtype``: every tile :func:`config` can pick, each in the
    kernel the rule runs it in (the persistent TMA kernel with every last-row-block box :func:`rem_rows` gives it,
    both launches of a row split for its 128-row tiles; the pointer kernel with and without ``EVEN_K`` and, without
    bias, into an fp32 output: the log-prob backward's products), bias or not — on aligned operands with sizes
    multiples of 16; and the stored-layout kernels of the backward's dx / dW / db (:func:`stored_build_calls`)."""
    large = {e[0] for e in rule._LARGE_TMA}
    k = 1024
    w = torch.empty((256, k), dtype=dtype, device="meta")
    bias = torch.empty((256,), dtype=dtype, device="meta")
    tma = [] if dtype == torch.float32 else sorted(
        {*rule._SMALL_TMA, *rule._MID_TMA, *rule._TAIL_TMA, *large})
    for tile in tma:
        bm = tile[0]
        rows = {0: 2 * bm}  # per last-row-block box a row count that gives it (a tail tile has none)
        if len(tile) <= 6:
            for m in range(2 * bm, 0, -1):
                rows.setdefault(rule.rem_rows(m, bm), m)
        for m in rows.values():
            for b in (None, bias):
                x = torch.empty((m, k), dtype=dtype, device="meta")
                y = torch.empty((m, 256), dtype=dtype, device="meta")
                yield into, (x, w, b, y, rule.tile_config(tile, k, dtype, True))
                if tile in large and bm == 128:  # a row split: the first launch (PDL 1), the second (PDL 2)
                    x, y = x.new_empty((2 * m, k)), y.new_empty((2 * m, 256))
                    cfg = dict(rule.tile_config(tile, k, dtype, True), SPLIT_ROWS=m,
                               REST=rule.tile_config(tile, k, dtype, True))
                    yield into, (x, w, b, y, cfg)
    ptr = rule.shipped_tiles(dtype) if dtype == torch.float32 else sorted({*rule._DECODE, rule._SMALL_PTR,
                                                                           rule._LARGE_PTR})
    outs = (dtype,) if dtype == torch.float32 else (dtype, torch.float32)
    for tile in ptr:
        for even_k in (False, True):
            kk = tile[2] * 4 if even_k else tile[2] * 4 + 16
            x = torch.empty((64, kk), dtype=dtype, device="meta")
            wk = torch.empty((256, kk), dtype=dtype, device="meta")
            for o in outs:
                for b in (None, bias) if o == dtype else (None,):
                    yield into, (x, wk, b, x.new_empty((64, 256), dtype=o), rule.tile_config(tile, kk, dtype, False))
    yield from stored_build_calls(dtype, sms)


def stored_build_calls(dtype: torch.dtype, sms: int):
    """The backward's stored-layout GEMMs (``ops/linear/__init__.py::_backward``): dx = dy W (``W.t()`` read as
    stored), dW = dy^T x (both read as stored) and db = dy^T 1 (a column of ones of stride 0), for every tile
    :func:`stored_config` picks — the rule's TMA tiles (bf16/fp16) and its pointer tiles, wide and narrow."""
    t, k = 4096, 1024
    dy = torch.empty((t, 256), dtype=dtype, device="meta")
    x = torch.empty((t, k), dtype=dtype, device="meta")
    w = torch.empty((256, k), dtype=dtype, device="meta")
    ones = torch.empty((1,), dtype=dtype, device="meta").as_strided((1, t), (1, 0))
    narrow = rule.stored_tile_config(rule._STORED_NARROW[dtype], dtype, False)
    if dtype == torch.float32:
        wide = [rule.stored_tile_config(rule._STORED_PTR[dtype], dtype, False)]
    else:
        wide = [rule.stored_tile_config(tile, dtype, True) for tile, _ in rule._STORED_TMA]
    for cfg in [*wide, narrow]:
        yield into, (dy, w.t(), None, x.new_empty((t, k)), cfg)  # dx
        yield into, (dy.t(), x.t(), None, w.new_empty((256, k)), cfg)  # dW
    yield into, (dy.t(), ones, None, dy.new_empty((256, 1)), narrow)  # db


from rlk_core.ops._plan import jit_plan  # noqa: E402  (rlk_core.ops._plan imports no Triton)
