"""The attention ops on ``rlk.cuda``: ``rlk.triton``'s kernels (:mod:`rlk_core.ops.attention.triton`,
:mod:`~rlk_core.ops.attention.triton_backward`) from their AOT cubins, launched by ``rlk_core._C`` with the
launchers' own configs, grids and arguments (each written below as the Triton launcher writes its launch).

Every launch is resolved against the manifest as Triton's JIT would specialise it
(:func:`rlk_core.ops._cuda_common.resolve`): only that binary is served; any other launch (a layout, head size or
GQA group not built) is declined by ``supports`` and runs on ``rlk.triton`` (``same_bits_as``: not a fallback).

Host time: the forward ops and ``kv_cache_write`` keep one decision per call signature (shapes, strides, dtypes,
device, the pointers' low 4 bits, the scalars): ``supports`` is one dict lookup and the launch one ``_C.run``
(output allocation and argument packing in C++); the registry's ``fn(*args)`` right after ``supports(*args)`` takes
the decision ``supports`` found by the arguments' identity (decode, chunked prefill, kv_cache_write). Traced calls
are told by their first tensors (the op's checks put every tensor on one device: fake or meta alike).
``attention_decode``'s ``cu_seqlens_q`` (the ``arange(B + 1)`` rlk.triton builds per call) is a prefix of one
cached ``arange`` per device, made outside CUDA-graph capture and never freed (a captured graph may read it); under
capture without it a call builds its own, as rlk.triton does. The backward (training; milliseconds of device time)
decides its four launches once per call signature and runs them as one program.
"""

from __future__ import annotations

from typing import Any

import torch

from rlk_core.aot.specs import TRITON_TYPE
from rlk_core.ops import _cuda_calls as cl
from rlk_core.ops import _cuda_common as cc
from rlk_core.ops._triton_common import next_pow2
from rlk_core.ops.attention import triton as tr
from rlk_core.ops.attention import triton_backward as tb

FWD = tr._attention_fwd_kernel
KV_WRITE = tr._kv_cache_write_kernel
_RECORDS = cc.records()
_OFFSETS: dict[torch.device, torch.Tensor] = {}  # device -> arange(n) int32, n >= every decode batch seen
_KEEP: list[torch.Tensor] = []  # every offsets tensor ever made (a captured graph may still read one)
# The last supports() call of each hot op: its arguments and decision. The registry asks supports(*args) and then
# runs fn(*args) with the same objects, so the launch takes that decision by the arguments' identity instead of
# computing the call signature again (any other object: computed).
_LAST = cc.records()  # "decode" / "prefill" / "kv": (*arguments, decision); emptied with the decisions
_NONE = (None,) * 8


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _tsig(t: torch.Tensor) -> tuple:
    return t.shape, t.stride(), t.dtype, t.data_ptr() & 15


def _meta(shape: Any, dtype: torch.dtype) -> torch.Tensor:
    """A buffer the launch allocates, before it exists (:func:`~rlk_core.ops._cuda_common.address_low_bits`)."""
    return torch.empty(shape, dtype=dtype, device="meta")


# -- forward: the kernel arguments of triton._launch ------------------------------------------------------
def _forward(q, k, v, out, table, stride_tb, page_size, k_strides, v_strides, cu_q, b, lens, q_positions, causal,
             scale, form) -> tuple[dict[str, Any], tuple[int, int, int], dict[str, Any]]:
    """``triton._launch``'s launch of ``_attention_fwd_kernel`` for ``b`` sequences (``cu_q`` may be longer than
    ``b + 1``; ``q_positions`` already int32): its arguments by name, grid and options, ``out`` the output."""
    t, hq, d = q.shape
    hkv = k.shape[-2]
    g = hq // hkv
    cfg = dict(tr.config(q.dtype, d, form))
    kv_tma = bool(cfg.pop("KV_TMA", False)) and page_size == 0 and tr.kv_tma_ok(k, v, d, cfg["D_PAD"])
    warps, stages = cfg.pop("num_warps"), cfg.pop("num_stages")
    g_pad = next_pow2(g)
    tok = cfg["BLOCK_M"] // g_pad
    qpos = q_positions if q_positions is not None else cu_q  # not read without positions
    args = cl.positional(
        FWD, q, k, v, out, cl.Desc(k) if kv_tma else None, cl.Desc(v) if kv_tma else None, table, cu_q, lens, qpos,
        b, g, hkv, (page_size.bit_length() - 1) if page_size else tr._VARLEN_SHIFT, stride_tb,
        q.stride(0), q.stride(1), q.stride(2), *k_strides, *v_strides, out.stride(0), out.stride(1), out.stride(2),
        tr.qk_scale_f32(scale), int(q_positions is not None), int(bool(causal)),
        G_PAD=g_pad, PAGED=page_size != 0, KV_TMA=kv_tma, **cfg,
    )
    return args, ((_cdiv(t, tok) + b) * hkv, 1, 1), {"num_warps": warps, "num_stages": stages,
                                                       "enable_fp_fusion": False}


