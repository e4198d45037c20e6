"""Triton forward attention under contract ``rlk.attention.v1`` (backend ``rlk.triton``).

One ``@triton.jit`` kernel, :func:`_attention_fwd_kernel`, runs varlen prefill, chunked prefill over a
paged cache and paged decode. The forms differ in addressing (``PAGED``: contiguous varlen K/V or a
block table) and in tile height (``CONFIGS``: a prefill and a decode entry); per row they run the same
arithmetic — the same MMA k-steps, the same softmax reductions, the same KV block order — which the GPU
tests check bit for bit (prefill == chunked prefill == decode, any page size, any batch composition):

- A tile is ``BLOCK_M`` rows; row ``r`` is query token ``r // G_PAD`` of the tile and group head
  ``r % G_PAD`` of one KV head (``G = Hq // Hkv`` padded to a power of two), so K/V of a block are loaded
  once for the whole GQA group. Decode is a chunk of one token (``cu_seqlens_q = arange(B + 1)``).
- Row limit ``t`` (its absolute position; non-causal ``Lk_b - 1``; padding rows ``0``). KV blocks of
  ``BLOCK_N = KV_BLOCK = 64`` from position 0 up to the tile's largest limit, increasing order. ``s =
  dot(q, k^T) * (scale * log2 e)``, positions ``> t`` selected to ``-inf`` after the dot; online softmax
  in fp32 with ``exp2``; ``p`` rounded to ``v.dtype`` before ``dot(p, v)``; ``l`` sums the fp32 ``p``;
  ``out = acc / l`` rounded once. A block past a row's limit is an exact no-op for that row
  (``alpha = exp2(0) = 1``, ``p = 0``). Blocks wholly at or below every valid row's limit skip the
  selection and the load masks (it would keep every element); the kernel is compiled with
  ``enable_fp_fusion=False`` so that the two loops cannot contract ``s * scale - m`` differently.
- Addressing: position ``j`` of sequence ``b`` lives at ``base + table[b, j >> S] * s_page + (j & (2^S -
  1)) * s_off`` with ``2^S`` the page size (a power of two). Varlen: token ``cu_seqlens_k[b] + j``. K/V
  loads past the tile's largest limit are masked (``other=0``), so unused cache slots (NaN) and
  block-table entries past a sequence's pages are never read.
- Tile schedule without host work or a sync: per sequence ``ceil(Lq_b / TOK)`` tiles; one grid axis of
  the upper bound ``(ceil(T / TOK) + B) * Hkv`` programs, the KV head fastest, each finding its
  sequence by a scan of ``cu_seqlens_q`` on the device (:func:`find_tile`; programs past the end
  return). (Computing the cumulative tile counts with torch ops would cost ~80 us of host time per call.)

Configuration per (dtype, padded head size, form) only (``CONFIGS``); counts are ``do_not_specialize``.
No atomics, no split-KV, no autotuning. fp32 inputs use ``input_precision="ieee"``.

``KV_TMA`` (the d = 128 prefill entries): in varlen prefill the K/V blocks of the unmasked loop — wholly
inside the sequence — arrive through TMA tensor descriptors instead of pointer loads; the masked tail and
the arithmetic are unchanged. A load path, not arithmetic: on the H200 sweep it gives identical bits and
522 TFLOP/s at L = 8192 against 436 with pointer loads, and the GPU tests compare this prefill with
chunked prefill and decode (pointer loads) bit for bit. Paged calls, other layouts (:func:`kv_tma_ok`)
and GPUs without TMA (before sm_90, ROCm) take the pointer loads.
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from rlk_core.ops._plan import hold, next_pow2
from rlk_core.ops.attention._core import KV_BLOCK

LOG2E = 1.4426950408889634
_VARLEN_SHIFT = 30  # "page size" 2^30 of contiguous varlen K/V: one page per sequence

# (dtype, padded head size) -> {form: (BLOCK_M, num_warps, num_stages)}; BLOCK_N is always KV_BLOCK = 64.
# "prefill" serves varlen and chunked paged prefill, "decode" one query token per sequence. The tile
# height and warp count change which rows share a program, never a row's arithmetic (each row's dot
# products, softmax reductions and P.V accumulation run the same MMA k-steps in the same order): the
# GPU tests prove prefill == chunked prefill == decode bit for bit across the two entries.
# KV_TMA (the sweep's 128w8s3tma) only where measured: d = 128 prefill.
CONFIGS: dict[tuple[torch.dtype, int], dict[str, tuple[int, int, int]]] = {}
KV_TMA: frozenset[tuple[torch.dtype, int, str]] = frozenset(
    (dt, 128, "prefill") for dt in (torch.bfloat16, torch.float16))
for _dt in (torch.bfloat16, torch.float16):
    for _d in (16, 32, 64):
        CONFIGS[(_dt, _d)] = {"prefill": (128, 4, 3), "decode": (128, 4, 3)}
    # d = 128 from the H200 sweep (benchmarks/results/h200/sweep/): prefill 128 rows / 8 warps / 3 stages
    # (441 vs 371 TFLOP/s at L = 8192 for 64/4/2); decode keeps 64 rows — 16- and 32-row tiles (mma.sync
    # instead of wgmma) were faster there but changed bits, so they are not used
    CONFIGS[(_dt, 128)] = {"prefill": (128, 8, 3), "decode": (64, 4, 2)}
    CONFIGS[(_dt, 256)] = {"prefill": (64, 8, 2), "decode": (64, 8, 2)}
for _d in (16, 32, 64):
    CONFIGS[(torch.float32, _d)] = {"prefill": (64, 4, 2), "decode": (64, 4, 2)}
CONFIGS[(torch.float32, 128)] = {"prefill": (64, 8, 2), "decode": (64, 8, 2)}


def config(dtype: torch.dtype, head_size: int, form: str = "prefill") -> dict[str, int | bool]:
    """The launch configuration for ``dtype``, head size and form — never a function of token counts."""
    d_pad = max(16, next_pow2(head_size))
    block_m, warps, stages = CONFIGS[(dtype, d_pad)][form]
    return {"BLOCK_M": block_m, "BLOCK_N": KV_BLOCK, "HEAD_D": head_size, "D_PAD": d_pad,
            "IEEE": dtype == torch.float32, "KV_TMA": (dtype, d_pad, form) in KV_TMA, "num_warps": warps,
            "num_stages": stages}


def kv_tma_ok(p, k: torch.Tensor, v: torch.Tensor, d: int, d_pad: int) -> bool:
    """Whether contiguous varlen K/V ``[Tk, Hkv, d]`` can be read as 2-D TMA descriptors ``[Tk, Hkv * d]``
    with ``[BLOCK_N, d_pad]`` boxes: ``d == d_pad`` (a wider box would read the next head's columns),
    heads contiguous (``stride(2) == 1``, ``stride(1) == d``, rows not overlapping), at least one row,
    16-byte aligned base pointer and row stride."""
    return d == d_pad and all(
        t.dim() == 3 and t.shape[0] > 0 and t.stride(2) == 1 and t.stride(1) == d and t.stride(0) >= t.shape[1] * d
        and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0 for t in (k, v)
    ) and (p.tma or p.device.type == "cpu")  # CPU tensors: the Triton interpreter


def kv_descriptor(p, t: torch.Tensor, block_n: int, d_pad: int):
    """``t [Tk, Hkv, d]`` viewed as ``[Tk, Hkv * d]``: head ``h`` of token ``i`` is the box at ``[i, h * d]``."""
    return p.desc(t, [block_n, d_pad], [t.shape[0], t.shape[1] * t.shape[2]], [t.stride(0), 1])


@triton.jit
def _kv_rows(table_row, seq0, kpos, page_shift, PAGED: tl.constexpr):
    """Row offsets (in units of the token stride / page stride) of key positions ``kpos``."""
    if PAGED:
        page = tl.load(table_row + (kpos >> page_shift)).to(tl.int64)
        off = (kpos & ((1 << page_shift) - 1)).to(tl.int64)
    else:
        page = seq0
        off = kpos.to(tl.int64)
    return page, off


@triton.jit
def find_tile(pid, cu_ptr, B, TILE: tl.constexpr):
    """Program ``pid``'s tile in a launch over the tiles (``TILE`` rows each) of B packed sequences with
    offsets ``cu[0..B]`` (on the device: no host work, no sync): ``(sequence, index of the tile in it,
    the sequence's tile count, the total tile count)``; a program with ``pid >= total`` has no tile.
    One vectorised scan over the offsets, ``SCHED`` = 128 sequences per step: every program derives the same
    schedule from the same offsets.

    ``SCHED`` is a local constexpr, not a module global: Triton 3.6 folds a callee's global constexprs into a
    caller's compile key only if the callee was hashed first (``DependenciesFinder._update_hash`` merges its
    globals before computing its key), so a global here gave the backward kernels two keys, by which kernel a
    process happened to hash first — and the AOT build's parallel workers compiled some under the other one."""
    SCHED: tl.constexpr = 128
    zero = pid * 0
    seq, first, count, total = zero, zero, zero, zero
    for c0 in range(0, B, SCHED):
        idx = c0 + tl.arange(0, SCHED)
        ok = idx < B
        lo = tl.load(cu_ptr + idx, mask=ok, other=0).to(tl.int32)
        hi = tl.load(cu_ptr + idx + 1, mask=ok, other=0).to(tl.int32)
        n = (hi - lo + (TILE - 1)) // TILE  # 0 where masked
        end = total + tl.cumsum(n, 0)
        mine = (end - n <= pid) & (pid < end)
        seq += tl.sum(tl.where(mine, idx, 0), 0)
        first += tl.sum(tl.where(mine, end - n, 0), 0)
        count += tl.sum(tl.where(mine, n, 0), 0)
        total += tl.sum(n, 0)
    return seq, pid - first, count, total


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def qk_scale_f32(scale: float) -> float:
    """``fp32(scale) * fp32(log2 e)`` rounded to fp32, on the host without torch ops: the product of two
    floats is exact in a double, so packing it rounds once, as the fp32 multiply does."""
    return _f32(_f32(float(scale)) * _f32(LOG2E))


@triton.jit
def _softmax_block(q, k, v, m_i, l_i, acc, kpos, limit, qk_scale, MASK: tl.constexpr, IEEE: tl.constexpr):
    """One KV block of the online softmax. ``MASK=False`` only for blocks wholly at or below every
    valid row's limit, where the selection would keep every element: the same arithmetic."""
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * qk_scale
    if MASK:
        s = tl.where(kpos[None, :] <= limit[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    if IEEE:
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["B", "G", "NH", "page_shift", "stride_tb", "has_qpos", "causal"])
def _attention_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, k_desc, v_desc,
    table_ptr, cu_q_ptr, lens_ptr, qpos_ptr,
    B, G, NH, page_shift, stride_tb,
    stride_qt, stride_qh, stride_qd,
    stride_kp, stride_ko, stride_kh, stride_kd,
    stride_vp, stride_vo, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    qk_scale, has_qpos, causal,
    G_PAD: tl.constexpr, HEAD_D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, PAGED: tl.constexpr,
    KV_TMA: tl.constexpr,
):
    """``k_desc``/``v_desc``: ``None`` unless ``KV_TMA`` (contiguous varlen only, ``HEAD_D == D_PAD``):
    then K/V as ``[Tk, Hkv * HEAD_D]`` descriptors with ``[BLOCK_N, D_PAD]`` boxes (:func:`kv_descriptor`)."""
    tl.static_assert(not KV_TMA or (not PAGED and HEAD_D == D_PAD))
    TOK: tl.constexpr = BLOCK_M // G_PAD
    # one grid axis, the KV head fastest: the tiles start in the schedule's order (longest first) across
    # all heads, so the short tiles fill the last wave (a head-major order left long tiles of the last
    # heads for the end)
    pid = tl.program_id(0) // NH
    kvh = tl.program_id(0) % NH

    # -- which sequence and which tokens (a scan of the offsets) -------------------------------
    b, i, n_tiles, total = find_tile(pid, cu_q_ptr, B, TOK)
    if pid >= total:
        return
    q0 = tl.load(cu_q_ptr + b)
    n_q = tl.load(cu_q_ptr + b + 1) - q0
    if PAGED:
        n_k = tl.load(lens_ptr + b)
    else:  # varlen: the table is cu_seqlens_k
        n_k = tl.load(table_ptr + b + 1) - tl.load(table_ptr + b)
    tile = n_tiles - 1 - i  # the sequence's last (longest) tiles first
    tok0 = tile * TOK

    rows = tl.arange(0, BLOCK_M)
    tok = tok0 + rows // G_PAD
    hg = rows % G_PAD
    row_ok = (tok < n_q) & (hg < G)
    head = kvh * G + hg
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_D

    # -- each row's limit: the last key position it sees ---------------------------------------
    if has_qpos != 0:
        pos = tl.load(qpos_ptr + q0 + tok, mask=row_ok, other=0)
    else:
        pos = n_k - n_q + tok
    if causal == 0:
        pos = tok * 0 + (n_k - 1)
    limit = tl.where(row_ok, pos, 0)
    last = tl.max(limit, axis=0)
    first = tl.min(tl.where(row_ok, limit, last), axis=0)

    q_rows = (q0 + tok).to(tl.int64) * stride_qt + head.to(tl.int64) * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, D_PAD), dtype=tl.float32)

    offs_n = tl.arange(0, BLOCK_N)
    k_head = k_ptr + kvh.to(tl.int64) * stride_kh
    v_head = v_ptr + kvh.to(tl.int64) * stride_vh
    table_row = table_ptr + b.to(tl.int64) * stride_tb
    if PAGED:
        seq0 = 0
    else:
        seq0 = tl.load(table_row).to(tl.int64)  # varlen: the sequence's first token (cu_seqlens_k[b])
    # blocks 0 .. n_full-1 lie wholly at or below every valid row's limit: no selection, no load masks
    n_full = (first + 1) // BLOCK_N
    for j in range(0, n_full):
        kpos = j * BLOCK_N + offs_n
        if KV_TMA:
            # the box's rows seq0 + j * BLOCK_N + [0, BLOCK_N) lie inside this sequence, its columns in head kvh
            row = (seq0 + j * BLOCK_N).to(tl.int32)
            k = k_desc.load([row, kvh * HEAD_D])
            v = v_desc.load([row, kvh * HEAD_D])
        else:
            page, off = _kv_rows(table_row, seq0, kpos, page_shift, PAGED)
            k = tl.load(k_head + (page * stride_kp + off * stride_ko)[:, None] + offs_d[None, :] * stride_kd,
                        mask=d_ok[None, :], other=0.0)
            v = tl.load(v_head + (page * stride_vp + off * stride_vo)[:, None] + offs_d[None, :] * stride_vd,
                        mask=d_ok[None, :], other=0.0)
        m_i, l_i, acc = _softmax_block(q, k, v, m_i, l_i, acc, kpos, limit, qk_scale, False, IEEE)
    for j in range(n_full, last // BLOCK_N + 1):
        kpos = j * BLOCK_N + offs_n
        ld = kpos <= last
        page, off = _kv_rows(table_row, seq0, tl.where(ld, kpos, 0), page_shift, PAGED)
        kv_ok = ld[:, None] & d_ok[None, :]
        k = tl.load(k_head + (page * stride_kp + off * stride_ko)[:, None] + offs_d[None, :] * stride_kd,
                    mask=kv_ok, other=0.0)
        v = tl.load(v_head + (page * stride_vp + off * stride_vo)[:, None] + offs_d[None, :] * stride_vd,
                    mask=kv_ok, other=0.0)
        m_i, l_i, acc = _softmax_block(q, k, v, m_i, l_i, acc, kpos, limit, qk_scale, True, IEEE)

    out = acc / l_i[:, None]
    o_rows = (q0 + tok).to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
    tl.store(o_ptr + o_rows[:, None] + offs_d[None, :] * stride_od, out.to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


def _launch(p, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, stride_tb: int,
            page_size: int, k_strides: tuple[int, int, int, int], v_strides: tuple[int, int, int, int],
            cu_q: torch.Tensor, b: int, lens: torch.Tensor | None, q_positions: torch.Tensor | None, causal: bool,
            scale: float, form: str, cfg: dict[str, int | bool] | None = None) -> torch.Tensor:
    """Launch the forward kernel for ``b`` sequences (``cu_q`` may be longer than ``b + 1``). ``page_size = 0`` means
    contiguous varlen K/V (``table`` is ``cu_seqlens_k``, from which the kernel takes the key counts: ``lens`` is not
    read, may be None); paged: ``lens`` is ``seq_lens``. ``cfg`` is for exploratory benchmarks only (anything but
    :func:`config` is outside the contract). ``KV_TMA`` is dropped for this call (pointer loads: the same bits) when
    the call is paged or :func:`kv_tma_ok` fails."""
    t, hq, d = q.shape
    hkv = k.shape[-2]
    out = p.new(q.shape, q.dtype)
    if t == 0 or b == 0:
        return out
    g = hq // hkv
    cfg = dict(cfg or config(q.dtype, d, form))
    kv_tma = bool(cfg.pop("KV_TMA", False)) and page_size == 0 and kv_tma_ok(p, k, v, d, cfg["D_PAD"])
    k_desc = kv_descriptor(p, k, cfg["BLOCK_N"], cfg["D_PAD"]) if kv_tma else None
    v_desc = kv_descriptor(p, v, cfg["BLOCK_N"], cfg["D_PAD"]) if kv_tma else None
    g_pad = next_pow2(g)
    tok = cfg["BLOCK_M"] // g_pad
    if q_positions is not None and q_positions.dtype != torch.int32:
        q_positions = p.contiguous(q_positions, torch.int32)
    qpos = q_positions if q_positions is not None else cu_q  # not read without positions
    p.launch(_attention_fwd_kernel, ((triton.cdiv(t, tok) + b) * hkv,),
             q, k, v, out, k_desc, v_desc, table, cu_q, lens, qpos,
             b, g, hkv, (page_size.bit_length() - 1) if page_size else _VARLEN_SHIFT, stride_tb,
             q.stride(0), q.stride(1), q.stride(2), *k_strides, *v_strides, hq * d, d, 1,
             qk_scale_f32(scale), int(q_positions is not None), int(bool(causal)),
             G_PAD=g_pad, PAGED=page_size != 0, KV_TMA=kv_tma, enable_fp_fusion=False, **cfg)
    return out


def attention_varlen(p, q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, q_positions):
    ks = (k.stride(0), k.stride(0), k.stride(1), k.stride(2))
    vs = (v.stride(0), v.stride(0), v.stride(1), v.stride(2))
    return _launch(p, q, k, v, cu_seqlens_k, 1, 0, ks, vs, cu_seqlens_q, cu_seqlens_q.shape[0] - 1, None,
                   q_positions if causal else None, causal, scale, "prefill")


def _paged(p, q, k_cache, v_cache, block_table, cu_q, b, seq_lens, scale, form):
    return _launch(p, q, k_cache, v_cache, block_table, block_table.stride(0), k_cache.shape[1],
                   tuple(k_cache.stride()), tuple(v_cache.stride()), cu_q, b, seq_lens, None, True, scale, form)


def attention_paged_prefill(p, q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, scale):
    return _paged(p, q, k_cache, v_cache, block_table, cu_seqlens_q, cu_seqlens_q.shape[0] - 1, seq_lens, scale,
                  "prefill")


_OFFSETS: dict[torch.device, torch.Tensor] = {}  # device -> arange(n) int32, n >= every decode batch seen
_KEEP: list[torch.Tensor] = []  # every offsets tensor ever made (a captured graph may still read one)


def decode_offsets(device: torch.device, n: int) -> torch.Tensor | None:
    """``arange(m)`` int32 on ``device`` with ``m >= n`` (decode's ``cu_seqlens_q``, read up to ``B + 1``): one
    cached tensor per device, grown outside CUDA-graph capture (None under capture) and synchronised with its stream
    once, so that any stream may read it; never freed, never written again (:func:`~rlk_core.ops._plan.hold`)."""
    cu = _OFFSETS.get(device)
    if cu is not None and cu.shape[0] >= n:
        return cu
    cuda = device.type == "cuda"
    if cuda and torch.cuda.is_current_stream_capturing():
        return None
    cu = torch.arange(max(1024, next_pow2(n)), dtype=torch.int32, device=device)
    if cuda:
        torch.cuda.current_stream(device).synchronize()  # once per size: ready before any stream reads it
    _KEEP.append(cu)
    _OFFSETS[device] = cu
    hold(cu)
    return cu


def attention_decode(p, q, k_cache, v_cache, block_table, seq_lens, scale):
    # decode is chunked prefill with one token per sequence: the same kernel and per-row arithmetic
    b = q.shape[0]
    cu_q = decode_offsets(q.device, b + 1)
    if cu_q is None:  # under capture before any offsets exist: this call's own
        cu_q = p.host(torch.arange, b + 1, dtype=torch.int32, device=q.device)
    return _paged(p, q, k_cache, v_cache, block_table, cu_q, b, seq_lens, scale, "decode")


@triton.jit(do_not_specialize=["T"])
def _kv_cache_write_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, T, H, page_size,
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_kcp, stride_kco, stride_kch, stride_kcd, stride_vcp, stride_vco, stride_vch, stride_vcd,
    HEAD_D: tl.constexpr, D_PAD: tl.constexpr, H_PAD: tl.constexpr,
):
    i = tl.program_id(0)
    slot = tl.load(slot_ptr + i)
    if slot < 0:
        return
    page = slot // page_size
    off = slot % page_size
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, D_PAD)
    mask = (h < H)[:, None] & (d < HEAD_D)[None, :]
    it = i.to(tl.int64)
    hh = h.to(tl.int64)[:, None]
    kx = tl.load(k_ptr + it * stride_kt + hh * stride_kh + d[None, :] * stride_kd, mask=mask)
    vx = tl.load(v_ptr + it * stride_vt + hh * stride_vh + d[None, :] * stride_vd, mask=mask)
    tl.store(kc_ptr + page * stride_kcp + off * stride_kco + hh * stride_kch + d[None, :] * stride_kcd, kx, mask=mask)
    tl.store(vc_ptr + page * stride_vcp + off * stride_vco + hh * stride_vch + d[None, :] * stride_vcd, vx, mask=mask)


