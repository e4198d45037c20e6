"""The fixed vocab-block tree of contract ``rlk.logp.v1``, shared by ``token_logprobs`` and
``linear_logprobs``.

Structure (a function of the vocabulary size ``V`` only — never of the number of rows, of the
tensor-parallel split, or of whether the logits were materialised):

* the vocabulary ``[0, V)`` is cut into ``GROUPS = 8`` top-level groups of ``GS = ceil(V / 8)``
  columns; group ``g`` is ``[min(g*GS, V), min((g+1)*GS, V))`` (trailing groups may be short or empty);
* inside a group, leaf blocks of ``BLOCK = 256`` columns anchored at the group start; every group
  has ``NB = ceil(GS / 256)`` block slots, padded to ``P = next_pow2(NB)`` with identities;
* a leaf block gives the partial ``(m, s)``: ``m = max(z)`` over the block (absent columns are
  ``-inf``), ``s = tree_sum(exp(z - m))`` over the 256 slots (absent slots contribute exact zeros);
* two partials merge as ``m = max(m1, m2)``, ``s = s1*exp(m1 - m) + s2*exp(m2 - m)`` (each product
  rounded, then the add; no FMA). The identity is ``(-inf, 0)``: when ``m == -inf`` the exponent
  base is taken as 0 so no ``-inf - -inf`` NaN appears, and merging with the identity is an exact
  no-op (``s*1 + 0*0 == s``);
* inside a group, the ``P`` block partials merge pairwise, upper half onto lower half (like
  :func:`~rlk_core.ops._fixed.tree_sum`); the 8 group partials merge in the adjacent-pairs tree
  ``((g0+g1)+(g2+g3))+((g4+g5)+(g6+g7))``;
* ``lse = m + log(s)``, ``logp = z[target] - lse``.

A tensor-parallel shard holds whole groups, so it computes exactly the group partials the unsharded
computation would; the merge of the gathered group partials is then the same tree for 1, 2, 4 or 8
shards. Every step is an elementwise fp32 operation or a max (exact in any order), so the result is
batch-invariant and run-to-run deterministic by construction on the CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlk_core.ops import _checks as C
from rlk_core.ops._fixed import tree_sum

GROUPS = 8
BLOCK = 256
NEG_INF = float("-inf")


def group_size(vocab_size: int) -> int:
    return -(-vocab_size // GROUPS)


def group_bounds(vocab_size: int) -> list[int]:
    """The 9 group boundaries ``min(g * GS, V)`` for ``g = 0..8``."""
    gs = group_size(vocab_size)
    return [min(g * gs, vocab_size) for g in range(GROUPS + 1)]


def num_groups(vocab_size: int) -> int:
    """Number of non-empty groups (the trailing empty ones are identities held by no shard)."""
    return -(-vocab_size // group_size(vocab_size))


def padded_blocks(vocab_size: int) -> int:
    """Block slots per group after padding to a power of two."""
    nb = -(-group_size(vocab_size) // BLOCK)
    return 1 << (nb - 1).bit_length()


def shard_groups(op: str, vocab_start: int, width: int, vocab_size: int) -> tuple[int, int]:
    """Groups ``[g0, g1)`` held by the shard ``[vocab_start, vocab_start + width)``; raise unless the
    shard starts and ends on group boundaries of ``vocab_size``."""
    C.require(vocab_size > 0, op, f"vocab_size must be > 0, got {vocab_size}")
    bounds = group_bounds(vocab_size)
    end = vocab_start + width
    if not (vocab_start in bounds and end in bounds and end <= vocab_size and width >= 0):
        C.require(False, op,
                  f"vocab shard [{vocab_start}, {end}) does not start and end on group boundaries of "
                  f"vocab_size={vocab_size} (8 groups of ceil(V/8)={group_size(vocab_size)} columns; allowed "
                  f"boundaries: {sorted(set(int(b) for b in bounds))}). Split the vocab into whole groups, "
                  f"e.g. V/TP columns per rank with V divisible by 8 (pad the vocab with -inf logits if needed)")
    return bounds.index(vocab_start), bounds.index(end)


def check_shard_widths(op: str, widths: list[int], what: str) -> int:
    """The vocabulary size of contiguous shards of these widths (in rank order); raise when it is empty
    or a shard does not start and end on group boundaries. ``what`` describes the shards in errors."""
    vocab_size = sum(widths)
    C.require(vocab_size > 0, op, f"the vocabulary is empty ({what})")
    start = 0
    for width in widths:
        shard_groups(op, start, width, vocab_size)
        start += width
    return vocab_size


def identity(shape: tuple[int, ...], like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.full(shape, NEG_INF, dtype=torch.float32, device=like.device),
            torch.zeros(shape, dtype=torch.float32, device=like.device))


def _base(m: torch.Tensor) -> torch.Tensor:
    """``m`` with ``-inf`` replaced by 0: the exponent base that keeps the identity NaN-free."""
    return torch.where(m == NEG_INF, torch.zeros_like(m), m)


def block_partials(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``z``: fp32 ``[..., BLOCK]`` (absent columns ``-inf``) -> per-block ``(m, s)`` of shape ``[...]``."""
    m = z.amax(-1)
    s = tree_sum(torch.exp(z - _base(m)[..., None]))
    return m, s