def _varlen(q, k, v, cu_q, cu_k, scale, causal, q_positions, out, meta=False):
    ks = (k.stride(0), k.stride(0), k.stride(1), k.stride(2))
    vs = (v.stride(0), v.stride(0), v.stride(1), v.stride(2))
    qp = q_positions if causal else None
    if qp is not None and qp.dtype != torch.int32:  # triton._launch: q_positions.to(torch.int32)
        qp = _meta(qp.shape, torch.int32) if meta else qp.to(torch.int32)
    return _forward(q, k, v, out, cu_k, 1, 0, ks, vs, cu_q, cu_q.shape[0] - 1, None, qp, causal, scale, "prefill")


def _paged(q, k_cache, v_cache, block_table, cu_q, b, seq_lens, scale, form, out):
    return _forward(q, k_cache, v_cache, out, block_table, block_table.stride(0), k_cache.shape[1],
                    tuple(k_cache.stride()), tuple(v_cache.stride()), cu_q, b, seq_lens, None, True, scale, form)


def _decide(key: tuple, inputs: tuple, said: tuple[bool, str], build, empty: bool) -> tuple:
    """One forward call signature's decision: rlk.triton's own ``supports`` answer ``said``, then the variant
    the JIT would run (else declined, with the reason) and, where the output is a fresh contiguous tensor and
    every argument an input, the :class:`~rlk_core.ops._cuda_common.Launch` record."""
    launch = None
    q = inputs[0]
    if said[0] and q.dtype not in TRITON_TYPE:
        said = (False, f"no AOT variant for dtype {q.dtype}")
    if said[0] and not empty:
        out = torch.empty_like(q, device="meta")  # triton._launch's torch.empty_like(q)
        args, grid, options = build(out)
        r = cl.resolve(q.get_device(), FWD, TRITON_TYPE[q.dtype], args, options)
        if isinstance(r, str):
            said = (False, r)
        elif out.is_contiguous():
            launch = cl.launch_of(cc.handle(q.get_device(), r[0]), grid, r[1], inputs, out, tuple(q.shape))
    return cc.remember(_RECORDS, key, (said, launch))


def _general(q: torch.Tensor, build, empty: bool) -> torch.Tensor:
    out = torch.empty_like(q)
    if empty:
        return out
    args, grid, options = build(out)
    r = cl.resolve(q.get_device(), FWD, TRITON_TYPE[q.dtype], args, options)
    if isinstance(r, str):
        raise RuntimeError(f"rlk.cuda attention called on a launch it declines: {r}")
    cl.launch_resolved(q.get_device(), r, grid)
    return out


# -- attention_varlen ---------------------------------------------------------------------------------
def _varlen_key(q, k, v, cu_q, cu_k, scale, causal, q_positions) -> tuple:
    return ("varlen", q.get_device(), *_tsig(q), *_tsig(k), *_tsig(v), *_tsig(cu_q), *_tsig(cu_k), scale,
            bool(causal), None if q_positions is None else _tsig(q_positions))


def _varlen_decision(q, k, v, cu_q, cu_k, scale, causal, q_positions) -> tuple:
    key = _varlen_key(q, k, v, cu_q, cu_k, scale, causal, q_positions)
    hit = _RECORDS.get(key)
    if hit is not None:
        return hit
    inputs = (q, k, v, cu_q, cu_k, q_positions)
    return _decide(key, inputs, tr.supports_varlen(q, k, v, cu_q, cu_k, scale, causal, q_positions),
                   lambda out: _varlen(q, k, v, cu_q, cu_k, scale, causal, q_positions, out, meta=True),
                   q.shape[0] == 0 or cu_q.shape[0] == 1)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, q_positions):
    launch = _varlen_decision(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, q_positions)[1]
    if launch is not None:
        out = cc.run(launch, q, k, v, cu_seqlens_q, cu_seqlens_k, q_positions)
        if out is not None:
            return out
    return _general(q, lambda out: _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, q_positions, out),
                    q.shape[0] == 0 or cu_seqlens_q.shape[0] == 1)


