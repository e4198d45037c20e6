"""``kept_set`` on the GPU (backend ``rlk.triton``, Triton's JIT; no AOT family yet): the top-k path in one pass over
the logits instead of a ``topk`` of 64-bit keys built over the whole ``[T, V]``.

Every row of a top-k call keeps a prefix of at most ``kmax`` tokens in the contract's order. ``z = f32(x) / T`` is
monotone in ``x`` (``T > 0``), so ``tau = z`` of the ``kmax``-th largest raw logit is the ``kmax``-th largest ``z``
and the row's first ``kmax`` tokens are every token with ``z > tau`` (fewer than ``kmax``) and the lowest ids with
``z == tau``. ``_candidates_kernel`` (one program per row, the row's columns in order) writes both: the ``z > tau``
tokens (value, id) and the first ``kmax`` ids with ``z == tau``, each at its rank among its kind (an exact prefix
count), and counts ``z >= z_max + log(min_p)`` for min-p. A ``topk`` of 64-bit order keys over those ``2 kmax``
candidates gives the first ``kmax`` tokens in order — the very values and ids the reference's ``topk`` over the
whole row gives — and the reference's own code finishes (top-p's fixed-order mass, the threshold). Counts, compares
and one IEEE division (``div_rn``) per element: exact, so this path gives the reference's bits by construction
(tests: the interpreter on the CPU, ``tests/gpu`` on the device). The other paths (no top-k on some row) run the
reference's torch ops on the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlk_core.ops.kept_set import reference as R

BLOCK = 2048  # columns per step of a row's program (a constant: never a function of T or V)
NUM_WARPS = 8
KM = 256  # the finish kernel's candidates per kind (kmax <= KM: the top-p scan is one block of the contract's 256)
LOW: tl.constexpr = tl.constexpr((1 << 32) - 1)
NO_KEY: tl.constexpr = tl.constexpr(-(1 << 63))  # below every candidate's key (a NaN's is above it)


@triton.jit(do_not_specialize=["V", "cap", "stride_x"])
def _candidates_kernel(x_ptr, temp_ptr, tau_ptr, minz_ptr, gv_ptr, gi_ptr, ei_ptr, count_ptr, V, cap, stride_x,
                       BLOCK: tl.constexpr):
    """Row ``program_id``: ``gv/gi[row, r]`` the value and id of its ``r``-th token (in id order) with ``z > tau``,
    ``ei[row, r]`` the ``r``-th id with ``z == tau`` (``r < cap``); ``count[row] = (#z > tau, #z == tau,
    #z >= minz)``."""
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(temp_ptr + row)
    tau = tl.load(tau_ptr + row)
    minz = tl.load(minz_ptr + row)
    n_gt = tl.sum(tl.zeros([BLOCK], dtype=tl.int32), axis=0)
    n_eq = n_gt
    n_min = n_gt
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < V
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
        z = tl.math.div_rn(x.to(tl.float32), t)
        z = tl.where(z == 0.0, 0.0, z)  # -0.0 as +0.0 (the reference's z + 0.0)
        n_min += tl.sum((ok & (z >= minz)).to(tl.int32), axis=0)
        gt = ok & (z > tau)
        rank = n_gt + tl.cumsum(gt.to(tl.int32), axis=0) - 1
        keep = gt & (rank < cap)
        tl.store(gv_ptr + row * cap + rank, z, mask=keep)
        tl.store(gi_ptr + row * cap + rank, cols.to(tl.int64), mask=keep)
        n_gt += tl.sum(gt.to(tl.int32), axis=0)
        eq = ok & (z == tau)
        rank = n_eq + tl.cumsum(eq.to(tl.int32), axis=0) - 1
        tl.store(ei_ptr + row * cap + rank, cols.to(tl.int64), mask=eq & (rank < cap))
        n_eq += tl.sum(eq.to(tl.int32), axis=0)
    tl.store(count_ptr + row * 3, n_gt)
    tl.store(count_ptr + row * 3 + 1, n_eq)
    tl.store(count_ptr + row * 3 + 2, n_min)


@triton.jit
def _halve(x, W: tl.constexpr):
    """``[W] -> [W/2]``: element ``i`` plus element ``i + W/2`` (one level of ``tree_sum``'s pairwise halves)."""
    a, b = tl.split(tl.permute(tl.reshape(x, (2, W // 2)), (1, 0)))
    return a + b


@triton.jit
def _first_half(x, W: tl.constexpr):
    """``[W] -> [W/2]``: the first ``W/2`` elements."""
    a, b = tl.split(tl.permute(tl.reshape(x, (2, W // 2)), (1, 0)))
    return a


@triton.jit(do_not_specialize=["V"])
def _finish_kernel(gv_ptr, gi_ptr, ei_ptr, eg_ptr, et_ptr, count_ptr, tau_ptr, topk_ptr, topp_ptr, scan_ptr,
                   value_ptr, id_ptr, size_ptr, V, KM: tl.constexpr):
    """Row ``program_id``'s kept set from its candidates (``kmax <= KM = 256``: one block of the top-p scan) — the
    reference's ``_finish`` + ``prefix_threshold`` with the same fp32 operations: the candidates ordered by their
    64-bit keys (a slot number in place of the id: equal values are all ``z > tau`` slots in id order or all ``tau``
    slots in id order, so slot order is id order), ``e`` (the torch ``exp`` of each candidate, given) summed by the
    pairwise-halves tree, ``target = top_p * C``, the Hillis-Steele scan through ``scan_ptr`` and the first position
    reaching the target."""
    row = tl.program_id(0).to(tl.int64)
    n_gt = tl.load(count_ptr + row * 3).to(tl.int64)
    n_eq = tl.load(count_ptr + row * 3 + 1).to(tl.int64)
    n_min = tl.load(count_ptr + row * 3 + 2).to(tl.int64)
    tau = tl.load(tau_ptr + row)
    k = tl.load(topk_ptr + row)
    top_p = tl.load(topp_ptr + row)
    slot = tl.arange(0, 2 * KM).to(tl.int64)
    in_g = slot < KM
    gslot = tl.where(in_g, slot, 0)
    eslot = tl.where(in_g, 0, slot - KM)
    valid = tl.where(in_g, slot < n_gt, eslot < n_eq)
    value = tl.where(in_g, tl.load(gv_ptr + row * KM + gslot, mask=in_g & valid, other=0.0), tau)
    bits = value.to(tl.int32, bitcast=True)
    mono = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
    key = tl.where(valid, mono * 4294967296 + (LOW - slot), NO_KEY)
    order = _first_half(tl.sort(key, descending=True), 2 * KM)  # the first KM candidates in the contract's order
    pos = tl.arange(0, KM).to(tl.int64)
    s = LOW - (order & LOW)  # their slots
    n_k = tl.where((k >= 1) & (k < V), k, V)
    n1 = tl.minimum(n_min, n_k)
    e = tl.where(s < KM, tl.load(eg_ptr + row * KM + tl.where(s < KM, s, 0)), tl.load(et_ptr + row))
    e = tl.where(pos < n1, e, 0.0)
    total = _halve(e, KM)
    total = _halve(total, KM // 2)
    total = _halve(total, KM // 4)
    total = _halve(total, KM // 8)
    total = _halve(total, KM // 16)
    total = _halve(total, KM // 32)
    total = _halve(total, KM // 64)
    total = _halve(total, KM // 128)
    target = top_p * tl.reshape(total, ())
    # the inclusive Hillis-Steele scan of e: shifts 1, 2, ..., KM/2, each x[i] + x[i - s] for i >= s
    c = e
    base = scan_ptr + row * KM
    for step in tl.static_range(8):
        tl.store(base + pos, c)
        tl.debug_barrier()
        prev = tl.load(base + pos - (1 << step), mask=pos >= (1 << step), other=0.0)
        tl.debug_barrier()
        c = tl.where(pos >= (1 << step), c + prev, c)
    j = tl.min(tl.where(c >= target, pos, KM - 1), axis=0)
    n = tl.where(top_p < 1.0, tl.minimum(j + 1, n1), n1)
    last = tl.sum(tl.where(pos == n - 1, s, 0), axis=0)
    in_last_g = last < KM
    v = tl.where(in_last_g, tl.load(gv_ptr + row * KM + tl.where(in_last_g, last, 0)), tau)
    tid = tl.where(in_last_g, tl.load(gi_ptr + row * KM + tl.where(in_last_g, last, 0)),
                   tl.load(ei_ptr + row * KM + tl.where(in_last_g, 0, last - KM)))
    whole = n >= V
    tl.store(value_ptr + row, tl.where(whole, float("-inf"), v))
    tl.store(id_ptr + row, tl.where(whole, V - 1, tid))
    tl.store(size_ptr + row, tl.where(whole, V, n))


def _bounds(logits: torch.Tensor, temperature: torch.Tensor, min_p: torch.Tensor, kmax: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(z_max, tau, min-p bound)`` per row from a ``topk`` of the raw logits (``z`` is monotone in them)."""
    top = torch.topk(logits, kmax, dim=-1).values
    zmax = R.tempered(top[:, :1], temperature)[:, 0]
    tau = R.tempered(top[:, kmax - 1:kmax], temperature)[:, 0]
    return zmax, tau, R.min_p_bound(zmax, min_p)


def _finish(gv: torch.Tensor, gi: torch.Tensor, ei: torch.Tensor, count: torch.Tensor, tau: torch.Tensor,
            zmax: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, kmax: int, vocab: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first ``kmax`` tokens in order from the candidates, then the reference's top-p and threshold."""
    t = gv.shape[0]
    rank = torch.arange(kmax, device=gv.device)
    count = count.to(torch.int64)
    values = torch.cat([gv, tau[:, None].expand(t, kmax)], dim=1)
    ids = torch.cat([gi, ei], dim=1)
    valid = torch.cat([rank[None, :] < count[:, :1], rank[None, :] < count[:, 1:2]], dim=1)
    ids = torch.where(valid, ids, torch.zeros_like(ids))  # unwritten slots: any id, their key is the lowest
    keys = torch.where(valid, R.order_keys(values, ids), torch.full_like(ids, torch.iinfo(torch.int64).min))
    pick = torch.topk(keys, kmax, dim=-1).indices
    n1 = R.prefix_bound(count[:, 2], top_k, vocab)
    return R.prefix_threshold(values.gather(1, pick), ids.gather(1, pick), zmax, n1, top_p, vocab)


def kept_set(p, logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
             min_p: torch.Tensor, path: int, kmax: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t, vocab = logits.shape
    if path != R.PATH_TOP_K or t == 0:
        return p.host(R.kept_set_reference, logits, temperature, top_k, top_p, min_p, path, kmax)
    x, temperature = p.contiguous(logits), p.contiguous(temperature)
    zmax, tau, minz = p.host(_bounds, x, temperature, min_p, kmax)
    cap = KM if kmax <= KM else kmax
    gv, gi, ei = p.new((t, cap), torch.float32), p.new((t, cap), torch.int64), p.new((t, cap), torch.int64)
    count = p.new((t, 3), torch.int32)
    p.launch(_candidates_kernel, (t,), x, temperature, tau, minz, gv, gi, ei, count, vocab, cap, x.stride(0),
             BLOCK=BLOCK, num_warps=NUM_WARPS)
    if kmax > KM:
        return p.host(_finish, gv, gi, ei, count, tau, zmax, top_k, top_p, kmax, vocab)
    eg, et = p.host(_exps, gv, tau, zmax)
    value, token_id, size = p.new((t,), torch.float32), p.new((t,), torch.int64), p.new((t,), torch.int64)
    scratch = p.new((t, KM), torch.float32)
    p.launch(_finish_kernel, (t,), gv, gi, ei, eg, et, count, tau, p.contiguous(top_k, torch.int64),
             p.contiguous(top_p, torch.float32), scratch, value, token_id, size, vocab, KM=KM, num_warps=4)
    return value, token_id, size


def _exps(gv: torch.Tensor, tau: torch.Tensor, zmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``exp(z - base(z_max))`` of each candidate (torch's ``exp``, as the reference's top-p mass takes it)."""
    base = torch.where(zmax == R.NEG_INF, torch.zeros_like(zmax), zmax)
    return torch.exp(gv - base[:, None]), torch.exp(tau - base)


APPLY_BLOCK = 4096  # columns per program of the apply kernel


@triton.jit(do_not_specialize=["V", "stride_x", "stride_o"])
def _apply_kernel(x_ptr, temp_ptr, value_ptr, id_ptr, out_ptr, V, stride_x, stride_o, BLOCK: tl.constexpr):
    """Columns ``[program_id(1) * BLOCK, ...)`` of row ``program_id(0)``: ``z = f32(x) / T`` (``div_rn``, ``-0.0``
    as ``+0.0``) where ``z > value or (z == value and id <= token_id)``, ``-inf`` elsewhere."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < V
    t = tl.load(temp_ptr + row)
    value = tl.load(value_ptr + row)
    last = tl.load(id_ptr + row)
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    z = tl.math.div_rn(x.to(tl.float32), t)
    z = tl.where(z == 0.0, 0.0, z)
    keep = (z > value) | ((z == value) & (cols <= last))
    tl.store(out_ptr + row * stride_o + cols, tl.where(keep, z, float("-inf")), mask=ok)


def apply_kept(p, logits: torch.Tensor, temperature: torch.Tensor, value: torch.Tensor,
               token_id: torch.Tensor) -> torch.Tensor:
    """The processed logits in one pass over ``logits`` (a read and a write per element)."""
    t, vocab = logits.shape
    out = p.new((t, vocab), torch.float32)
    if t == 0 or vocab == 0:
        return out
    x = p.contiguous(logits)
    p.launch(_apply_kernel, (t, triton.cdiv(vocab, APPLY_BLOCK)), x, p.contiguous(temperature), p.contiguous(value),
             p.contiguous(token_id), out, vocab, x.stride(0), out.stride(0), BLOCK=APPLY_BLOCK, num_warps=8)
    return out
