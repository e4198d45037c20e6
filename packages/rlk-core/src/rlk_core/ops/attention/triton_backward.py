"""Triton backward of ``attention_varlen`` (dq, dk, dv) under contract ``rlk.attention.v1`` (backend ``rlk.triton``).

Flash-style recomputation in three kernels, all arithmetic in fp32 except the MMA inputs:

1. ``_attn_bwd_stats_kernel`` — one program per (query tile, query head): recomputes the forward for
   each row (online softmax over KV blocks in increasing order; ``p`` rounded to ``v.dtype`` before
   ``p @ v`` as the forward does), the output ``O = round_to(q.dtype)(acc / l)`` as a forward would
   have saved it, ``lse`` (base 2) and ``Delta = sum_D(dO * O)``.
2. ``_attn_bwd_dkdv_kernel`` — one program per (KV block, query head) (``SPLIT_G``, the default for
   16-bit inputs) or per (KV block, KV head): loops over its query heads (one, or the G of the group),
   then over the query tiles that can see the block, in increasing order; recomputes
   ``P = exp2(s * log2(e) - lse)`` and accumulates ``dV += P^T dO``, ``dK += dS^T Q`` with
   ``dS = P * (dO V^T - Delta)`` in one fp32 register accumulator each. With ``SPLIT_G`` each program
   writes its head's fp32 sums and ``_attn_bwd_group_sum_kernel`` adds the G heads of a group in
   increasing head order, then rounds once: G times the programs, so the causal triangle's long
   programs (the first KV blocks see every query tile) do not bound the kernel, for one fp32
   ``[Tk, Hq, D]`` buffer each for dK and dV.
3. ``_attn_bwd_dq_kernel`` — one program per (query tile, query head): loops over the KV blocks the
   tile can see, in increasing order: ``dQ += dS K``.

K/V loads: in the stats and dQ kernels the blocks of the unmasked loop (wholly inside the sequence)
arrive by TMA descriptor for bf16/fp16 (``KV_TMA``; pointer loads where the layout or the GPU does not
allow it, see ``triton.kv_tma_ok``) — a load path, not arithmetic.

Determinism: every output element is written by exactly one program and accumulated in a fixed
order (no atomics, no split whose count depends on the batch); the launch configuration
(``CONFIGS``) is a function of dtype and head size only; the tile schedule is a function of
``cu_seqlens`` only. Results are therefore bitwise equal run to run; they are within tolerance of
``attention_varlen_backward_reference`` (not bitwise: MMA summation order, ``exp2``, and ``P``/``dS``
rounded to the input dtype before their MMAs, as every flash backward does).

Masking: a query row sees keys ``0..limit``, computed in the kernels as in the reference
(``MODE_ALIGNED``: ``Lk_b - Lq_b + i``; ``MODE_FULL`` (``causal=False``): ``Lk_b - 1``;
``MODE_POSITIONS``: ``q_positions[i]``). Only blocks that straddle a limit run the masked path; masked
scores are *selected* to zero probability (``tl.where``), K/V/Q rows past a sequence are masked loads
(zeros) and are never stored, so garbage never leaks into a result.

Schedule without host work or a sync (as the forward): per sequence ``ceil(L_b / BLOCK)`` tiles, a grid
of the upper bound ``ceil(T / BLOCK) + B`` programs (times the heads), each finding its tile by a scan of
the sequence offsets (``triton.find_tile``); programs past the end return. Query tiles run the
sequence's last (longest) tiles first, KV tiles its first (longest) ones.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlk_core.ops._plan import next_pow2
from rlk_core.ops.attention.triton import HEAD_DIMS, find_tile, kv_descriptor, kv_tma_ok, qk_scale_f32

MAX_HEAD_DIM = 128

# Per kernel: (BLOCK_M, BLOCK_N, num_warps, num_stages) for stats, dkdv, dq.
CONFIGS: dict[torch.dtype, dict[str, tuple[int, int, int, int]]] = {
    torch.bfloat16: {"stats": (128, 64, 8, 3), "dkdv": (32, 64, 4, 3), "dq": (128, 64, 8, 3)},
    torch.float16: {"stats": (128, 64, 8, 3), "dkdv": (32, 64, 4, 3), "dq": (128, 64, 8, 3)},
    torch.float32: {"stats": (64, 32, 4, 1), "dkdv": (32, 64, 4, 1), "dq": (64, 32, 4, 1)},
}
# dK/dV programs per query head (fp32 partial sums + a fixed-order group sum) instead of per KV head
SPLIT_G: dict[torch.dtype, bool] = {torch.bfloat16: True, torch.float16: True, torch.float32: False}
# stats and dQ: K/V blocks of the unmasked loops by TMA descriptor (as the forward's d = 128 prefill)
KV_TMA: frozenset[torch.dtype] = frozenset({torch.bfloat16, torch.float16})
_SUM_BLOCK_T = 32

# Masking mode of a call (constexpr): how a query row's limit depends on the row.
MODE_ALIGNED, MODE_FULL, MODE_POSITIONS = 0, 1, 2


def config(dtype: torch.dtype, head_dim: int) -> dict[str, dict[str, int]]:
    """Launch configuration: a pure function of ``(dtype, head_dim)`` — never of lengths or batch."""
    block_d = max(16, next_pow2(head_dim))
    cfg = {name: {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_D": block_d, "num_warps": w, "num_stages": st}
           for name, (bm, bn, w, st) in CONFIGS[dtype].items()}
    cfg["dkdv"]["SPLIT_G"] = SPLIT_G[dtype]
    for name in ("stats", "dq"):
        cfg[name]["KV_TMA"] = dtype in KV_TMA
    return cfg


@triton.jit
def _mma(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _load_rows(ptr, tok, ok, h, s_t, s_h, offs_d, d_ok):
    return tl.load(ptr + tok[:, None] * s_t + h * s_h + offs_d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)


@triton.jit
def _row_limits(pos_ptr, q0, rows, row_ok, lq, lk, MODE: tl.constexpr):
    """Last key position each query row sees; -1 for rows past the sequence (they see nothing)."""
    if MODE == 0:
        lim = tl.where(row_ok, lk - lq + rows, -1)
    elif MODE == 1:
        lim = tl.where(row_ok, lk - 1 + rows * 0, -1)
    else:
        lim = tl.load(pos_ptr + q0 + rows, mask=row_ok, other=-1).to(tl.int32)
    return lim


@triton.jit
def _load_kv(k_ptr, v_ptr, k_desc, v_desc, k0, lk, hk, j, s_kt, s_kh, offs_n, offs_d, d_ok,
             BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TMA: tl.constexpr):
    """K/V rows of KV block ``j``; ``TMA`` only for blocks wholly inside the sequence (no row mask)."""
    kpos = j * BLOCK_N + offs_n
    if TMA:
        row = (k0 + j * BLOCK_N).to(tl.int32)
        k = k_desc.load([row, hk * BLOCK_D])
        v = v_desc.load([row, hk * BLOCK_D])
    else:
        ktok = (k0 + kpos).to(tl.int64)
        k = _load_rows(k_ptr, ktok, kpos < lk, hk, s_kt, s_kh, offs_d, d_ok)
        v = _load_rows(v_ptr, ktok, kpos < lk, hk, s_kt, s_kh, offs_d, d_ok)
    return kpos, k, v


@triton.jit
def _stats_step(q, m, l, acc, k_ptr, v_ptr, k_desc, v_desc, k0, lk, hk, j, lim, qk_scale2, s_kt, s_kh, offs_n,
                offs_d, d_ok, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                MASK: tl.constexpr, IEEE: tl.constexpr, TMA: tl.constexpr):
    kpos, k, v = _load_kv(k_ptr, v_ptr, k_desc, v_desc, k0, lk, hk, j, s_kt, s_kh, offs_n, offs_d, d_ok,
                          BLOCK_N, BLOCK_D, TMA)
    s = _mma(q, tl.trans(k), tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), IEEE) * qk_scale2
    if MASK:
        valid = kpos[None, :] <= lim[:, None]
        s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_use)
    p = tl.exp2(s - m_use[:, None])
    if MASK:
        p = tl.where(valid, p, 0.0)
    l = l * alpha + tl.sum(p, axis=1)
    acc = _mma(p.to(v.dtype), v, acc * alpha[:, None], IEEE)
    return m_new, l, acc


@triton.jit(do_not_specialize=["T", "Tk", "B", "NH"])
def _attn_bwd_stats_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, pos_ptr, cu_q_ptr, cu_k_ptr, k_desc, v_desc,
    lse_ptr, delta_ptr,
    T, Tk, B, NH, D, qk_scale2,
    s_qt, s_qh, s_kt, s_kh, s_dot, s_doh,
    G: tl.constexpr, MODE: tl.constexpr, IEEE: tl.constexpr, KV_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0) // NH  # one grid axis, the head fastest (see the forward kernel)
    h = tl.program_id(0) % NH
    hk = h // G
    seq, i, n_tiles, total = find_tile(pid, cu_q_ptr, B, BLOCK_M)
    if pid >= total:
        return
    start = (n_tiles - 1 - i) * BLOCK_M  # the sequence's last (longest) tiles first
    q0 = tl.load(cu_q_ptr + seq)
    lq = tl.load(cu_q_ptr + seq + 1) - q0
    k0 = tl.load(cu_k_ptr + seq)
    lk = tl.load(cu_k_ptr + seq + 1) - k0

    rows = start + tl.arange(0, BLOCK_M)
    row_ok = rows < lq
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    offs_n = tl.arange(0, BLOCK_N)
    lim = _row_limits(pos_ptr, q0, rows, row_ok, lq, lk, MODE)
    tok = (q0 + rows).to(tl.int64)
    q = _load_rows(q_ptr, tok, row_ok, h, s_qt, s_qh, offs_d, d_ok)
    do = _load_rows(do_ptr, tok, row_ok, h, s_dot, s_doh, offs_d, d_ok)

    m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    # blocks every valid row sees entirely need no mask (rows past the sequence are never stored)
    n_full = (tl.min(tl.where(row_ok, lim, 2147483647)) + 1) // BLOCK_N
    n_blocks = (tl.max(lim) + BLOCK_N) // BLOCK_N
    for j in range(0, n_full):
        m, l, acc = _stats_step(q, m, l, acc, k_ptr, v_ptr, k_desc, v_desc, k0, lk, hk, j, lim, qk_scale2, s_kt,
                                s_kh, offs_n, offs_d, d_ok, BLOCK_M, BLOCK_N, BLOCK_D, False, IEEE, KV_TMA)
    for j in range(n_full, n_blocks):
        m, l, acc = _stats_step(q, m, l, acc, k_ptr, v_ptr, k_desc, v_desc, k0, lk, hk, j, lim, qk_scale2, s_kt,
                                s_kh, offs_n, offs_d, d_ok, BLOCK_M, BLOCK_N, BLOCK_D, True, IEEE, False)

    l_safe = tl.where(l > 0.0, l, 1.0)
    o = (acc / l_safe[:, None]).to(q_ptr.dtype.element_ty).to(tl.float32)
    delta = tl.sum(do.to(tl.float32) * o, axis=1)
    lse = tl.where(l > 0.0, m + tl.log2(l_safe), 0.0)
    stat = h.to(tl.int64) * T + q0 + rows
    tl.store(lse_ptr + stat, lse, mask=row_ok)
    tl.store(delta_ptr + stat, delta, mask=row_ok)


@triton.jit
def _dkdv_step(dk, dv, k, v, q_ptr, do_ptr, pos_ptr, lse_ptr, delta_ptr, kpos, q0, lq, lk, h, m_start, T, qk_scale2,
               s_qt, s_qh, s_dot, s_doh, offs_m, offs_d, d_ok,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, MODE: tl.constexpr,
               IEEE: tl.constexpr):
    rows = m_start + offs_m
    row_ok = rows < lq
    tok = (q0 + rows).to(tl.int64)
    # rows past the sequence load q = dO = 0, lse = Delta = 0: P stays finite and they add exactly 0
    q = _load_rows(q_ptr, tok, row_ok, h, s_qt, s_qh, offs_d, d_ok)
    do = _load_rows(do_ptr, tok, row_ok, h, s_dot, s_doh, offs_d, d_ok)
    stat = h.to(tl.int64) * T + q0 + rows
    lse = tl.load(lse_ptr + stat, mask=row_ok, other=0.0)
    delta = tl.load(delta_ptr + stat, mask=row_ok, other=0.0)
    zero = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    p_t = tl.exp2(_mma(k, tl.trans(q), zero, IEEE) * qk_scale2 - lse[None, :])
    if MASK:
        lim = _row_limits(pos_ptr, q0, rows, row_ok, lq, lk, MODE)
        p_t = tl.where(kpos[:, None] <= lim[None, :], p_t, 0.0)
    dv = _mma(p_t.to(do.dtype), do, dv, IEEE)
    dp_t = _mma(v, tl.trans(do), zero, IEEE)
    ds_t = p_t * (dp_t - delta[None, :])
    dk = _mma(ds_t.to(q.dtype), q, dk, IEEE)
    return dk, dv


@triton.jit(do_not_specialize=["T", "Tk", "B", "NH"])
def _attn_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, pos_ptr, cu_q_ptr, cu_k_ptr,
    lse_ptr, delta_ptr, dk_ptr, dv_ptr,
    T, Tk, B, NH, D, qk_scale2, scale,
    s_qt, s_qh, s_kt, s_kh, s_dot, s_doh, s_dkt, s_dkh,
    G: tl.constexpr, MODE: tl.constexpr, IEEE: tl.constexpr, SPLIT_G: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """``SPLIT_G``: the program's head (``NH = Hq``) is a query head; ``dk_ptr``/``dv_ptr`` are the fp32
    per-head sums ``[Tk, Hq, D]`` (unscaled). Otherwise it is a KV head (``NH = Hkv``), results final."""
    pid = tl.program_id(0) // NH  # one grid axis, the head fastest (see the forward kernel)
    head = tl.program_id(0) % NH
    if SPLIT_G:
        hk = head // G
        g_lo = head % G
        g_hi = g_lo + 1
    else:
        hk = head
        g_lo = 0
        g_hi = G
    seq, i, _, total = find_tile(pid, cu_k_ptr, B, BLOCK_N)
    if pid >= total:
        return
    kstart = i * BLOCK_N  # the sequence's first KV blocks (seen by the most query tiles) first
    q0 = tl.load(cu_q_ptr + seq)
    lq = tl.load(cu_q_ptr + seq + 1) - q0
    k0 = tl.load(cu_k_ptr + seq)
    lk = tl.load(cu_k_ptr + seq + 1) - k0

    kpos = kstart + tl.arange(0, BLOCK_N)
    k_ok = kpos < lk
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    offs_m = tl.arange(0, BLOCK_M)
    ktok = (k0 + kpos).to(tl.int64)
    k = _load_rows(k_ptr, ktok, k_ok, hk, s_kt, s_kh, offs_d, d_ok)
    v = _load_rows(v_ptr, ktok, k_ok, hk, s_kt, s_kh, offs_d, d_ok)
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)

    # Query tiles [m_begin, m_full) need the mask, [m_full, lq) see the whole block; tiles before
    # m_begin see none of it (they would add exactly 0). Bottom-right aligned causal: row r sees
    # keys 0..lk-lq+r. Non-causal: every row sees every key. Arbitrary positions: mask everything.
    if MODE == 0:
        off = lk - lq
        m_begin = (tl.maximum(kstart - off, 0) // BLOCK_M) * BLOCK_M
        m_full = ((tl.maximum(kstart + BLOCK_N - 1 - off, 0) + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
    elif MODE == 1:
        m_begin = 0
        m_full = 0
    else:
        m_begin = 0
        m_full = lq
    m_mask_end = tl.minimum(m_full, lq)
    for g in range(g_lo, g_hi):
        h = hk * G + g
        for m_start in range(m_begin, m_mask_end, BLOCK_M):
            dk, dv = _dkdv_step(dk, dv, k, v, q_ptr, do_ptr, pos_ptr, lse_ptr, delta_ptr, kpos, q0, lq, lk, h,
                                m_start, T, qk_scale2, s_qt, s_qh, s_dot, s_doh, offs_m, offs_d, d_ok,
                                BLOCK_M, BLOCK_N, True, MODE, IEEE)
        for m_start in range(m_full, lq, BLOCK_M):
            dk, dv = _dkdv_step(dk, dv, k, v, q_ptr, do_ptr, pos_ptr, lse_ptr, delta_ptr, kpos, q0, lq, lk, h,
                                m_start, T, qk_scale2, s_qt, s_qh, s_dot, s_doh, offs_m, offs_d, d_ok,
                                BLOCK_M, BLOCK_N, False, MODE, IEEE)

    kv_mask = k_ok[:, None] & d_ok[None, :]
    if SPLIT_G:
        out = ktok[:, None] * s_dkt + (hk * G + g_lo) * s_dkh + offs_d[None, :]
        tl.store(dk_ptr + out, dk, mask=kv_mask)
        tl.store(dv_ptr + out, dv, mask=kv_mask)
    else:
        dk = dk * scale
        out = ktok[:, None] * s_dkt + hk * s_dkh + offs_d[None, :]
        tl.store(dk_ptr + out, dk.to(dk_ptr.dtype.element_ty), mask=kv_mask)
        tl.store(dv_ptr + out, dv.to(dv_ptr.dtype.element_ty), mask=kv_mask)


@triton.jit(do_not_specialize=["Tk"])
def _attn_bwd_group_sum_kernel(
    dk_part_ptr, dv_part_ptr, dk_ptr, dv_ptr, Tk, D, scale, s_pt, s_ph, s_dkt, s_dkh,
    G: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """``dK[t, hk] = round(scale * sum_g part_k[t, hk * G + g])``, ``dV`` likewise without the scale: the
    G per-head sums added in increasing head order (fp32), one rounding."""
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    hk = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (rows < Tk)[:, None] & (offs_d < D)[None, :]
    part = rows[:, None] * s_pt + offs_d[None, :]
    dk = tl.load(dk_part_ptr + part + (hk * G) * s_ph, mask=mask, other=0.0)
    dv = tl.load(dv_part_ptr + part + (hk * G) * s_ph, mask=mask, other=0.0)
    for g in tl.static_range(1, G):
        dk += tl.load(dk_part_ptr + part + (hk * G + g) * s_ph, mask=mask, other=0.0)
        dv += tl.load(dv_part_ptr + part + (hk * G + g) * s_ph, mask=mask, other=0.0)
    out = rows[:, None] * s_dkt + hk * s_dkh + offs_d[None, :]
    tl.store(dk_ptr + out, (dk * scale).to(dk_ptr.dtype.element_ty), mask=mask)
    tl.store(dv_ptr + out, dv.to(dv_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dq_step(dq, q, do, lse, delta, lim, k_ptr, v_ptr, k_desc, v_desc, k0, lk, hk, j, qk_scale2, s_kt, s_kh, offs_n,
             offs_d, d_ok, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, MASK: tl.constexpr,
             IEEE: tl.constexpr, TMA: tl.constexpr):
    kpos, k, v = _load_kv(k_ptr, v_ptr, k_desc, v_desc, k0, lk, hk, j, s_kt, s_kh, offs_n, offs_d, d_ok,
                          BLOCK_N, BLOCK_D, TMA)
    zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    p = tl.exp2(_mma(q, tl.trans(k), zero, IEEE) * qk_scale2 - lse[:, None])
    if MASK:
        p = tl.where(kpos[None, :] <= lim[:, None], p, 0.0)
    dp = _mma(do, tl.trans(v), zero, IEEE)
    ds = p * (dp - delta[:, None])
    return _mma(ds.to(k.dtype), k, dq, IEEE)


@triton.jit(do_not_specialize=["T", "Tk", "B", "NH"])
def _attn_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, pos_ptr, cu_q_ptr, cu_k_ptr, k_desc, v_desc,
    lse_ptr, delta_ptr, dq_ptr,
    T, Tk, B, NH, D, qk_scale2, scale,
    s_qt, s_qh, s_kt, s_kh, s_dot, s_doh, s_dqt, s_dqh,
    G: tl.constexpr, MODE: tl.constexpr, IEEE: tl.constexpr, KV_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0) // NH  # one grid axis, the head fastest (see the forward kernel)
    h = tl.program_id(0) % NH
    hk = h // G
    seq, i, n_tiles, total = find_tile(pid, cu_q_ptr, B, BLOCK_M)
    if pid >= total:
        return
    start = (n_tiles - 1 - i) * BLOCK_M  # the sequence's last (longest) tiles first
    q0 = tl.load(cu_q_ptr + seq)
    lq = tl.load(cu_q_ptr + seq + 1) - q0
    k0 = tl.load(cu_k_ptr + seq)
    lk = tl.load(cu_k_ptr + seq + 1) - k0

    rows = start + tl.arange(0, BLOCK_M)
    row_ok = rows < lq
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    offs_n = tl.arange(0, BLOCK_N)
    tok = (q0 + rows).to(tl.int64)
    q = _load_rows(q_ptr, tok, row_ok, h, s_qt, s_qh, offs_d, d_ok)
    do = _load_rows(do_ptr, tok, row_ok, h, s_dot, s_doh, offs_d, d_ok)
    lim = _row_limits(pos_ptr, q0, rows, row_ok, lq, lk, MODE)
    stat = h.to(tl.int64) * T + q0 + rows
    lse = tl.load(lse_ptr + stat, mask=row_ok, other=0.0)
    delta = tl.load(delta_ptr + stat, mask=row_ok, other=0.0)

    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    # blocks every valid row sees entirely need no mask (rows past the sequence are never stored)
    n_full = (tl.min(tl.where(row_ok, lim, 2147483647)) + 1) // BLOCK_N
    n_blocks = (tl.max(lim) + BLOCK_N) // BLOCK_N
    for j in range(0, n_full):
        dq = _dq_step(dq, q, do, lse, delta, lim, k_ptr, v_ptr, k_desc, v_desc, k0, lk, hk, j, qk_scale2, s_kt, s_kh,
                      offs_n, offs_d, d_ok, BLOCK_M, BLOCK_N, BLOCK_D, False, IEEE, KV_TMA)
    for j in range(n_full, n_blocks):
        dq = _dq_step(dq, q, do, lse, delta, lim, k_ptr, v_ptr, k_desc, v_desc, k0, lk, hk, j, qk_scale2, s_kt, s_kh,
                      offs_n, offs_d, d_ok, BLOCK_M, BLOCK_N, BLOCK_D, True, IEEE, False)

    dq = dq * scale
    tl.store(dq_ptr + tok[:, None] * s_dqt + h * s_dqh + offs_d[None, :], dq.to(dq_ptr.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


def _with_descriptors(p, cfg: dict[str, int | bool], k: torch.Tensor, v: torch.Tensor, d: int
                      ) -> tuple[dict[str, int | bool], tuple]:
    """``cfg`` with ``KV_TMA`` kept only where the layout and the GPU allow it (else pointer loads,
    the same bits), and the K/V descriptors for the kernel's block (``None`` without TMA)."""
    cfg = dict(cfg)
    cfg["KV_TMA"] = bool(cfg.get("KV_TMA", False)) and kv_tma_ok(p, k, v, d, cfg["BLOCK_D"])
    if not cfg["KV_TMA"]:
        return cfg, (None, None)
    return cfg, tuple(kv_descriptor(p, t, cfg["BLOCK_N"], cfg["BLOCK_D"]) for t in (k, v))


