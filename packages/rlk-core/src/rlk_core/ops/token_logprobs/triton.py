"""Triton kernels of contract ``rlk.logp.v1`` (backend ``rlk.triton``), shared by ``token_logprobs``
and ``linear_logprobs`` so that the fused and unfused forms run the same arithmetic by construction.

Leaf-block partials (``_logp_block_fwd_kernel``): one program takes ``BLOCK_T`` rows and one
256-column leaf block of one group (blocks anchored at the group start, as in
:mod:`rlk_core.ops._logp_tree`); ``z = div_rn(f32(x), temp[row])`` (one IEEE division), absent
columns ``-inf``, ``m = max(z)`` (exact in any order), ``s`` = the pairwise-halves tree of
``exp(z - base(m))`` written out as 8 levels of elementwise adds on reshaped halves of the tile —
never ``tl.sum`` — so a row's bits do not depend on the register layout or on ``BLOCK_T``. The
program whose block holds a row's target writes ``z[target]``. The block partials land in a
``[T, groups, P]`` buffer pre-filled with the identity ``(-inf, 0)``.

Merges: ``_merge_blocks_kernel`` runs the group halves tree (``[T, G, P] -> [T, G]``) and
``_merge_groups_kernel`` the 8-group adjacent-pairs tree and ``lse = m + log(s)``, ``logp = z[target] -
lse`` — the trees of :mod:`rlk_core.ops._logp_tree`, each level an elementwise merge of reshaped halves
(or even/odd pairs) of a row's tile, with fp-contraction off (``enable_fp_fusion=False``: ``s1*e1 + s2*e2``
is two rounded products, then the add). One launch each instead of ~90 small torch launches per call,
which the sampling step of a rollout engine pays at every decoded token.

Every GPU path (``token_logprobs`` with any vocab sharding, ``logp_partials`` +
``merge_logp_partials``, ``linear_logprobs``) produces each block partial with this one kernel and
merges with this one code, so they agree bit for bit. The GPU bits need not equal the CPU
reference's (``tl.exp`` is not the CPU ``expf``); they are within ``dtype_tols`` of it.

Backward (``_logp_grad_kernel``): ``dz = (g_logp*(onehot - p) + g_lse*p) / temp``,
``p = exp(z - lse)``, elementwise, written in the output's dtype (may alias the input: each element
is read before it is written by the same program).

Launch configurations are constants (never a function of the number of rows); T is not specialised.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlk_core.ops import _logp_tree as L

BLOCK_T = 16  # rows per program of the partials kernel (a constant: never a function of T)
GRAD_BLOCK_T = 16
GRAD_BLOCK_N = 256
NUM_WARPS = 4


@triton.jit
def _halves(x, R: tl.constexpr, W: tl.constexpr):
    """``[R, W] -> ([R, W/2], [R, W/2])``: elements ``i`` and ``i + W/2``."""
    return tl.split(tl.permute(tl.reshape(x, (R, 2, W // 2)), (0, 2, 1)))


@triton.jit
def _halve(x, R: tl.constexpr, W: tl.constexpr):
    """``[R, W] -> [R, W/2]``: element ``i`` plus element ``i + W/2`` (one level of the halves tree)."""
    a, b = _halves(x, R, W)
    return a + b


@triton.jit
def _kept(z, kv_ptr, kid_ptr, rows, row_ok, gcols):
    """``[R, W]`` bool: whether global column ``gcols`` of each row is in its kept set ``(kv, kid)``:
    ``z > kv or (z == kv and col <= kid)`` (``z + 0.0``: ``-0.0`` compares as ``+0.0`` in IEEE anyway)."""
    kv = tl.load(kv_ptr + rows, mask=row_ok, other=float("-inf"))
    kid = tl.load(kid_ptr + rows, mask=row_ok, other=0)
    return (z > kv[:, None]) | ((z == kv[:, None]) & (gcols[None, :].to(tl.int64) <= kid[:, None]))


@triton.jit(do_not_specialize=["T"])
def _logp_block_fwd_kernel(
    x_ptr, temp_ptr, target_ptr, m_ptr, s_ptr, zt_ptr, kv_ptr, kid_ptr,
    T, width, col0, slot0,
    stride_xt, stride_xn, stride_mt,
    BLOCK_T: tl.constexpr, BLOCK: tl.constexpr, FILTER: tl.constexpr,
):
    """``x``: the logits of columns ``[col0, col0 + width)`` (global ids) of one group, starting on a
    leaf-block boundary of it; program (i, b) writes slot ``slot0 + b`` of ``m``/``s`` (row stride
    ``stride_mt``) for rows ``i*BLOCK_T ...``. ``FILTER``: columns outside each row's kept set (its threshold
    ``(kv, kid)``, contract ``rlk.logp.processed.v1``) are ``-inf`` before anything else."""
    pid_t = tl.program_id(0)
    pid_b = tl.program_id(1)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = pid_b * BLOCK + tl.arange(0, BLOCK)
    row_ok = rows < T
    col_ok = cols < width
    ok = row_ok[:, None] & col_ok[None, :]
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xt + cols[None, :].to(tl.int64) * stride_xn,
                mask=ok, other=0.0)
    temp = tl.load(temp_ptr + rows, mask=row_ok, other=1.0)
    z = tl.math.div_rn(x.to(tl.float32), temp[:, None])
    z = tl.where(ok, z, float("-inf"))
    if FILTER:
        z = tl.where(_kept(z, kv_ptr, kid_ptr, rows, row_ok, cols + col0), z, float("-inf"))
    m = tl.max(z, axis=1)
    base = tl.where(m == float("-inf"), 0.0, m)
    e = tl.exp(z - base[:, None])
    # pairwise-halves tree over the 256 slots, 8 explicit levels
    e = _halve(e, BLOCK_T, 256)
    e = _halve(e, BLOCK_T, 128)
    e = _halve(e, BLOCK_T, 64)
    e = _halve(e, BLOCK_T, 32)
    e = _halve(e, BLOCK_T, 16)
    e = _halve(e, BLOCK_T, 8)
    e = _halve(e, BLOCK_T, 4)
    e = _halve(e, BLOCK_T, 2)
    s = tl.reshape(e, (BLOCK_T,))
    slot = slot0 + pid_b
    tl.store(m_ptr + rows.to(tl.int64) * stride_mt + slot, m, mask=row_ok)
    tl.store(s_ptr + rows.to(tl.int64) * stride_mt + slot, s, mask=row_ok)
    # z[target] from the one program whose block holds the target (no other program writes that row)
    tgt = tl.load(target_ptr + rows, mask=row_ok, other=-1).to(tl.int64)
    local = tgt - col0 - pid_b * BLOCK
    mine = row_ok & (local >= 0) & (local < BLOCK) & (local < width - pid_b * BLOCK)
    hit = (cols[None, :].to(tl.int64) - pid_b * BLOCK) == local[:, None]
    zt = tl.max(tl.where(hit & ok, z, float("-inf")), axis=1)
    tl.store(zt_ptr + rows, zt, mask=mine)


@triton.jit
def _merge(m1, s1, m2, s2):
    """One merge of two partials (the identity ``(-inf, 0)`` is an exact no-op; NaN propagates)."""
    m = tl.maximum(m1, m2, propagate_nan=tl.PropagateNan.ALL)
    base = tl.where(m == float("-inf"), 0.0, m)
    return m, s1 * tl.exp(m1 - base) + s2 * tl.exp(m2 - base)


@triton.jit
def _merge_halves(m, s, R: tl.constexpr, W: tl.constexpr):
    """``[R, W] -> [R, W/2]``: slot ``i`` merged with slot ``i + W/2`` (one level of the halves tree)."""
    m_lo, m_hi = _halves(m, R, W)
    s_lo, s_hi = _halves(s, R, W)
    return _merge(m_lo, s_lo, m_hi, s_hi)


@triton.jit
def _merge_pairs(m, s, R: tl.constexpr, W: tl.constexpr):
    """``[R, W] -> [R, W/2]``: slot ``2j`` merged with slot ``2j + 1`` (one level of the adjacent-pairs tree)."""
    m_even, m_odd = tl.split(tl.reshape(m, (R, W // 2, 2)))
    s_even, s_odd = tl.split(tl.reshape(s, (R, W // 2, 2)))
    return _merge(m_even, s_even, m_odd, s_odd)


@triton.jit(do_not_specialize=["T"])
def _merge_blocks_kernel(
    m_ptr, s_ptr, gm_ptr, gs_ptr,
    T, stride_t, stride_g, stride_gt,
    BLOCK_T: tl.constexpr, P: tl.constexpr,
):
    """Program (i, g): rows ``i*BLOCK_T ...`` of group ``g``, ``[BLOCK_T, P]`` block partials (unit slot
    stride) -> the group partial at ``gm[row, g]`` / ``gs[row, g]`` (row stride ``stride_gt``)."""
    pid_t = tl.program_id(0)
    g = tl.program_id(1)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    off = rows[:, None].to(tl.int64) * stride_t + g * stride_g + tl.arange(0, P)[None, :]
    m = tl.load(m_ptr + off, mask=row_ok[:, None], other=float("-inf"))
    s = tl.load(s_ptr + off, mask=row_ok[:, None], other=0.0)
    # the halves tree, widest level first (levels above P are skipped at compile time)
    if P >= 4096:
        m, s = _merge_halves(m, s, BLOCK_T, 4096)
    if P >= 2048:
        m, s = _merge_halves(m, s, BLOCK_T, 2048)
    if P >= 1024:
        m, s = _merge_halves(m, s, BLOCK_T, 1024)
    if P >= 512:
        m, s = _merge_halves(m, s, BLOCK_T, 512)
    if P >= 256:
        m, s = _merge_halves(m, s, BLOCK_T, 256)
    if P >= 128:
        m, s = _merge_halves(m, s, BLOCK_T, 128)
    if P >= 64:
        m, s = _merge_halves(m, s, BLOCK_T, 64)
    if P >= 32:
        m, s = _merge_halves(m, s, BLOCK_T, 32)
    if P >= 16:
        m, s = _merge_halves(m, s, BLOCK_T, 16)
    if P >= 8:
        m, s = _merge_halves(m, s, BLOCK_T, 8)
    if P >= 4:
        m, s = _merge_halves(m, s, BLOCK_T, 4)
    if P >= 2:
        m, s = _merge_halves(m, s, BLOCK_T, 2)
    out = rows.to(tl.int64) * stride_gt + g
    tl.store(gm_ptr + out, tl.reshape(m, (BLOCK_T,)), mask=row_ok)
    tl.store(gs_ptr + out, tl.reshape(s, (BLOCK_T,)), mask=row_ok)


@triton.jit(do_not_specialize=["T", "K"])
def _merge_groups_kernel(
    m_ptr, s_ptr, zt_ptr, logp_ptr, lse_ptr,
    T, K, stride_mt, stride_st,
    BLOCK_T: tl.constexpr, GROUPS: tl.constexpr,
):
    """``[T, K]`` group partials (``K <= GROUPS``; slots ``>= K`` are identities) -> the adjacent-pairs
    tree over ``GROUPS = 8`` slots, then ``lse = m + log(s)`` and ``logp = z[target] - lse``."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, GROUPS)
    row_ok = rows < T
    ok = row_ok[:, None] & (cols[None, :] < K)
    r64 = rows[:, None].to(tl.int64)
    m = tl.load(m_ptr + r64 * stride_mt + cols[None, :], mask=ok, other=float("-inf"))
    s = tl.load(s_ptr + r64 * stride_st + cols[None, :], mask=ok, other=0.0)
    m, s = _merge_pairs(m, s, BLOCK_T, 8)
    m, s = _merge_pairs(m, s, BLOCK_T, 4)
    m, s = _merge_pairs(m, s, BLOCK_T, 2)
    lse = tl.reshape(m, (BLOCK_T,)) + tl.log(tl.reshape(s, (BLOCK_T,)))
    zt = tl.load(zt_ptr + rows, mask=row_ok, other=0.0)
    tl.store(lse_ptr + rows, lse, mask=row_ok)
    tl.store(logp_ptr + rows, zt - lse, mask=row_ok)