def kv_cache_write(p, k, v, k_cache, v_cache, slot_mapping):
    t, h, d = k.shape
    if t == 0:
        return None
    p.launch(_kv_cache_write_kernel, (t,), k, v, k_cache, v_cache, slot_mapping, t, h, k_cache.shape[1],
             *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
             HEAD_D=d, D_PAD=next_pow2(d), H_PAD=next_pow2(h))
    return None


# -- what the AOT build compiles (rlk_core.aot.build) ---------------------------------------------------------------
HEAD_DIMS = (64, 128, 256)  # HEAD_D and D_PAD are constexprs: each head size is a family of binaries
KV_HEADS_MAX = 128  # kv_cache_write: H_PAD is a constexpr; head counts 1..128 per rank are built


def build_calls(dtype: torch.dtype, sms: int):
    """The forward for each head size of :data:`HEAD_DIMS` with a configuration for ``dtype``, every padded GQA group
    ``_supports_heads`` accepts, in its three forms — varlen prefill (contiguous K/V, with ``KV_TMA`` where the config
    has it and without, as :func:`kv_tma_ok` may drop it), chunked prefill and decode over a paged cache — and
    ``kv_cache_write`` for 1..:data:`KV_HEADS_MAX` KV heads and page sizes of every class (1, < 16, 16k)."""
    m = dict(dtype=dtype, device="meta")
    i32 = dict(dtype=torch.int32, device="meta")
    for d in HEAD_DIMS:
        yield from _kv_write_calls(dtype, d)
        if (dtype, max(16, next_pow2(d))) not in CONFIGS:
            continue
        block_m = min(c[0] for c in CONFIGS[(dtype, max(16, next_pow2(d)))].values())
        for g in (1 << i for i in range(block_m.bit_length()) if 1 << i <= block_m):
            hkv = 2
            q = torch.empty((64, g * hkv, d), **m)
            kv = torch.empty((64, hkv, d), **m)
            cu = torch.empty((3,), **i32)
            cfg = config(dtype, d, "prefill")
            for kv_tma in sorted({cfg["KV_TMA"], False}):
                ks = (kv.stride(0), kv.stride(0), kv.stride(1), kv.stride(2))
                yield _launch, (q, kv, kv, cu, 1, 0, ks, ks, cu, 2, None, None, True, 0.125, "prefill",
                                dict(cfg, KV_TMA=kv_tma))
            cache = torch.empty((8, 16, hkv, d), **m)
            table = torch.empty((2, 4), **i32)
            for form in ("prefill", "decode"):
                yield _paged, (q, cache, cache, table, cu, 2, cu[:2], 0.125, form)