def supports_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, q_positions):
    if cc.without_storage(q, k, v, cu_seqlens_q, cu_seqlens_k, q_positions):
        return cc.NO_STORAGE
    return _varlen_decision(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, q_positions)[0]


# -- attention_paged_prefill ------------------------------------------------------------------------------
def _paged_key(op, q, k_cache, v_cache, block_table, seq_lens, scale) -> tuple:
    return (op, q.get_device(), q.shape, q.stride(), q.dtype, q.data_ptr() & 15, k_cache.shape, k_cache.stride(),
            k_cache.dtype, k_cache.data_ptr() & 15, v_cache.stride(), v_cache.dtype, v_cache.data_ptr() & 15,
            block_table.shape, block_table.stride(), block_table.dtype, block_table.data_ptr() & 15,
            seq_lens.shape, seq_lens.dtype, seq_lens.data_ptr() & 15, scale)


def _prefill_decision(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, scale) -> tuple:
    key = (*_paged_key("prefill", q, k_cache, v_cache, block_table, seq_lens, scale), *_tsig(cu_seqlens_q))
    hit = _RECORDS.get(key)
    if hit is not None:
        return hit
    b = cu_seqlens_q.shape[0] - 1
    inputs = (q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens)
    return _decide(key, inputs,
                   tr.supports_paged_prefill(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, scale),
                   lambda out: _paged(q, k_cache, v_cache, block_table, cu_seqlens_q, b, seq_lens, scale, "prefill",
                                      out), q.shape[0] == 0 or b == 0)


def attention_paged_prefill(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, scale):
    last = _LAST.get("prefill", _NONE)
    if (last[0] is q and last[1] is k_cache and last[2] is v_cache and last[3] is block_table
            and last[4] is cu_seqlens_q and last[5] is seq_lens and last[6] == scale):
        launch = last[7][1]
    else:
        launch = _prefill_decision(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, scale)[1]
    if launch is not None:
        out = cc.run(launch, q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens)
        if out is not None:
            return out
    b = cu_seqlens_q.shape[0] - 1
    return _general(q, lambda out: _paged(q, k_cache, v_cache, block_table, cu_seqlens_q, b, seq_lens, scale,
                                          "prefill", out), q.shape[0] == 0 or b == 0)


def supports_paged_prefill(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, scale):
    if cc.without_storage(q, k_cache):
        return cc.NO_STORAGE
    decision = _prefill_decision(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, scale)
    _LAST["prefill"] = (q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, scale, decision)
    return decision[0]


# -- attention_decode ---------------------------------------------------------------------------------
def decode_offsets(device: torch.device, n: int) -> torch.Tensor | None:
    """``arange(m)`` int32 on ``device`` with ``m >= n`` (decode's ``cu_seqlens_q``, read up to ``B + 1``): one
    cached tensor per device, grown outside CUDA-graph capture (None under capture) and synchronised with its
    stream once, so that any stream may read it; never freed."""
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
    cc.keep_stable(cu)  # a fast-path decode call may hold it: the offsets are never written again
    return cu


def _decode_decision(q, k_cache, v_cache, block_table, seq_lens, scale) -> tuple:
    key = _paged_key("decode", q, k_cache, v_cache, block_table, seq_lens, scale)
    hit = _RECORDS.get(key)
    if hit is not None:
        return hit
    b = q.shape[0]
    cu = decode_offsets(q.device, b + 1)
    if cu is None:  # under capture, before any offsets exist: the record takes them as its sixth input
        cu = _meta((b + 1,), torch.int32)
    inputs = (q, k_cache, v_cache, block_table, seq_lens, cu)
    return _decide(key, inputs, tr.supports_decode(q, k_cache, v_cache, block_table, seq_lens, scale),
                   lambda out: _paged(q, k_cache, v_cache, block_table, cu, b, seq_lens, scale, "decode", out), b == 0)


def attention_decode(q, k_cache, v_cache, block_table, seq_lens, scale):
    last = _LAST.get("decode", _NONE)
    if (last[0] is q and last[1] is k_cache and last[2] is v_cache and last[3] is block_table and last[4] is seq_lens
            and last[5] == scale):
        launch = last[6][1]
    else:
        launch = _decode_decision(q, k_cache, v_cache, block_table, seq_lens, scale)[1]
    b = q.shape[0]
    cu = _OFFSETS.get(q.device)
    if cu is None or cu.shape[0] <= b:
        cu = decode_offsets(q.device, b + 1)
    if launch is not None and cu is not None:
        out = cc.run(launch, q, k_cache, v_cache, block_table, seq_lens, cu)
        if out is not None:
            return out
    if cu is None:  # under capture without cached offsets: rlk.triton's own per-call arange
        cu = torch.arange(b + 1, dtype=torch.int32, device=q.device)
    return _general(q, lambda out: _paged(q, k_cache, v_cache, block_table, cu, b, seq_lens, scale, "decode", out),
                    b == 0)