def pad_block(z: torch.Tensor) -> torch.Tensor:
    """Pad the last dim of a (possibly short) leaf block to ``BLOCK`` columns with ``-inf``."""
    w = z.shape[-1]
    return z if w == BLOCK else F.pad(z, (0, BLOCK - w), value=NEG_INF)


def merge(m1: torch.Tensor, s1: torch.Tensor, m2: torch.Tensor, s2: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    m = torch.maximum(m1, m2)
    b = _base(m)
    return m, s1 * torch.exp(m1 - b) + s2 * torch.exp(m2 - b)


def tree_merge_halves(m: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge the last dim (a power of two) upper half onto lower half until one partial remains."""
    n = m.shape[-1]
    assert n > 0 and n & (n - 1) == 0, n
    while m.shape[-1] > 1:
        h = m.shape[-1] // 2
        m, s = merge(m[..., :h], s[..., :h], m[..., h:], s[..., h:])
    return m[..., 0], s[..., 0]


def tree_merge_groups(m: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, k]`` group partials (``k <= 8``, trailing groups absent) -> the adjacent-pairs tree
    ``((g0+g1)+(g2+g3))+((g4+g5)+(g6+g7))`` over the 8 slots, absent slots being identities."""
    k = m.shape[-1]
    if k < GROUPS:
        im, is_ = identity((*m.shape[:-1], GROUPS - k), m)
        m, s = torch.cat([m, im], -1), torch.cat([s, is_], -1)
    while m.shape[-1] > 1:
        m, s = merge(m[..., 0::2], s[..., 0::2], m[..., 1::2], s[..., 1::2])
    return m[..., 0], s[..., 0]


def group_partial_from_blocks(ms: list[torch.Tensor], ss: list[torch.Tensor], vocab_size: int
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge one group's block partials (each ``[T]``, in column order) in the fixed halves tree."""
    p = padded_blocks(vocab_size)
    m, s = torch.stack(ms, -1), torch.stack(ss, -1)
    if m.shape[-1] < p:
        im, is_ = identity((*m.shape[:-1], p - m.shape[-1]), m)
        m, s = torch.cat([m, im], -1), torch.cat([s, is_], -1)
    return tree_merge_halves(m, s)


def group_partial(zg: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All leaf blocks of one group at once: ``zg`` fp32 ``[T, w]`` (``w <= GS``) -> ``([T], [T])``."""
    p = padded_blocks(vocab_size)
    t, w = zg.shape
    zp = F.pad(zg, (0, p * BLOCK - w), value=NEG_INF).view(t, p, BLOCK)
    return tree_merge_halves(*block_partials(zp))


def select_target(z: torch.Tensor, target: torch.Tensor, col_start: int, z_t: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """``z[t, target[t] - col_start]`` where the target lies in ``z``'s columns, else ``z_t`` (or -inf)."""
    t, w = z.shape
    if z_t is None:
        z_t = torch.full((t,), NEG_INF, dtype=torch.float32, device=z.device)
    if w == 0:
        return z_t
    local = target.long() - col_start
    owned = (local >= 0) & (local < w)
    picked = z.gather(1, local.clamp(0, w - 1)[:, None])[:, 0]
    return torch.where(owned, picked, z_t)


def finish(m: torch.Tensor, s: torch.Tensor, z_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    lse = m + torch.log(s)
    return z_t - lse, lse


def grad_z(z: torch.Tensor, target: torch.Tensor, col_start: int, temp: torch.Tensor, lse: torch.Tensor,
           g_logp: torch.Tensor, g_lse: torch.Tensor, kept: torch.Tensor | None = None) -> torch.Tensor:
    """``dL/dlogits`` for the columns of ``z`` (fp32): ``(g_logp*(onehot - p) + g_lse*p) / T``,
    ``p = exp(z - lse)``. Elementwise, so it is the same wherever the columns are computed. With ``kept``
    (``[T, w]`` bool; ``z`` already ``-inf`` outside it) the one-hot counts only a kept target."""
    p = torch.exp(z - lse[:, None])
    cols = torch.arange(col_start, col_start + z.shape[1], device=z.device)
    hit = cols[None, :] == target.long()[:, None]
    onehot = (hit if kept is None else hit & kept).to(torch.float32)
    return (g_logp[:, None] * (onehot - p) + g_lse[:, None] * p) / temp[:, None]


# -- validation shared by the two ops -------------------------------------------------------------
def check_rows(op: str, t: int, target: torch.Tensor, temperature: torch.Tensor, vocab_size: int) -> None:
    """``target`` int ``[T]`` in ``[0, V)``; ``temperature`` fp32 ``[T]``, finite and > 0."""
    C.int_tensor(target, op, "target")
    C.require(tuple(target.shape) == (t,), op, f"target must have shape ({t},), got {tuple(target.shape)}")
    C.in_range(target, op, "target", 0, vocab_size)
    check_temperature(op, t, temperature)


def check_temperature(op: str, t: int, temperature: torch.Tensor) -> None:
    """``temperature`` fp32 ``[T]``, finite and > 0."""
    C.require(isinstance(temperature, torch.Tensor) and temperature.dtype == torch.float32, op,
              "temperature must be an fp32 tensor here (the public function converts a float)")
    C.require(tuple(temperature.shape) == (t,), op,
              f"temperature must have shape ({t},) (one per row), got {tuple(temperature.shape)}")
    if temperature.numel() and C.values_checked(temperature):  # reading GPU values syncs: RLK_VALUE_CHECKS
        bad = ~(torch.isfinite(temperature) & (temperature > 0))
        if bool(bad.any()):
            C.require(False, op, f"temperature must be finite and > 0; got {temperature[bad][:4].tolist()} at "
                                 f"rows {bad.nonzero()[:4, 0].tolist()}")


def as_temperature(op: str, temperature: float | torch.Tensor, t: int, device: torch.device) -> torch.Tensor:
    """A float or a 0-d / ``[T]`` float tensor -> fp32 ``[T]`` (``f32(temperature)``, converted once)."""
    if isinstance(temperature, torch.Tensor):
        C.require(temperature.dtype in (*C.FLOAT_DTYPES, torch.float64), op,
                  f"temperature has dtype {temperature.dtype}; allowed: a float or a floating-point tensor")
        C.require(temperature.dim() == 0 or tuple(temperature.shape) == (t,), op,
                  f"temperature must be a float, a 0-d tensor or shape ({t},), got {tuple(temperature.shape)}")
        return temperature.float().expand(t).contiguous() if temperature.dim() == 0 else temperature.float()
    C.require(isinstance(temperature, (int, float)), op,
              f"temperature must be a float or a tensor, got {type(temperature).__name__}")
    return torch.full((t,), float(temperature), dtype=torch.float32, device=device)


def grads_or_zeros(lse: torch.Tensor, g_logp: torch.Tensor | None, g_lse: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    z = torch.zeros_like(lse)
    return (z if g_logp is None else g_logp.float()), (z if g_lse is None else g_lse.float())
