"""The arithmetic of contract ``rlk.attention.v1``: one query row against the K/V of its own sequence.

Every attention form (varlen prefill, chunked prefill over a paged cache, paged decode) gathers the
K/V of a query's sequence (exact data movement) and calls :func:`attend` — so prefill, chunked prefill
and decode run the *same* per-row arithmetic by construction. Per query row with causal limit ``t``
(the last key position it may see), per head ``h`` (KV head ``h // (Hq // Hkv)``):

1. KV positions are cut into blocks of ``KV_BLOCK = 64`` anchored at position 0; blocks
   ``0 .. t // 64`` are processed in increasing order; later blocks are skipped (state unchanged).
2. ``s = tree_sum_D(f32(q) * f32(k)) * f32(scale)`` — products exact for bf16/fp16 inputs, the
   D reduction in the fixed pairwise-halves tree of :func:`rlk_core.ops._fixed.tree_sum`.
   Positions ``> t`` get ``s = -inf`` (selected, never computed from the key: garbage/NaN in unused
   cache slots cannot leak).
3. Online softmax in fp32, state ``m = -inf, l = 0, acc = 0`` before block 0; per block:
   ``m_new = max(m, tree_max(s))``; ``alpha = exp(m - m_new)``; ``p = exp(s - m_new)``, exactly ``0``
   at masked positions; ``l = l * alpha + tree_sum(p)``;
   ``acc = acc * alpha + tree_sum_block(f32(round_to(v.dtype)(p)) * f32(v))`` with masked positions
   contributing exactly ``+0``. ``p`` is rounded to ``v.dtype`` before the product (what a flash kernel
   does before its P·V MMA; the identity for fp32); ``l`` sums the unrounded fp32 ``p``.
   Block 0 always holds position 0, so ``m`` is finite after it.
4. ``out = round_to(q.dtype)(acc / l)`` — one fp32 division, one rounding.

``exp`` is :func:`exp_f32`: a fixed float64 polynomial built from elementwise add/multiply only, rounded
once to fp32 — the same bits for an element wherever it sits in a tensor (SIMD body or tail) and on any
device. The argument (``s - m_new``, ``m - m_new``) is formed in fp32 first.

Vectorising rows (queries, heads) over the same blocks is bitwise safe: a row's arithmetic never
reads another row, and a block beyond a row's limit leaves that row's state untouched.
"""

from __future__ import annotations

import torch

from rlk_core.ops._fixed import tree_sum

KV_BLOCK = 64
# Elements of the largest per-block product tensor ([rows, Hq, KV_BLOCK, D]); chunking rows changes
# no row's arithmetic.
_CHUNK_ELEMENTS = 1 << 22

# Cody-Waite split of ln 2 (fdlibm): k * _LN2_HI is exact for |k| < 2^11.
_LN2_HI = 6.93147180369123816490e-01
_LN2_LO = 1.90821492927058770002e-10
_INV_LN2 = 1.44269504088896338700e00
_EXP_COEF = [1.0 / float(__import__("math").factorial(j)) for j in range(11)]


def exp_f32(x: torch.Tensor) -> torch.Tensor:
    """``exp`` of an fp32 tensor, from elementwise float64 add/multiply only, rounded once to fp32.

    ``k = round(x / ln2)``, ``r = (x - k*ln2_hi) - k*ln2_lo`` (``|r| <= 0.35``), a degree-10 Taylor
    polynomial in Horner form (relative error < 3e-13), times ``2^k`` built exactly from the exponent
    bits. ``-inf`` gives ``+0`` (the argument is clamped to ``[-200, 100]``; fp32 underflows to 0 below about -103.3).
    """
    xd = x.double().clamp(-200.0, 100.0)
    k = torch.round(xd * _INV_LN2)
    r = (xd - k * _LN2_HI) - k * _LN2_LO
    poly = torch.full_like(r, _EXP_COEF[-1])
    for c in reversed(_EXP_COEF[:-1]):
        poly = poly * r + c
    ki = torch.nan_to_num(k, nan=0.0).to(torch.int64)
    two_k = torch.bitwise_left_shift(ki + 1023, 52).view(torch.float64)
    return (poly * two_k).float()


