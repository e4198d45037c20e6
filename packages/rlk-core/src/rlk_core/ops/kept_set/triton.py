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
    gv, gi, ei = p.new((t, kmax), torch.float32), p.new((t, kmax), torch.int64), p.new((t, kmax), torch.int64)
    count = p.new((t, 3), torch.int32)
    p.launch(_candidates_kernel, (t,), x, temperature, tau, minz, gv, gi, ei, count, vocab, kmax, x.stride(0),
             BLOCK=BLOCK, num_warps=NUM_WARPS)
    return p.host(_finish, gv, gi, ei, count, tau, zmax, top_k, top_p, kmax, vocab)