def supports_decode(q, k_cache, v_cache, block_table, seq_lens, scale):
    if cc.without_storage(q, k_cache):
        return cc.NO_STORAGE
    decision = _decode_decision(q, k_cache, v_cache, block_table, seq_lens, scale)
    _LAST["decode"] = (q, k_cache, v_cache, block_table, seq_lens, scale, decision)
    return decision[0]


# -- kv_cache_write -------------------------------------------------------------------------------------
def _kv_write(k, v, k_cache, v_cache, slot_mapping):
    """``triton.kv_cache_write``'s launch: arguments by name, grid, options (Triton's defaults)."""
    t, h, d = k.shape
    args = cl.positional(KV_WRITE, k, v, k_cache, v_cache, slot_mapping, t, h, k_cache.shape[1], *k.stride(),
                         *v.stride(), *k_cache.stride(), *v_cache.stride(), HEAD_D=d, D_PAD=next_pow2(d),
                         H_PAD=next_pow2(h))
    return args, (t, 1, 1), {}


def _kv_decision(k, v, k_cache, v_cache, slot_mapping) -> tuple:
    key = ("kv_cache_write", k.get_device(), *_tsig(k), *_tsig(v), *_tsig(k_cache), *_tsig(v_cache),
           *_tsig(slot_mapping))
    hit = _RECORDS.get(key)
    if hit is not None:
        return hit
    said = tr.supports_kv_cache_write(k, v, k_cache, v_cache, slot_mapping)
    launch = None
    if said[0] and k.dtype not in TRITON_TYPE:
        said = (False, f"no AOT variant for dtype {k.dtype}")
    if said[0] and k.shape[0]:
        args, grid, options = _kv_write(k, v, k_cache, v_cache, slot_mapping)
        r = cl.resolve(k.get_device(), KV_WRITE, TRITON_TYPE[k.dtype], args, options)
        if isinstance(r, str):
            said = (False, r)
        else:
            launch = cl.launch_of(cc.handle(k.get_device(), r[0]), grid, r[1], (k, v, k_cache, v_cache, slot_mapping))
    return cc.remember(_RECORDS, key, (said, launch))


def kv_cache_write(k, v, k_cache, v_cache, slot_mapping):
    last = _LAST.get("kv", _NONE)
    if last[0] is k and last[1] is v and last[2] is k_cache and last[3] is v_cache and last[4] is slot_mapping:
        launch = last[5][1]
    else:
        launch = _kv_decision(k, v, k_cache, v_cache, slot_mapping)[1]
    if launch is not None:
        return cc.run(launch, k, v, k_cache, v_cache, slot_mapping)  # None: the kernel writes into the caches
    if k.shape[0] == 0:
        return None
    args, grid, options = _kv_write(k, v, k_cache, v_cache, slot_mapping)
    r = cl.resolve(k.get_device(), KV_WRITE, TRITON_TYPE[k.dtype], args, options)
    if isinstance(r, str):
        raise RuntimeError(f"rlk.cuda kv_cache_write called on a launch it declines: {r}")
    cl.launch_resolved(k.get_device(), r, grid)
    return None


def supports_kv_cache_write(k, v, k_cache, v_cache, slot_mapping):
    if cc.without_storage(k, k_cache):
        return cc.NO_STORAGE
    decision = _kv_decision(k, v, k_cache, v_cache, slot_mapping)
    _LAST["kv"] = (k, v, k_cache, v_cache, slot_mapping, decision)
    return decision[0]


