"""The kept set of filtered sampling — the specification of contract ``rlk.logp.processed.v1``.

Per row: ``z = f32(logits) / f32(T)`` (``-0.0`` taken as ``+0.0``), a total order on the vocabulary (value
descending, ties by id ascending), min-p, top-k and top-p each keeping a prefix of that order; the kept set is
the first ``n`` tokens and is returned as its last element ``(value, token_id)`` and ``n``. Every step is a
max, a compare, a count, an exact sort / topk, a gather or an elementwise fp32 operation in a fixed tree
(``docs/ops/kept_set.md``), so a row's result depends on that row alone, on any device.
"""

from __future__ import annotations

import torch

from rlk_core.ops._fixed import tree_sum

BLOCK = 256  # positions per block of the top-p mass scan
NEG_INF = float("-inf")
_LOW = (1 << 32) - 1


def tempered(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``z = f32(logits) / f32(T)`` per row, one IEEE division, with ``-0.0`` turned into ``+0.0``."""
    return logits.float() / temperature[:, None] + 0.0


def order_keys(z: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
    """Unique int64 keys whose descending order is the contract's order: the fp32 bits made monotone (a negative
    value's magnitude bits flipped) in the high 32 bits, ``2^32 - 1 - id`` in the low 32 bits (``ids``: the
    token ids of ``z``'s columns, default ``0 .. V-1``)."""
    bits = z.contiguous().view(torch.int32)
    mono = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
    if ids is None:
        ids = torch.arange(z.shape[-1], device=z.device, dtype=torch.int64)
    return mono * (1 << 32) + (_LOW - ids)


def scan(x: torch.Tensor) -> torch.Tensor:
    """Inclusive Hillis-Steele scan of the last dim (a power of two): shifts 1, 2, 4, ..., each an elementwise add."""
    n, s = x.shape[-1], 1
    while s < n:
        x = torch.cat([x[..., :s], x[..., s:] + x[..., :-s]], dim=-1)
        s *= 2
    return x


def _first(cond: torch.Tensor, default: int) -> torch.Tensor:
    """Index of the first True along the last dim, ``default`` where there is none."""
    idx = torch.argmax(cond.to(torch.int8), dim=-1)
    return torch.where(cond.any(-1), idx, torch.full_like(idx, default))


def top_p_count(zs: torch.Tensor, zmax: torch.Tensor, n1: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The shortest prefix of the ordered values ``zs`` ``[T, L]`` (only the first ``n1`` counted) whose mass
    reaches ``top_p`` of the mass, by the fixed two-level sum of the contract; ``[T]`` int64 in ``[1, n1]``."""
    t, width = zs.shape
    base = torch.where(zmax == NEG_INF, torch.zeros_like(zmax), zmax)
    pos = torch.arange(width, device=zs.device)
    e = torch.where(pos[None, :] < n1[:, None], torch.exp(zs - base[:, None]), torch.zeros_like(zs))
    nb = -(-width // BLOCK)
    e = torch.nn.functional.pad(e, (0, nb * BLOCK - width)).view(t, nb, BLOCK)
    totals = tree_sum(e)                                             # [T, NB]
    p2 = 1 << (nb - 1).bit_length()
    prefix = scan(torch.nn.functional.pad(totals, (0, p2 - nb)))[:, :nb]  # [T, NB] inclusive
    # the mass C: the prefix sum at the block of the last counted position (so every path's C is the same sum;
    # the first block reaching top_p * C is at or before it, since top_p <= 1)
    target = top_p * prefix.gather(1, ((n1 - 1) // BLOCK)[:, None])[:, 0]
    b = _first(prefix >= target[:, None], nb - 1)
    before = torch.where(b > 0, prefix.gather(1, (b - 1).clamp(min=0)[:, None])[:, 0], torch.zeros_like(target))
    block = e.gather(1, b[:, None, None].expand(t, 1, BLOCK))[:, 0]  # [T, 256]
    c = before[:, None] + scan(block)
    j = _first(c >= target[:, None], BLOCK - 1)
    return torch.minimum(b * BLOCK + j + 1, n1)


# how a call finds its rows' prefixes: a choice of speed only, every path gives the same bits (tested)
PATH_ALL, PATH_MIN_P, PATH_TOP_K, PATH_SORT = 0, 1, 2, 3


def choose_path(vocab: int, top_k: list[int], top_p: list[float], min_p: list[float]) -> tuple[int, int]:
    """``(path, kmax)`` for rows with these parameters (host values): no filter, min-p alone, a top-k on every
    row (a ``topk`` of the largest k), or a full sort."""
    ks = [k if 1 <= k < vocab else vocab for k in top_k]
    if any(p < 1.0 for p in top_p) or any(k < vocab for k in ks):
        if ks and all(k < vocab for k in ks):
            return PATH_TOP_K, max(ks)
        return PATH_SORT, 0
    return (PATH_MIN_P if any(m > 0.0 for m in min_p) else PATH_ALL), 0


def kept_set_reference(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                       min_p: torch.Tensor, path: int, kmax: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(value fp32 [T], token_id int64 [T], size int64 [T])`` of each row's kept set (see the module); ``path``
    and ``kmax`` from :func:`choose_path` (any path whose preconditions hold gives the same bits)."""
    z = tempered(logits, temperature)
    t, vocab = z.shape
    dev = z.device
    zmax = z.amax(-1) if vocab else z.new_empty((t,))
    full = torch.full((t,), vocab, dtype=torch.int64, device=dev)
    if t == 0 or path == PATH_ALL:
        return torch.full((t,), NEG_INF, device=dev), torch.full_like(full, vocab - 1), full
    min_z = min_p_bound(zmax, min_p)[:, None]
    n1 = prefix_bound((z >= min_z).sum(-1), top_k, vocab)
    if path == PATH_MIN_P:  # min-p alone keeps whole values: its last element is the smallest kept value, largest id
        kept = z >= min_z
        value = torch.where(kept, z, torch.full_like(z, float("inf"))).amin(-1)
        ids = torch.arange(vocab, device=dev, dtype=torch.int64)
        token_id = torch.where(kept & (z == value[:, None]), ids[None, :], torch.full_like(ids, -1)[None, :]).amax(-1)
        return threshold(value, token_id, n1, vocab)
    if path == PATH_TOP_K:  # every row has a top-k <= kmax: the first kmax of the order suffice
        keys = torch.topk(order_keys(z), kmax, dim=-1).values
        ids = _LOW - (keys & _LOW)
        zs = z.gather(1, ids)
    else:
        zs, ids = torch.sort(z, dim=-1, descending=True, stable=True)
    return prefix_threshold(zs, ids, zmax, n1, top_p, vocab)


def min_p_bound(zmax: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """``z_max + log(f32(min_p))`` per row (``min_p = 0``: ``log 0 = -inf`` keeps every token)."""
    return zmax + torch.log(min_p)


def prefix_bound(n_minp: torch.Tensor, top_k: torch.Tensor, vocab: int) -> torch.Tensor:
    """``n1 = min(n_minp, n_k)``: how many tokens of the order min-p and top-k keep (``n_k = V`` for no top-k)."""
    k = top_k.to(torch.int64)
    return torch.minimum(n_minp, torch.where((k >= 1) & (k < vocab), k, torch.full_like(k, vocab)))


def prefix_threshold(zs: torch.Tensor, ids: torch.Tensor, zmax: torch.Tensor, n1: torch.Tensor, top_p: torch.Tensor,
                     vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kept set from a row's first ``L`` tokens in the order (``zs`` values, ``ids`` ``[T, L]``, ``L >= n1``):
    top-p over the first ``n1``, then its last element."""
    n = torch.where(top_p < 1.0, top_p_count(zs, zmax, n1, top_p), n1)
    last = (n - 1)[:, None]
    return threshold(zs.gather(1, last)[:, 0], ids.gather(1, last)[:, 0], n, vocab)


def threshold(value: torch.Tensor, token_id: torch.Tensor, n: torch.Tensor, vocab: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(value, token_id, size)``, the whole vocabulary written ``(-inf, V - 1, V)``."""
    full = torch.full_like(n, vocab)
    whole = n >= vocab
    value = torch.where(whole, torch.full_like(value, NEG_INF), value)
    token_id = torch.where(whole, torch.full_like(token_id, vocab - 1), token_id)
    return value, token_id, torch.where(whole, full, n)


def in_kept(z: torch.Tensor, value: torch.Tensor, token_id: torch.Tensor, col_start: int = 0) -> torch.Tensor:
    """``[T, w]`` bool: which columns ``[col_start, col_start + w)`` of ``z`` (tempered) lie in the kept set."""
    cols = torch.arange(col_start, col_start + z.shape[-1], device=z.device, dtype=torch.int64)
    v = value[:, None]
    return (z > v) | ((z == v) & (cols[None, :] <= token_id[:, None]))


def mask_outside(z: torch.Tensor, value: torch.Tensor, token_id: torch.Tensor, col_start: int = 0) -> torch.Tensor:
    """``z`` with the columns outside the kept set set to ``-inf``."""
    return torch.where(in_kept(z, value, token_id, col_start), z, torch.full_like(z, NEG_INF))
