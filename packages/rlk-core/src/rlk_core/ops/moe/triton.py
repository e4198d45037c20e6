"""Triton MoE kernels under contract ``rlk.moe.v1`` (backends ``rlk.triton`` and ``rlk.cuda``; ``docs/ops/moe.md``).

- ``_moe_topk_fwd_kernel`` / ``_moe_topk_bwd_kernel``: one program per token row over ``BLOCK_E = next_pow2(E)``
  lanes: fp32 softmax (``tl.max``, ``tl.exp``, one ``tl.sum`` of the block: a reduction tree fixed by BLOCK_E),
  then ``TOP_K`` rounds of (the largest probability, the lowest id holding it), the renormalising sum left to right.
- ``_moe_grouped_fwd_kernel``: the batch-invariant grouped GEMM. The grid ``(cdiv(M, BLOCK_M) + E, cdiv(N,
  BLOCK_N))`` bounds the row tiles of any split of M rows into E groups; a program reads the offsets, finds its
  expert and row tile by a prefix sum of the per-expert tile counts, and runs ``linear``'s K loop (one fp32
  accumulator through the K blocks in increasing k, ``acc = tl.dot(a, b, acc)``) over that expert's weight; rows past
  the expert's end are masked. The tile is :func:`config` of the dtype only — no row's arithmetic depends on M, the
  counts or the row's place in its group.
- ``_moe_wgrad_kernel``: ``dW[e] = grad[seg]^T x[seg]`` with one accumulator through row blocks anchored at the
  segment's start, in increasing order; one program per (expert, output tile). No atomics, no split over rows.
- ``_moe_combine_fwd_kernel`` / ``_moe_combine_bwd_kernel``: per token, the k slots in slot order in fp32.

The interpreter does not reproduce GPU bits; the kernels are compared with the reference within tolerance on the
CPU (``tests/core/ops/test_moe_interpret.py``) and bitwise with themselves on the GPU (``tests/gpu/test_moe_gpu.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlk_core.ops._plan import next_pow2

DTYPES = frozenset({torch.bfloat16, torch.float16, torch.float32})
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): one tile per dtype, never a function of M or of the loads.
# UNTUNED: the shape of linear's M > 128 pointer tile (bf16/fp16) and its fp32 tile; no H200 sweep yet.
_TILE = {torch.bfloat16: (64, 128, 64, 4, 3), torch.float16: (64, 128, 64, 4, 3), torch.float32: (32, 64, 32, 4, 2)}
# the weight gradient's (BLOCK_R rows per step, BLOCK_N, BLOCK_K, warps, stages); UNTUNED
_WGRAD_TILE = {torch.bfloat16: (64, 128, 64, 8, 3), torch.float16: (64, 128, 64, 8, 3),
               torch.float32: (32, 32, 32, 4, 2)}
COMBINE_BLOCK = 1024


def config(dtype: torch.dtype) -> dict[str, int | bool]:
    bm, bn, bk, warps, stages = _TILE[dtype]
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages,
            "IEEE": dtype == torch.float32}


def wgrad_config(dtype: torch.dtype) -> dict[str, int | bool]:
    br, bn, bk, warps, stages = _WGRAD_TILE[dtype]
    return {"BLOCK_R": br, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages,
            "IEEE": dtype == torch.float32}


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


# -- router: softmax and top-k ------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["E"])
def _moe_topk_fwd_kernel(l_ptr, w_ptr, id_ptr, E, stride_l, TOP_K: tl.constexpr, NORMALIZE: tl.constexpr,
                         BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK_E)
    valid = lanes < E
    logit = tl.load(l_ptr + row * stride_l + lanes, mask=valid, other=float("-inf")).to(tl.float32)
    z = tl.exp(logit - tl.max(logit, 0))
    p = z / tl.sum(z, 0)
    work = tl.where(valid, p, -1.0)  # probabilities are >= 0: a lane past E is never taken
    slots = tl.arange(0, BLOCK_K)
    vals = tl.zeros((BLOCK_K,), dtype=tl.float32)
    ids = tl.zeros((BLOCK_K,), dtype=tl.int32)
    total = 0.0
    for j in tl.static_range(TOP_K):
        v = tl.max(work, 0)
        i = tl.min(tl.where(work == v, lanes, BLOCK_E), 0)  # ties: the lowest id
        vals = tl.where(slots == j, v, vals)
        ids = tl.where(slots == j, i, ids)
        total = total + v
        work = tl.where(lanes == i, -2.0, work)
    if NORMALIZE:
        vals = vals / total
    keep = slots < TOP_K
    tl.store(w_ptr + row * TOP_K + slots, vals, mask=keep)
    tl.store(id_ptr + row * TOP_K + slots, ids.to(tl.int64), mask=keep)


@triton.jit(do_not_specialize=["E"])
def _moe_topk_bwd_kernel(g_ptr, l_ptr, w_ptr, id_ptr, dl_ptr, E, stride_l, stride_dl, TOP_K: tl.constexpr,
                         NORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK_E)
    valid = lanes < E
    slots = tl.arange(0, BLOCK_K)
    keep = slots < TOP_K
    g = tl.load(g_ptr + row * TOP_K + slots, mask=keep, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + row * TOP_K + slots, mask=keep, other=0.0)
    ids = tl.load(id_ptr + row * TOP_K + slots, mask=keep, other=-1).to(tl.int32)
    gw = g * w
    c = 0.0
    for j in tl.static_range(TOP_K):  # left to right over the slots
        c = c + tl.sum(tl.where(slots == j, gw, 0.0), 0)
    hit = ids[None, :] == lanes[:, None]  # [BLOCK_E, BLOCK_K]: at most one slot per lane
    big_g = tl.sum(tl.where(hit, g[None, :], 0.0), 1)
    if NORMALIZE:
        q = tl.sum(tl.where(hit, w[None, :], 0.0), 1)
    else:
        logit = tl.load(l_ptr + row * stride_l + lanes, mask=valid, other=float("-inf")).to(tl.float32)
        z = tl.exp(logit - tl.max(logit, 0))
        q = z / tl.sum(z, 0)
    dl = q * (big_g - c)
    tl.store(dl_ptr + row * stride_dl + lanes, dl.to(dl_ptr.dtype.element_ty), mask=valid)


def _rows(p, t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else p.contiguous(t)


def _topk_blocks(e: int, top_k: int) -> dict[str, int]:
    block_e = max(16, next_pow2(e))
    return {"BLOCK_E": block_e, "BLOCK_K": max(2, next_pow2(top_k)), "num_warps": 4 if block_e <= 1024 else 8}


def topk_forward(p, logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    lg = _rows(p, logits)
    t, e = lg.shape
    w = p.new((t, top_k), torch.float32)
    ids = p.new((t, top_k), torch.int64)
    if t > 0:
        p.launch(_moe_topk_fwd_kernel, (t,), lg, w, ids, e, lg.stride(0), TOP_K=top_k, NORMALIZE=bool(normalize),
                 **_topk_blocks(e, top_k))
    return w, ids


def topk_backward(p, grad: torch.Tensor, logits: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  normalize: bool) -> torch.Tensor:
    lg = _rows(p, logits)
    t, e = lg.shape
    top_k = ids.shape[1]
    g, w, i = p.contiguous(grad, torch.float32), p.contiguous(weights), p.contiguous(ids)
    dl = p.new((t, e), logits.dtype)
    if t > 0:
        p.launch(_moe_topk_bwd_kernel, (t,), g, lg, w, i, dl, e, lg.stride(0), e, TOP_K=top_k,
                 NORMALIZE=bool(normalize), **_topk_blocks(e, top_k))
    return dl


def supports_topk(logits, top_k, normalize) -> tuple[bool, str]:
    if logits.shape[-1] > 8192:
        return False, f"{logits.shape[-1]} experts: more than one program's 8192 lanes"
    return True, ""


def supports_topk_backward(grad, logits, weights, ids, normalize) -> tuple[bool, str]:
    return supports_topk(logits, ids.shape[1], normalize)


# -- the grouped GEMM ---------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["M", "E"])
def _moe_grouped_fwd_kernel(x_ptr, w_ptr, y_ptr, off_ptr, M, N, K, E,
                            stride_xm, stride_we, stride_wn, stride_wk, stride_ym,
                            IEEE: tl.constexpr, BLOCK_E: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    experts = tl.arange(0, BLOCK_E)
    has = experts < E
    starts = tl.load(off_ptr + experts, mask=has, other=0)
    ends = tl.load(off_ptr + experts + 1, mask=has, other=0)
    tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
    after = tl.cumsum(tiles, 0)  # tiles of experts 0..e
    e = tl.sum((after <= pid_m).to(tl.int32), 0)  # the expert whose tiles hold tile pid_m (E: none)
    if e < E:
        mine = experts == e
        start = tl.sum(tl.where(mine, starts, 0), 0)
        end = tl.sum(tl.where(mine, ends, 0), 0)
        first = tl.sum(tl.where(mine, after - tiles, 0), 0)
        rows = start + (pid_m - first) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        ks = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :]
        w_ptrs = (w_ptr + e.to(tl.int64) * stride_we + cols[None, :].to(tl.int64) * stride_wn
                  + ks[:, None].to(tl.int64) * stride_wk)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            k_left = K - kb * BLOCK_K
            a = tl.load(x_ptrs, mask=row_ok[:, None] & (ks[None, :] < k_left), other=0.0)
            b = tl.load(w_ptrs, mask=col_ok[None, :] & (ks[:, None] < k_left), other=0.0)
            acc = _dot(a, b, acc, IEEE)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K * stride_wk
        y_ptrs = y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["E"])
def _moe_wgrad_kernel(g_ptr, x_ptr, dw_ptr, off_ptr, N, K, E, stride_gm, stride_xm, stride_dwe, stride_dwn,
                      IEEE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    e = tl.program_id(0)
    tile = tl.program_id(1)
    num_n = tl.cdiv(N, BLOCK_N)
    cols_n = (tile % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_k = (tile // num_n) * BLOCK_K + tl.arange(0, BLOCK_K)
    n_ok = cols_n < N
    k_ok = cols_k < K
    start = tl.load(off_ptr + e)
    end = tl.load(off_ptr + e + 1)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for r0 in range(start, end, BLOCK_R):  # the segment's rows in increasing order, anchored at its start
        rows = r0 + tl.arange(0, BLOCK_R)
        ok = rows < end
        g = tl.load(g_ptr + rows[:, None].to(tl.int64) * stride_gm + cols_n[None, :],
                    mask=ok[:, None] & n_ok[None, :], other=0.0)
        xb = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols_k[None, :],
                     mask=ok[:, None] & k_ok[None, :], other=0.0)
        acc = _dot(tl.trans(g), xb, acc, IEEE)
    out = dw_ptr + e.to(tl.int64) * stride_dwe + cols_n[:, None].to(tl.int64) * stride_dwn + cols_k[None, :]
    tl.store(out, acc.to(dw_ptr.dtype.element_ty), mask=n_ok[:, None] & k_ok[None, :])


def _grouped(p, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, cfg: dict) -> torch.Tensor:
    m, k = x.shape
    e, n, _ = weight.shape
    y = p.new((m, n), x.dtype)
    if m > 0 and n > 0:
        cfg = dict(cfg)
        grid = (triton.cdiv(m, cfg["BLOCK_M"]) + e, triton.cdiv(n, cfg["BLOCK_N"]))
        p.launch(_moe_grouped_fwd_kernel, grid, x, weight, y, offsets, m, n, k, e, x.stride(0), weight.stride(0),
                 weight.stride(1), weight.stride(2), n, BLOCK_E=max(16, next_pow2(e)), **cfg)
    return y


def grouped_forward(p, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return _grouped(p, _rows(p, x), weight, p.contiguous(offsets, torch.int64), config(x.dtype))


def _wgrad(p, grad: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor, e: int, dtype: torch.dtype,
           cfg: dict) -> torch.Tensor:
    n, k = grad.shape[1], x.shape[1]
    dw = p.new((e, n, k), dtype, fill="zeros" if x.shape[0] == 0 else "empty")
    if x.shape[0] > 0 and n > 0 and k > 0:
        cfg = dict(cfg)
        grid = (e, triton.cdiv(n, cfg["BLOCK_N"]) * triton.cdiv(k, cfg["BLOCK_K"]))
        p.launch(_moe_wgrad_kernel, grid, grad, x, dw, offsets, n, k, e, grad.stride(0), x.stride(0), n * k, k,
                 **cfg)
    return dw


def grouped_backward(p, grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    g, xs = _rows(p, p.contiguous(grad, x.dtype)), _rows(p, x)
    off = p.contiguous(offsets, torch.int64)
    dx = _grouped(p, g, weight.transpose(1, 2), off, config(x.dtype))
    return dx, _wgrad(p, g, xs, off, weight.shape[0], weight.dtype, wgrad_config(x.dtype))


def supports_grouped(x, weight, offsets) -> tuple[bool, str]:
    if weight.shape[0] > 4096:
        return False, f"{weight.shape[0]} experts: more than the offsets block of 4096"
    if x.shape[0] + weight.shape[0] > 2 ** 31 - 1:
        return False, "more rows than the grid's first dimension"
    return True, ""


def supports_grouped_backward(grad, x, weight, offsets) -> tuple[bool, str]:
    return supports_grouped(x, weight, offsets)


# -- the combine --------------------------------------------------------------------------------------------------
@triton.jit
def _moe_combine_fwd_kernel(o_ptr, w_ptr, y_ptr, H, stride_ot, stride_oj, stride_yt, TOP_K: tl.constexpr,
                            BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):  # slot order
        w = tl.load(w_ptr + t * TOP_K + j)
        o = tl.load(o_ptr + t * stride_ot + j * stride_oj + cols, mask=ok, other=0.0).to(tl.float32)
        acc = acc + w * o
    tl.store(y_ptr + t * stride_yt + cols, acc.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _moe_combine_bwd_kernel(g_ptr, o_ptr, w_ptr, do_ptr, dw_ptr, H, stride_gt, stride_ot, stride_oj,
                            TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    w = tl.load(w_ptr + t * TOP_K + j)
    acc = 0.0
    for h0 in range(0, H, BLOCK):  # fixed blocks of H in increasing order
        cols = h0 + tl.arange(0, BLOCK)
        ok = cols < H
        g = tl.load(g_ptr + t * stride_gt + cols, mask=ok, other=0.0).to(tl.float32)
        o = tl.load(o_ptr + t * stride_ot + j * stride_oj + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(do_ptr + t * stride_ot + j * stride_oj + cols, (g * w).to(do_ptr.dtype.element_ty), mask=ok)
        acc = acc + tl.sum(g * o, 0)
    tl.store(dw_ptr + t * TOP_K + j, acc)


def _combine_block(h: int) -> dict[str, int]:
    block = min(COMBINE_BLOCK, max(16, next_pow2(h)))
    return {"BLOCK": block, "num_warps": max(1, min(8, block // 256))}


def combine_forward(p, expert_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    o, w = p.contiguous(expert_out), p.contiguous(weights)
    t, top_k, h = o.shape
    y = p.new((t, h), o.dtype)
    if t > 0 and h > 0:
        c = _combine_block(h)
        p.launch(_moe_combine_fwd_kernel, (t, triton.cdiv(h, c["BLOCK"])), o, w, y, h, top_k * h, h, h, TOP_K=top_k,
                 **c)
    return y


def combine_backward(p, grad: torch.Tensor, expert_out: torch.Tensor, weights: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    g, o, w = p.contiguous(grad), p.contiguous(expert_out), p.contiguous(weights)
    t, top_k, h = o.shape
    d_out = p.new((t, top_k, h), o.dtype)
    d_w = p.new((t, top_k), torch.float32)
    if t > 0:
        p.launch(_moe_combine_bwd_kernel, (t, top_k), g, o, w, d_out, d_w, h, h, top_k * h, h, TOP_K=top_k,
                 **_combine_block(h))
    return d_out, d_w


def supports_combine(expert_out, weights) -> tuple[bool, str]:
    if expert_out.shape[1] > 64:
        return False, f"top_k {expert_out.shape[1]} > 64 (the slots are unrolled)"
    return True, ""


def supports_combine_backward(grad, expert_out, weights) -> tuple[bool, str]:
    return supports_combine(expert_out, weights)


# -- what the AOT build compiles ----------------------------------------------------------------------------------
BUILD_EXPERTS = (8, 16, 32, 64, 128, 256)  # the offsets block (BLOCK_E) of each
BUILD_TOP_K = (1, 2, 4, 6, 8)
BUILD_HIDDEN = (1024, 2048, 4096)


def build_calls(dtype: torch.dtype, sms: int):
    """Per expert count of :data:`BUILD_EXPERTS` and k of :data:`BUILD_TOP_K`: the router forward and backward; per
    expert count the grouped GEMM's forward and backward at Qwen3-30B-A3B's expert shapes (gate/up ``[E, 1536,
    2048]``, down ``[E, 2048, 768]``: N, K and strides multiples of 16, which is what the variants specialise on);
    per k and hidden size the combine and its backward."""
    meta = {"device": "meta"}
    for e in BUILD_EXPERTS:
        for k in BUILD_TOP_K:
            logits = torch.empty((7, e), dtype=dtype, **meta)
            yield topk_forward, (logits, k, True)
            yield topk_forward, (logits, k, False)
            w, ids = torch.empty((7, k), **meta), torch.empty((7, k), dtype=torch.int64, **meta)
            for norm in (True, False):
                yield topk_backward, (w, logits, w, ids, norm)
        offsets = torch.empty((e + 1,), dtype=torch.int64, **meta)
        for n, kk in ((1536, 2048), (2048, 768)):
            x = torch.empty((40, kk), dtype=dtype, **meta)
            weight = torch.empty((e, n, kk), dtype=dtype, **meta)
            yield grouped_forward, (x, weight, offsets)
            yield grouped_backward, (torch.empty((40, n), dtype=dtype, **meta), x, weight, offsets)
    for k in BUILD_TOP_K:
        for h in BUILD_HIDDEN:
            o = torch.empty((7, k, h), dtype=dtype, **meta)
            w = torch.empty((7, k), **meta)
            yield combine_forward, (o, w)
            yield combine_backward, (torch.empty((7, h), dtype=dtype, **meta), o, w)