def attention_varlen_backward(p, grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, scale: float, causal: bool,
                              q_positions: torch.Tensor | None, cfg: dict[str, dict[str, int | bool]] | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of ``attention_varlen`` (see the module docstring); deterministic run to run.
    ``cfg`` is for exploratory benchmarks only (the backend always uses :func:`config`)."""
    t, hq, d = q.shape
    tk, hkv = k.shape[0], k.shape[1]
    q, k, v = (p.contiguous(x) for x in (q, k, v))
    do = p.contiguous(grad_out, q.dtype)
    dq, dk, dv = p.new(q.shape, q.dtype), p.new(k.shape, k.dtype), p.new(v.shape, v.dtype)
    nb = cu_seqlens_q.shape[0] - 1
    if tk == 0 or hq == 0 or d == 0 or nb == 0:
        return p.host(lambda: (dq.zero_(), dk.zero_(), dv.zero_()))
    cu_q, cu_k = p.contiguous(cu_seqlens_q, torch.int32), p.contiguous(cu_seqlens_k, torch.int32)
    if not causal:
        mode, pos = MODE_FULL, cu_q
    elif q_positions is not None:
        mode, pos = MODE_POSITIONS, p.contiguous(q_positions)
    else:
        mode, pos = MODE_ALIGNED, cu_q
    c = cfg or config(q.dtype, d)
    # grids are upper bounds; each program finds its tile on the device (find_tile)
    bm_s, bm_q, bn_kv = c["stats"]["BLOCK_M"], c["dq"]["BLOCK_M"], c["dkdv"]["BLOCK_N"]
    qk_scale2 = qk_scale_f32(scale)
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), do.stride(0), do.stride(1))
    common = dict(G=hq // hkv, MODE=mode, IEEE=q.dtype == torch.float32)

    stats = p.new((2, hq, max(t, 1)), torch.float32)  # lse, delta: one allocation (host time)
    lse, delta = stats[0], stats[1]
    if t:
        s_cfg, s_desc = _with_descriptors(p, c["stats"], k, v, d)
        p.launch(_attn_bwd_stats_kernel, ((triton.cdiv(t, bm_s) + nb) * hq,),
                 q, k, v, do, pos, cu_q, cu_k, *s_desc, lse, delta, t, tk, nb, hq, d, qk_scale2, *strides,
                 **common, **s_cfg)
        q_cfg, q_desc = _with_descriptors(p, c["dq"], k, v, d)
        p.launch(_attn_bwd_dq_kernel, ((triton.cdiv(t, bm_q) + nb) * hq,),
                 q, k, v, do, pos, cu_q, cu_k, *q_desc, lse, delta, dq, t, tk, nb, hq, d, qk_scale2, scale,
                 *strides, dq.stride(0), dq.stride(1), **common, **q_cfg)
    kv_cfg = dict(c["dkdv"])
    split = bool(kv_cfg.pop("SPLIT_G", False)) and hq > hkv
    if split:  # fp32 per-query-head sums, then the fixed-order group sum
        parts = p.new((2, tk, hq, d), torch.float32)
        dk_out, dv_out = parts[0], parts[1]
    else:
        dk_out, dv_out = dk, dv
    nh_kv = hq if split else hkv
    p.launch(_attn_bwd_dkdv_kernel, ((triton.cdiv(tk, bn_kv) + nb) * nh_kv,),
             q, k, v, do, pos, cu_q, cu_k, lse, delta, dk_out, dv_out, t, tk, nb, nh_kv, d, qk_scale2, scale,
             *strides, dk_out.stride(0), dk_out.stride(1), **common, SPLIT_G=split, **kv_cfg)
    if split:
        p.launch(_attn_bwd_group_sum_kernel, (triton.cdiv(tk, _SUM_BLOCK_T), hkv),
                 dk_out, dv_out, dk, dv, tk, d, scale, dk_out.stride(0), dk_out.stride(1), dk.stride(0), dk.stride(1),
                 G=hq // hkv, BLOCK_T=_SUM_BLOCK_T, BLOCK_D=kv_cfg["BLOCK_D"])
    return dq, dk, dv


def supports_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, scale: float, causal: bool,
                      q_positions: torch.Tensor | None) -> tuple[bool, str]:
    if q.dtype not in CONFIGS:
        return False, f"dtype {q.dtype} has no rlk.triton attention backward configuration"
    if q.shape[-1] > MAX_HEAD_DIM:
        return False, f"head size {q.shape[-1]} > {MAX_HEAD_DIM} (rlk.triton attention backward)"
    return True, ""


GROUPS = (1, 2, 4, 5, 6, 7, 8)  # Hq / Hkv of the backward (a constexpr): the GQA ratios of Qwen2.5/3, Llama 3


def build_calls(dtype: torch.dtype, sms: int):
    """The four backward kernels for every head size of ``HEAD_DIMS`` up to :data:`MAX_HEAD_DIM` that is a power of
    two, every group size of :data:`GROUPS` (``G`` is a constexpr of every kernel: a family of binaries per group),
    each mode (aligned causal, full, explicit positions int32 or int64)."""
    if dtype not in CONFIGS:
        return
    m = dict(dtype=dtype, device="meta")
    cu = torch.empty((3,), dtype=torch.int32, device="meta")
    for d in HEAD_DIMS:
        if d > MAX_HEAD_DIM or next_pow2(d) != d:
            continue
        for g in GROUPS:
            q = torch.empty((64, 2 * g, d), **m)
            kv = torch.empty((64, 2, d), **m)
            for causal, positions in ((True, None), (False, None),
                                      *((True, torch.empty((64,), dtype=pt, device="meta"))
                                        for pt in (torch.int32, torch.int64))):
                yield attention_varlen_backward, (q, q, kv, kv, cu, cu, 0.125, causal, positions)