def tree_max(x: torch.Tensor) -> torch.Tensor:
    """Max over the last dimension in the fixed pairwise-halves order (padding with ``-inf``)."""
    n = x.shape[-1]
    p = 1 << (n - 1).bit_length()
    if p != n:
        x = torch.nn.functional.pad(x, (0, p - n), value=float("-inf"))
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = torch.maximum(x[..., :h], x[..., h:])
    return x[..., 0]


def _padded(t: torch.Tensor, length: int) -> torch.Tensor:
    """``t`` [nk, L, H, D] cut or zero-padded along L to ``length``, upcast to fp32 (exact)."""
    t = t[:, :length].float()
    if t.shape[1] < length:
        t = torch.nn.functional.pad(t, (0, 0, 0, 0, 0, length - t.shape[1]))
    return t


def _rows_per_chunk(hq: int, d: int) -> int:
    return max(1, _CHUNK_ELEMENTS // (hq * max(d, 1) * KV_BLOCK))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, limit: torch.Tensor, scale: float) -> torch.Tensor:
    """Rows of queries against their K/V; returns ``[n, Hq, D]`` in ``q.dtype``.

    q: ``[n, Hq, D]``; k, v: ``[nk, L, Hkv, D]`` with ``nk`` 1 (all rows share one sequence's K/V)
    or ``n`` (row ``i`` uses ``k[i]``); limit: ``[n]`` int64, the last key position row ``i`` sees
    (``0 <= limit < L``). Keys at positions ``> limit`` are never read into the result.
    """
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    n = q.shape[0]
    if n == 0:
        return out
    rows = _rows_per_chunk(q.shape[1], q.shape[2])
    for i in range(0, n, rows):
        sl = slice(i, i + rows)
        ks, vs = (k, v) if k.shape[0] == 1 else (k[sl], v[sl])
        o, _, _ = attend_rows(q[sl], ks, vs, limit[sl], scale)
        out[sl] = o.to(q.dtype)
    return out


def attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, limit: torch.Tensor, scale: float
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk of rows: ``(acc / l`` in fp32 ``[n, Hq, D]``, ``m`` and ``l`` ``[n, Hkv, G]``)."""
    n, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    nblocks = int(limit.max()) // KV_BLOCK + 1
    length = nblocks * KV_BLOCK
    kf = _padded(k, length).permute(0, 2, 1, 3)  # [nk, Hkv, Lpad, D]
    vf = _padded(v, length).permute(0, 2, 3, 1)  # [nk, Hkv, D, Lpad]
    qf = q.float().reshape(n, hkv, g, d)
    scale_t = torch.tensor(scale, dtype=torch.float32, device=q.device)
    limit = limit.to(device=q.device, dtype=torch.int64)
    m = torch.full((n, hkv, g), float("-inf"), dtype=torch.float32, device=q.device)
    l = torch.zeros((n, hkv, g), dtype=torch.float32, device=q.device)
    acc = torch.zeros((n, hkv, g, d), dtype=torch.float32, device=q.device)
    base = torch.arange(KV_BLOCK, device=q.device)
    for j in range(nblocks):
        lo, hi = j * KV_BLOCK, (j + 1) * KV_BLOCK
        s = tree_sum(qf[:, :, :, None, :] * kf[:, :, None, lo:hi, :]) * scale_t
        valid = ((base + lo)[None, :] <= limit[:, None])[:, None, None, :]  # [n, 1, 1, 64]
        s = torch.where(valid, s, float("-inf"))
        m_new = torch.maximum(m, tree_max(s))
        alpha = exp_f32(m - m_new)
        p = torch.where(valid, exp_f32(s - m_new[..., None]), 0.0)
        l_new = l * alpha + tree_sum(p)
        pr = p.to(v.dtype).float()
        pv = pr[:, :, :, None, :] * vf[:, :, None, :, lo:hi]  # [n, Hkv, G, D, 64]
        pv = torch.where(valid[:, :, :, None, :], pv, 0.0)
        acc_new = acc * alpha[..., None] + tree_sum(pv)
        active = (limit >= lo)[:, None, None]
        m = torch.where(active, m_new, m)
        l = torch.where(active, l_new, l)
        acc = torch.where(active[..., None], acc_new, acc)
    return (acc / l[..., None]).reshape(n, hq, d), m, l


def attend_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, limit: torch.Tensor,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients for one sequence, fp32: ``dq [n, Hq, D]``, ``dk, dv [L, Hkv, D]``.

    q, do: ``[n, Hq, D]``; k, v: ``[L, Hkv, D]`` (this sequence's keys); limit: ``[n]``. The forward
    statistics ``m, l`` and the output ``O`` (rounded to ``q.dtype``, as saved by a forward) are
    recomputed with :func:`attend_rows`. Then, per KV block in increasing order, in fp32:
    ``P = exp(s - m) / l`` (0 where masked), ``dP = tree_sum_D(dO * v)``, ``Delta = tree_sum_D(dO * O)``,
    ``dS = P * (dP - Delta)``; ``dq += tree_sum_block(dS * k)`` (``* scale`` at the end);
    ``dk = tree_sum_{queries, group heads}(dS * q) * scale``; ``dv = tree_sum_{queries, group heads}(P * dO)``.
    Every reduction is a fixed tree: deterministic run to run, no atomics.
    """
    n, hq, d = q.shape
    length, hkv = k.shape[0], k.shape[1]
    g = hq // hkv
    dq = torch.zeros((n, hq, d), dtype=torch.float32, device=q.device)
    dk = torch.zeros((length, hkv, d), dtype=torch.float32, device=q.device)
    dv = torch.zeros((length, hkv, d), dtype=torch.float32, device=q.device)
    if n == 0 or length == 0:
        return dq, dk, dv
    o, m, l = attend_rows(q, k[None], v[None], limit, scale)
    of = o.to(q.dtype).float().reshape(n, hkv, g, d)
    dof = do.float().reshape(n, hkv, g, d)
    qf = q.float().reshape(n, hkv, g, d)
    delta = tree_sum(dof * of)
    nblocks = int(limit.max()) // KV_BLOCK + 1
    padlen = nblocks * KV_BLOCK
    kf = _padded(k[None], padlen)[0].permute(1, 0, 2)  # [Hkv, Lpad, D]
    vf = _padded(v[None], padlen)[0].permute(1, 0, 2)
    scale_t = torch.tensor(scale, dtype=torch.float32, device=q.device)
    limit = limit.to(device=q.device, dtype=torch.int64)
    base = torch.arange(KV_BLOCK, device=q.device)
    dq_acc = torch.zeros((n, hkv, g, d), dtype=torch.float32, device=q.device)
    dk_pad = torch.zeros((padlen, hkv, d), dtype=torch.float32, device=q.device)
    dv_pad = torch.zeros((padlen, hkv, d), dtype=torch.float32, device=q.device)
    for j in range(nblocks):
        lo, hi = j * KV_BLOCK, (j + 1) * KV_BLOCK
        kj, vj = kf[:, lo:hi], vf[:, lo:hi]  # [Hkv, 64, D]
        s = tree_sum(qf[:, :, :, None, :] * kj[None, :, None]) * scale_t
        valid = ((base + lo)[None, :] <= limit[:, None])[:, None, None, :]
        s = torch.where(valid, s, float("-inf"))
        p = torch.where(valid, exp_f32(s - m[..., None]) / l[..., None], 0.0)
        dp = tree_sum(dof[:, :, :, None, :] * vj[None, :, None])
        ds = torch.where(valid, p * (dp - delta[..., None]), 0.0)
        dq_acc = dq_acc + tree_sum(ds[:, :, :, None, :] * kj.transpose(1, 2)[None, :, None])
        dk_j = tree_sum((ds[..., None] * qf[:, :, :, None, :]).permute(1, 3, 4, 0, 2).reshape(hkv, KV_BLOCK, d, n * g))
        dv_j = tree_sum((p[..., None] * dof[:, :, :, None, :]).permute(1, 3, 4, 0, 2).reshape(hkv, KV_BLOCK, d, n * g))
        dk_pad[lo:hi] = (dk_j * scale_t).transpose(0, 1)
        dv_pad[lo:hi] = dv_j.transpose(0, 1)
    dq = (dq_acc * scale_t).reshape(n, hq, d)
    keep = min(length, padlen)
    dk[:keep] = dk_pad[:keep]
    dv[:keep] = dv_pad[:keep]
    return dq, dk, dv