@triton.jit(do_not_specialize=["T"])
def _logp_grad_kernel(
    x_ptr, out_ptr, temp_ptr, target_ptr, lse_ptr, glogp_ptr, glse_ptr, kv_ptr, kid_ptr,
    T, width, col0,
    stride_xt, stride_xn, stride_ot, stride_on,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, FILTER: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < T
    ok = row_ok[:, None] & (cols[None, :] < width)
    r64 = rows[:, None].to(tl.int64)
    c64 = cols[None, :].to(tl.int64)
    x = tl.load(x_ptr + r64 * stride_xt + c64 * stride_xn, mask=ok, other=0.0)
    temp = tl.load(temp_ptr + rows, mask=row_ok, other=1.0)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    g_logp = tl.load(glogp_ptr + rows, mask=row_ok, other=0.0)
    g_lse = tl.load(glse_ptr + rows, mask=row_ok, other=0.0)
    tgt = tl.load(target_ptr + rows, mask=row_ok, other=-1).to(tl.int64)
    z = tl.math.div_rn(x.to(tl.float32), temp[:, None])
    hit = (c64 + col0) == tgt[:, None]
    if FILTER:  # outside the kept set: z = -inf, so p = 0, and the one-hot counts a kept target only
        keep = _kept(z, kv_ptr, kid_ptr, rows, row_ok, cols + col0)
        z = tl.where(keep, z, float("-inf"))
        hit = hit & keep
    p = tl.exp(z - lse[:, None])
    onehot = tl.where(hit, 1.0, 0.0)
    g = g_logp[:, None] * (onehot - p) + g_lse[:, None] * p
    # g / T, one IEEE division; a zero g (every column outside a kept set) is its own quotient (T > 0), and is kept
    # out of div_rn, whose zero numerators take the division's slow path (the processed gradient, ~all zeros, ran
    # 2.6x the unfiltered kernel's time on the H200): the same bits, -0.0 included
    zero = g == 0.0
    dz = tl.where(zero, g, tl.math.div_rn(tl.where(zero, 1.0, g), temp[:, None]))
    tl.store(out_ptr + r64 * stride_ot + c64 * stride_on, dz.to(out_ptr.dtype.element_ty), mask=ok)


# -- launchers ------------------------------------------------------------------------------------
F32 = torch.float32


def new_partials(p, t: int, groups: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Identity-filled block partials ``[T, groups, P]`` and ``z_target = -inf`` ``[T]``."""
    blocks = L.padded_blocks(vocab_size)
    return (p.new((t, groups, blocks), F32, "-inf"), p.new((t, groups, blocks), F32, "zeros"),
            p.new((t,), F32, "-inf"))


Kept = tuple[torch.Tensor, torch.Tensor] | None  # a kept set's (value fp32 [T], token_id int64 [T]), or none


def _kept_args(kept: Kept, temperature: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' ``(kv, kid)`` pointers: the kept set's, or (unread under ``FILTER=False``) two row tensors."""
    return (temperature, target) if kept is None else kept


def block_partials_into(p, x: torch.Tensor, temperature: torch.Tensor, target: torch.Tensor, m: torch.Tensor,
                        s: torch.Tensor, zt: torch.Tensor, col0: int, slot0: int, kept: Kept = None) -> None:
    """Block partials of ``x`` (``[T, w]``, columns ``[col0, col0 + w)`` of one group, starting on its
    leaf block ``slot0``) into ``m[:, slot0:]``, ``s[:, slot0:]`` (``[T, P]`` views, unit column
    stride) and ``z[target]`` into ``zt`` where the target lies in these columns (and in the kept set)."""
    t, w = x.shape
    if t == 0 or w == 0:
        return
    assert m.stride(1) == 1 and s.stride(1) == 1 and m.stride(0) == s.stride(0)
    kv, kid = _kept_args(kept, temperature, target)
    p.launch(_logp_block_fwd_kernel, (triton.cdiv(t, BLOCK_T), triton.cdiv(w, L.BLOCK)),
             x, temperature, target, m, s, zt, kv, kid, t, w, col0, slot0, x.stride(0), x.stride(1), m.stride(0),
             BLOCK_T=BLOCK_T, BLOCK=L.BLOCK, FILTER=kept is not None, num_warps=NUM_WARPS)


def shard_block_partials_into(p, x: torch.Tensor, temperature: torch.Tensor, target: torch.Tensor,
                              vocab_start: int, vocab_size: int, m: torch.Tensor, s: torch.Tensor,
                              zt: torch.Tensor, kept: Kept = None) -> None:
    """All groups of a logits shard (``m``/``s``: ``[T, groups of the shard, P]``)."""
    g0, g1 = L.shard_groups("logp_partials", vocab_start, x.shape[1], vocab_size)
    bounds = L.group_bounds(vocab_size)
    for i, g in enumerate(range(g0, g1)):
        lo, hi = bounds[g] - vocab_start, bounds[g + 1] - vocab_start
        block_partials_into(p, x[:, lo:hi], temperature, target, m[:, i], s[:, i], zt, bounds[g], 0, kept)


MERGE_BLOCK_T = 16  # rows per program of the merge kernels (a constant: never a function of T)
MAX_PADDED_BLOCKS = 4096  # the halves tree's widest level in _merge_blocks_kernel (V up to ~8.4M)


def merge_blocks(p, m: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, G, P]`` block partials -> ``[T, G]`` group partials (the fixed halves tree), one launch."""
    t, groups, blocks = m.shape
    assert blocks & (blocks - 1) == 0 and blocks <= MAX_PADDED_BLOCKS, blocks
    m, s = p.contiguous(m), p.contiguous(s)
    gm, gs = p.new((t, groups), F32), p.new((t, groups), F32)
    if t == 0 or groups == 0:
        return gm, gs
    p.launch(_merge_blocks_kernel, (triton.cdiv(t, MERGE_BLOCK_T), groups),
             m, s, gm, gs, t, m.stride(0), m.stride(1), groups,
             BLOCK_T=MERGE_BLOCK_T, P=blocks, num_warps=NUM_WARPS, enable_fp_fusion=False)
    return gm, gs


def logp_partials(p, x: torch.Tensor, target: torch.Tensor, temperature: torch.Tensor, vocab_start: int,
                  vocab_size: int, kept: Kept = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    target, temperature = p.contiguous(target), p.contiguous(temperature)
    kept = _contiguous_kept(p, kept)
    g0, g1 = L.shard_groups("logp_partials", vocab_start, x.shape[1], vocab_size)
    m, s, zt = new_partials(p, x.shape[0], g1 - g0, vocab_size)
    shard_block_partials_into(p, x, temperature, target, vocab_start, vocab_size, m, s, zt, kept)
    gm, gs = merge_blocks(p, m, s)
    return gm, gs, zt


def merge_logp_partials(p, m: torch.Tensor, s: torch.Tensor, z_target: torch.Tensor, vocab_size: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, k]`` group partials (``k <= 8``) and ``z[target]`` -> ``(logp, lse)``, one launch."""
    t, k = m.shape
    assert k <= L.GROUPS, k
    m, s, z_target = p.contiguous(m, F32), p.contiguous(s, F32), p.contiguous(z_target, F32)
    logp, lse = p.new((t,), F32), p.new((t,), F32)
    if t == 0:
        return logp, lse
    p.launch(_merge_groups_kernel, (triton.cdiv(t, MERGE_BLOCK_T),),
             m, s, z_target, logp, lse, t, k, m.stride(0), s.stride(0),
             BLOCK_T=MERGE_BLOCK_T, GROUPS=L.GROUPS, num_warps=NUM_WARPS, enable_fp_fusion=False)
    return logp, lse


def _contiguous_kept(p, kept: Kept) -> Kept:
    return None if kept is None else (p.contiguous(kept[0]), p.contiguous(kept[1]))


def forward(p, shards: list[torch.Tensor], target: torch.Tensor, temperature: torch.Tensor, kept: Kept = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    target, temperature = p.contiguous(target), p.contiguous(temperature)
    kept = _contiguous_kept(p, kept)
    vocab_size = sum(x.shape[1] for x in shards)
    m, s, zt = new_partials(p, shards[0].shape[0], L.num_groups(vocab_size), vocab_size)
    start, gi = 0, 0
    for x in shards:
        g0, g1 = L.shard_groups("token_logprobs", start, x.shape[1], vocab_size)
        shard_block_partials_into(p, x, temperature, target, start, vocab_size, m[:, gi:gi + g1 - g0],
                                  s[:, gi:gi + g1 - g0], zt, kept)
        gi += g1 - g0
        start += x.shape[1]
    return merge_logp_partials(p, *merge_blocks(p, m, s), zt, vocab_size)


def grad_into(p, x: torch.Tensor, out: torch.Tensor, target: torch.Tensor, temperature: torch.Tensor,
              lse: torch.Tensor, g_logp: torch.Tensor, g_lse: torch.Tensor, col0: int, kept: Kept = None) -> None:
    """``out = dL/dlogits`` of ``x`` (columns ``[col0, col0 + w)``), in ``out``'s dtype; ``out`` may be ``x``."""
    t, w = x.shape
    if t == 0 or w == 0:
        return
    kv, kid = _kept_args(kept, temperature, target)
    p.launch(_logp_grad_kernel, (triton.cdiv(t, GRAD_BLOCK_T), triton.cdiv(w, GRAD_BLOCK_N)),
             x, out, temperature, target, lse, g_logp, g_lse, kv, kid, t, w, col0,
             x.stride(0), x.stride(1), out.stride(0), out.stride(1),
             BLOCK_T=GRAD_BLOCK_T, BLOCK_N=GRAD_BLOCK_N, FILTER=kept is not None, num_warps=NUM_WARPS)


def backward(p, shards: list[torch.Tensor], target: torch.Tensor, temperature: torch.Tensor, lse: torch.Tensor,
             grad_logp: torch.Tensor, grad_lse: torch.Tensor, kept: Kept = None) -> list[torch.Tensor]:
    out, start = [], 0
    target, temperature, lse = p.contiguous(target), p.contiguous(temperature), p.contiguous(lse)
    g_logp, g_lse = p.contiguous(grad_logp, F32), p.contiguous(grad_lse, F32)
    kept = _contiguous_kept(p, kept)
    for x in shards:
        d = p.new(x.shape, x.dtype)
        grad_into(p, x, d, target, temperature, lse, g_logp, g_lse, start, kept)
        out.append(d)
        start += x.shape[1]
    return out


def supports(shards: list[torch.Tensor], target: torch.Tensor, temperature: torch.Tensor) -> tuple[bool, str]:
    if shards[0].dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False, f"dtype {shards[0].dtype} not supported by the rlk.triton log-prob kernels"
    return True, ""


def supports_backward(shards, target, temperature, lse, grad_logp, grad_lse) -> tuple[bool, str]:
    return supports(shards, target, temperature)


def supports_partials(x, target, temperature, vocab_start, vocab_size) -> tuple[bool, str]:
    return supports([x], target, temperature)


def supports_merge(m, s, z_target, vocab_size) -> tuple[bool, str]:
    return True, ""


# -- contract rlk.logp.processed.v1: the same plans with a kept set ---------------------------------------
def processed_forward(p, shards, target, temperature, kept_value, kept_id):
    return forward(p, shards, target, temperature, (kept_value, kept_id))


def processed_backward(p, shards, target, temperature, kept_value, kept_id, lse, grad_logp, grad_lse):
    return backward(p, shards, target, temperature, lse, grad_logp, grad_lse, (kept_value, kept_id))


def processed_logp_partials(p, x, target, temperature, kept_value, kept_id, vocab_start, vocab_size):
    return logp_partials(p, x, target, temperature, vocab_start, vocab_size, (kept_value, kept_id))


def supports_processed(shards, target, temperature, kept_value, kept_id) -> tuple[bool, str]:
    return supports(shards, target, temperature)


def supports_processed_backward(shards, target, temperature, kept_value, kept_id, lse, grad_logp, grad_lse):
    return supports(shards, target, temperature)


def supports_processed_partials(x, target, temperature, kept_value, kept_id, vocab_start, vocab_size):
    return supports([x], target, temperature)


VOCABS = (151936, 128256)  # Qwen3, Llama 3: multiples of 128 (the leaf-block variants depend on that only)


def build_calls(dtype: torch.dtype, sms: int):
    """Per vocabulary of :data:`VOCABS` whole and split over 1, 2, 4 and 8 shards, target ids int32 or int64: the
    forward, the backward and the vocab-parallel partials (the leaf-block and gradient variants: every group width
    ``ceil(V / 8)`` a multiple of 16); every group merge an aligned leaf-block variant can feed; the final merge of
    1..8 groups. (The first leaf slot of a ``linear_logprobs`` chunk is that op's: its build calls.)"""
    for vocab in VOCABS:
        for tp in (1, 2, 4, 8):
            width = vocab // tp
            for target_dtype in (torch.int32, torch.int64):
                x = torch.empty((17, width), dtype=dtype, device="meta")
                target = torch.empty((17,), dtype=target_dtype, device="meta")
                temp = torch.empty((17,), dtype=F32, device="meta")
                shards = [x] * tp
                yield forward, (shards, target, temp)
                stats = torch.empty((17,), dtype=F32, device="meta")
                yield backward, (shards, target, temp, stats, stats, stats)
                for start in range(0, vocab, width):
                    yield logp_partials, (x, target, temp, start, vocab)
                kv, kid = temp, torch.empty((17,), dtype=torch.int64, device="meta")
                yield processed_forward, (shards, target, temp, kv, kid)
                yield processed_backward, (shards, target, temp, kv, kid, stats, stats, stats)
                for start in range(0, vocab, width):
                    yield processed_logp_partials, (x, target, temp, kv, kid, start, vocab)
    blocks = 4  # every group merge whose [T, G, P] partials the leaf-block variant writes aligned: P a multiple of 4
    while blocks <= MAX_PADDED_BLOCKS:  # (16-byte groups) and a row stride G * P that is a multiple of 16
        for g in range(1, L.GROUPS + 1):
            if g * blocks % 16 == 0:
                m = torch.empty((17, g, blocks), dtype=F32, device="meta")
                yield merge_blocks, (m, m)
        blocks *= 2
    for k in range(1, L.GROUPS + 1):
        gm = torch.empty((17, k), dtype=F32, device="meta")
        yield merge_logp_partials, (gm, gm, gm[:, 0].contiguous(), VOCABS[0])