def _kv_write_calls(dtype: torch.dtype, d: int):
    k_i64 = torch.empty((8,), dtype=torch.int64, device="meta")
    for h in range(1, KV_HEADS_MAX + 1):
        if next_pow2(h) * next_pow2(d) > 1 << 16:
            continue
        k = torch.empty((8, h, d), dtype=dtype, device="meta")
        for page in (1, 2, 16):
            cache = torch.empty((4, page, h, d), dtype=dtype, device="meta")
            yield kv_cache_write, (k, k, cache, cache, k_i64)


# -- supports: (ok, reason); anything else falls back to the reference --------------------------
def _supports_heads(q: torch.Tensor, k: torch.Tensor) -> tuple[bool, str]:
    d = q.shape[-1]
    d_pad = max(16, next_pow2(d))
    if (q.dtype, d_pad) not in CONFIGS:
        return False, f"no rlk.triton attention configuration for dtype {q.dtype} and head size {d}"
    if k.dtype != q.dtype:
        return False, f"K/V dtype {k.dtype} != q dtype {q.dtype}"
    g_pad = next_pow2(q.shape[-2] // k.shape[-2])
    block_m = min(c[0] for c in CONFIGS[(q.dtype, d_pad)].values())
    if g_pad > block_m:
        return False, f"GQA group size {q.shape[-2] // k.shape[-2]} exceeds BLOCK_M={block_m}"
    return True, ""


def supports_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, q_positions):
    return _supports_heads(q, k)


def _supports_paged(q: torch.Tensor, k_cache: torch.Tensor) -> tuple[bool, str]:
    page = k_cache.shape[1]
    if page & (page - 1):
        return False, f"page size {page} is not a power of two (the kernel splits positions with shifts)"
    return _supports_heads(q, k_cache)


def supports_paged_prefill(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, scale):
    return _supports_paged(q, k_cache)


def supports_decode(q, k_cache, v_cache, block_table, seq_lens, scale):
    return _supports_paged(q, k_cache)


def supports_kv_cache_write(k, v, k_cache, v_cache, slot_mapping):
    if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
        return False, f"K/V dtype {k.dtype} != cache dtype {k_cache.dtype}"
    if next_pow2(k.shape[1]) * next_pow2(k.shape[2]) > 1 << 16:
        return False, f"Hkv * head size = {k.shape[1] * k.shape[2]} too large for one program"
    return True, ""


__all__ = ["CONFIGS", "attention_decode", "attention_paged_prefill", "attention_varlen", "config",
           "kv_cache_write", "supports_decode", "supports_kv_cache_write", "supports_paged_prefill",
           "supports_varlen"]