# -- attention_varlen_backward ----------------------------------------------------------------------------
def _backward(calls: cl.Calls, grad_out, q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, q_positions):
    """``triton_backward.attention_varlen_backward``'s launches on ``calls``; returns ``(dq, dk, dv)``."""
    t, hq, d = q.shape
    tk, hkv = k.shape[0], k.shape[1]
    q, k, v = (calls.contiguous(x) for x in (q, k, v))
    do = calls.contiguous(grad_out, q.dtype)
    dq, dk, dv = calls.new(q.shape, q.dtype), calls.new(k.shape, k.dtype), calls.new(v.shape, v.dtype)
    nb = cu_seqlens_q.shape[0] - 1
    if tk == 0 or hq == 0 or d == 0 or nb == 0:
        if not calls.meta:
            dq.zero_(), dk.zero_(), dv.zero_()
        return dq, dk, dv
    cu_q, cu_k = calls.contiguous(cu_seqlens_q), calls.contiguous(cu_seqlens_k)  # int32 on the device (checked)
    if not causal:
        mode, pos = tb.MODE_FULL, cu_q
    elif q_positions is not None:
        mode, pos = tb.MODE_POSITIONS, calls.contiguous(q_positions)
    else:
        mode, pos = tb.MODE_ALIGNED, cu_q
    c = tb.config(q.dtype, d)
    bm_s, bm_q, bn_kv = c["stats"]["BLOCK_M"], c["dq"]["BLOCK_M"], c["dkdv"]["BLOCK_N"]
    qk_scale2 = tr.qk_scale_f32(scale)
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), do.stride(0), do.stride(1))
    common = dict(G=hq // hkv, MODE=mode, IEEE=q.dtype == torch.float32)
    name = f"{TRITON_TYPE[q.dtype]},pos={cl.POINTER_TYPES[cl.type_name(pos.dtype)][1:]}"

    def cfg_of(part):
        cfg = dict(c[part])
        options = {"num_warps": cfg.pop("num_warps"), "num_stages": cfg.pop("num_stages")}
        if "KV_TMA" in cfg:  # triton_backward._with_descriptors
            cfg["KV_TMA"] = bool(cfg["KV_TMA"]) and tr.kv_tma_ok(k, v, d, cfg["BLOCK_D"])
        return cfg, options, (cl.Desc(k), cl.Desc(v)) if cfg.get("KV_TMA") else (None, None)

    stats = calls.new((2, hq, max(t, 1)), torch.float32)  # one allocation: lse, delta
    lse, delta = cl.Slice(stats, stats[0]), cl.Slice(stats, stats[1])
    if t:
        cfg, options, descs = cfg_of("stats")
        calls.launch(tb._attn_bwd_stats_kernel, ((_cdiv(t, bm_s) + nb) * hq,), cl.positional(
            tb._attn_bwd_stats_kernel, q, k, v, do, pos, cu_q, cu_k, *descs, lse, delta, t, tk, nb, hq, d, qk_scale2,
            *strides, **common, **cfg), options, name)
        cfg, options, descs = cfg_of("dq")
        calls.launch(tb._attn_bwd_dq_kernel, ((_cdiv(t, bm_q) + nb) * hq,), cl.positional(
            tb._attn_bwd_dq_kernel, q, k, v, do, pos, cu_q, cu_k, *descs, lse, delta, dq, t, tk, nb, hq, d, qk_scale2,
            scale, *strides, dq.stride(0), dq.stride(1), **common, **cfg), options, name)
    cfg, options, _ = cfg_of("dkdv")
    split = bool(cfg.pop("SPLIT_G", False)) and hq > hkv
    if split:  # fp32 per-query-head sums, then the fixed-order group sum
        parts = calls.new((2, tk, hq, d), torch.float32)
        dk_out, dv_out = cl.Slice(parts, parts[0]), cl.Slice(parts, parts[1])
        out_strides = (parts.stride(1), parts.stride(2))
    else:
        dk_out, dv_out, out_strides = dk, dv, (dk.stride(0), dk.stride(1))
    nh_kv = hq if split else hkv
    calls.launch(tb._attn_bwd_dkdv_kernel, ((_cdiv(tk, bn_kv) + nb) * nh_kv,), cl.positional(
        tb._attn_bwd_dkdv_kernel, q, k, v, do, pos, cu_q, cu_k, lse, delta, dk_out, dv_out, t, tk, nb, nh_kv, d,
        qk_scale2, scale, *strides, *out_strides, **common, SPLIT_G=split, **cfg), options, name)
    if split:
        calls.launch(tb._attn_bwd_group_sum_kernel, (_cdiv(tk, tb._SUM_BLOCK_T), hkv), cl.positional(
            tb._attn_bwd_group_sum_kernel, dk_out, dv_out, dk, dv, tk, d, scale, *out_strides, dk.stride(0),
            dk.stride(1), G=hq // hkv, BLOCK_T=tb._SUM_BLOCK_T, BLOCK_D=cfg["BLOCK_D"]), {}, TRITON_TYPE[q.dtype])
    return dq, dk, dv


_BACKWARD = cl.Served("attention_varlen_backward", _backward, tb.supports_backward, lambda *a: (*a[:6], a[8]),
                      lambda *a: (a[6], bool(a[7])))
attention_varlen_backward, supports_backward = _BACKWARD.run, _BACKWARD.supports
